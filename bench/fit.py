"""Benchmark: fit.py's fast sigmoid fit against the paper's A.5 grid on the Table 1 curves
(A.13), and what the identifiability rule (fit._identify, A's profile) costs.

`python bench/fit.py` (about 2 minutes on 2 CPU cores: the grid runs 7,100 curve_fit calls per
curve). Data as in tests/test_fit.py: R0 = 0.35, 40 evals evenly spaced in compute from 0.2 C_mid to
8 C_mid, Gaussian noise sigma = 0.005, seed 0. Per curve: the grid's time, the fast fit's time with
the profile (fit_sigmoid) and without it (fit._fit_fast), their ratio grid / fast, the SSE ratio
fast / grid (<= 1 + 1e-9: fast is no worse), A from each and A's profile interval; then the totals
and one 200-resample bootstrap. Fast times are the best of 5 repeats of 5 fits; read ratios, not
absolute times: this machine is shared and noisy.
"""

import os
import sys
import time

import numpy as np

sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # root, not bench/
import fit  # noqa: E402

TABLE_1 = [  # Table 1 (A.13): (experiment, C_mid, B, A)
    ("ScaleRL", 2542, 1.92, 0.610),
    ("ScaleRL-32k", 11272, 1.89, 0.645),
    ("ScaleRL-8gen", 2542, 2.44, 0.585),
    ("ScaleRL-24gen", 3054, 2.22, 0.590),
    ("ScaleRL-32gen", 2936, 2.07, 0.595),
    ("ScaleRL-Scout", 4242, 1.65, 0.710),
    ("ScaleRL-bs512", 2818, 1.77, 0.605),
    ("ScaleRL-bs2048", 10909, 1.70, 0.645),
    ("math+code, math", 2896, 2.05, 0.595),
    ("math+code, code", 1675, 1.09, 0.615),
]


def best_time(f, repeats=5, n=5):
    """The least mean time of n calls of f over `repeats` rounds, in seconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        times.append((time.perf_counter() - t0) / n)
    return min(times)


def main():
    print(
        f"{'curve':<16} {'grid s':>6} {'fast ms':>7} {'no prof':>7} {'speedup':>7} "
        f"{'SSE f/g':>8} {'A fast':>6} {'A grid':>6} {'A true':>6}  A profile 95%"
    )
    t_grid = 0.0  # seconds summed over the curves: the A.5 grid, fast fit, fast fit unprofiled
    t_fast = 0.0
    t_bare = 0.0
    worst = 0.0
    for name, C_mid, B, A in TABLE_1:
        C = np.linspace(0.2 * C_mid, 8 * C_mid, 40)
        R = fit.sigmoid(C, A, B, C_mid, 0.35) + np.random.default_rng(0).normal(0, 0.005, C.size)
        fast = fit.fit_sigmoid(C, R, 0.35)
        tf = best_time(lambda C=C, R=R: fit.fit_sigmoid(C, R, 0.35))
        tb = best_time(lambda C=C, R=R: fit._fit_fast(C, R, 0.35))  # no profile: the bare fit
        t0 = time.perf_counter()
        grid = fit.fit_sigmoid(C, R, 0.35, method="grid")
        tg = time.perf_counter() - t0
        t_grid += tg
        t_fast += tf
        t_bare += tb
        worst = max(worst, fast.sse / grid.sse)
        lo, hi = fast.A_interval
        print(
            f"{name:<16} {tg:>6.2f} {1e3 * tf:>7.1f} {1e3 * tb:>7.1f} {tg / tf:>6.0f}x "
            f"{fast.sse / grid.sse:>8.4f} {fast.A:>6.4f} {grid.A:>6.4f} {A:>6.3f}  "
            f"[{lo:.4f}, {hi:.4f}]"
        )
    verdict = "fast no worse" if worst <= 1 + 1e-9 else "FAST WORSE"
    print(f"total: fast is {t_grid / t_fast:.0f}x faster than the A.5 grid (profile included); ")
    print(f"worst SSE ratio fast/grid = {worst:.6f} ({verdict})")
    print(
        f"fast fit: {1e3 * t_fast / len(TABLE_1):.1f} ms per curve with the profile, "
        f"{1e3 * t_bare / len(TABLE_1):.1f} ms without ({t_fast / t_bare:.2f}x)"
    )
    C = np.linspace(0.2 * 2542, 8 * 2542, 40)
    R = fit.sigmoid(C, 0.610, 1.92, 2542, 0.35) + np.random.default_rng(0).normal(0, 0.005, 40)
    t0 = time.perf_counter()
    bs = fit.bootstrap(fit.fit_sigmoid(C, R, 0.35), C, R, n_boot=200)
    print(
        f"bootstrap, 200 resamples (ScaleRL): {time.perf_counter() - t0:.1f} s, {bs.n_ok} "
        f"converged, A in [{bs.A[0]:.4f}, {bs.A[1]:.4f}]"
    )


if __name__ == "__main__":
    main()
