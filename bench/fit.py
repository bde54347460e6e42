"""Benchmark: fit.py's fast sigmoid fit against the paper's A.5 grid on the Table 1 curves (PAPER.md 10.1).

`python bench/fit.py` (about 2 minutes on 2 CPU cores: the grid runs 7,100 curve_fit calls per curve).
Data as in tests/test_fit.py: R0 = 0.35, 40 evals evenly spaced in compute from 0.2 C_mid to 8 C_mid,
Gaussian noise sigma = 0.005, seed 0. Prints per curve the time ratio grid/fast and the SSE ratio
fast/grid (<= 1 + 1e-9 means fast is no worse), then the totals. Ratios, not absolute times: this
machine is shared and noisy.
"""

import os
import sys
import time

import numpy as np

sys.path[0] = os.path.dirname(
    os.path.dirname(os.path.abspath(__file__))
)  # repo root, not bench/ (name clash)
import fit  # noqa: E402

TABLE_1 = [  # PAPER.md 10.1: (experiment, C_mid, B, A)
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


def main():
    print(
        f"{'curve':<16} {'t_grid s':>8} {'t_fast ms':>9} {'speedup':>8} {'SSE fast/grid':>14} "
        f"{'A fast':>7} {'A grid':>7} {'A true':>7}"
    )
    t_grid = t_fast = 0.0
    worst = 0.0
    for name, C_mid, B, A in TABLE_1:
        C = np.linspace(0.2 * C_mid, 8 * C_mid, 40)
        R = fit.sigmoid(C, A, B, C_mid, 0.35) + np.random.default_rng(0).normal(0, 0.005, C.size)
        t0 = time.perf_counter()
        for _ in range(5):
            fast = fit.fit_sigmoid(C, R, 0.35)
        tf = (time.perf_counter() - t0) / 5
        t0 = time.perf_counter()
        grid = fit.fit_sigmoid(C, R, 0.35, method="grid")
        tg = time.perf_counter() - t0
        t_grid, t_fast, worst = t_grid + tg, t_fast + tf, max(worst, fast.sse / grid.sse)
        print(
            f"{name:<16} {tg:>8.2f} {1e3 * tf:>9.1f} {tg / tf:>7.0f}x {fast.sse / grid.sse:>14.6f} "
            f"{fast.A:>7.4f} {grid.A:>7.4f} {A:>7.3f}"
        )
    print(
        f"total: fast is {t_grid / t_fast:.0f}x faster than the A.5 grid; worst SSE ratio fast/grid = {worst:.6f} "
        f"({'fast no worse' if worst <= 1 + 1e-9 else 'FAST WORSE'})"
    )


if __name__ == "__main__":
    main()
