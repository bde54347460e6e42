"""Benchmark: a recipe comparison in miniature (paper §4, Figure 2): ScaleRL against DeepSeek's
GRPO recipe.

    python bench/recipes.py     # 2 recipes x 2 seeds of the default run, one at a time
    python bench/recipes.py --runs-dir runs/recipes --reuse   # refit finished runs, train the rest
    python bench/recipes.py --steps 4 --eval-every 2 --eval-size 8 --eval-n 2   # smoke test (extra
                                                   # flags go to every train.py run)

Each run is `python train.py --recipe R --seed S` with the default (tiny) preset, so each arm sees
the same warm-started model, held-out split and prompt order per seed. Every run's held-out curve
(eval/pass_rate against --x, default gpu_hours) is fitted with Eq. 1 (R0 = its step-0 eval); each
recipe's two seeds are then pooled into one curve (all their points, R0 = the mean of their R0)
and fitted again. Printed per run and per pooled recipe: A, B and C_mid (the compute to reach half
the gain A - R0) with pairs-bootstrap 95% intervals; then the paper's verdict on the pooled curves,
fit.compare (§4, A.5, Fig 8a): when the A differ by the margin 0.02 or more, the higher A wins;
otherwise both are refitted at their mean A and the higher B wins. The verdict is also given per
seed, so a reader sees whether the seeds agree. The paper's ordering (Figure 2, A.16):
ScaleRL A = 0.61 above DeepSeek (GRPO) at 0.49, at 100k GPU-hours on an 8B model.

Where this departs from the paper, and why: two seeds and one 0.43M-parameter model on a synthetic
task, minutes of CPU instead of 100k GPU-hours; on a CPU `fp32_head` is a no-op, so the GRPO arm
differs from ScaleRL in the loss (GRPO clipping, sample-level aggregation, prompt-level advantage
normalisation), the off-policy mode (PPO-off-policy-k instead of PipelineRL-k), and no
zero-variance filter or No-Positive-Resampling (config.RECIPES).
"""

import argparse
import math
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # repo root, not bench/ (bench/fit.py would shadow fit.py)
import fit  # noqa: E402
from infra.fit_report import _num, load_metrics  # noqa: E402

PAPER_A = {"scalerl": 0.61, "deepseek-grpo": 0.49}  # Figure 2 (A.16)


def train(run_dir: str, recipe: str, seed: int, extra: list[str], timeout: float) -> float:
    """One `python train.py` run into run_dir; returns its wall seconds. Raises RuntimeError naming
    the run and the log file when train.py fails or runs past `timeout` s."""
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--run-dir", run_dir]
    cmd += ["--recipe", recipe, "--seed", str(seed), *extra]
    log = run_dir + ".log"
    print(f"train: {' '.join(cmd[1:])}  (log: {log})", flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{run_dir}: train.py ran past {timeout:g} s; see {log}") from e
    if rc != 0:
        raise RuntimeError(f"{run_dir}: train.py exited with {rc}; see {log}")
    return time.perf_counter() - t0


def curve(run_dir: str, x: str) -> tuple[np.ndarray, np.ndarray, float]:
    """(C, R, R0) of a finished run: its evals past the first, and the first eval (step 0) as R0."""
    C, R, _ = load_metrics(os.path.join(run_dir, "metrics.jsonl"), x)
    if len(C) < 5:
        raise ValueError(f"{run_dir}: {len(C)} evals; a fit needs R0 and at least 4 more")
    return C[1:], R[1:], float(R[0])


def describe(name: str, C, R, R0, n_boot: int) -> tuple[list[str], fit.SigmoidFit]:
    """One table row (A, B, C_mid with bootstrap 95% intervals) and the fit; a failed fit gives a
    row naming the error and None."""
    try:
        f = fit.fit_sigmoid(C, R, R0)
        bs = fit.bootstrap(f, C, R, n_boot=n_boot)
    except (ValueError, RuntimeError) as e:
        return [name, f"{R0:.3f}", f"{R[-1]:.3f}", f"fit failed: {e}", "", "", "", "", ""], None
    num = _num
    return [
        name,
        f"{R0:.3f}",
        f"{R[-1]:.3f}",
        f"{f.A:.3f}",
        f"[{bs.A[0]:.3f}, {bs.A[1]:.3f}]",
        f"{f.B:.2f}",
        f"[{bs.B[0]:.2f}, {bs.B[1]:.2f}]",
        num(f.C_mid),
        f"[{num(bs.C_mid[0])}, {num(bs.C_mid[1])}]"
        + ("" if f.converged else f"  fit not trusted: {f.message}"),
    ], f


def verdict(names: list[str], curves: list[tuple]) -> str:
    """fit.compare's §4 verdict on [(C, R, R0), ...], in one line."""
    try:
        cmp = fit.compare(curves)
    except (ValueError, RuntimeError) as e:
        return f"no verdict: {e}"
    shared = (
        ""
        if cmp.refits is None
        else " (B at the shared A: "
        + ", ".join(f"{n} {f.B:.2f}" for n, f in zip(names, cmp.refits, strict=True))
        + ")"
    )
    return f"{cmp.rule}{shared} -> {names[cmp.best]} scales best"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", nargs=2, default=["scalerl", "deepseek-grpo"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--runs-dir", default=os.path.join(ROOT, "runs", "recipes"))
    p.add_argument(
        "--reuse", action="store_true", help="keep finished runs (metrics.jsonl + fit.json)"
    )
    p.add_argument("--x", default="gpu_hours", help="compute axis: gpu_hours (paper), step, tokens")
    p.add_argument("--n-boot", type=int, default=200)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per train.py run")
    args, extra = p.parse_known_args(argv)  # unknown flags go to train.py
    runs = {}
    for seed in args.seeds:  # seeds outer: a run stopped midway leaves both arms of the first seeds
        for recipe in args.recipes:
            run_dir = os.path.join(args.runs_dir, f"{recipe}-s{seed}")
            done = os.path.exists(os.path.join(run_dir, "fit.json"))
            if not (args.reuse and done):
                if os.path.exists(run_dir):
                    raise SystemExit(f"{run_dir} exists; pass --reuse or remove it")
                train(run_dir, recipe, seed, extra, args.timeout)
            runs[recipe, seed] = curve(run_dir, args.x)
    head = ["run", "R0", "final", "A", "95% CI", "B", "95% CI", f"C_mid ({args.x})", "95% CI"]
    table, pooled = [head], {}
    for recipe in args.recipes:
        for seed in args.seeds:
            table.append(describe(f"{recipe} s{seed}", *runs[recipe, seed], args.n_boot)[0])
        pts = [runs[recipe, s] for s in args.seeds]
        C, R = np.concatenate([c for c, _, _ in pts]), np.concatenate([r for _, r, _ in pts])
        order = np.argsort(C, kind="stable")
        pooled[recipe] = (C[order], R[order], float(np.mean([r0 for *_, r0 in pts])))
        table.append(describe(f"{recipe} (pooled)", *pooled[recipe], args.n_boot)[0])
    widths = [max(len(row[k]) for row in table) for k in range(len(head))]
    print(
        "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table)
    )
    print(f"verdict, pooled seeds: {verdict(args.recipes, [pooled[r] for r in args.recipes])}")
    for seed in args.seeds:
        print(
            f"verdict, seed {seed}: {verdict(args.recipes, [runs[r, seed] for r in args.recipes])}"
        )
    paper = ", ".join(f"{r} A={PAPER_A[r]}" for r in args.recipes if r in PAPER_A)
    paper = paper or "not in Figure 2"
    print(f"paper (Figure 2, 8B, 100k GPU-h): {paper}; margin on A: +-{fit.A_MARGIN}")
    return 0 if not any(math.isnan(runs[k][2]) for k in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
