"""infra/fit_report.py, fit.py's command line (issue 13 item 11): a table whose numbers match the
generating curves, the comparison verdict and the PNG; a run directory for its metrics.jsonl; one-
line errors with exit code 2 for usage errors found before any work (no path, a missing file or
--out folder) and 1 for a file that cannot be read or fitted, each naming the path once; distinct
run names for two files in one folder; a cut-off last line skipped with a note, a bad line before it
refused."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tyro

from infra import fit_report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
R0 = 0.35


def eq1(C, A, B, C_mid):
    """Eq. 1 in plain numpy power form."""
    return R0 + (A - R0) / (1 + (C_mid / np.asarray(C, dtype=float)) ** B)


def write_run(path, A, B, C_mid, seed, steps=801, hours_per_step=40.0, eval_every=10):
    """metrics.jsonl as train.py writes it: every step logs step/gpu_hours/tokens; evals every N."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for step in range(steps):
            rec = {"step": step, "gpu_hours": step * hours_per_step, "tokens": step * 1e6}
            if step % eval_every == 0:
                g = step * hours_per_step
                rec["eval/pass_rate"] = (
                    R0 if step == 0 else float(eq1(g, A, B, C_mid) + rng.normal(0, 0.005))
                )
            f.write(json.dumps(rec) + "\n")
    return path


def table_rows(out):
    """The printed table's rows by run name; columns are separated by two or more spaces."""
    rows = [re.split(r"\s{2,}", line.strip()) for line in out.splitlines()]
    return {r[0]: r for r in rows[1:] if len(r) == len(rows[0]) and rows[0][0] == "run"}


def main(*argv):
    """fit_report.main on tyro-parsed arguments, as `python fit.py ARGV` runs it."""
    fit_report.main(tyro.cli(fit_report.Args, args=[str(a) for a in argv]))


def run_fit_py(*argv, cwd):
    """`python fit.py ARGV` in a subprocess: (exit code, stdout, stderr)."""
    cmd = [sys.executable, os.path.join(ROOT, "fit.py"), *map(str, argv)]
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_cli(tmp_path, capsys):
    """Run a as its metrics.jsonl, run b as its directory."""
    write_run(tmp_path / "a" / "metrics.jsonl", 0.610, 1.92, 2542, seed=0)
    write_run(tmp_path / "b" / "metrics.jsonl", 0.645, 1.70, 4000, seed=1)
    png = tmp_path / "fit.png"
    a = tmp_path / "a" / "metrics.jsonl"
    main(
        a, tmp_path / "b", "--c-min", "1500", "--fit-until", "16000", "--n-boot", "20", "--out", png
    )
    out = capsys.readouterr().out
    rows = table_rows(out)
    # 81 evals at 0, 400, ..., 32000 GPU-h; step 0 is R0; c_min 1500 leaves 1600..16000 (37) to fit
    for name, (A, B, C_mid) in {"a": (0.610, 1.92, 2542), "b": (0.645, 1.70, 4000)}.items():
        r = rows[name]
        assert r[1] == "37" and float(r[2]) == R0
        assert abs(float(r[3]) - A) < 0.01
        lo, hi = map(float, r[5].strip("[]").split(", "))  # A's profile interval
        assert lo < float(r[3]) < hi and hi - lo < 0.1
        assert abs(float(r[7]) / B - 1) < 0.1 and abs(float(r[9]) / C_mid - 1) < 0.1
        mae, n_tail = r[12].split()
        assert float(mae) < 0.01 and n_tail == "(40)"  # extrapolation error on the held-out tail
    assert "comparison (§4)" in out and "-> b scales best" in out  # A 0.035 apart: ceiling decides
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_cli_other_x_column_and_r0(tmp_path, capsys):
    a = write_run(tmp_path / "a" / "metrics.jsonl", 0.610, 1.92, 2542, seed=0)
    main(a, "--x", "step", "--r0", "0.35", "--n-boot", "0", "--out", tmp_path / "s.png")
    r = table_rows(capsys.readouterr().out)["a"]
    assert r[1] == "80" and abs(float(r[3]) - 0.610) < 0.01  # steps 10..800 (step 0 has C = 0)
    assert abs(float(r[9]) / (2542 / 40) - 1) < 0.1  # C_mid in steps: 2542 GPU-h / 40 per step
    assert (tmp_path / "s.png").exists()


def one_line(text):
    """The single line of a message (stderr or a SystemExit's), or fail."""
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


def test_cli_no_path_is_a_usage_error(tmp_path):
    rc, out, err = run_fit_py(cwd=tmp_path)
    assert rc == 2 and out == "" and "no run given" in one_line(err) and "usage" in err
    assert not (tmp_path / "fit.png").exists()


def test_cli_missing_path_is_a_usage_error(tmp_path):
    rc, out, err = run_fit_py("runs/nope/metrics.jsonl", cwd=tmp_path)
    assert (
        rc == 2 and out == "" and one_line(err) == "fit.py: runs/nope/metrics.jsonl: no such file"
    )


@pytest.mark.parametrize("what", ["empty run directory", "--out folder"])
def test_cli_usage_errors_before_any_work(tmp_path, capsys, what):
    """A directory with no metrics.jsonl, a --out folder that does not exist: exit 2 before any
    fit, so nothing printed on stdout and no plot."""
    good = write_run(tmp_path / "a" / "metrics.jsonl", 0.610, 1.92, 2542, seed=0)
    (tmp_path / "empty").mkdir()
    args = [tmp_path / "empty"] if what == "empty run directory" else [good]
    args += [
        "--out",
        tmp_path / "nope" / "fit.png" if what == "--out folder" else tmp_path / "f.png",
    ]
    with pytest.raises(SystemExit) as e:
        main(*args)
    out, err = capsys.readouterr()
    named = tmp_path / "empty" / "metrics.jsonl" if what == "empty run directory" else "--out"
    assert e.value.code == 2 and out == "" and str(named) in one_line(err)
    assert not (tmp_path / "f.png").exists()


def test_cli_bad_line_names_the_path_once(tmp_path):
    """A line that is not JSON before the last: exit 1, one line with path:line, the path once."""
    p = tmp_path / "a" / "metrics.jsonl"
    p.parent.mkdir()
    p.write_text('{"step": 0}\n{"step": 1, oops\n{"step": 2}\n')
    rc, out, err = run_fit_py(p, cwd=tmp_path)
    assert rc == 1 and out == "" and f"{p}:2: not a JSON object" in one_line(err)
    assert err.count(str(p)) == 1


def test_cli_cut_off_last_line_is_skipped(tmp_path, capsys):
    """A killed run's half-written last line (no newline) is skipped with a note: the same table
    as without it."""
    whole = write_run(tmp_path / "whole" / "metrics.jsonl", 0.610, 1.92, 2542, seed=0)
    cut = tmp_path / "cut" / "metrics.jsonl"
    cut.parent.mkdir()
    cut.write_text(whole.read_text() + '{"step": 801, "gpu_hours": 32040.0, "eval/pa')
    main(whole, "--n-boot", "0", "--out", tmp_path / "w.png")
    want = table_rows(capsys.readouterr().out)["whole"]
    main(cut, "--n-boot", "0", "--out", tmp_path / "c.png")
    out = capsys.readouterr().out
    assert table_rows(out)["cut"][1:] == want[1:]
    assert f"cut: {cut}:802: last line cut off (not JSON), skipped" in out


def test_cli_two_files_in_one_folder_get_distinct_names(tmp_path, capsys):
    a = write_run(tmp_path / "flat" / "metrics.jsonl", 0.610, 1.92, 2542, seed=0)
    b = write_run(tmp_path / "flat" / "metrics-b.jsonl", 0.645, 1.70, 4000, seed=1)
    main(a, b, "--n-boot", "0", "--out", tmp_path / "fit.png")
    out = capsys.readouterr().out
    assert set(table_rows(out)) == {"flat/metrics", "flat/metrics-b"}
    assert "-> flat/metrics-b scales best" in out  # A 0.645 vs 0.610: the ceiling decides


@pytest.mark.parametrize(
    "paths,names",
    [
        (["runs/a/metrics.jsonl", "runs/b/metrics.jsonl"], ["a", "b"]),
        (["runs/a/m1.jsonl", "runs/a/m2.jsonl", "runs/b/m1.jsonl"], ["a/m1", "a/m2", "b"]),
        (["x/a/metrics.jsonl", "y/a/metrics.jsonl"], ["x/a/metrics", "y/a/metrics"]),
    ],
)
def test_run_names(paths, names):
    assert fit_report.run_names(paths) == names


def test_run_names_same_file_twice(capsys):
    with pytest.raises(SystemExit) as e:
        fit_report.run_names(["runs/a/metrics.jsonl", "runs/b/../a/metrics.jsonl"])
    assert e.value.code == 2 and "given twice" in one_line(capsys.readouterr().err)


def test_load_metrics(tmp_path):
    p = tmp_path / "m.jsonl"
    p.write_text(
        '{"step": 2, "gpu_hours": 2.0, "eval/pass_rate": 0.5}\n{"step": 1, "gpu_hours": 1.0}\n\n'
        '{"step": 0, "gpu_hours": 0.0, "eval/pass_rate": 0.4}\n'
    )
    C, R, note = fit_report.load_metrics(p)
    assert C.tolist() == [0.0, 2.0] and R.tolist() == [0.4, 0.5] and note == ""
    p.write_text('{"step": 0, "eval/pass_rate": 0.4}\n')
    with pytest.raises(ValueError, match="m.jsonl:1: has 'eval/pass_rate' but no 'gpu_hours'"):
        fit_report.load_metrics(p)
    p.write_text('{"step": 0, "gpu_hours": 0.0, "eval/pass_rate": null}\n')
    with pytest.raises(ValueError, match="m.jsonl:1: 'gpu_hours' or 'eval/pass_rate' is not a num"):
        fit_report.load_metrics(p)
    p.write_text('[1, 2]\n{"step": 0, "gpu_hours": 0.0, "eval/pass_rate": 0.4}\n')
    with pytest.raises(ValueError, match="m.jsonl:1: not a JSON object"):
        fit_report.load_metrics(p)
