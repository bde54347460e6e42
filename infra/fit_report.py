"""fit.py's command line and Figure 1: train.py's metrics.jsonl files in, a table and a plot out.

`python fit.py runs/a/metrics.jsonl runs/b --fit-from 1500 --fit-until 8000`: fit.py stays the
command and calls `cli` here. A run directory stands for its metrics.jsonl; each run is fitted
with fit.py (R0 = its step-0 eval) on its evals from --fit-from on, bootstrapped, compared by the
§4 rule when there are several, and drawn. Kept apart from fit.py, which is pure (arrays in,
numbers out): this file reads files, prints and draws. records.final_fit fits the whole run with
`whole_run_fit` and draws fit.png with `plot`; train.py ends a run by printing `summary`, its fits
in words.
"""

import json
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import tyro

from fit import A_MARGIN, Method, bootstrap, compare, extrapolate, fit_sigmoid


def load_metrics(path, x="gpu_hours", y="eval/pass_rate"):
    """train.py's metrics.jsonl, one JSON object per line; lines without `y` (no eval ran) are
    skipped, and so is a last line that is not JSON (cut off by a kill: checkpoint.truncate_log
    drops it too). Returns float64 (C, R) sorted by C and a note on a line skipped so ("" if
    none). Raises ValueError naming the path and line for a bad line before the last, a `y` without
    `x` or a value that is not a number, and if no line has `y`; OSError if it cannot be read."""
    with open(path) as f:
        lines = f.read().splitlines()
    last = max([k for k, line in enumerate(lines, 1) if line.strip()], default=0)
    pts = []
    note = ""
    for k, line in enumerate(lines, 1):
        try:
            rec = json.loads(line) if line.strip() else {}
            if not isinstance(rec, dict):
                raise ValueError(f"a JSON {type(rec).__name__}, not an object")
        except ValueError as e:  # json.JSONDecodeError is one
            if k < last:
                raise ValueError(f"{path}:{k}: not a JSON object ({e})") from None
            rec = {}
            note = f"{path}:{k}: last line cut off (not JSON), skipped"
        if y in rec and x not in rec:
            raise ValueError(f"{path}:{k}: has {y!r} but no {x!r}")
        try:
            if y in rec:
                pts.append((float(rec[x]), float(rec[y])))
        except (TypeError, ValueError):
            raise ValueError(f"{path}:{k}: {x!r} or {y!r} is not a number") from None
    if not pts:
        raise ValueError(f"{path}: no line has {y!r}")
    return (*np.array(sorted(pts)).T, note)


def _num(v):
    return f"{v:.0f}" if 10 <= abs(v) < 1e6 else f"{v:.3g}"


def plot(runs, out, *, xlabel, ylabel, fit_from=0.0, fit_until=None):
    """The paper's Figure 1, one colour per run: fitted points (dots), points below fit_from
    (hollow), held-out points (crosses), solid curve over the fitted range, dashed extrapolation,
    dotted line at A. runs: [(name, C, R, SigmoidFit)] with C, R 1-D arrays. Writes the image to
    `out`."""
    import matplotlib

    matplotlib.use("Agg")  # to a file, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (name, C, R, fit) in enumerate(runs):
        col = f"C{i}"
        end = fit_until or C.max()
        used = (C >= fit_from) & (C <= end)  # fitted
        held = C > end  # held out: the extrapolation's test
        ax.scatter(C[used], R[used], s=16, color=col, alpha=0.8)
        ax.scatter(C[C < fit_from], R[C < fit_from], s=16, facecolors="none", edgecolors=col)
        ax.scatter(C[held], R[held], s=30, marker="x", color=col, alpha=0.6)
        label = f"{name}: A={fit.A:.3f}  B={fit.B:.2f}  C_mid={_num(fit.C_mid)}"
        g = np.geomspace(C[used].min(), end, 200)
        ax.plot(g, fit.predict(g), color=col, lw=2, label=label + " (!)" * (not fit.converged))
        if held.any():
            g = np.geomspace(end, C.max() * 1.15, 100)
            ax.plot(g, fit.predict(g), "--", color=col, lw=2)
        ax.axhline(fit.A, color=col, ls=":", lw=1)
    if fit_until:
        ax.axvline(fit_until, color="grey", lw=0.8, ls="-.", label=f"fit until {fit_until:g}")
    ax.set(
        xscale="log", xlabel=xlabel, ylabel=ylabel, title="R = R0 + (A - R0) / (1 + (C_mid/C)^B)"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def run_names(paths):
    """A short, distinct name per metrics.jsonl: its folder's (train.py's run directory), else the
    fewest trailing path components, file stem included, that tell it from the others. Raises
    SystemExit(2) for a file given twice."""
    parts = [os.path.splitext(os.path.abspath(p))[0].split(os.sep) for p in paths]
    name = lambda p, k: p[-2] if k == 1 else "/".join(p[-k:])
    names = []
    for i, p in enumerate(parts):
        others = parts[:i] + parts[i + 1 :]
        ks = [k for k in range(1, len(p) + 1) if all(name(p, k) != name(q, k) for q in others)]
        if not ks:
            _usage(f"{paths[i]} given twice")
        names.append(name(p, ks[0]))
    return names


@dataclass
class Args:
    """Fits Eq. 1 to each run's eval pass rate against compute, prints a table and writes a plot."""

    paths: tyro.conf.Positional[list[str]]
    """metrics.jsonl files or run directories (DIR/metrics.jsonl), one per run"""
    x: str = "gpu_hours"
    """compute column: any logged column (gpu_hours, tokens, step)"""
    y: str = "eval/pass_rate"
    """metric column; lines without it (no eval ran) are skipped"""
    fit_from: float = 0.0
    """fit the evals at this compute (--x) and beyond, leaving out the early transient (paper A.5:
    1,500 GPU-hours; train.py's start is "fit_from" under "evals" in the run's fit.json)"""
    fit_until: float | None = None
    """fit on C <= this, report the mean absolute error of the prediction beyond it"""
    r0: float | None = None
    """R0; default: the eval at the smallest compute (step 0), which is then not a fit point"""
    method: Method = "fast"
    """fast (default) or the paper's A.5 grid (GPU-hour scale only)"""
    n_boot: int = 200
    """bootstrap resamples for the 95% intervals (0: none)"""
    seed: int = 0
    out: str = "fit.png"
    """the plot; its folder must exist"""


def _usage(msg):
    print(f"fit.py: {msg}", file=sys.stderr)
    raise SystemExit(2)


# the table's columns: per run, the fit, its bootstrap 95% intervals and A's profile interval
COLUMNS = ["run", "n", "R0", "A", "95% CI", "profile 95%", "paper", "B", "95% CI", "C_mid"]
COLUMNS += ["95% CI", "SSE", "MAE tail (n)"]


def _ci(v, f="{:.3f}".format):
    return f"[{f(v[0])}, {f(v[1])}]"


def _checked_paths(args: Args) -> list[str]:
    """The metrics.jsonl of each run; exits 2 on a usage error, before any work."""
    if not args.paths:
        _usage("no run given; usage: python fit.py RUN_DIR[/metrics.jsonl] ... [--fit-until X]")
    paths = [os.path.join(p, "metrics.jsonl") if os.path.isdir(p) else p for p in args.paths]
    for p in paths:
        if not os.path.isfile(p):
            _usage(f"{p}: no such file")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        _usage(f"--out {args.out}: no folder {folder}")
    if args.n_boot < 0:
        _usage(f"--n-boot {args.n_boot}: must be >= 0")
    return paths


def _fit_run(path: str, name: str, args: Args):
    """Load, fit and bootstrap one run -> ((name, C, R, fit) for `plot`, (C, R, R0) of its fit
    points for `compare`, its table row, its notes). Exits 1 when it cannot be read or fitted."""
    try:
        C, R, note = load_metrics(path, args.x, args.y)
    except (OSError, ValueError) as e:  # most name the path already: print it once
        raise SystemExit(f"fit.py: {e}" if path in str(e) else f"fit.py: {path}: {e}") from None
    c0 = C[0]
    if args.r0 is None:
        # R0 = the eval at the smallest compute (the step-0 eval, C = 0): it anchors the curve
        # there, so it is no fit point
        R0 = float(R[0])
        keep = C > c0
    else:
        R0 = args.r0
        keep = C > 0  # C = 0 is outside ln C
    C = C[keep]
    R = R[keep]
    head = C <= (math.inf if args.fit_until is None else args.fit_until)
    kw = dict(fit_from=args.fit_from, method=args.method)
    try:
        if args.fit_until is None:
            fit = fit_sigmoid(C, R, R0, **kw)
            mae = math.nan
            n_tail = 0
        else:
            fit, mae, n_tail = extrapolate(C, R, R0, fit_until=args.fit_until, **kw)
        bs = bootstrap(
            fit, C[head], R[head], fit_from=args.fit_from, n_boot=args.n_boot, seed=args.seed
        )
    except (ValueError, RuntimeError) as e:
        raise SystemExit(f"fit.py: {path}: {e}") from None
    row = [name, str(fit.n), f"{R0:.3f}", f"{fit.A:.4f}", _ci(bs.A, "{:.4f}".format)]
    row += [_ci(fit.A_interval), f"+-{A_MARGIN}", f"{fit.B:.3f}", _ci(bs.B)]
    row += [_num(fit.C_mid), _ci(bs.C_mid, _num), f"{fit.sse:.2e}", f"{mae:.4f} ({n_tail})"]
    notes = []
    if note:
        notes.append(f"{name}: {note}")
    if (~keep).sum() > 1:
        notes.append(f"{name}: {(~keep).sum()} evals at {args.x} <= {c0:g} are R0, not fitted")
    if (C < args.fit_from).any():
        n_out = int((C < args.fit_from).sum())
        notes.append(f"{name}: {n_out} evals at {args.x} < {args.fit_from:g} left out (--fit-from)")
    if bs.n_failed:
        notes.append(
            f"{name}: {bs.n_failed}/{args.n_boot} bootstrap refits failed or not converged"
        )
    if not fit.converged:
        notes.append(f"{name}: fit not trusted: {fit.message}")
    return (name, C, R, fit), (C[head], R[head], R0), row, notes


def _comparison(runs, fit_pts, fit_from: float) -> str:
    """The §4 rule's verdict over two or more runs (fit.compare), with B refitted at a shared A."""
    cmp = compare(fit_pts, fit_from=fit_from)
    shared = ""
    if cmp.refits is not None:
        Bs = (f"{r[0]} {f.B:.3f}" for r, f in zip(runs, cmp.refits, strict=True))
        shared = f" (B at shared A: {', '.join(Bs)})"
    return f"comparison (§4): {cmp.rule}{shared} -> {runs[cmp.best][0]} scales best"


def whole_run_fit(C, R, R0: float, n_boot: int = 200, fit_from: float = 0.0) -> dict:
    """Eq. 1 on the whole run (records.final_fit's "whole_run", bench/seeds.py's check): pass rate
    R against C (1-D arrays; C in gpu_hours, the compute clock; the evals after step 0), R0 = the
    step-0 eval, fitted on the evals at C >= fit_from (A.5: the early transient left out). Returns
    the fit's A, A_interval (A's 95% profile interval), B, C_mid, converged, message, and
    A_bootstrap, the pairs bootstrap's 95% interval for A (fit.bootstrap, n_boot refits; None when
    the fit did not converge or under 2 refits did); or {"error": ...} when fit_sigmoid raises
    (ValueError: under 4 evals, a flat curve)."""
    try:
        f = fit_sigmoid(C, R, R0, fit_from=fit_from)
    except (ValueError, RuntimeError) as e:
        return {"error": str(e)}
    boot = bootstrap(f, C, R, fit_from=fit_from, n_boot=n_boot).A
    out = {k: getattr(f, k) for k in ("A", "A_interval", "B", "C_mid", "converged", "message")}
    return out | {"A_bootstrap": list(boot) if np.isfinite(boot).all() else None}


def _fit_words(f: dict, whole: bool) -> str:
    """A fit of fit.json in words: A, trusted or why not (the whole run's also with its 95%
    intervals, B and C_mid); or why there is none."""
    if "error" in f:
        return f"no fit: {f['error']}"
    status = "A identified" if f["converged"] else f"fit not trusted: {f['message']}"
    if not whole:
        return f"A {f['A']:.3f} ({status})"
    ci = "profile [{:.3f}, {:.3f}]".format(*f["A_interval"])
    if f["A_bootstrap"]:  # None when the fit did not converge
        ci = "bootstrap [{:.3f}, {:.3f}], ".format(*f["A_bootstrap"]) + ci
    return f"A {f['A']:.3f} (95% {ci}), B {f['B']:.3g}, C_mid {f['C_mid']:.3g} gpu-hours ({status})"


def _span(steps: list[int]) -> str:
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def _fitted_words(evals: dict) -> str:
    """final_fit's "evals" in words: the evals fitted and those --fit-from left out."""
    kept = evals["whole_run"]
    left = evals["left_out"]
    fitted = f"the {len(kept)} evals of {_span(kept)}" if kept else "no eval"
    return (
        f"  fitted: {fitted}, from {evals['fit_from']:.4g} gpu-hours on; --fit-from leaves out "
        f"the {len(left)} before ({_span(left)}: the early transient, A.5)"
    )


def summary(run_dir: str, out: dict) -> str:
    """final_fit's `out` in a few lines for the console (train.py prints it at the end of a run;
    fit.json holds every number). Per curve (the run's, then each task's, indented): the pass rate
    from R0 (the step-0 eval) to the last eval; the whole-run fit; the §5 check, the first half's
    fit (compute, gpu_hours, up to fit_until) and its mean absolute error on the later evals. When
    --fit-from left evals out, a second line names the evals fitted (out["evals"]). A fit not to
    be trusted says why ("fit not trusted: A not identified: ..."); one that raised, its error.
    Never raises."""
    if "R0" not in out:  # no step-0 eval
        return f"run {run_dir}: {out['error']}"
    lines = []
    tasks = [(f"task {t}", "  ", c) for t, c in out.get("tasks", {}).items()]
    for name, pad, c in [(f"run {run_dir}", "", out), *tasks]:
        R0, final = c["R0"], c["final_pass_rate"]
        rise = f"{R0:.3f} (R0) -> {final:.3f} at the last eval ({final - R0:+.3f})"
        lines += [f"{pad}{name}: pass rate {rise}"]
        if c is out and out.get("evals", {}).get("left_out"):
            lines += [_fitted_words(out["evals"])]
        lines += [f"{pad}  whole run: {_fit_words(c['whole_run'], whole=True)}"]
        half = f"{pad}  first half (to {c['fit_until']:.3g} gpu-hours) -> second half: "
        lines += [half + _fit_words(c, whole=False)]
        if "n_tail" in c:
            lines[-1] += f"; mean error {c['tail_mae']:.3f} on the {c['n_tail']} later evals"
    plot = " and fit.png" * os.path.exists(os.path.join(run_dir, "fit.png"))
    return "\n".join(lines + [f"every number in {os.path.join(run_dir, 'fit.json')}{plot}"])


def main(args: Args):
    """The CLI. Exits 2 on a usage error, found before any work (no path, a missing file, a missing
    --out folder), 1 when a file cannot be read or fitted or a fit did not converge."""
    paths = _checked_paths(args)
    runs = []
    fit_pts = []
    notes = []
    table = [COLUMNS]
    for path, name in zip(paths, run_names(paths), strict=True):
        run, pts, row, run_notes = _fit_run(path, name, args)
        runs.append(run)
        fit_pts.append(pts)
        table.append(row)
        notes += run_notes
    widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
    print("\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table))
    if len(fit_pts) >= 2:
        notes.insert(0, _comparison(runs, fit_pts, args.fit_from))
    kw = dict(xlabel=args.x, ylabel=args.y, fit_from=args.fit_from, fit_until=args.fit_until)
    plot(runs, args.out, **kw)
    print("\n".join(notes + [f"wrote {args.out}"]))
    if any(not f.converged for *_, f in runs):
        raise SystemExit("fit.py: a fit did not converge (see above): do not trust its parameters")


def cli():
    """`python fit.py ...`: fit.py's entry point calls this."""
    main(tyro.cli(Args))
