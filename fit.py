"""Sigmoid compute-performance curves: fit, compare, extrapolate, plot (ScaleRL §2.1, §4, A.4-A.8).

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)          Eq. 1, PAPER.md 8.1
         = R0 + (A - R0) * expit(B * (ln C - ln C_mid))  the same curve as a logistic in ln C

A is the ceiling (asymptotic pass rate), B the efficiency exponent, C_mid the compute at half the gain,
R0 the pass rate before RL. Run: `python fit.py runs/a/metrics.jsonl runs/b/metrics.jsonl --c-min 1500
--fit-until 8000 --out fit.png` (table on stdout, plot like the paper's Figure 1).

Where this departs from the paper, and why:
1. The default `method="fast"` is not the A.5 grid: a bounded multi-start least squares over all of A, B,
   C_mid (R0 < A <= 1, B >= 0) in ln C, started from the basins of a coarse profile scan with A solved in
   closed form. The A.5 grid is `method="grid"`; fast reaches an SSE no worse (bench/fit.py), hundreds of
   times faster, and at any compute scale (the paper's C_mid grid only suits GPU-hours in the thousands).
2. Everything is computed as expit(B (ln C - ln C_mid)), so no power or exponential overflows. The grid's
   per-point curve_fit uses this form too: algebraically the paper's curve, same default start B = 1.
3. The grid skips points where curve_fit fails, returns B <= 0 (B > 0 by definition, PAPER.md 8.1) or
   returns a non-finite covariance (it then just hands back its start); a best point on the grid's edge is
   flagged as not converged, since the optimum may lie outside.
4. R0 is held fixed at the measured pre-RL pass rate (PAPER.md 8.3 [inferred]). The CLI takes the eval at
   the smallest compute (the step-0 eval, C = 0) as R0 and does not fit that point: C = 0 is outside the
   curve's domain (ln C) and the curve passes through R0 there by construction.
5. Bootstrap intervals (resampling points) are ours; the paper only states a +-0.02 margin on A (§4).
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

A_MARGIN = 0.02  # §4, A.5: A varied by at most +-0.015 over three seeds, so 0.02 is the error margin on A
PAPER_GRID_A = np.round(np.arange(0.450, 0.8001, 0.005), 3)  # A.5: 71 values
PAPER_GRID_C_MID = np.linspace(100.0, 40000.0, 100)  # A.5: 100 linearly spaced GPU-hour values
RANK_TOL = 1e-8  # smallest/largest singular value of the Jacobian below this = parameters not identified


def sigmoid(C, A, B, C_mid, R0):
    """Eq. 1 (PAPER.md 8.1): pass rate after compute C. C: array-like >= 0 (any unit, same as C_mid);
    A, B, C_mid, R0: floats, B > 0, C_mid > 0. Returns float64 array shaped like C; C = 0 gives R0.
    Raises ValueError on negative compute."""
    C = np.asarray(C, dtype=np.float64)
    if np.any(C < 0):
        raise ValueError("negative compute")
    with np.errstate(divide="ignore"):  # ln 0 = -inf -> expit(-inf) = 0 -> R0, the curve's limit at C = 0
        return R0 + (A - R0) * expit(B * (np.log(C) - math.log(C_mid)))


@dataclass
class SigmoidFit:
    """A fitted Eq. 1 curve. `converged` False means the numbers are not to be trusted; `message` says why."""

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
    """Checks the data and drops points below c_min (A.5 step 1). Returns float64 (C, R) of the fit points."""
    C, R = np.asarray(C, dtype=np.float64), np.asarray(R, dtype=np.float64)
    if C.ndim != 1 or C.shape != R.shape:
        raise ValueError(f"C and R must be 1-D and equally long, got shapes {C.shape} and {R.shape}")
    if not (np.isfinite(C).all() and np.isfinite(R).all() and math.isfinite(R0)):
        raise ValueError(f"NaN or inf in C, R or R0 (at indices {np.flatnonzero(~np.isfinite(C + R)).tolist()})")
    if np.any(C < 0):
        raise ValueError(f"negative compute at indices {np.flatnonzero(C < 0).tolist()}")
    keep = C >= c_min
    C, R = C[keep], R[keep]
    if np.any(C == 0):
        raise ValueError("compute 0 is outside the sigmoid's domain (ln C): it is R0, drop it or set c_min > 0")
    if np.unique(C).size < 4:
        raise ValueError(f"{np.unique(C).size} distinct compute values at C >= c_min={c_min}; need at least 4")
    if not R0 < 1:
        raise ValueError(f"R0={R0} must be below 1, the largest possible A")
    if np.ptp(R) <= 1e-12 * max(1.0, np.abs(R).max()):
        raise ValueError(f"R is flat ({R[0]:.6g} everywhere): no curve to fit")
    slope = np.cov(np.log(C), R)[0, 1]  # least-squares trend of R against ln C
    if slope <= 0:
        raise ValueError("R does not increase with compute (trend against ln C <= 0): Eq. 1 cannot describe it")
    return C, R


def _lsq(res, jac, starts, lo, hi):
    """Bounded least squares from each start (trf keeps every iterate inside the bounds); the best result
    and the reasons not to trust it: optimizer stopped early, or singular Jacobian = infinite covariance."""
    best = None
    for p0 in starts:
        p0 = np.clip(p0, np.add(lo, 1e-9), np.subtract(hi, 1e-9))  # trf must start strictly inside
        out = least_squares(res, p0, jac=jac, bounds=(lo, hi), method="trf", x_scale="jac", ftol=1e-15,
                            xtol=1e-15, gtol=1e-15, max_nfev=1000)
        best = out if best is None or out.cost < best.cost else best
    sv = np.linalg.svd(best.jac, compute_uv=False)
    return best, [m for bad, m in ((best.status <= 0, f"optimizer stopped: {best.message}"),
                                   (sv[-1] <= RANK_TOL * sv[0], "singular Jacobian (infinite covariance): the "
                                    "data do not determine the parameters")) if bad]


def _fit_fast(C, R, R0, A=None, p0=None) -> SigmoidFit:
    """Bounded multi-start least squares in (A, B, m), m = ln C_mid - mean ln C (A fixed: (B, m) only).
    Starts: every basin of a coarse (B, m) scan with A - R0 solved in closed form (linear for fixed B, m),
    or the single start p0 = (A, B, C_mid) (bootstrap refits)."""
    x = np.log(C)
    xm, fixed, r = x.mean(), A is not None, R - R0
    u, w = x - xm, max(np.ptp(x), 1e-12)  # centred ln C: the problem looks the same at any compute scale
    if p0 is None:
        Bs = np.geomspace(0.25, 64.0, 17) / w  # slopes relative to the data's ln C span
        ms = np.linspace(u.min() - 2 * w, u.max() + 2 * w, 41)
        s = expit(Bs[:, None, None] * (u[None, None, :] - ms[None, :, None]))  # (17, 41, n)
        a = np.full(s.shape[:2], A - R0) if fixed else np.clip(
            (s * r).sum(-1) / np.maximum((s * s).sum(-1), 1e-300), 0.0, 1.0 - R0)  # (17, 41) best A - R0
        sse = ((r - a[..., None] * s) ** 2).sum(-1)  # (17, 41)
        pad = np.pad(sse, 1, constant_values=np.inf)  # local minima: no worse than any of the 8 neighbours
        nb = np.stack([pad[1 + i : 18 + i, 1 + j : 42 + j] for i in (-1, 0, 1) for j in (-1, 0, 1) if i or j])
        cells = np.argwhere((sse <= nb).all(0))
        _, first = np.unique(sse[tuple(cells.T)], return_index=True)  # one cell per plateau, best first
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

    lo, hi = [R0, 0.0, -np.inf], [1.0, np.inf, np.inf]  # R0 < A <= 1, B > 0 (PAPER.md 8.1); closed for trf
    out, problems = _lsq(res, jac, [p[fixed:] for p in starts], lo[fixed:], hi[fixed:])
    A_, B_, m = unpack(out.x)
    problems += [m_ for bad, m_ in ((not fixed and A_ >= 1 - 1e-9, "A at its bound 1: no saturation in the data,"
                                     " the ceiling is not identified (A.4)"),
                                    (not fixed and A_ <= R0 + 1e-9, "A at R0: the data do not rise above R0"),
                                    (B_ <= 1e-12, "B at 0: no rise with compute")) if bad]
    with np.errstate(over="ignore"):
        C_mid = float(np.exp(m + xm))  # inf if the fit ran off far beyond the data
    if not math.isfinite(C_mid):
        problems.append("C_mid overflows: far beyond the data, not identified")
    return SigmoidFit(float(A_), float(B_), C_mid, float(R0), float(2 * out.cost), len(C), not problems,
                      "; ".join(problems), "fast", fixed)


def _fit_grid(C, R, R0, grid_A, grid_C_mid) -> SigmoidFit:
    """A.5: for each (A, C_mid) fit B with curve_fit from its default start B = 1; keep the smallest SSE."""
    x, best, n_bad = np.log(C), None, 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", OptimizeWarning)  # a non-finite covariance is checked below instead
        for A, m in itertools.product(grid_A, np.log(grid_C_mid)):
            def f(x_, B, A=A, m=m):
                return R0 + (A - R0) * expit(B * (x_ - m))
            try:
                (B,), pcov = curve_fit(f, x, R, p0=[1.0])  # p0 = [1.0] is SciPy's default initialization
            except RuntimeError:  # maxfev reached
                n_bad += 1
                continue
            if not (np.isfinite(pcov).all() and B > 0):  # start handed back, or the sigmoid upside down
                n_bad += 1
                continue
            sse = float(((f(x, B) - R) ** 2).sum())
            best = (sse, float(A), float(B), math.exp(m)) if best is None or sse < best[0] else best
    if best is None:
        raise RuntimeError(f"grid: all {n_bad} (A, C_mid) points failed (curve_fit error, B <= 0 or infinite "
                           f"covariance); the C_mid grid [{min(grid_C_mid):g}, {max(grid_C_mid):g}] likely does "
                           f"not match the compute scale [{C.min():.3g}, {C.max():.3g}]")
    sse, A, B, C_mid = best
    problems = [f"best {name}={v:g} is on the grid's edge: the optimum may lie outside it"
                for name, v, g in (("A", A, grid_A), ("C_mid", C_mid, grid_C_mid))
                if len(g) >= 3 and (np.isclose(v, min(g), rtol=1e-12) or np.isclose(v, max(g), rtol=1e-12))]
    return SigmoidFit(A, B, C_mid, float(R0), sse, len(C), not problems, "; ".join(problems), "grid",
                      len(grid_A) == 1)


def fit_sigmoid(C, R, R0, *, A=None, c_min=0.0, method: Literal["fast", "grid"] = "fast", grid_A=None,
                grid_C_mid=None) -> SigmoidFit:
    """Fits Eq. 1 to pass rate R against compute C with R0 held fixed (PAPER.md 8.1, 8.3).

    C, R: 1-D array-likes of equal length (compute in any unit, pass rate). Points with C < c_min are
    dropped first (A.5: the paper uses 1,500 GPU-hours). `A` given: fixed-A refit (the §4 comparison rule),
    only B and C_mid are fitted. method="grid": the A.5 procedure over `grid_A` x `grid_C_mid` (default:
    the paper's grids, which suit GPU-hours); "fast": bounded multi-start least squares, scale-free.
    Raises ValueError on bad data (NaN/inf, negative or zero compute, < 4 distinct compute values, flat or
    non-increasing R, R0 >= 1, A outside (R0, 1]) and RuntimeError when every grid point fails. A fit on a
    bound, with a singular Jacobian (infinite covariance) or on the grid's edge comes back with
    converged=False and the reason in `message`."""
    C, R = _validate(C, R, R0, c_min)
    if A is not None and not R0 < A <= 1:
        raise ValueError(f"fixed A={A} must lie in (R0={R0}, 1]")
    if method == "fast":
        return _fit_fast(C, R, R0, A)
    if method != "grid":
        raise ValueError(f"method must be 'fast' or 'grid', got {method!r}")
    gA = np.asarray([A] if A is not None else PAPER_GRID_A if grid_A is None else grid_A, dtype=np.float64)
    gC = np.asarray(PAPER_GRID_C_MID if grid_C_mid is None else grid_C_mid, dtype=np.float64)
    if np.any(gA <= R0) or np.any(gA > 1) or np.any(gC <= 0):
        raise ValueError(f"grid_A must lie in (R0={R0}, 1] and grid_C_mid be > 0")
    return _fit_grid(C, R, R0, gA, gC)


@dataclass
class Bootstrap:
    """Percentile intervals over refits on resampled points; failed refits are counted, not used."""

    A: tuple[float, float]
    B: tuple[float, float]
    C_mid: tuple[float, float]
    n_ok: int
    n_failed: int  # resamples with < 4 distinct C or flat/non-rising R, or refits flagged not converged


def bootstrap(fit: SigmoidFit, C, R, *, c_min=0.0, n_boot=200, level=0.95, seed=0) -> Bootstrap:
    """Pairs bootstrap (ours; the paper gives only the +-0.02 margin on A, §4): resample the fit points with
    replacement, refit each resample with the fast method started at `fit`'s parameters (A stays fixed if
    `fit` is a fixed-A refit), and return the central `level` percentile interval of A, B, C_mid.
    C, R, c_min: the data `fit` was fitted on (1-D array-likes). Intervals are NaN when fewer than 2 of the
    n_boot refits succeed."""
    C, R = _validate(C, R, fit.R0, c_min)
    rng, draws = np.random.default_rng(seed), []
    for _ in range(n_boot):
        i = rng.integers(0, len(C), len(C))
        try:
            f = _fit_fast(*_validate(C[i], R[i], fit.R0, 0.0), fit.R0, fit.A if fit.fixed_A else None,
                          p0=(fit.A, fit.B, fit.C_mid))
        except ValueError:
            continue
        if f.converged:
            draws.append((f.A, f.B, f.C_mid))
    q = [50 * (1 - level), 50 * (1 + level)]
    ci = np.percentile(np.array(draws), q, axis=0).T if len(draws) >= 2 else np.full((3, 2), np.nan)
    return Bootstrap(*(tuple(float(v) for v in row) for row in ci), len(draws), n_boot - len(draws))


@dataclass
class PowerLawFit:
    """A.4's power law R(C) = A - D / C^B (B > 0, D >= 0, A <= 1), valid above its threshold c_min."""

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
    """Least-squares fit of A.4's power law to points with C >= c_min (for the A.4 comparison: it keeps
    rising where a sigmoid saturates, so fitted on early points it overshoots A). Same inputs and errors as
    fit_sigmoid; A on its bound 1 or a singular Jacobian gives converged=False."""
    C, R = _validate(C, R, 0.0, c_min)
    x = np.log(C)
    u, w = x - x.mean(), np.ptp(x)  # centred ln C: d = D exp(-B mean ln C) stays O(1) at any scale

    def res(p):
        return p[0] - p[2] * np.exp(-p[1] * u) - R

    def jac(p):
        g = np.exp(-p[1] * u)
        return np.stack([np.ones_like(u), p[2] * u * g, -g], axis=1)

    scan = []  # for fixed B the model is linear in (A, d): one least-squares solve per start slope
    for B in np.geomspace(0.01, 64.0, 25) / w:
        X = np.stack([np.ones_like(u), -np.exp(-B * u)], axis=1)
        (A, d), *_ = np.linalg.lstsq(X, R)
        scan.append((float(((X @ [A, d] - R) ** 2).sum()), A, B, d))
    out, problems = _lsq(res, jac, [min(scan)[1:]], [-np.inf, 0.0, 0.0], [1.0, np.inf, np.inf])
    A, B, d = out.x
    problems += ["A at its bound 1"] if A >= 1 - 1e-9 else []
    with np.errstate(over="ignore"):
        D = float(d * np.exp(B * x.mean()))
    return PowerLawFit(float(A), float(B), D, float(2 * out.cost), len(C), not problems, "; ".join(problems))


@dataclass
class Comparison:
    """The §4 comparison rule applied to several runs."""

    fits: list[SigmoidFit]  # free fits, one per run
    A_shared: float | None  # mean A when every A lies within the margin, else None
    refits: list[SigmoidFit] | None  # fixed-A refits at A_shared
    best: int  # index of the run that scales best
    rule: str


def compare(runs, *, c_min=0.0, margin=A_MARGIN) -> Comparison:
    """§4, A.5 (PAPER.md 8.4): runs = [(C, R, R0), ...]. If all fitted A lie within `margin` of each other
    (max - min < margin), refit every run with A fixed at their mean; the highest B scales best. Otherwise
    the highest A wins (A.8: the ceiling first). Raises as fit_sigmoid; refits must converge."""
    fits = [fit_sigmoid(C, R, R0, c_min=c_min) for C, R, R0 in runs]
    As = np.array([f.A for f in fits])
    if np.ptp(As) >= margin:
        return Comparison(fits, None, None, int(As.argmax()), f"A differ by {np.ptp(As):.3f} >= {margin}: higher A")
    A_shared = float(As.mean())
    refits = [fit_sigmoid(C, R, R0, A=A_shared, c_min=c_min) for C, R, R0 in runs]
    best = int(np.argmax([f.B for f in refits]))
    return Comparison(fits, A_shared, refits, best, f"A within {margin}: refit at mean A={A_shared:.4f}, higher B")


def extrapolate(C, R, R0, *, fit_until, c_min=0.0, method: Literal["fast", "grid"] = "fast"):
    """§5 protocol (PAPER.md 8.5): fit on the points with C <= fit_until, predict the rest.
    Returns (SigmoidFit, mean absolute error on the held-out points with C > fit_until, their count).
    Raises ValueError when no point lies beyond fit_until, and as fit_sigmoid."""
    C, R = np.asarray(C, dtype=np.float64), np.asarray(R, dtype=np.float64)
    tail = C > fit_until
    if not tail.any():
        raise ValueError(f"no point beyond fit_until={fit_until:g} (max C={C.max():g}): nothing to extrapolate to")
    fit = fit_sigmoid(C[~tail], R[~tail], R0, c_min=c_min, method=method)
    return fit, float(np.abs(fit.predict(C[tail]) - R[tail]).mean()), int(tail.sum())


def load_metrics(path, x="gpu_hours", y="eval/pass_rate"):
    """Reads train.py's metrics.jsonl (one JSON object per line). Lines without `y` (no eval ran) are
    skipped. Returns float64 arrays (C, R), sorted by C. Raises ValueError naming the line on bad JSON or
    on an eval line without `x`, and when no line has `y`."""
    pts = []
    with open(path) as f:
        for k, line in enumerate(f, 1):
            try:
                rec = json.loads(line) if line.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{k}: not JSON ({e})") from e
            if y in rec and x not in rec:
                raise ValueError(f"{path}:{k}: has {y!r} but no {x!r}")
            if y in rec:
                pts.append((float(rec[x]), float(rec[y])))
    if not pts:
        raise ValueError(f"{path}: no line has {y!r}")
    C, R = np.array(sorted(pts)).T
    return C, R


def plot(runs, out, *, xlabel, ylabel, c_min=0.0, fit_until=None):
    """Figure 1 style, one colour per run: fitted points (dots), points below c_min (hollow), held-out
    points (crosses), solid curve over the fitted range, dashed extrapolation, dotted line at A.
    runs = [(name, C, R, fit)] with C, R 1-D arrays; writes the image to `out`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for i, (name, C, R, fit) in enumerate(runs):
        col, end = f"C{i}", fit_until or C.max()
        used, held = (C >= c_min) & (C <= end), C > end
        ax.scatter(C[used], R[used], s=16, color=col, alpha=0.8)
        ax.scatter(C[C < c_min], R[C < c_min], s=16, facecolors="none", edgecolors=col)
        ax.scatter(C[held], R[held], s=30, marker="x", color=col, alpha=0.6)
        g = np.geomspace(C[used].min(), end, 200)
        label = f"{name}: A={fit.A:.3f}  B={fit.B:.2f}  C_mid={_num(fit.C_mid)}" + ("" if fit.converged else " (!)")
        ax.plot(g, fit.predict(g), color=col, lw=2, label=label, zorder=3)
        if held.any():
            g = np.geomspace(end, C.max() * 1.15, 100)
            ax.plot(g, fit.predict(g), "--", color=col, lw=2, zorder=3)
        ax.axhline(fit.A, color=col, ls=":", lw=1)
    if fit_until:
        ax.axvline(fit_until, color="grey", lw=0.8, ls="-.", label=f"fit until {fit_until:g} (x: held out)")
    ax.set(xscale="log", xlabel=xlabel, ylabel=ylabel, title="R = R0 + (A - R0) / (1 + (C_mid / C)^B)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def _num(v):
    return f"{v:.0f}" if 10 <= abs(v) < 1e6 else f"{v:.3g}"


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
    table = [["run", "n", "R0", "A", "95% CI", "paper", "B", "95% CI", "C_mid", "95% CI", "SSE", "MAE tail (n)"]]
    for path in args.paths:
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) or path
        try:
            C, R = load_metrics(path, args.x, args.y)
            # R0 = the eval at the smallest compute (the step-0 eval, C = 0): it anchors the curve there, so it
            # is not also a fit point (and C = 0 is outside the curve's ln C domain)
            R0, keep = (float(R[0]), C > C[0]) if args.r0 is None else (args.r0, C > 0)
            c0 = C[0]
            C, R = C[keep], R[keep]
            head = C <= (math.inf if args.fit_until is None else args.fit_until)
            if args.fit_until is None:
                fit, mae, n_tail = fit_sigmoid(C, R, R0, c_min=args.c_min, method=args.method), math.nan, 0
            else:
                fit, mae, n_tail = extrapolate(C, R, R0, fit_until=args.fit_until, c_min=args.c_min,
                                               method=args.method)
            bs = bootstrap(fit, C[head], R[head], c_min=args.c_min, n_boot=args.n_boot, seed=args.seed)
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"{path}: {e}") from e
        runs.append((name, C, R, fit))
        fit_pts.append((C[head], R[head], R0))
        table.append([name, str(fit.n), f"{R0:.3f}", f"{fit.A:.4f}", f"[{bs.A[0]:.4f}, {bs.A[1]:.4f}]",
                      f"+-{A_MARGIN}", f"{fit.B:.3f}", f"[{bs.B[0]:.3f}, {bs.B[1]:.3f}]", _num(fit.C_mid),
                      f"[{_num(bs.C_mid[0])}, {_num(bs.C_mid[1])}]", f"{fit.sse:.2e}", f"{mae:.4f} ({n_tail})"])
        for cond, note in (((~keep).sum() > 1, f"{(~keep).sum()} evals at {args.x} <= {c0:g} are R0, not fitted"),
                           (bs.n_failed, f"{bs.n_failed}/{args.n_boot} bootstrap refits degenerate or at a bound"),
                           (not fit.converged, f"NOT CONVERGED: {fit.message}")):
            notes += [f"{name}: {note}"] if cond else []
    widths = [max(len(row[k]) for row in table) for k in range(len(table[0]))]
    print("\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in table))
    if len(fit_pts) >= 2:
        cmp = compare(fit_pts, c_min=args.c_min)
        shared = "" if cmp.refits is None else " (B at shared A: " + ", ".join(
            f"{r[0]} {f.B:.3f}" for r, f in zip(runs, cmp.refits, strict=True)) + ")"
        print(f"comparison (§4): {cmp.rule}{shared} -> {runs[cmp.best][0]} scales best")
    print("\n".join(notes)) if notes else None
    plot(runs, args.out, xlabel=args.x, ylabel=args.y, c_min=args.c_min, fit_until=args.fit_until)
    print(f"wrote {args.out}")
    if any(not f.converged for *_, f in runs):
        raise SystemExit("a fit did not converge (see above): its parameters are not to be trusted")


if __name__ == "__main__":
    main(tyro.cli(Args))
