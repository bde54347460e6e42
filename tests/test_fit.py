"""fit.py: the sigmoid compute-performance fits (§2.1, A.4-A.8; Table 1 of A.13).

Pins: Eq. 1 against a hand evaluation; recovery of every Table 1 row from noisy synthetic evals (all
points, and the paper's half-budget protocol with the prediction of the second half); exact recovery
on noise-free data; the same answer at CPU-hour, GPU-hour and FLOP scale; the A.5 grid agreeing with
the fast fit and never beating its SSE; each degenerate input raising or being flagged not
converged; the fixed-A refit and the §4 comparison rule; the identifiability rule (issue 12: a left
tail and a flat curve refused, a well-sampled curve kept, its profile interval's ends checked with
scipy's curve_fit); bootstrap intervals; A.4's power-law overshoot; extrapolate raises on a NaN eval
inside the fit range and in the held-out tail alike. The CLI:
tests/test_fit_report.py.
Every numpy/scipy warning is an error here: the module must emit none.
"""

import dataclasses
import math
import re
import warnings

import numpy as np
import pytest
from scipy.optimize import OptimizeWarning, curve_fit
from scipy.stats import t as student_t

import fit

pytestmark = pytest.mark.filterwarnings("error")

R0 = 0.35
TABLE_1 = [  # Table 1 (A.13): (experiment, C_mid GPU-h, B, A)
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
ROWS = pytest.mark.parametrize("name,C_mid,B,A", TABLE_1, ids=[r[0] for r in TABLE_1])


def eq1(C, A, B, C_mid, R0=R0):
    """Eq. 1 written out in plain numpy power form, independent of fit.sigmoid's expit form."""
    return R0 + (A - R0) / (1 + (C_mid / np.asarray(C, dtype=float)) ** B)


def evals(C_mid, B, A, noise=0.005, seed=0):
    """40 evals evenly spaced in compute from 0.2 C_mid to 8 C_mid, Gaussian noise (fixed seed)."""
    C = np.linspace(0.2 * C_mid, 8 * C_mid, 40)
    clean = eq1(C, A, B, C_mid)
    return C, clean + np.random.default_rng(seed).normal(0, noise, C.size), clean


def test_sigmoid_is_eq1():
    C = np.array([0.0, 1.0, 100.0, 2542.0, 1e5])
    want = [
        R0,
        eq1(1.0, 0.61, 1.92, 2542),
        eq1(100.0, 0.61, 1.92, 2542),
        (0.61 + R0) / 2,
        eq1(1e5, 0.61, 1.92, 2542),
    ]
    np.testing.assert_allclose(fit.sigmoid(C, 0.61, 1.92, 2542, R0), want, rtol=1e-14)
    assert fit.sigmoid(1e300, 0.61, 1.92, 1e-300, R0) == 0.61  # no overflow far past C_mid
    with pytest.raises(ValueError, match="negative"):
        fit.sigmoid([-1.0], 0.61, 1.92, 2542, R0)


@ROWS
def test_table1_fast_recovers_A(name, C_mid, B, A):
    C, R, _ = evals(C_mid, B, A)
    f = fit.fit_sigmoid(C, R, R0)
    assert f.converged, f.message
    assert abs(f.A - A) < 0.01
    assert f.n == 40 and f.sse == pytest.approx(
        ((eq1(C, f.A, f.B, f.C_mid) - R) ** 2).sum(), rel=1e-9
    )


@ROWS
def test_table1_half_budget_extrapolates(name, C_mid, B, A):
    """§5 protocol: fit on the first half of the compute budget (8 C_mid), predict the rest."""
    C, R, clean = evals(C_mid, B, A)
    f, mae, n_tail = fit.extrapolate(C, R, R0, fit_until=4 * C_mid)
    tail = C > 4 * C_mid
    assert f.converged and f.n == (~tail).sum() == 20 and n_tail == tail.sum() == 20
    assert abs(f.A - A) < 0.03
    # against the noise-free curve
    assert np.abs(eq1(C[tail], f.A, f.B, f.C_mid) - clean[tail]).mean() < 0.01
    assert mae == pytest.approx(np.abs(eq1(C[tail], f.A, f.B, f.C_mid) - R[tail]).mean(), rel=1e-9)


@ROWS
def test_table1_grid_agrees_with_fast(name, C_mid, B, A):
    """A.5 grid on the part of the paper's grids near the truth (A +- 0.03, C_mid within x2): same
    curve, and fast's SSE is never worse (it searches a superset: C_mid continuous)."""
    C, R, _ = evals(C_mid, B, A)
    gA = fit.PAPER_GRID_A[np.abs(fit.PAPER_GRID_A - A) < 0.03 + 1e-9]
    gC = fit.PAPER_GRID_C_MID[
        (fit.PAPER_GRID_C_MID >= C_mid / 2) & (fit.PAPER_GRID_C_MID <= 2 * C_mid)
    ]
    g = fit.fit_sigmoid(C, R, R0, method="grid", grid_A=gA, grid_C_mid=gC)
    f = fit.fit_sigmoid(C, R, R0)
    assert g.converged and g.A in gA and g.C_mid in gC and g.method == "grid"
    assert g.sse == pytest.approx(((eq1(C, g.A, g.B, g.C_mid) - R) ** 2).sum(), rel=1e-9)
    assert f.sse <= g.sse * (1 + 1e-9)
    assert abs(f.A - g.A) < 0.01
    assert np.abs(f.predict(C) - g.predict(C)).max() < 0.01


@pytest.mark.slow
def test_paper_grid_in_full():
    """The whole A.5 grid (71 x 100 curve_fit calls) on the ScaleRL row."""
    C, R, _ = evals(2542, 1.92, 0.610)
    g = fit.fit_sigmoid(C, R, R0, method="grid")
    f = fit.fit_sigmoid(C, R, R0)
    assert g.converged and g.A in fit.PAPER_GRID_A and g.C_mid in fit.PAPER_GRID_C_MID
    assert (
        len(fit.PAPER_GRID_A) == 71 and fit.PAPER_GRID_A[0] == 0.45 and fit.PAPER_GRID_A[-1] == 0.8
    )
    assert abs(g.A - 0.610) < 0.01 and f.sse <= g.sse * (1 + 1e-9)


@ROWS
def test_noise_free_exact(name, C_mid, B, A):
    C, _, clean = evals(C_mid, B, A)
    f = fit.fit_sigmoid(C, clean, R0)
    assert f.converged
    np.testing.assert_allclose([f.A, f.B, f.C_mid], [A, B, C_mid], rtol=1e-6)


# CPU-hours (C in 1e-3..1e-1), GPU-hours, FLOPs
@pytest.mark.parametrize("scale", [4e-6, 1.0, 1e17])
def test_scale_free(scale):
    C, R, clean = evals(2542, 1.92, 0.610)
    assert scale != 4e-6 or (1e-3 <= C.min() * scale and C.max() * scale <= 1e-1)
    exact = fit.fit_sigmoid(C * scale, clean, R0)
    np.testing.assert_allclose(
        [exact.A, exact.B, exact.C_mid], [0.610, 1.92, 2542 * scale], rtol=1e-6
    )
    noisy, ref = fit.fit_sigmoid(C * scale, R, R0), fit.fit_sigmoid(C, R, R0)
    assert noisy.converged and abs(noisy.A - 0.610) < 0.01
    np.testing.assert_allclose(
        [noisy.A, noisy.B, noisy.C_mid / scale], [ref.A, ref.B, ref.C_mid], rtol=1e-5
    )


def test_paper_grid_at_the_wrong_scale_raises():
    """At FLOP scale curve_fit hands back its start B = 1 with an infinite covariance at every grid
    point (checked directly below); the grid must say so, not return that start."""
    C, R, _ = evals(2542, 1.92, 0.610)
    C = C * 1e18
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)
        (B,), pcov = curve_fit(lambda c, B: R0 + (0.6 - R0) / (1 + (40000 / c) ** B), C, R)
    assert B == 1.0 and np.isinf(pcov).all()
    with pytest.raises(RuntimeError, match="infinite covariance"):
        fit.fit_sigmoid(C, R, R0, method="grid", grid_A=[0.6, 0.61], grid_C_mid=[100.0, 40000.0])


def test_grid_edge_is_flagged():
    C, R, _ = evals(2542, 1.92, 0.610)
    g = fit.fit_sigmoid(
        C, R, R0, method="grid", grid_A=[0.50, 0.52, 0.54], grid_C_mid=[2000.0, 2500.0, 3000.0]
    )
    assert not g.converged and "edge" in g.message and g.A == 0.54


C40 = np.linspace(500.0, 20000.0, 40)


@pytest.mark.parametrize(
    "C,R,kw,match",
    [
        (C40[:10], eq1(C40[:10], 0.6, 2, 3000), {"fit_from": C40[7]}, "need at least 4"),
        (C40, np.full(40, 0.5), {}, "flat"),
        (C40, eq1(C40, 0.6, 2, 3000)[::-1], {}, "does not increase"),
        (C40, np.where(C40 > 9000, np.nan, eq1(C40, 0.6, 2, 3000)), {}, "NaN or inf"),
        (np.where(C40 > 9000, np.inf, C40), eq1(C40, 0.6, 2, 3000), {}, "NaN or inf"),
        (C40 - 1000, eq1(C40, 0.6, 2, 3000), {}, "negative compute"),
        (np.r_[0.0, C40], np.r_[R0, eq1(C40, 0.6, 2, 3000)], {}, "compute 0"),
        (C40, eq1(C40, 0.6, 2, 3000), {"A": 0.3}, "fixed A"),
        (C40, eq1(C40, 0.6, 2, 3000), {"method": "newton"}, "method"),
        (C40, eq1(C40, 0.6, 2, 3000), {"method": "grid", "grid_A": [0.2, 0.6]}, "grid_A"),
    ],
    ids=[
        "too-few",
        "flat",
        "decreasing",
        "nan",
        "inf",
        "negative",
        "zero",
        "A<=R0",
        "method",
        "grid<=R0",
    ],
)
def test_bad_input_raises(C, R, kw, match):
    with pytest.raises(ValueError, match=match):
        fit.fit_sigmoid(C, R, R0, **kw)


def test_bad_R0_raises():
    with pytest.raises(ValueError, match="NaN or inf"):
        fit.fit_sigmoid(C40, eq1(C40, 0.6, 2, 3000), math.nan)
    with pytest.raises(ValueError, match="below 1"):
        fit.fit_sigmoid(C40, eq1(C40, 0.6, 2, 3000), 1.0)


def test_fit_from_drops_points_and_zero_compute():
    C = np.r_[0.0, C40]
    R = np.r_[R0, eq1(C40, 0.6, 2.0, 3000)]
    f = fit.fit_sigmoid(C, R, R0, fit_from=C40[5])
    assert f.n == 35 and f.converged and f.A == pytest.approx(0.6, rel=1e-6)


@pytest.mark.parametrize(
    "R,why",
    [
        (np.where(C40 < 5000, R0, 0.6), "singular Jacobian"),  # a step: B runs off to infinity
        (
            0.5 + np.random.default_rng(2).normal(0, 0.005, 40),
            "standard error",
        ),  # noise on a plateau, rising by chance
        (np.linspace(0.1, 0.3, 40), "singular Jacobian"),  # rising, but below R0: A pinned at R0
    ],
    ids=["step", "noisy-plateau", "below-R0"],
)
def test_degenerate_fit_is_flagged(R, why):
    f = fit.fit_sigmoid(C40, R, R0)
    assert not f.converged and why in f.message


def test_early_points_only_hit_the_A_bound():
    """Evals only up to half of C_mid: no sign of saturation, so the ceiling is not identified."""
    C = np.linspace(0.05 * 2542, 0.5 * 2542, 20)
    R = eq1(C, 0.61, 1.92, 2542) + np.random.default_rng(0).normal(0, 0.005, 20)
    f = fit.fit_sigmoid(C, R, R0)
    assert not f.converged and "A at its bound 1" in f.message and f.A == pytest.approx(1.0)


def test_fixed_A_refit():
    C, _, clean = evals(2542, 1.92, 0.610)
    f = fit.fit_sigmoid(C, clean, R0, A=0.610)
    assert f.fixed_A and f.A == 0.610 and f.converged and f.A_interval == (0.610, 0.610)
    np.testing.assert_allclose([f.B, f.C_mid], [1.92, 2542], rtol=1e-6)
    g = fit.fit_sigmoid(
        C, clean, R0, A=0.610, method="grid", grid_C_mid=np.linspace(2000, 3000, 11)
    )
    # the grid's nearest C_mid to 2542 wins at the true A
    assert g.fixed_A and g.A == 0.610 and g.C_mid == 2500.0


def test_comparison_rule_within_margin_refits_at_mean_A():
    """A 0.600 vs 0.610 (< 0.02 apart): both refit at their mean A; the higher B (run 0) wins."""
    runs = [(*evals(3000, 2.2, 0.600, seed=1)[:2], R0), (*evals(3000, 1.6, 0.610, seed=2)[:2], R0)]
    cmp = fit.compare(runs)
    assert cmp.A_shared == pytest.approx((cmp.fits[0].A + cmp.fits[1].A) / 2, abs=1e-15)
    assert all(f.fixed_A and f.A == cmp.A_shared and f.converged for f in cmp.refits)
    assert cmp.refits[0].B > cmp.refits[1].B and cmp.best == 0
    # a constrained fit cannot beat the free one
    for free, fixed in zip(cmp.fits, cmp.refits, strict=True):
        assert fixed.sse >= free.sse * (1 - 1e-9)
    assert "refit at mean A" in cmp.rule


def test_comparison_rule_ceiling_first():
    """A 0.60 vs 0.66 (>= 0.02 apart): no refit, the higher A wins although its B is lower."""
    runs = [(*evals(3000, 2.2, 0.60, seed=1)[:2], R0), (*evals(3000, 1.4, 0.66, seed=2)[:2], R0)]
    cmp = fit.compare(runs)
    assert cmp.refits is None and cmp.A_shared is None and cmp.best == 1
    assert cmp.fits[0].B > cmp.fits[1].B


def test_bootstrap():
    C, R, clean = evals(2542, 1.92, 0.610)
    f = fit.fit_sigmoid(C, R, R0)
    bs = fit.bootstrap(f, C, R, n_boot=60, seed=0)
    assert bs.n_ok + bs.n_failed == 60 and bs.n_ok >= 55
    assert bs.A[0] < 0.610 < bs.A[1] and bs.A[1] - bs.A[0] < 2 * fit.A_MARGIN
    assert bs.B[0] < f.B < bs.B[1] and bs.C_mid[0] < f.C_mid < bs.C_mid[1]
    # seeded, and each resample refitted from the fast method's own starts, not from the fit's
    # parameters: a fit object with absurd B, C_mid gives the same intervals
    absurd = dataclasses.replace(f, B=50.0, C_mid=1e-3)
    assert fit.bootstrap(absurd, C, R, n_boot=20, seed=1) == fit.bootstrap(
        f, C, R, n_boot=20, seed=1
    )
    # no noise: every refit exact
    exact = fit.bootstrap(fit.fit_sigmoid(C, clean, R0), C, clean, n_boot=10)
    np.testing.assert_allclose(
        [exact.A, exact.B, exact.C_mid], [[0.61] * 2, [1.92] * 2, [2542] * 2], rtol=1e-6
    )
    fixed = fit.bootstrap(fit.fit_sigmoid(C, R, R0, A=0.6), C, R, n_boot=10)
    assert fixed.A == (0.6, 0.6)
    # not converged: no intervals, every resample counted as failed
    step = np.where(C40 < 5000, R0, 0.6)
    none = fit.bootstrap(fit.fit_sigmoid(C40, step, R0), C40, step, n_boot=10)
    assert (
        none.n_ok == 0
        and none.n_failed == 10
        and all(math.isnan(v) for v in none.A + none.B + none.C_mid)
    )


# ---- A.4's power law, the alternative the paper rejects: only this test fits it


@dataclasses.dataclass
class PowerLawFit:
    """A.4's power law R(C) = A - D / C^B (B >= 0, D >= 0, A <= 1), fitted above a threshold."""

    A: float
    B: float
    D: float
    sse: float
    n: int
    converged: bool = True
    message: str = ""

    def predict(self, C):
        return self.A - self.D * np.exp(-self.B * np.log(np.asarray(C, dtype=np.float64)))


def fit_power_law(C, R, fit_from=0.0) -> PowerLawFit:
    """Least-squares fit of A.4's power law to the points with C >= fit_from (1-D C, R), with
    fit.py's own checks and least squares (fit._validate, fit._lsq). A.4: fitted from low compute it
    overshoots the ceiling (A 1.0 vs the sigmoid's 0.645). Raises as fit.fit_sigmoid; A at its
    bound 1, a singular Jacobian or a standard error above B or D gives converged=False."""
    C, R = fit._validate(C, R, 0.0, fit_from)
    x = np.log(C)
    u = x - x.mean()  # centred ln C: d = D exp(-B mean ln C) stays O(1) at any compute scale
    res = lambda p: p[0] - p[2] * np.exp(-p[1] * u) - R
    jac = lambda p: np.stack([np.ones_like(u), p[2] * u * np.exp(-p[1] * u), -np.exp(-p[1] * u)], 1)
    scan = []  # for a fixed B the model is linear in (A, d): one linear solve per start slope
    for B in np.geomspace(0.01, 64.0, 25) / np.ptp(x):
        X = np.stack([np.ones_like(u), -np.exp(-B * u)], axis=1)
        (A, d), *_ = np.linalg.lstsq(X, R)
        scan.append((float(((X @ [A, d] - R) ** 2).sum()), A, B, d))
    out, problems, se = fit._lsq(
        res, jac, [min(scan)[1:]], [-np.inf, 0.0, 0.0], [1.0, np.inf, np.inf]
    )
    A, B, d = out.x
    with np.errstate(over="ignore"):  # d = D exp(-B mean ln C), as centred above
        D = float(d * np.exp(B * x.mean()))
    if A >= 1 - 1e-9:
        problems.append("A at its bound 1")
    if not problems and (se[1:] > out.x[1:]).any():
        problems.append("standard error above the value of B or D: not determined by the data")
    msg = "; ".join(problems)
    return PowerLawFit(float(A), float(B), D, float(2 * out.cost), len(C), not msg, msg)


def test_power_law():
    """Exact on its own form; on the 100k-GPU-h run's sigmoid (A.4/A.7 values) it overshoots A when
    fit from 1.5k (A.4: 1.0, at its bound) or 5k (A.4: 0.74), and finds the ceiling from 30k-60k
    only."""
    C = np.geomspace(10, 1e4, 30)
    p = fit_power_law(C, 0.7 - 2.0 * C**-0.5)
    assert p.converged
    np.testing.assert_allclose([p.A, p.B, p.D], [0.7, 0.5, 2.0], rtol=1e-6)
    np.testing.assert_allclose(p.predict([100.0]), 0.7 - 2.0 / 10, rtol=1e-12)
    C = np.linspace(1500, 50000, 60)
    R = eq1(C, 0.645, 1.70, 10909)
    assert fit.fit_sigmoid(C, R, R0).A == pytest.approx(0.645, rel=1e-6)
    low = fit_power_law(C, R)
    assert low.A == pytest.approx(1.0) and not low.converged
    assert fit_power_law(C, R, fit_from=5000).A > 0.645 + 0.05
    C = np.linspace(30000, 60000, 20)
    assert abs(fit_power_law(C, eq1(C, 0.645, 1.70, 10909)).A - 0.645) < 0.01
    # rising by chance
    plateau = fit_power_law(C40, 0.5 + np.random.default_rng(2).normal(0, 0.005, 40))
    assert not plateau.converged and "standard error" in plateau.message


def test_extrapolate_needs_a_tail():
    C, R, _ = evals(2542, 1.92, 0.610)
    with pytest.raises(ValueError, match="nothing to extrapolate"):
        fit.extrapolate(C, R, R0, fit_until=C.max())


@pytest.mark.parametrize("k", [5, 35], ids=["fitted", "held-out"])
def test_extrapolate_nan_raises_inside_and_in_the_tail(k):
    # fit_until 15000 splits C40 (500, 1000, ..., 20000) at index 29: a NaN pass rate at 3000 (k 5)
    # or at 18000 (k 35) raises the same error naming its index; no NaN error comes back
    R = eq1(C40, 0.6, 2, 3000)
    R[k] = math.nan
    with pytest.raises(ValueError, match=re.escape(f"NaN or inf in C, R or R0 (indices [{k}])")):
        fit.extrapolate(C40, R, R0, fit_until=15000.0)


def threshold(sse, n):
    """t^2 s^2: Student's t 97.5% point on n - 3 degrees of freedom (scipy.stats, not fit.py's
    stdtrit), squared, times s^2 = sse / (n - 3)."""
    return student_t.ppf(0.975, n - 3) ** 2 * sse / (n - 3)


def sse_fixed_A(C, R, A, p0, R0=R0):
    """The least SSE of Eq. 1 with A fixed, by scipy's curve_fit on eq1's power form (B, C_mid > 0),
    independent of fit.py's expit form and optimizer."""
    f = lambda C_, B, C_mid: eq1(C_, A, B, C_mid, R0)
    (B, C_mid), _ = curve_fit(f, C, R, p0=p0, bounds=([1e-6, 1e-12], [np.inf, np.inf]))
    return float(((f(C, B, C_mid) - R) ** 2).sum())


LEFT_TAIL = np.linspace(0.1 / 16, 0.1, 16)  # 16 evals at C <= 0.1, far left of C_mid = 1


@pytest.mark.parametrize("seed", [2, 3, 5])
def test_left_tail_A_not_identified(seed):
    """Issue 12's example: R0 = 0.2, A = 0.8, B = 1, C_mid = 1, evals only at C <= 0.1, where R
    climbs from 0.2 to 0.25, noise 0.005. On these seeds fit.py before the rule returned A =
    0.27-0.29, converged. The true A fits within the noise yet lies far from the fitted A: refused,
    and A's profile interval holds the truth and reaches the bound 1."""
    R = eq1(LEFT_TAIL, 0.8, 1.0, 1.0, R0=0.2) + np.random.default_rng(seed).normal(0, 0.005, 16)
    f = fit.fit_sigmoid(LEFT_TAIL, R, 0.2)
    sse_true_A = sse_fixed_A(LEFT_TAIL, R, 0.8, (1.0, 1.0), R0=0.2)
    assert f.sse <= sse_true_A < f.sse + threshold(f.sse, 16) and abs(f.A - 0.8) >= 0.05
    assert not f.converged and "A not identified" in f.message
    assert f.A_interval[0] < 0.8 and f.A_interval[1] == 1.0


@ROWS
def test_table1_A_identified(name, C_mid, B, A):
    """Well sampled (0.2-8 C_mid): converged, A inside its profile interval, which is under 0.1 wide
    (A_CLEAR each side) and whose ends are where a fixed-A refit by scipy's curve_fit exceeds the
    least SSE by t^2 s^2 (within 5%: the ends are interpolated between profile points)."""
    C, R, _ = evals(C_mid, B, A)
    f = fit.fit_sigmoid(C, R, R0)
    lo, hi = f.A_interval
    assert f.converged and lo < f.A < hi and hi - lo < 2 * fit.A_CLEAR
    for end in (lo, hi):
        excess = sse_fixed_A(C, R, end, (f.B, f.C_mid)) - f.sse
        assert excess == pytest.approx(threshold(f.sse, 40), rel=0.05)


def free_fit(C, R, p0, R0=R0):
    """The least SSE of Eq. 1 with A unbounded (a ceiling past 1 allowed) and its A, by scipy's
    curve_fit on eq1's power form from p0 = (A, B, C_mid)."""
    f = lambda C_, A, B, C_mid: eq1(C_, A, B, C_mid, R0)
    p, _ = curve_fit(f, C, R, p0=p0, bounds=([R0, 1e-6, 1e-12], [np.inf, np.inf, np.inf]))
    return float(((f(C, *p) - R) ** 2).sum()), float(p[0])


def test_ceiling_at_the_bound_identified():
    """Issue 29: a policy that masters its task saturates at A = 1, Eq. 1's bound. Fixed-A refits
    by scipy show what the data say: A = 1 fits within the noise of the best unbounded fit and A =
    1.05 does not, so A = 1 is kept, converged, its interval closed at 1; the lower end where the
    refit exceeds the least SSE by t^2 s^2 (as test_table1_A_identified)."""
    C, R, _ = evals(2542, 1.92, 1.0)
    f = fit.fit_sigmoid(C, R, R0)
    sse_free, _ = free_fit(C, R, (1.0, 1.92, 2542))
    bar = threshold(sse_free, 40)
    assert sse_fixed_A(C, R, 1.0, (1.92, 2542)) - sse_free < bar
    assert sse_fixed_A(C, R, 1.0 + fit.A_CLEAR, (1.92, 2542)) - sse_free > bar
    assert f.A == pytest.approx(1.0, abs=1e-9) and f.converged, f.message
    lo, hi = f.A_interval
    assert hi == 1.0 and 1.0 - fit.A_CLEAR < lo < 1.0
    assert sse_fixed_A(C, R, lo, (f.B, f.C_mid)) - sse_free == pytest.approx(bar, rel=0.05)


def test_curve_heading_past_1_not_identified():
    """Evals up to 1.2 C_mid of a curve heading for 1.3 (0.36-0.91): the bound fit A = 1 is worse
    than the unbounded fit by more than the noise (scipy's refits), so the data show no ceiling."""
    C = np.linspace(0.1 * 2542, 1.2 * 2542, 30)
    R = eq1(C, 1.3, 1.92, 2542) + np.random.default_rng(0).normal(0, 0.002, 30)
    sse_free, A_free = free_fit(C, R, (1.3, 1.92, 2542))
    assert A_free > 1.0 + fit.A_CLEAR
    assert sse_fixed_A(C, R, 1.0, (1.92, 2542)) - sse_free > threshold(sse_free, 30)
    f = fit.fit_sigmoid(C, R, R0)
    assert f.A == pytest.approx(1.0, abs=1e-9) and not f.converged
    assert "A at its bound 1: Eq. 1 extended past it fits better" in f.message
    assert 1.0 < f.A_interval[0] < A_free < f.A_interval[1]  # the ends past 1, not clipped


def test_flat_curve_A_not_identified():
    """No rise: R = R0 + noise (a seed whose trend against ln C is positive, so that it is not
    rejected as decreasing). Any A fits with C_mid beyond the data: the curve stays at R0 there,
    SSE = sum (R - R0)^2, within the noise of the least. Refused."""
    R = R0 + np.random.default_rng(2).normal(0, 0.005, 40)
    assert np.cov(np.log(C40), R)[0, 1] > 0
    f = fit.fit_sigmoid(C40, R, R0)
    assert ((R - R0) ** 2).sum() < f.sse + threshold(f.sse, 40)
    assert not f.converged and "A not identified" in f.message and f.A_interval[1] == 1.0
