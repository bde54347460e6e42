"""Sigmoid compute-performance curves: fit, compare, extrapolate (ScaleRL §2.1, §4, A.4-A.8).

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B) = R0 + (A - R0) expit(B (ln C - ln C_mid))  (Eq. 1)

A: ceiling (asymptotic pass rate), B: efficiency exponent, C_mid: compute at half the gain, R0: pass
rate before RL. Pure: arrays in, numbers out. `python fit.py RUN_DIR ...` runs infra/fit_report.py.

Where this departs from the paper, and why:
1. method="fast" (default): least squares (R0 <= A <= 1, B >= 0) from every basin of a coarse scan,
   an SSE no worse than the A.5 grid's, far faster, at any compute scale (A.5's suits GPU-hours).
2. The curve is always evaluated as expit(B (ln C - ln C_mid)): no power or exponential overflows.
   The grid's per-point curve_fit uses it too (the same function of B, the same start B = 1).
3. The grid skips points where curve_fit fails, gives B <= 0 (Eq. 1: B > 0), or hands back
   its start with an infinite covariance; an optimum on the grid's edge is flagged not converged.
4. R0 is held fixed (A.5 calls the fit a three-parameter problem, {A, B, C_mid});
   infra/fit_report.py takes it from the step-0 eval.
5. A fit must identify its ceiling (ours, issues 12, 29): see _identify; a curve's left tail fits
   any A. A fit at the bound A = 1 stands when, with Eq. 1 extended past 1, A = 1 fits within the
   noise and no A of 1.05 or more does: a task the policy masters.
6. Bootstrap intervals are ours; the paper only states a +-0.02 margin on A (§4).
"""

import itertools
import math
import warnings
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np
from scipy.ndimage import minimum_filter
from scipy.optimize import OptimizeWarning, curve_fit, least_squares
from scipy.special import expit, stdtrit

A_MARGIN = 0.02  # §4, A.5: A varied by at most +-0.015 over three seeds, hence a 0.02 margin on A
A_CLEAR = 0.05  # "clearly different" A for _identify: issue 12's bar for a half-run A vs the whole
PAPER_GRID_A = np.round(np.arange(0.450, 0.8001, 0.005), 3)  # A.5: 71 values
PAPER_GRID_C_MID = np.linspace(100.0, 40000.0, 100)  # A.5: 100 linearly spaced values (GPU-hours)
A_EXTENDED = 2.0  # _identify at the bound A = 1: Eq. 1 profiled past it up to here (a diagnostic)
RANK_TOL = 1e-8  # Jacobian singular values: smallest/largest below this = infinite covariance
Method = Literal["fast", "grid"]


def sigmoid(C, A, B, C_mid, R0):
    """Eq. 1 (§2.1). C: array-like of compute >= 0 (any unit, C_mid's); A, B, C_mid > 0, R0:
    floats. Returns the pass rate, float64 shaped like C (R0 at C = 0). ValueError if any C < 0."""
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
    A_interval: tuple[float, float] = (math.nan, math.nan)  # 95% profile interval (_identify)

    def predict(self, C):
        return sigmoid(C, self.A, self.B, self.C_mid, self.R0)


def _finite(C, R, R0):
    """float64 (C, R), 1-D and equally long, all finite with R0: the rule for every point given,
    fitted or held out (extrapolate). Raises ValueError naming the indices of NaN or inf."""
    C, R = np.asarray(C, dtype=np.float64), np.asarray(R, dtype=np.float64)
    if C.ndim != 1 or C.shape != R.shape:
        raise ValueError(f"C and R must be 1-D and equally long, got {C.shape} and {R.shape}")
    if not (np.isfinite(C).all() and np.isfinite(R).all() and math.isfinite(R0)):
        bad = np.flatnonzero(~np.isfinite(C + R)).tolist()
        raise ValueError(f"NaN or inf in C, R or R0 (indices {bad})")
    return C, R


def _validate(C, R, R0, fit_from):
    """The checks every fit needs; drops C < fit_from (A.5 step 1). Returns float64 (C, R) to
    fit."""
    C, R = _finite(C, R, R0)
    if np.any(C < 0):
        raise ValueError(f"negative compute at indices {np.flatnonzero(C < 0).tolist()}")
    C, R = C[C >= fit_from], R[C >= fit_from]
    if np.any(C == 0):
        raise ValueError("compute 0 is outside the curve's domain (ln C): it is R0; raise fit_from")
    if (n_c := np.unique(C).size) < 4:
        raise ValueError(
            f"{n_c} distinct compute values at C >= fit_from={fit_from}; need at least 4"
        )
    if not R0 < 1:
        raise ValueError(f"R0={R0} must be below 1, the largest possible A")
    if np.ptp(R) <= 1e-12 * max(1.0, np.abs(R).max()):
        raise ValueError(f"R is flat ({R[0]:.6g} everywhere): no curve to fit")
    if np.cov(np.log(C), R)[0, 1] <= 0:  # least-squares trend of R against ln C
        raise ValueError("R does not increase with compute (trend against ln C <= 0): no Eq. 1")
    return C, R


def _model(u, R, R0, A=None):
    """Residuals and Jacobian of Eq. 1 in p = (A, B, m), m = ln C_mid - mean ln C, or in p = (B, m)
    with A fixed; u = ln C - mean ln C (n,)."""
    unpack = (lambda p: p) if A is None else (lambda p: (A, *p))

    def res(p):
        A_, B_, m_ = unpack(p)
        return R0 + (A_ - R0) * expit(B_ * (u - m_)) - R

    def jac(p):
        A_, B_, m_ = unpack(p)
        s = expit(B_ * (u - m_))
        g = (A_ - R0) * s * (1 - s)  # d/dz of (A - R0) expit(z), z = B (u - m)
        return np.stack(([s] if A is None else []) + [g * (u - m_), -g * B_], axis=1)

    return res, jac


def _ls(res, jac, p0, lo, hi, tol=1e-15):
    """Bounded least squares (trf) from p0, moved strictly inside the bounds (trf needs that)."""
    p0 = np.clip(p0, np.add(lo, 1e-9), np.subtract(hi, 1e-9))
    kw = dict(ftol=tol, xtol=tol, gtol=tol, max_nfev=1000)
    return least_squares(res, p0, jac=jac, bounds=(lo, hi), method="trf", x_scale="jac", **kw)


def _lsq(res, jac, starts, lo, hi):
    """_ls from each start. Returns the best result, the reasons not to trust it (the optimizer
    stopped early, a singular Jacobian = infinite covariance) and the parameters' standard errors
    from the covariance sse / (n - k) (J^T J)^-1 (what curve_fit reports)."""
    best = min((_ls(res, jac, p0, lo, hi) for p0 in starts), key=lambda out: out.cost)
    J = best.jac
    problems = []
    if best.status <= 0:
        problems.append(f"optimizer stopped: {best.message}")
    se = np.sqrt(np.diag(np.linalg.pinv(J.T @ J)) * 2 * best.cost / max(len(J) - J.shape[1], 1))
    sv = np.linalg.svd(J, compute_uv=False)
    if sv[-1] <= RANK_TOL * sv[0]:  # an infinite covariance
        problems.append("singular Jacobian: the data do not determine the parameters")
    return best, problems, se


def _scan(u, r):
    """The coarse scan: 17 B x 41 m cells over u = centred ln C (n,), r = R - R0 (n,). Returns the
    cells' B (17,), m (41,) and sums s.r, s.s (17, 41), s = expit(B (u - m)): for A - R0 = a a
    cell's SSE is r.r - 2 a s.r + a^2 s.s, least at a = s.r / s.s (closed form)."""
    w = max(np.ptp(u), 1e-12)
    Bs, ms = np.geomspace(0.25, 64.0, 17) / w, np.linspace(u.min() - 2 * w, u.max() + 2 * w, 41)
    s = expit(Bs[:, None, None] * (u - ms[:, None]))  # (17, 41, n)
    return Bs, ms, s @ r, (s * s).sum(-1)


def _fit_fast(C, R, R0, A=None) -> SigmoidFit:
    """Least squares in (A, B, m) ((B, m) if A is fixed) from the best cell of each of the 3 best
    basins of _scan (a basin: a cell no worse than its 8 neighbours; A in closed form there)."""
    x = np.log(C)
    r = R - R0
    fixed = A is not None
    k = 1 if fixed else 0  # parameters (A, B, m)[k:]: A is not one when fixed
    u = x - x.mean()  # centred ln C: the same problem at any scale
    w = max(np.ptp(x), 1e-12)
    Bs, ms, sr, ss = _scan(u, r)
    a = np.full(sr.shape, A - R0) if fixed else np.clip(sr / np.maximum(ss, 1e-300), 0, 1 - R0)
    sse = r @ r - 2 * a * sr + a * a * ss
    cells = np.argwhere(sse <= minimum_filter(sse, size=3, mode="constant", cval=np.inf))
    _, first = np.unique(sse[tuple(cells.T)], return_index=True)  # one cell per plateau, best first
    starts = [(R0 + a[i, j], Bs[i], ms[j])[k:] for i, j in cells[first[:3]]]
    lo = [R0, 0.0, -np.inf][k:]  # Eq. 1's bounds, closed: R0 <= A <= 1, B >= 0
    hi = [1.0, np.inf, np.inf][k:]
    out, problems, se = _lsq(*_model(u, R, R0, A), starts, lo, hi)
    if fixed:
        A_ = A
        B_, m = out.x
        se_A = 0
        se_B, se_m = se
    else:
        A_, B_, m = out.x
        se_A, se_B, se_m = se
    with np.errstate(over="ignore"):
        C_mid = float(np.exp(m + x.mean()))
    se_big = not problems and (se_A > A_ - R0 or se_B > B_ or se_m > w)  # m: vs the ln C span
    for bad, msg in (
        (not fixed and A_ <= R0 + 1e-9, "A at R0: the data do not rise above R0"),
        (B_ <= 1e-12, "B at 0: no rise with compute"),
        (not math.isfinite(C_mid), "C_mid overflows: far beyond the data"),
        (se_big, "standard error above the value of A - R0, B or ln C_mid: not determined"),
    ):
        if bad:
            problems.append(msg)
    msg = "; ".join(problems)
    return SigmoidFit(*map(float, (A_, B_, C_mid, R0, 2 * out.cost)), len(C), not msg, msg)


def _fit_grid(C, R, R0, grid_A, grid_C_mid) -> SigmoidFit:
    """A.5: for each (A, C_mid), fit B with curve_fit from its default start; keep the least SSE."""
    x = np.log(C)
    best = (math.inf,)  # (SSE, A, B, C_mid) of the best grid point so far
    n_bad = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)  # an infinite covariance: checked below
        for A, C_mid in itertools.product(grid_A, grid_C_mid):
            a, m = A - R0, math.log(C_mid)
            f = lambda x_, B, a=a, m=m: R0 + a * expit(B * (x_ - m))
            try:
                (B,), pcov = curve_fit(f, x, R, p0=[1.0])  # 1.0 is curve_fit's own default start
            except RuntimeError:  # maxfev reached
                B, pcov = 0.0, None
            if pcov is None or not np.isfinite(pcov).all() or B <= 0:  # start back, or upside down
                n_bad += 1
                continue
            best = min(best, (float(((f(x, B) - R) ** 2).sum()), float(A), float(B), float(C_mid)))
    if len(best) == 1:
        msg = f"grid: all {n_bad} (A, C_mid) failed (curve_fit error, B <= 0, infinite covariance)"
        msg += f": C_mid in [{min(grid_C_mid):g}, {max(grid_C_mid):g}] may not match the compute"
        raise RuntimeError(msg + f" scale [{C.min():.3g}, {C.max():.3g}]; use method='fast'")
    sse, A, B, C_mid = best
    msg = "; ".join(
        f"best {name}={v:g} is on the grid's edge: the optimum may lie outside"
        for name, v, g in (("A", A, grid_A), ("C_mid", C_mid, grid_C_mid))
        if len(g) >= 3 and np.isclose(v, [min(g), max(g)], rtol=1e-12, atol=0).any()
    )
    return SigmoidFit(A, B, C_mid, float(R0), sse, len(C), not msg, msg, "grid")


def _refit(res, jac, p0):
    """A fixed-A refit for _identify in (B, m), SSE to ~1e-8 (the rule needs ~1e-2): Levenberg-
    Marquardt (MINPACK, 4x faster than trf here), or trf within B >= 0 if that finds B < 0."""
    out = least_squares(res, p0, jac=jac, method="lm", ftol=1e-8, xtol=1e-8, gtol=1e-8)
    return out if out.x[0] >= 0 else _ls(res, jac, p0, [0, -np.inf], [np.inf, np.inf], 1e-8)


def _join(*messages: str) -> str:
    return "; ".join(filter(None, messages))


def _identify(fit: SigmoidFit, C, R) -> SigmoidFit:
    """Is A identified (ours, issues 12, 29)? A's profile: the least SSE with A fixed (B, C_mid
    free) at fit.A +- 0.025, +-0.05, then every 0.05 out to R0 and 1, each refit from its
    neighbour's solution (and _scan's best cell if better). An A fits within the noise if its SSE
    exceeds the least by under t^2 s^2, s^2 = SSE / (n - 3), t Student's 97.5% point on n - 3
    degrees of freedom (t^2 = F(1, n - 3): 4.67 at n = 16; chi^2(1)'s 3.84 ignores that s^2 is
    estimated). These A form the 95% profile interval (Bates & Watts 1988, §6.1), A_interval, its
    ends found by secant steps in the profile t. A is not identified (converged=False) if one lies
    A_CLEAR = 0.05 or more from fit.A (issue 12: a half-run A within 0.05 of the whole run's). Not
    the standard error: a left tail fools it (A = 0.28 +- 0.02; any A in 0.3-1 fits). At its bound 1
    A's profile goes on past it to A_EXTENDED (issue 29), the least SSE there included: A = 1 is not
    identified either if it lies outside the noise (the curve heads past 1; A_interval: the ends
    past 1) or as above; else A_interval is clipped to 1."""
    x = np.log(C)
    u = x - x.mean()
    r = R - fit.R0
    R0 = fit.R0
    Bs, ms, sr, ss = _scan(u, r)

    def profile(A, p):  # (least SSE, its (B, m)) at this A, from p or _scan's best cell if better
        res, jac = _model(u, R, R0, A)
        U = r @ r - 2 * (A - R0) * sr + (A - R0) ** 2 * ss  # _scan's SSE at this A
        i, j = np.unravel_index(U.argmin(), U.shape)
        out = _refit(res, jac, (Bs[i], ms[j]) if p is None else p)
        if U[i, j] < 2 * out.cost:  # continuation stuck in a worse basin
            out = min(out, _refit(res, jac, (Bs[i], ms[j])), key=lambda o: o.cost)
        return 2 * out.cost, out.x

    steps = np.r_[0.025, np.arange(A_CLEAR, 1, A_CLEAR)]
    at_bound = fit.A >= 1 - 1e-9
    up = [*(fit.A + steps)[fit.A + steps < 1], 1.0]
    if at_bound:
        up += [*(1 + steps)[1 + steps <= A_EXTENDED]]
    down = fit.A - steps[fit.A - steps > R0 + 1e-3]
    p_hat = (fit.B, math.log(fit.C_mid) - x.mean()) if 0 < fit.C_mid < math.inf else None
    prof = {fit.A: (fit.sse, p_hat)}  # A -> (SSE, (B, m))
    for side in (up, down):
        for A, prev in zip(side, [fit.A, *side], strict=False):
            prof[A] = profile(A, prof[prev][1])
    if at_bound:  # the least SSE of the extended Eq. 1, where the profile's t counts from
        A0 = min((A for A in prof if A >= 1), key=lambda A: prof[A][0])
        res, jac = _model(u, R, R0)
        out = _ls(
            res, jac, (A0, *prof[A0][1]), [R0, 0, -np.inf], [A_EXTENDED, np.inf, np.inf], 1e-8
        )
        if out.x[0] > 1:
            prof[float(out.x[0])] = (2 * out.cost, out.x[1:])
    dof = len(C) - 3
    for secant in (True, True, False):  # interpolate each end in t, refit there; twice
        As, sse = np.array([(A, prof[A][0]) for A in sorted(prof)]).T
        t = np.sqrt((sse - sse.min()) / max(stdtrit(dof, 0.975) ** 2 * sse.min() / dof, 1e-300))
        inside = np.flatnonzero(t < 1)
        ends = []
        for k, k_out in ((inside[0], inside[0] - 1), (inside[-1], inside[-1] + 1)):
            bracket = 0 <= k_out < len(As)  # else the end is the profile's last point: a bound
            ends.append(float(np.interp(1, t[[k, k_out]], As[[k, k_out]]) if bracket else As[k]))
            if secant and bracket:
                prof[ends[-1]] = profile(ends[-1], prof[As[k]][1])
    noise = f"fit within the noise (95% profile), {A_CLEAR} or more from A={fit.A:.3f}"
    if at_bound and t[np.abs(As - fit.A).argmin()] >= 1:
        best, lo, hi = As[t.argmin()], *ends
        why = f"A at its bound 1: Eq. 1 extended past it fits better (A={best:.3f}, profile "
        why += f"[{lo:.3f}, {hi:.3f}]): no saturation in the data, no ceiling"
        return replace(fit, converged=False, message=_join(fit.message, why), A_interval=(lo, hi))
    if np.any((t < 1) & (np.abs(As - fit.A) > A_CLEAR - 1e-9)):
        if at_bound:
            why = "A at its bound 1 and A not identified: with Eq. 1 extended past 1, A in "
        else:
            why = "A not identified: fixed-A refits with A in "
        why += f"[{ends[0]:.3f}, {ends[1]:.3f}] {noise}"
        fit = replace(fit, converged=False, message=_join(fit.message, why))
    return replace(fit, A_interval=(ends[0], min(ends[1], 1.0)))


def fit_sigmoid(
    C, R, R0, *, A=None, fit_from=0.0, method: Method = "fast", grid_A=None, grid_C_mid=None
) -> SigmoidFit:
    """Fits Eq. 1 to pass rate R (1-D) against compute C (1-D, any unit) with R0 fixed (§2.1,
    A.5), on the points with C >= fit_from (A.5: 1,500 GPU-hours). A given: the §4 comparison
    rule's fixed-A refit (B, C_mid fitted). method="grid": A.5 over grid_A x grid_C_mid (default:
    the paper's grids, for GPU-hours); "fast": multi-start least squares, scale-free. A free fit
    gets A's profile interval and the identifiability rule (_identify). Raises ValueError on
    NaN/inf, negative or zero compute, < 4 distinct C, flat or non-increasing R, R0 >= 1, A outside
    (R0, 1]; RuntimeError when every grid point fails. A fit with A at R0 or B at 0, with infinite
    covariance, on the grid's edge or with A not identified (_identify; at A = 1 too) returns
    converged=False with the reason."""
    C, R = _validate(C, R, R0, fit_from)
    if A is not None and not R0 < A <= 1:
        raise ValueError(f"fixed A={A} must lie in (R0={R0}, 1]")
    if method not in ("fast", "grid"):
        raise ValueError(f"method must be 'fast' or 'grid', got {method!r}")
    if method == "fast":
        fit = _fit_fast(C, R, R0, A)
    else:
        if A is not None:  # the fixed-A refit: a grid of one A
            gA = np.asarray([A])
        elif grid_A is None:
            gA = PAPER_GRID_A
        else:
            gA = np.asarray(grid_A)
        gC = np.asarray(PAPER_GRID_C_MID if grid_C_mid is None else grid_C_mid, dtype=np.float64)
        if np.any(gA <= R0) or np.any(gA > 1) or np.any(gC <= 0):
            raise ValueError(f"grid_A must lie in (R0={R0}, 1] and grid_C_mid above 0")
        fit = _fit_grid(C, R, R0, gA.astype(np.float64), gC)
    return replace(fit, fixed_A=True, A_interval=(A, A)) if A is not None else _identify(fit, C, R)


@dataclass
class Bootstrap:
    """Percentile intervals (lo, hi) from refits on resampled points."""

    A: tuple[float, float]
    B: tuple[float, float]
    C_mid: tuple[float, float]
    n_ok: int
    n_failed: int  # degenerate resamples (< 4 distinct C, flat), refits not converged/identified


def bootstrap(fit: SigmoidFit, C, R, *, fit_from=0.0, n_boot=200, level=0.95, seed=0) -> Bootstrap:
    """Pairs bootstrap (ours; §4 gives only the margin A_MARGIN): resample the fit points (C, R,
    fit_from: those `fit` was fitted on) with replacement, refit each as fit_sigmoid fits (fast:
    every basin of its scan, then _identify; A fixed for a fixed-A fit) and take the central `level`
    percentile interval of the converged refits. Unfittable resamples and refits not converged (A
    not identified too) are failed. No resampling if `fit` did not converge; NaN if < 2 converge."""
    C, R = _validate(C, R, fit.R0, fit_from)
    rng = np.random.default_rng(seed)
    draws = []  # (A, B, C_mid) of each converged refit
    for _ in range(n_boot if fit.converged else 0):  # around a non-answer resampling means nothing
        i = rng.integers(0, len(C), len(C))
        try:
            f = fit_sigmoid(C[i], R[i], fit.R0, A=fit.A if fit.fixed_A else None)
        except ValueError:
            continue
        if f.converged:
            draws.append((f.A, f.B, f.C_mid))
    q = [50 * (1 - level), 50 * (1 + level)]
    ci = np.percentile(draws, q, axis=0).T if len(draws) >= 2 else np.full((3, 2), np.nan)
    return Bootstrap(*(tuple(map(float, row)) for row in ci), len(draws), n_boot - len(draws))


@dataclass
class Comparison:
    """The §4 comparison rule applied to several runs."""

    fits: list[SigmoidFit]  # free fits, one per run
    A_shared: float | None  # the mean A, when all A lie within the margin
    refits: list[SigmoidFit] | None  # the fixed-A refits at A_shared
    best: int  # index of the run that scales best
    rule: str  # which rule decided, and any fit not converged


def compare(runs, *, fit_from=0.0, margin=A_MARGIN) -> Comparison:
    """§4, A.5 (Fig 8a). runs: [(C, R, R0), ...]. If the fitted A all lie within `margin`
    (max - min < margin), refit every run with A fixed at their mean: the highest B scales best.
    Otherwise the highest A wins (A.8: the ceiling first). Raises as fit_sigmoid."""
    fits = [fit_sigmoid(C, R, R0, fit_from=fit_from) for C, R, R0 in runs]
    As = np.array([f.A for f in fits])
    if np.ptp(As) >= margin:
        A_shared = None
        refits = None
        best = int(As.argmax())
        rule = f"A spread {np.ptp(As):.3f} >= {margin}: higher A"
    else:
        A_shared = float(As.mean())
        refits = [fit_sigmoid(C, R, R0, A=A_shared, fit_from=fit_from) for C, R, R0 in runs]
        best = int(np.argmax([f.B for f in refits]))
        rule = f"A within {margin}: refit at mean A={A_shared:.4f}, higher B"
    bad = [k for k, f in enumerate(fits + (refits or [])) if not f.converged]
    if bad:
        rule += f" (UNRELIABLE: fits {bad} not converged)"
    return Comparison(fits, A_shared, refits, best, rule)


def extrapolate(C, R, R0, *, fit_until, fit_from=0.0, method: Method = "fast"):
    """§5's protocol (fit on half the target budget, extrapolate to the target): fit on C <=
    fit_until (1-D C, R), predict the points beyond. Returns (SigmoidFit, mean absolute error on
    the held-out points, their count). Raises ValueError on NaN or inf in any point, held out or
    not (a NaN error is never returned), if no point lies beyond fit_until, and as fit_sigmoid."""
    C, R = _finite(C, R, R0)
    tail = C > fit_until
    if not tail.any():
        raise ValueError(f"nothing to extrapolate to: no C beyond fit_until={fit_until:g}")
    fit = fit_sigmoid(C[~tail], R[~tail], R0, fit_from=fit_from, method=method)
    return fit, float(np.abs(fit.predict(C[tail]) - R[tail]).mean()), int(tail.sum())


if __name__ == "__main__":  # the command line lives in fit_report.py: files, a table, a plot
    from infra import fit_report

    fit_report.cli()
