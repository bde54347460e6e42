"""infra/fit_report.py, fit.py's command line (issue 13 item 11): a table whose numbers match the
generating curves, the comparison verdict and the PNG; a run directory for its metrics.jsonl; one-
line errors with exit code 2 for usage errors found before any work (no path, a missing file or
--out folder) and 1 for a file that cannot be read or fitted, each naming the path once; distinct
run names for two files in one folder; a cut-off last line skipped with a note, a bad line before it
refused. --fit-from (issue 26): on a qwen3-8b-shaped history with an early transient, the preset's
start (1/5 of the run's compute) recovers the true A in records.final_fit (whole run, first half),
records.curve_fit and `python fit.py --fit-from`, fit.json and the summary name the evals fitted,
and fitting from the start (the tiny preset's) misses A by more than the margin."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tyro

import config
from fit import A_MARGIN
from infra import fit_report, records

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
        a,
        tmp_path / "b",
        "--fit-from",
        "1500",
        "--fit-until",
        "16000",
        "--n-boot",
        "20",
        "--out",
        png,
    )
    out = capsys.readouterr().out
    rows = table_rows(out)
    # 81 evals at 0, 400, ..., 32000 GPU-h; step 0 is R0; --fit-from 1500 leaves 1600..16000 (37)
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


# ---- --fit-from (issue 26, item 5): the early transient left out, as the paper does (A.5)

# a history shaped like the qwen3-8b preset: evals every 100 of 5,000 steps at 2 gpu-hours a step,
# on Eq. 1 with A 0.61, B 1.9, C_mid 2500, plus an early transient 0.1 (1 - C / 2000)^2 that is
# gone from 2000 gpu-hours (step 1000) on. The preset's start: 1/5 of the run's 10000 gpu-hours =
# 2000, the paper's first epoch (~1k of 5,000 steps at batch 768): steps 1000..5000 are fitted
# (41 evals), steps 100..900 (9) left out; the first half (C <= 5000) fits steps 1000..2500 (16)
# and holds out 2600..5000 (25).
STEPS_8B = np.arange(100, 5001, 100)
C_8B = 2.0 * STEPS_8B


def transient_curve(C):
    return eq1(C, 0.61, 1.9, 2500) + 0.1 * np.clip(1 - C / 2000, 0, None) ** 2


def transient_history():
    evals = [
        {"step": int(s), "gpu_hours": float(c), "eval/pass_rate": float(transient_curve(c))}
        for s, c in zip(STEPS_8B, C_8B, strict=True)
    ]
    return [{"step": 0, "gpu_hours": 0.0, "eval/pass_rate": R0}, *evals]


def test_final_fit_from_the_preset_start_reproduces_A(tmp_path):
    fit_from = config.parse_args(["--model", "qwen3-8b"]).fit_from
    out = records.final_fit(str(tmp_path), transient_history(), fit_from)
    whole = out["whole_run"]  # noise-free past the transient: the truth, A identified
    assert whole["converged"] and whole["A"] == pytest.approx(0.61, abs=1e-4)
    assert out["converged"] and out["A"] == pytest.approx(0.61, abs=1e-3)  # the first half
    assert out["tail_mae"] < 1e-3 and out["n_tail"] == 25
    assert out["evals"] == {
        "fit_from": 2000.0,
        "left_out": list(range(100, 901, 100)),
        "whole_run": list(range(1000, 5001, 100)),
        "first_half": list(range(1000, 2501, 100)),
        "held_out": list(range(2600, 5001, 100)),
    }
    with open(tmp_path / "fit.json") as f:
        assert json.load(f)["evals"] == out["evals"]
    lines = fit_report.summary(str(tmp_path), out).splitlines()
    assert lines[1] == (
        "  fitted: the 41 evals of steps 1000-5000, from 2000 gpu-hours on; --fit-from leaves out "
        "the 9 before (steps 100-900: the early transient, A.5)"
    )
    assert lines[2].startswith("  whole run: A 0.610 (95%") and lines[2].endswith("(A identified)")
    # an explicit start in gpu-hours is the same fit
    assert records.final_fit(str(tmp_path), transient_history(), 2000.0)["evals"] == out["evals"]


def test_final_fit_from_the_start_takes_in_the_transient(tmp_path):
    # the tiny preset's start, 0: every eval after step 0 is fitted, the transient too, and the A
    # found is off by more than the paper's margin (or not identified): what --fit-from is for
    fit_from = config.parse_args(["--model", "tiny"]).fit_from
    out = records.final_fit(str(tmp_path), transient_history(), fit_from)
    assert out["evals"]["fit_from"] == 0.0 and out["evals"]["left_out"] == []
    assert out["evals"]["whole_run"] == list(range(100, 5001, 100))
    whole = out["whole_run"]
    assert abs(whole["A"] - 0.61) > A_MARGIN or not whole["converged"]
    lines = fit_report.summary(str(tmp_path), out).splitlines()
    assert lines[1].startswith("  whole run: ")  # no evals left out: no line says so


def test_curve_fit_live_from_the_preset_start():
    history = transient_history()
    live = records.curve_fit(history, 5000, None)  # start: 1/5 of the projected 10000 gpu-hours
    assert (live["fit/from"], live["fit/n"]) == (2000.0, 41.0)
    assert live["fit/converged"] == 1.0 and live["fit/A"] == pytest.approx(0.61, abs=1e-4)
    assert live["fit/pred_final"] == pytest.approx(transient_curve(10000.0), abs=1e-4)
    whole = records.curve_fit(history, 5000, 0.0)
    assert whole["fit/n"] == 50.0
    assert abs(whole["fit/A"] - 0.61) > A_MARGIN or whole["fit/converged"] == 0.0
    # at step 1200 the projected run is 12000 gpu-hours, the start 2400: no eval to fit yet
    assert records.curve_fit(history[:13], 5000, None) == {}


def test_cli_fit_from(tmp_path, capsys):
    path = tmp_path / "r" / "metrics.jsonl"
    path.parent.mkdir()
    rows = [{"step": 0, "gpu_hours": 0.0, "eval/pass_rate": R0}]
    rows += [{"step": int(s), "gpu_hours": float(c)} for s, c in zip(STEPS_8B, C_8B, strict=True)]
    for r in rows[1:]:
        r["eval/pass_rate"] = float(transient_curve(r["gpu_hours"]))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(path, "--fit-from", "2000", "--n-boot", "0", "--out", tmp_path / "a.png")
    out = capsys.readouterr().out
    row = table_rows(out)["r"]
    assert row[1] == "41" and float(row[3]) == pytest.approx(0.61, abs=1e-4)
    assert "r: 9 evals at gpu_hours < 2000 left out (--fit-from)" in out
    with pytest.raises(SystemExit):  # from the start: A not identified, exit 1 after the table
        main(path, "--n-boot", "0", "--out", tmp_path / "b.png")
    row = table_rows(capsys.readouterr().out)["r"]
    assert row[1] == "50" and abs(float(row[3]) - 0.61) > A_MARGIN
