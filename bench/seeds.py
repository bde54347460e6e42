"""Benchmark: does the default run show the paper's method on every seed (issue 12; §5 fits half)?

    python bench/seeds.py            # python train.py --seed S for S = 0, 1, 2, one at a time
    python bench/seeds.py --seeds 0 1 2 7 11 13   # any seeds
    python bench/seeds.py --reuse    # refit finished runs, train only the missing ones
    python bench/seeds.py --seeds 0 --steps 4 --eval-every 2 --eval-size 8   # smoke (extra flags go
                                                   # to every train.py run)

Each run's held-out curve (eval/pass_rate against gpu_hours, R0 = its step-0 eval) is fitted twice
with fit.py: on the whole run, and on the first half of its compute (fit.extrapolate, the §5
protocol). Printed per seed, with the bar each must clear:
- rise: final pass rate - R0 >= 0.30;
- the whole-run fit converged with A identified (fit.fit_sigmoid's profile rule) and its
  pairs-bootstrap 95% interval for A at most 0.10 wide;
- the half-run fit predicts the later evals within 0.03 on average (MAE) and its A lies within
  0.05 of the whole run's;
- no late fall: the last eval at most 0.05 below the run's best (issue 29: the curve saturates
  and stays);
- wall seconds of the train.py process (the tiny model's build included when it was not cached).
One figure (--figure, default RUNS_DIR/seeds.png): every seed's evals, its half-run fit (solid up to
half the compute, dashed beyond) and its whole-run A (dotted). Exits 1 when a seed misses a bar.
"""

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # repo root, not bench/ (bench/fit.py would shadow fit.py)
import fit  # noqa: E402
from bench import recipes  # noqa: E402
from infra.fit_report import load_metrics, whole_run_fit  # noqa: E402

# issue 12's acceptance, and issue 29's fall from the best eval to the last
BARS = dict(rise=0.30, A_width=0.10, tail_mae=0.03, dA=fit.A_CLEAR, fall=0.05)


def train(run_dir: str, seed: int, extra: list[str], timeout: float) -> float:
    """`python train.py --seed seed` (with --recipe scalerl, the default) into run_dir, as
    bench/recipes.py runs it; returns its wall seconds. Raises RuntimeError naming the run and its
    log when train.py fails or runs past `timeout` s."""
    return recipes.train(run_dir, "scalerl", seed, extra, timeout)


def check(run_dir: str, n_boot: int) -> dict:
    """The acceptance numbers of one finished run (see the module docstring): R0, final, rise, the
    whole-run fit (A, its profile and bootstrap intervals, converged and why not), the half-run
    fit's A, its tail MAE and |A_half - A|, the fall from the best eval to the last; `ok` per bar.
    Raises ValueError (fit_sigmoid's) when the run has fewer than 5 evals."""
    C, R, _ = load_metrics(os.path.join(run_dir, "metrics.jsonl"))
    R0, C, R = float(R[0]), C[1:], R[1:]
    whole = whole_run_fit(C, R, R0, n_boot)  # the fit train.py's summary prints
    if "error" in whole:
        raise ValueError(whole["error"])
    boot = whole["A_bootstrap"] or (np.nan, np.nan)  # None: no interval, the A bar fails
    half, mae, n_tail = fit.extrapolate(C, R, R0, fit_until=C[-1] / 2)
    out = dict(
        R0=R0,
        final=float(R[-1]),
        rise=float(R[-1]) - R0,
        A=whole["A"],
        B=whole["B"],
        C_mid=whole["C_mid"],
        converged=whole["converged"],
        message=whole["message"],
        A_profile=whole["A_interval"],
        A_boot=boot,
        A_half=half.A,
        tail_mae=mae,
        n_tail=n_tail,
        dA=abs(half.A - whole["A"]),
        fall=float(R.max() - R[-1]),  # the evals after R0
    )
    width = boot[1] - boot[0]
    out["ok"] = dict(
        rise=out["rise"] >= BARS["rise"],
        A=whole["converged"] and width <= BARS["A_width"],  # NaN width (no bootstrap) fails
        half=mae <= BARS["tail_mae"] and out["dA"] <= BARS["dA"],
        fall=out["fall"] <= BARS["fall"],
    )
    return out | dict(curve=(C, R), half_fit=half)


def figure(runs: dict, out: str) -> None:
    """Writes the seeds figure to `out`: per seed, evals fitted by the half-run fit (dots), held out
    (crosses), R0 (hollow, drawn at a quarter of the first eval's compute), the half-run fit (solid,
    dashed beyond half) and the whole-run A (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (seed, r) in enumerate(runs.items()):
        (C, R), f, col = r["curve"], r["half_fit"], f"C{i}"
        half = C[-1] / 2
        ax.scatter(C[C <= half], R[C <= half], s=18, color=col)
        ax.scatter(C[C > half], R[C > half], s=30, marker="x", color=col)
        ax.scatter([C[0] / 4], [r["R0"]], s=18, facecolors="none", edgecolors=col)
        g = np.geomspace(C[0] / 4, half, 200)
        label = f"seed {seed}: R0 {r['R0']:.2f}, half-run A {f.A:.3f}, whole-run A {r['A']:.3f}"
        ax.plot(g, f.predict(g), color=col, lw=2, label=label)
        g = np.geomspace(half, C[-1] * 1.1, 100)
        ax.plot(g, f.predict(g), "--", color=col, lw=2)
        ax.axhline(r["A"], color=col, ls=":", lw=1)
    ax.set(
        xscale="log",
        xlabel="compute (gpu_hours: hours of the 2-core CPU)",
        ylabel="held-out pass rate (T = 1)",
        title="python train.py --seed S: half-run fit (dots), held out (x), whole-run A (dotted)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "seeds"))
    p.add_argument("--reuse", action="store_true", help="keep finished runs (those with fit.json)")
    p.add_argument("--figure", default=None, help="default: RUNS_DIR/seeds.png")
    p.add_argument("--n-boot", type=int, default=200)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per train.py run")
    args, extra = p.parse_known_args(argv)  # unknown flags go to train.py
    os.makedirs(args.runs_dir, exist_ok=True)
    runs, wall, failed = {}, {}, {}
    for seed in args.seeds:
        run_dir = os.path.join(args.runs_dir, f"s{seed}")
        if not (args.reuse and os.path.exists(os.path.join(run_dir, "fit.json"))):
            if os.path.exists(run_dir):
                raise SystemExit(f"{run_dir} exists; pass --reuse or remove it")
            wall[seed] = train(run_dir, seed, extra, args.timeout)
        try:
            runs[seed] = check(run_dir, args.n_boot)
        except (ValueError, RuntimeError) as e:  # a curve fit_sigmoid refuses (flat, too few evals)
            failed[seed] = str(e)
            print(f"seed {seed}: no fit: {e}")
    for seed, r in runs.items():
        print(
            f"seed {seed}: R0 {r['R0']:.3f} final {r['final']:.3f} rise {r['rise']:+.3f} "
            f"[{'ok' if r['ok']['rise'] else 'MISS'}] | whole-run A {r['A']:.3f} B {r['B']:.2f} "
            f"profile [{r['A_profile'][0]:.3f}, {r['A_profile'][1]:.3f}] bootstrap "
            f"[{r['A_boot'][0]:.3f}, {r['A_boot'][1]:.3f}] "
            f"{'converged' if r['converged'] else 'fit not trusted: ' + r['message']} "
            f"[{'ok' if r['ok']['A'] else 'MISS'}] | half-run A {r['A_half']:.3f} "
            f"(|dA| {r['dA']:.3f}) tail MAE {r['tail_mae']:.3f} on {r['n_tail']} evals "
            f"[{'ok' if r['ok']['half'] else 'MISS'}] | fall best -> last {r['fall']:.3f} "
            f"[{'ok' if r['ok']['fall'] else 'MISS'}]"
            + (f" | wall {wall[seed]:.0f} s" if seed in wall else "")
        )
    if runs:
        figure(runs, args.figure or os.path.join(args.runs_dir, "seeds.png"))
    summary = {
        s: {k: v for k, v in r.items() if k not in ("curve", "half_fit")} for s, r in runs.items()
    }
    with open(os.path.join(args.runs_dir, "seeds.json"), "w") as f:
        json.dump(dict(runs=summary, failed=failed, wall_s=wall, bars=BARS), f, indent=1)
    return 0 if not failed and all(all(r["ok"].values()) for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
