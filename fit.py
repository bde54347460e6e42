"""Sigmoid compute-performance curves: fit, compare, extrapolate, plot (ScaleRL §2.1, §4, A.4-A.8).

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)  =  R0 + (A - R0) expit(B (ln C - ln C_mid))   (Eq. 1)

A: ceiling (asymptotic pass rate), B: efficiency exponent, C_mid: compute at half the gain, R0: pass rate
before RL. `python fit.py runs/a/metrics.jsonl runs/b/metrics.jsonl --c-min 1500 --fit-until 8000` prints
a table and draws the paper's Figure 1 (fit.png).

Where this departs from the paper, and why:
1. The default method="fast" is not the A.5 grid but bounded multi-start least squares over A, B, C_mid
   (R0 <= A <= 1, B >= 0), started in every basin of a coarse scan with A solved in closed form. It reaches
   an SSE no worse than the grid's, far faster, at any compute scale (the A.5 C_mid grid suits GPU-hours
   in the thousands only). method="grid" is A.5 as written.
2. The curve is always evaluated as expit(B (ln C - ln C_mid)): no power or exponential can overflow. The
   grid's per-point curve_fit uses this form too (the same function of B, the same start B = 1).
3. The grid skips points where curve_fit fails, gives B <= 0 (PAPER.md 8.1: B > 0), or hands back its
   start with an infinite covariance; an optimum on the grid's edge is flagged not converged.
4. R0 is held fixed (PAPER.md 8.3, [inferred]). The CLI takes it from the eval at the smallest compute
   (the step-0 eval, C = 0) and does not fit that point: C = 0 is outside ln C; Eq. 1 passes R0 there.
5. Bootstrap intervals are ours; the paper only states a +-0.02 margin on A (§4), shown beside them.
"""

import itertools
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np
import tyro
from scipy.optimize import OptimizeWarning, curve_fit, least_squares
from scipy.special import expit

A_MARGIN = 0.02  # §4, A.5: A varied by at most +-0.015 over three seeds, hence a 0.02 margin on A
PAPER_GRID_A = np.round(np.arange(0.450, 0.8001, 0.005), 3)  # A.5: 71 values
PAPER_GRID_C_MID = np.linspace(100.0, 40000.0, 100)  # A.5: 100 linearly spaced values (GPU-hours)
RANK_TOL = 1e-8  # Jacobian singular values: smallest/largest below this = infinite covariance


def sigmoid(C, A, B, C_mid, R0):
    """Eq. 1 (PAPER.md 8.1). C: array-like of compute >= 0 (any unit, C_mid's); A, B > 0, C_mid > 0, R0:
    floats. Returns the pass rate, float64 shaped like C (R0 at C = 0). Raises ValueError if any C < 0."""
    C = np.asarray(C, dtype=np.float64)
    if np.any(C < 0):
        raise ValueError("negative compute")
    with np.errstate(divide="ignore"):  # ln 0 = -inf -> expit(-inf) = 0 -> R0, the limit at C = 0
        return R0 + (A - R0) * expit(B * (np.log(C) - math.log(C_mid)))


@dataclass
class SigmoidFit:
    """A fitted Eq. 1 curve. converged=False: do not trust the numbers; `message` says why."""

    A: float
    B: float
    C_mid: float
    R0: float
    sse: float  # sum of squared residuals over the n fit points
    n: int
    converged: bool = True
    message: str = ""
    method: str = "fast"
    fixed_A: bool = False  # A was given (comparison-rule refit), not fitted

    def predict(self, C):
        return sigmoid(C, self.A, self.B, self.C_mid, self.R0)


def _validate(C, R, R0, c_min):
    """The checks every fit needs; drops C < c_min (A.5 step 1). Returns float64 (C, R) of the fit points."""
    C, R = np.asarray(C, dtype=np.float64), np.asarray(R, dtype=np.float64)
    if C.ndim != 1 or C.shape != R.shape:
        raise ValueError(
            f"C and R must be 1-D and equally long, got shapes {C.shape} and {R.shape}"
        )
    if not (np.isfinite(C).all() and np.isfinite(R).all() and math.isfinite(R0)):
        raise ValueError(
            f"NaN or inf in C, R or R0 (indices {np.flatnonzero(~np.isfinite(C + R)).tolist()})"
        )
    if np.any(C < 0):
        raise ValueError(f"negative compute at indices {np.flatnonzero(C < 0).tolist()}")
    C, R = C[C >= c_min], R[C >= c_min]
    if np.any(C == 0):
        raise ValueError(
            "compute 0 is outside the curve's domain (ln C): that eval is R0; drop it or raise c_min"
        )
    if np.unique(C).size < 4:
        raise ValueError(
            f"{np.unique(C).size} distinct compute values at C >= c_min={c_min}; need at least 4"
        )
    if not R0 < 1:
        raise ValueError(f"R0={R0} must be below 1, the largest possible A")
    if np.ptp(R) <= 1e-12 * max(1.0, np.abs(R).max()):
        raise ValueError(f"R is flat ({R[0]:.6g} everywhere): no curve to fit")
    if np.cov(np.log(C), R)[0, 1] <= 0:  # least-squares trend of R against ln C
        raise ValueError(
            "R does not increase with compute (trend against ln C <= 0): Eq. 1 cannot fit it"
        )
    return C, R


def _lsq(res, jac, starts, lo, hi):
    """Bounded least squares (trf) from each start. Returns the best result, the reasons not to trust it
    (the optimizer stopped early, a singular Jacobian = infinite covariance) and the parameters' standard
    errors from the covariance sse / (n - k) (J^T J)^-1 (what curve_fit reports)."""
    best = None
    for p0 in starts:
        p0 = np.clip(
            p0, np.add(lo, 1e-9), np.subtract(hi, 1e-9)
        )  # trf starts strictly inside the bounds
        out = least_squares(
            res,
            p0,
            jac=jac,
            bounds=(lo, hi),
            method="trf",
            x_scale="jac",
            ftol=1e-15,
            xtol=1e-15,
            gtol=1e-15,
            max_nfev=1000,
        )
        best = out if best is None or out.cost < best.cost else best
    J = best.jac
    sv = np.linalg.svd(J, compute_uv=False)
    se = np.sqrt(np.diag(np.linalg.pinv(J.T @ J)) * 2 * best.cost / max(len(J) - J.shape[1], 1))
    return (
        best,
        [
            m
            for bad, m in (
                (best.status <= 0, f"optimizer stopped: {best.message}"),
                (
                    sv[-1] <= RANK_TOL * sv[0],
                    "singular Jacobian (infinite covariance): "
                    "the data do not determine the parameters",
                ),
            )
            if bad
        ],
        se,
    )


def _fit_fast(C, R, R0, A=None, p0=None) -> SigmoidFit:
    """Least squares in (A, B, m) with m = ln C_mid - mean ln C ((B, m) if A is fixed), from the best cell
    of each basin of a coarse (B, m) scan (A - R0 is linear there: closed form), or from p0 = (A, B, C_mid)."""
    x = np.log(C)
    xm, fixed, r, w = x.mean(), A is not None, R - R0, max(np.ptp(x), 1e-12)
    u = x - xm  # centred ln C: the problem looks the same at any compute scale
    if p0 is None:
        Bs, ms = np.geomspace(0.25, 64.0, 17) / w, np.linspace(u.min() - 2 * w, u.max() + 2 * w, 41)
        s = expit(Bs[:, None, None] * (u - ms[:, None]))  # (17, 41, n)
        a = (
            np.full(s.shape[:2], A - R0)
            if fixed
            else np.clip(  # (17, 41) least-squares A - R0, in bounds
                (s * r).sum(-1) / np.maximum((s * s).sum(-1), 1e-300), 0.0, 1.0 - R0
            )
        )
        sse = ((r - a[..., None] * s) ** 2).sum(-1)  # (17, 41)
        pad = np.pad(
            sse, 1, constant_values=np.inf
        )  # a cell no worse than its 8 neighbours starts a basin
        nb = np.stack(
            [pad[1 + i : 18 + i, 1 + j : 42 + j] for i in (-1, 0, 1) for j in (-1, 0, 1) if i or j]
        )
        cells = np.argwhere((sse <= nb).all(0))
        _, first = np.unique(
            sse[tuple(cells.T)], return_index=True
        )  # one cell per plateau, best first
        starts = [(R0 + a[i, j], Bs[i], ms[j]) for i, j in cells[first[:3]]]
    else:
        starts = [(p0[0], p0[1], math.log(p0[2]) - xm)]

    def unpack(p):
        return (A, *p) if fixed else p

    def res(p):
        A_, B_, m_ = unpack(p)
        return R0 + (A_ - R0) * expit(B_ * (u - m_)) - R

    def jac(p):
        A_, B_, m_ = unpack(p)
        s_ = expit(B_ * (u - m_))
        g = (A_ - R0) * s_ * (1 - s_)  # d/dz of (A - R0) expit(z), z = B (u - m)
        return np.stack(([] if fixed else [s_]) + [g * (u - m_), -g * B_], axis=1)

    lo, hi = (
        [R0, 0.0, -np.inf],
        [1.0, np.inf, np.inf],
    )  # R0 < A <= 1, B > 0 (PAPER.md 8.1), closed for trf
    out, problems, se = _lsq(
        res, jac, [p[fixed:] for p in starts], lo[fixed:], hi[fixed:]
    )  # [1:]: no A
    A_, B_, m = unpack(out.x)
    se_A, se_B, se_m = unpack(se) if not fixed else (0.0, *se)
    with np.errstate(over="ignore"):
        C_mid = float(np.exp(m + xm))
    problems += [
        msg
        for bad, msg in (
            (
                not fixed and A_ >= 1 - 1e-9,
                "A at its bound 1: no saturation in the data, the ceiling is unknown",
            ),
            (not fixed and A_ <= R0 + 1e-9, "A at R0: the data do not rise above R0"),
            (B_ <= 1e-12, "B at 0: no rise with compute"),
            (not math.isfinite(C_mid), "C_mid overflows: far beyond the data"),
            (
                not problems and (se_A > A_ - R0 or se_B > B_ or se_m > w),
                "standard error above the value (A - R0, "
                "B, or ln C_mid vs the data's ln C span): the data do not determine the parameters",
            ),
        )
        if bad
    ]
    return SigmoidFit(
        float(A_),
        float(B_),
        C_mid,
        float(R0),
        float(2 * out.cost),
        len(C),
        not problems,
        "; ".join(problems),
        "fast",
        fixed,
    )


def _fit_grid(C, R, R0, grid_A, grid_C_mid) -> SigmoidFit:
    """A.5: for each (A, C_mid), fit B with curve_fit from its default start; keep the smallest SSE."""
    x, best, n_bad = np.log(C), None, 0
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore", OptimizeWarning
        )  # an infinite covariance is checked below instead
        for A, C_mid in itertools.product(grid_A, grid_C_mid):
            m = math.log(C_mid)

            def f(x_, B, A=A, m=m):
                return R0 + (A - R0) * expit(B * (x_ - m))

            try:
                (B,), pcov = curve_fit(f, x, R, p0=[1.0])  # [1.0] is curve_fit's own default start
            except RuntimeError:  # maxfev reached
                n_bad += 1
                continue
            if not (
                np.isfinite(pcov).all() and B > 0
            ):  # start handed back, or the curve upside down
                n_bad += 1
                continue
            sse = float(((f(x, B) - R) ** 2).sum())
            best = (
                (sse, float(A), float(B), float(C_mid)) if best is None or sse < best[0] else best
            )
    if best is None:
        raise RuntimeError(
            f"grid: all {n_bad} (A, C_mid) points failed (curve_fit error, B <= 0 or infinite "
            f"covariance): C_mid in [{min(grid_C_mid):g}, {max(grid_C_mid):g}] likely does not "
            f"match the compute scale [{C.min():.3g}, {C.max():.3g}]; use method='fast'"
        )
    sse, A, B, C_mid = best
    problems = [
        f"best {name}={v:g} is on the grid's edge: the optimum may lie outside"
        for name, v, g in (("A", A, grid_A), ("C_mid", C_mid, grid_C_mid))
        if len(g) >= 3 and np.isclose(v, [min(g), max(g)], rtol=1e-12, atol=0).any()
    ]
    return SigmoidFit(
        A,
        B,
        C_mid,
        float(R0),
        sse,
        len(C),
        not problems,
        "; ".join(problems),
        "grid",
        len(grid_A) == 1,
    )


def fit_sigmoid(
    C,
    R,
    R0,
    *,
    A=None,
    c_min=0.0,
    method: Literal["fast", "grid"] = "fast",
    grid_A=None,
    grid_C_mid=None,
) -> SigmoidFit:
    """Fits Eq. 1 to pass rate R (1-D) against compute C (1-D, any unit) with R0 fixed (PAPER.md 8.1-8.3).

    Points with C < c_min are dropped (A.5 uses 1,500 GPU-hours). A given: the fixed-A refit of the §4
    comparison rule (only B, C_mid fitted). method="grid": A.5 over grid_A x grid_C_mid (default: the
    paper's grids, for GPU-hours); "fast": bounded multi-start least squares, scale-free.
    Raises ValueError on NaN/inf, negative or zero compute, < 4 distinct compute values, flat or
    non-increasing R, R0 >= 1, A outside (R0, 1]; RuntimeError when every grid point fails. A fit on a
    bound, with infinite covariance or on the grid's edge returns converged=False with the reason."""
    C, R = _validate(C, R, R0, c_min)
    if A is not None and not R0 < A <= 1:
        raise ValueError(f"fixed A={A} must lie in (R0={R0}, 1]")
    if method == "fast":
        return _fit_fast(C, R, R0, A)
    if method != "grid":
        raise ValueError(f"method must be 'fast' or 'grid', got {method!r}")
    gA = np.asarray(
        [A] if A is not None else PAPER_GRID_A if grid_A is None else grid_A, dtype=np.float64
    )
    gC = np.asarray(PAPER_GRID_C_MID if grid_C_mid is None else grid_C_mid, dtype=np.float64)
    if np.any(gA <= R0) or np.any(gA > 1) or np.any(gC <= 0):
        raise ValueError(f"grid_A must lie in (R0={R0}, 1] and grid_C_mid above 0")
    return _fit_grid(C, R, R0, gA, gC)


@dataclass
class Bootstrap:
    """Percentile intervals (lo, hi) from refits on resampled points."""

    A: tuple[float, float]
    B: tuple[float, float]
    C_mid: tuple[float, float]
    n_ok: int
    n_failed: (
        int  # degenerate resamples (< 4 distinct C, flat) and refits not converged (e.g. A at 1)
    )


def bootstrap(fit: SigmoidFit, C, R, *, c_min=0.0, n_boot=200, level=0.95, seed=0) -> Bootstrap:
    """Pairs bootstrap (ours; §4 gives only the margin A_MARGIN): resample the fit points (C, R, c_min:
    those `fit` was fitted on) with replacement, refit each with the fast method from `fit`'s parameters
    (A stays fixed for a fixed-A fit), take the central `level` percentile interval. NaN if < 2 refits work."""
    C, R = _validate(C, R, fit.R0, c_min)
    if not fit.converged:  # resampling around an answer that is not one means nothing
        return Bootstrap((math.nan,) * 2, (math.nan,) * 2, (math.nan,) * 2, 0, n_boot)
    rng, draws = np.random.default_rng(seed), []
    for _ in range(n_boot):
        i = rng.integers(0, len(C), len(C))
        try:
            f = _fit_fast(
                *_validate(C[i], R[i], fit.R0, 0.0),
                fit.R0,
                fit.A if fit.fixed_A else None,
                p0=(fit.A, fit.B, fit.C_mid),
            )
        except ValueError:
            continue
        draws += [(f.A, f.B, f.C_mid)] if f.converged else []
    q = [50 * (1 - level), 50 * (1 + level)]
    ci = np.percentile(draws, q, axis=0).T if len(draws) >= 2 else np.full((3, 2), np.nan)
    return Bootstrap(*(tuple(map(float, row)) for row in ci), len(draws), n_boot - len(draws))


@dataclass
class PowerLawFit:
    """A.4's power law R(C) = A - D / C^B (B >= 0, D >= 0, A <= 1), fitted above a threshold c_min."""

    A: float
    B: float
    D: float
    sse: float
    n: int
    converged: bool = True
    message: str = ""

    def predict(self, C):
        return self.A - self.D * np.exp(-self.B * np.log(np.asarray(C, dtype=np.float64)))


def fit_power_law(C, R, c_min=0.0) -> PowerLawFit:
    """Least-squares fit of A.4's power law to the points with C >= c_min (1-D C, R). A.4: fitted from low
    compute it overshoots the ceiling (A 1.0 vs the sigmoid's 0.645). Raises as fit_sigmoid; A at its bound
    1, a singular Jacobian or a standard error above B or D gives converged=False."""
    C, R = _validate(C, R, 0.0, c_min)
    x = np.log(C)
    u = x - x.mean()  # centred ln C: d = D exp(-B mean ln C) stays O(1) at any compute scale

    def res(p):
        return p[0] - p[2] * np.exp(-p[1] * u) - R

    def jac(p):
        g = np.exp(-p[1] * u)
        return np.stack([np.ones_like(u), p[2] * u * g, -g], axis=1)

    scan = []  # for a fixed B the model is linear in (A, d): one linear solve per start slope
    for B in np.geomspace(0.01, 64.0, 25) / np.ptp(x):
        X = np.stack([np.ones_like(u), -np.exp(-B * u)], axis=1)
        (A, d), *_ = np.linalg.lstsq(X, R)
        scan.append((float(((X @ [A, d] - R) ** 2).sum()), A, B, d))
    out, problems, se = _lsq(res, jac, [min(scan)[1:]], [-np.inf, 0.0, 0.0], [1.0, np.inf, np.inf])
    A, B, d = out.x
    with np.errstate(over="ignore"):
        D = float(d * np.exp(B * x.mean()))
    problems += [
        msg
        for bad, msg in (
            (A >= 1 - 1e-9, "A at its bound 1"),
            (
                not problems and (se[1:] > out.x[1:]).any(),
                "standard error above the value of B or D: not determined by the data",
            ),
        )
        if bad
    ]
    return PowerLawFit(
        float(A), float(B), D, float(2 * out.cost), len(C), not problems, "; ".join(problems)
    )


@dataclass
class Comparison:
    """The §4 comparison rule applied to several runs."""

    fits: list[SigmoidFit]  # free fits, one per run
    A_shared: float | None  # the mean A, when all A lie within the margin
    refits: list[SigmoidFit] | None  # the fixed-A refits at A_shared
    best: int  # index of the run that scales best
    rule: str  # which rule decided, and any fit not converged


def compare(runs, *, c_min=0.0, margin=A_MARGIN) -> Comparison:
    """§4, A.5 (PAPER.md 8.4). runs: [(C, R, R0), ...]. If the fitted A all lie within `margin` (max - min
    < margin), refit every run with A fixed at their mean: the highest B scales best. Otherwise the highest
    A wins (A.8: the ceiling first). Raises as fit_sigmoid."""
    fits = [fit_sigmoid(C, R, R0, c_min=c_min) for C, R, R0 in runs]
    As = np.array([f.A for f in fits])
    A_shared = float(As.mean()) if np.ptp(As) < margin else None
    refits = (
        None
        if A_shared is None
        else [fit_sigmoid(C, R, R0, A=A_shared, c_min=c_min) for C, R, R0 in runs]
    )
    best = int(As.argmax()) if refits is None else int(np.argmax([f.B for f in refits]))
    rule = (
        f"A spread {np.ptp(As):.3f} >= {margin}: higher A"
        if refits is None
        else f"A within {margin}: refit at mean A={A_shared:.4f}, higher B"
    )
    bad = [k for k, f in enumerate(fits + (refits or [])) if not f.converged]
    return Comparison(
        fits,
        A_shared,
        refits,
        best,
        rule + (f" (UNRELIABLE: fits {bad} not converged)" * bool(bad)),
    )


def extrapolate(C, R, R0, *, fit_until, c_min=0.0, method: Literal["fast", "grid"] = "fast"):
    """§5 protocol (PAPER.md 8.5): fit on C <= fit_until (1-D C, R), predict the points beyond. Returns
    (SigmoidFit, mean absolute error on the held-out points, their count). Raises ValueError if no point
    lies beyond fit_until, and as fit_sigmoid."""
    C, R = np.asarray(C, dtype=np.float64), np.asarray(R, dtype=np.float64)
    tail = C > fit_until
    if not tail.any():
        raise ValueError(
            f"no point beyond fit_until={fit_until:g} (max C={C.max():g}): nothing to extrapolate to"
        )
    fit = fit_sigmoid(C[~tail], R[~tail], R0, c_min=c_min, method=method)
    return fit, float(np.abs(fit.predict(C[tail]) - R[tail]).mean()), int(tail.sum())


def load_metrics(path, x="gpu_hours", y="eval/pass_rate"):
    """train.py's metrics.jsonl, one JSON object per line; lines without `y` (no eval ran) are skipped.
    Returns float64 (C, R) sorted by C. Raises ValueError naming the line for bad JSON or a `y` without
    `x`, and if no line has `y`."""
    pts = []
    with open(path) as f:
        for k, line in enumerate(f, 1):
            try:
                rec = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{k}: not JSON ({e})") from e
            if y in rec and x not in rec:
                raise ValueError(f"{path}:{k}: has {y!r} but no {x!r}")
            pts += [(float(rec[x]), float(rec[y]))] if y in rec else []
    if not pts:
        raise ValueError(f"{path}: no line has {y!r}")
    return tuple(np.array(sorted(pts)).T)


def _num(v):
    return f"{v:.0f}" if 10 <= abs(v) < 1e6 else f"{v:.3g}"


def plot(runs, out, *, xlabel, ylabel, c_min=0.0, fit_until=None):
    """The paper's Figure 1, one colour per run: fitted points (dots), points below c_min (hollow), held-out
    points (crosses), solid curve over the fitted range, dashed extrapolation, dotted line at A.
    runs: [(name, C, R, SigmoidFit)] with C, R 1-D arrays. Writes the image to `out`."""
    import matplotlib

    matplotlib.use("Agg")  # to a file, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (name, C, R, fit) in enumerate(runs):
        col, end = f"C{i}", fit_until or C.max()
        used, held = (C >= c_min) & (C <= end), C > end
        ax.scatter(C[used], R[used], s=16, color=col, alpha=0.8)
        ax.scatter(C[C < c_min], R[C < c_min], s=16, facecolors="none", edgecolors=col)
        ax.scatter(C[held], R[held], s=30, marker="x", color=col, alpha=0.6)
        g = np.geomspace(C[used].min(), end, 200)
        label = f"{name}: A={fit.A:.3f}  B={fit.B:.2f}  C_mid={_num(fit.C_mid)}" + (
            "" if fit.converged else " (!)"
        )
        ax.plot(g, fit.predict(g), color=col, lw=2, label=label, zorder=3)
        g = np.geomspace(end, C.max() * 1.15, 100)
        ax.plot(g, fit.predict(g), "--", color=col, lw=2, zorder=3) if held.any() else None
        ax.axhline(fit.A, color=col, ls=":", lw=1)
    if fit_until:
        ax.axvline(
            fit_until, color="grey", lw=0.8, ls="-.", label=f"fit until {fit_until:g} (x: held out)"
        )
    ax.set(
        xscale="log", xlabel=xlabel, ylabel=ylabel, title="R = R0 + (A - R0) / (1 + (C_mid / C)^B)"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


@dataclass
class Args:
    """Fits Eq. 1 to each run's eval pass rate against compute, prints a table and writes a plot."""

    paths: tyro.conf.Positional[list[str]]
    """metrics.jsonl files, one per run"""
    x: str = "gpu_hours"
    """compute column: any logged column (gpu_hours, tokens, step)"""
    y: str = "eval/pass_rate"
    """metric column; lines without it (no eval ran) are skipped"""
    c_min: float = 0.0
    """drop points below this compute before fitting (paper: 1500 GPU-hours)"""
    fit_until: float | None = None
    """fit on C <= this, report the mean absolute error of the prediction beyond it"""
    r0: float | None = None
    """R0; default: the eval at the smallest compute (step 0), which is then not a fit point"""
    method: Literal["fast", "grid"] = "fast"
    """fast (default) or the paper's A.5 grid (GPU-hour scale only)"""
    n_boot: int = 200
    """bootstrap resamples for the 95% intervals (0: none)"""
    seed: int = 0
    out: str = "fit.png"


def main(args: Args):
    runs, fit_pts, notes = [], [], []
    table = [
        [
            "run",
            "n",
            "R0",
            "A",
            "95% CI",
            "paper",
            "B",
            "95% CI",
            "C_mid",
            "95% CI",
            "SSE",
            "MAE tail (n)",
        ]
    ]
    for path in args.paths:
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
        try:
            C, R = load_metrics(path, args.x, args.y)
            # R0 = the eval at the smallest compute (the step-0 eval, C = 0): it anchors the curve there, so
            # it is not also a fit point (C = 0 is outside ln C anyway)
            (R0, keep), c0 = (
                ((float(R[0]), C > C[0]) if args.r0 is None else (args.r0, C > 0)),
                C[0],
            )
            C, R = C[keep], R[keep]
            head = C <= (math.inf if args.fit_until is None else args.fit_until)
            fit, mae, n_tail = (
                (fit_sigmoid(C, R, R0, c_min=args.c_min, method=args.method), math.nan, 0)
                if args.fit_until is None
                else extrapolate(
                    C, R, R0, fit_until=args.fit_until, c_min=args.c_min, method=args.method
                )
            )
            bs = bootstrap(
                fit, C[head], R[head], c_min=args.c_min, n_boot=args.n_boot, seed=args.seed
            )
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"{path}: {e}") from e
        runs.append((name, C, R, fit))
        fit_pts.append((C[head], R[head], R0))
        table.append(
            [
                name,
                str(fit.n),
                f"{R0:.3f}",
                f"{fit.A:.4f}",
                f"[{bs.A[0]:.4f}, {bs.A[1]:.4f}]",
                f"+-{A_MARGIN}",
                f"{fit.B:.3f}",
                f"[{bs.B[0]:.3f}, {bs.B[1]:.3f}]",
                _num(fit.C_mid),
                f"[{_num(bs.C_mid[0])}, {_num(bs.C_mid[1])}]",
                f"{fit.sse:.2e}",
                f"{mae:.4f} ({n_tail})",
            ]
        )
        for bad, note in (
            ((~keep).sum() > 1, f"{(~keep).sum()} evals at {args.x} <= {c0:g} are R0, not fitted"),
            (bs.n_failed, f"{bs.n_failed}/{args.n_boot} bootstrap refits degenerate or at a bound"),
            (not fit.converged, f"NOT CONVERGED: {fit.message}"),
        ):
            notes += [f"{name}: {note}"] if bad else []
    widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
    print(
        "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table)
    )
    if len(fit_pts) >= 2:
        cmp = compare(fit_pts, c_min=args.c_min)
        shared = (
            ""
            if cmp.refits is None
            else " (B at shared A: "
            + ", ".join(f"{r[0]} {f.B:.3f}" for r, f in zip(runs, cmp.refits, strict=True))
            + ")"
        )
        notes.insert(0, f"comparison (§4): {cmp.rule}{shared} -> {runs[cmp.best][0]} scales best")
    print("\n".join(notes + [f"wrote {args.out}"]))
    plot(runs, args.out, xlabel=args.x, ylabel=args.y, c_min=args.c_min, fit_until=args.fit_until)
    if any(not f.converged for *_, f in runs):
        raise SystemExit("a fit did not converge (see above): its parameters are not to be trusted")


if __name__ == "__main__":
    main(tyro.cli(Args))
