"""A target clipping band, and the check of a window's τ on held-out steps.

A practical way to choose τ is so that the clipping ratio lands in a small band (large-scale
pretraining: low, often below 5%; a rule of thumb, not a published bound). ``band_quantile`` aims at
the band's midpoint, τ = Quantile_{1 − (low + high)/2} of the window (the realised ratio's sampling
error is binomial, about symmetric in absolute terms, and the band is stated in absolute shares);
``check_band`` then compares the ratio the window predicts (its share of norms above τ) with the
ratio realised while clipping at τ on the following ``validate`` steps, with an exact
(Clopper–Pearson) interval on the realised ratio so that a handful of validation steps is not
mistaken for drift. Its bounds are Beta quantiles, found on the regularized incomplete beta
(``beta_ppf``) in the standard library's float arithmetic: the engine needs no scipy.

References:
    Clopper & Pearson, "The use of confidence or fiducial limits illustrated in the case of the
    binomial", Biometrika 26 (1934).
    Loader, "Fast and accurate computation of binomial probabilities" (2000) (``_stirlerr``, ``_bd0``).
    Press et al., "Numerical Recipes", 3rd ed. (2007), §6.4 (the incomplete beta's continued fraction).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import NormalDist

from .calibration import CONFIDENCE
from .spelling import ENGINE, Spelling

#: A healthy clipping ratio for large-scale pretraining: low, often below 5% (a rule of thumb, not a published bound).
PRETRAINING_BAND = (0.01, 0.05)
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)


def validate_band(band: tuple[float, float]) -> tuple[float, float]:
    """``band`` as a (low, high) pair of clipping ratios with 0 ≤ low < high ≤ 1, else a ``ValueError`` naming it.

    τ aims at the band's midpoint and its held-out steps are judged against the band, so the band needs a
    width (low < high: a band of one ratio would hold no sampled ratio and bound no window); low = 0 is no
    floor, high = 1 no ceiling."""
    try:
        low, high = (float(x) for x in band)
    except (TypeError, ValueError):
        raise ValueError(f"target_clip={band!r} must be two ratios [low, high], e.g. [0.01, 0.05]") from None
    if not 0.0 <= low < high <= 1.0:
        raise ValueError(
            f"target_clip=[{low:g}, {high:g}] needs 0 <= low < high <= 1 (τ aims at the band's midpoint and "
            "its held-out steps are judged against it, so it needs a width), e.g. [0.01, 0.05]"
        )
    return low, high


def band_quantile(band: tuple[float, float]) -> float:
    """The quantile whose window clipping ratio is the band's midpoint (low + high) / 2."""
    low, high = validate_band(band)
    return 1.0 - (low + high) / 2


def _stirlerr(x: float) -> float:
    """log Γ(x) − ((x − ½)·log x − x + ½·log 2π), Stirling's error term (Loader 2000)."""
    if x < 16:
        return math.lgamma(x) - (x - 0.5) * math.log(x) + x - _HALF_LOG_2PI
    y = 1.0 / (x * x)
    return (1 / 12 - y * (1 / 360 - y * (1 / 1260 - y * (1 / 1680 - y / 1188)))) / x


def _bd0(u: float, v: float, d: float) -> float:
    """u·log(u / v) + v − u, given d = u − v as well: near u ≈ v from ``d`` alone (Loader 2000's series),
    so neither the cancellation there nor that of two terms whose v's add up to their u's costs digits."""
    if abs(d) >= 0.1 * (u + v):
        return u * math.log(u / v) - d
    e = d / (2 * u - d)
    s, term, e2, j = d * e, 2 * u * e, e * e, 1
    while True:
        term *= e2
        nxt = s + term / (2 * j + 1)
        if nxt == s:
            return s
        s, j = nxt, j + 1


def _log_beta_front(x: float, a: float, b: float) -> float:
    """log(xᵃ (1 − x)ᵇ / B(a, b)), with B(a, b) by Stirling's series and the exponents as ``_bd0``'s
    around a = x·(a + b), b = (1 − x)·(a + b): no difference of large log-gammas, so it stays accurate
    to ~1e-14 at a + b ~ 10⁷."""
    n = a + b
    d = a - x * n  # and b − (1 − x)·n = −d exactly
    return (
        0.5 * math.log(a * b / n)
        - _HALF_LOG_2PI
        - _bd0(a, x * n, d)
        - _bd0(b, (1.0 - x) * n, -d)
        - _stirlerr(a)
        - _stirlerr(b)
        + _stirlerr(n)
    )


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz; Press et al., Numerical Recipes §6.4)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 100_000):
        for num in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-16:
            return h
    raise ArithmeticError(f"I_x(a={a:g}, b={b:g}) at x={x!r}: the continued fraction did not converge")


def _betainc(x: float, a: int, b: int) -> tuple[float, float]:
    """The regularized incomplete beta I_x(a, b) for whole a, b ≥ 1 and the Beta(a, b) density at ``x``
    (0 < x < 1). Below (a + 1)/(a + b + 2) by the continued fraction; above it as 1 − P(Bin(a + b − 1, x)
    ≤ a − 1), the binomial terms summed down from the largest (pmf(a − 1) = front/(x·b)), each from the
    previous by their ratio: both read x itself, where I_{1−x}(b, a) would first round 1 − x (a relative
    error of ε/x, 10⁻¹⁰ at x ~ 10⁻⁶)."""
    front = math.exp(_log_beta_front(x, a, b))
    density = front / (x * (1.0 - x))
    if x < (a + 1) / (a + b + 2):
        return front * _betacf(a, b, x) / a, density
    term = front / (x * b)
    total, odds = term, (1.0 - x) / x
    for j in range(a - 1, 0, -1):  # term: pmf(j) → pmf(j − 1) = pmf(j)·j/(a + b − j)·(1 − x)/x
        term *= j / (a + b - j) * odds
        total += term
        if term < 1e-17 * total:
            break
    return 1.0 - total, density


def beta_ppf(p: float, a: int, b: int) -> float:
    """The p-quantile of Beta(a, b) (whole a, b ≥ 1, 0 < p < 1): the x with I_x(a, b) = p, by Newton's method
    kept inside a shrinking bracket (a bisection step whenever Newton would leave it), to ~1e-15 relative."""
    mean, sd = a / (a + b), math.sqrt(a * b / (a + b + 1)) / (a + b)
    x = min(max(mean + NormalDist().inv_cdf(p) * sd, 1e-300), 1 - 1e-16)
    lo, hi = 0.0, 1.0
    for _ in range(2000):
        value, density = _betainc(x, a, b)
        lo, hi = (x, hi) if value < p else (lo, x)
        new = x - (value - p) / density if density > 0 else math.nan
        if abs(new - x) <= 1e-15 * x:  # Newton's step: converged (the error left is about its square)
            return new
        if not lo < new < hi:
            new = (lo + hi) / 2
            if new in (lo, hi):  # the bracket is two neighbouring floats
                return new
        x = new
    return x


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Exact two-sided interval for a binomial proportion from ``k`` successes in ``n`` trials
    (Clopper & Pearson 1934): the p_low with P(B ≥ k; p_low) = α/2 and the p_high with
    P(B ≤ k; p_high) = α/2, i.e. the Beta quantiles p_low = Beta(k, n − k + 1).ppf(α/2) and
    p_high = Beta(k + 1, n − k).ppf(1 − α/2) (0 when k = 0, 1 when k = n; (0, 1) when n < 1).
    Each bound is one ``beta_ppf``: a few continued-fraction evaluations, not a binomial CDF over 0..n
    per bisection step, so n = 10⁵ takes milliseconds."""
    if n < 1:
        return 0.0, 1.0
    half = (1.0 - confidence) / 2
    lower = 0.0 if k == 0 else beta_ppf(half, k, n - k + 1)
    upper = 1.0 if k == n else beta_ppf(1.0 - half, k + 1, n - k)
    return lower, upper


def window_ratio(n: int, band: tuple[float, float]) -> float:
    """The clipping ratio τ = Quantile_q of ``n`` distinct norms predicts at the band's q = 1 − m (m its
    midpoint): linear interpolation puts τ at rank (n − 1)·q, so ⌈(n − 1)·m⌉ of the n norms lie above it."""
    mid = 1.0 - band_quantile(band)
    return math.ceil((n - 1) * mid - 1e-9) / n


def min_band_window(band: tuple[float, float]) -> int:
    """The fewest norms from which on every window's band quantile predicts a ratio inside the band.

    With m = (low + high)/2 and w = high − low: ⌈(n − 1)m⌉/n ≥ (n − 1)m/n ≥ low once n ≥ 2m/w, and
    ⌈(n − 1)m⌉/n < ((n − 1)m + 1)/n ≤ high once n ≥ 2(1 − m)/w; so n ≥ 2·max(m, 1 − m)/w suffices
    (49 norms for [1%, 5%]), and the answer walks down from there while shorter windows still land inside."""
    low, high = validate_band(band)
    n = math.ceil(2 * max(1.0 - band_quantile(band), band_quantile(band)) / (high - low) - 1e-9)
    while n > 1 and low <= window_ratio(n - 1, band) <= high:
        n -= 1
    return n


@dataclass(frozen=True)
class BandCheck:
    """Predicted vs realised clipping ratio over the validation steps, with a verdict and the next action."""

    tau: float
    band: tuple[float, float]
    predicted: float  # share of the window's norms above τ
    clipped: int  # validation steps clipped at τ
    steps: int  # validation steps taken (skipped steps are not counted)
    realised: float
    realised_low: float  # Clopper–Pearson interval of the realised ratio
    realised_high: float
    inside: bool  # realised ratio in the band
    consistent: bool  # the predicted ratio lies in the realised ratio's interval (no evidence of drift)
    within_2x: bool  # predicted / 2 ≤ realised ≤ 2 · predicted
    verdict: str
    action: str

    @property
    def factor(self) -> float:
        """realised / predicted (inf when the window predicted no clipping)."""
        return self.realised / self.predicted if self.predicted > 0 else (math.inf if self.realised else 1.0)

    def as_dict(self) -> dict:
        return {**asdict(self), "band": list(self.band), "factor": self.factor}


def check_band(
    tau: float,
    predicted: float,
    clipped: int,
    steps: int,
    band: tuple[float, float],
    confidence: float = CONFIDENCE,
    *,
    repeating: bool = False,
    placed_auto: bool = False,
    held_out_by: str = "steps",
    quantile: float | None = None,
    norms: int | None = None,
    room: int | None = None,
    validate: int = 0,
    spelling: Spelling = ENGINE,
) -> BandCheck:
    """Judge τ on its validation steps: inside the band, or drifted from the prediction (by how much).
    ``repeating``: the run already re-calibrates (``every``); ``placed_auto``: the window was placed
    by ``start='auto'``; ``held_out_by``: what ended its validation steps (``"validate"``: their
    number, ``"every"``: the next window, ``"steps"``: the end of the run); ``room``: the run's steps after
    the window (``None``: unknown); ``validate``: the option ``validate``. The next action accounts for them and
    names the settings as ``spelling`` writes them (``clipamp_engine.spelling``)."""
    low, high = validate_band(band)
    if steps < 1:
        more = spelling.name("validate")
        more += f" or {spelling.name('length')}" if spelling.lengthen == "raise" else f", or {spelling.longer_run()}"
        raise ValueError(f"no validation step was taken: raise {more}")
    realised = clipped / steps
    lo, hi = clopper_pearson(clipped, steps, confidence)
    inside = low <= realised <= high
    consistent = lo <= predicted <= hi
    within = predicted / 2 <= realised <= 2 * predicted
    side = "inside" if inside else "above" if realised > high else "below"
    verdict = (
        f"realised {realised:.1%} ({clipped}/{steps} steps, {confidence:.0%} interval {lo:.1%}–{hi:.1%}) "
        f"vs predicted {predicted:.1%}: {side} the band [{low:.0%}, {high:.0%}]; "
    )
    verdict += (
        "consistent with the window"
        if consistent
        else f"drifted: {realised / predicted:.2g}× the prediction"
        if predicted > 0
        else "drifted: the window predicted no clipping"
    )
    return BandCheck(
        tau,
        (low, high),
        predicted,
        clipped,
        steps,
        realised,
        lo,
        hi,
        inside,
        consistent,
        within,
        verdict,
        _action(
            tau,
            predicted,
            realised,
            steps,
            (low, high),
            inside,
            consistent,
            repeating,
            placed_auto,
            held_out_by,
            quantile,
            norms,
            room,
            validate,
            spelling,
        ),
    )


def _more_held_out(need: int, held_out_by: str, room: int | None, validate: int, sp: Spelling = ENGINE) -> str:
    """The change that gives τ ``need`` validation steps: only a knob that binds, never ``validate``
    alone where the run ends before that many steps (``room``: the run's steps after the window)."""
    if held_out_by == "every":
        return f"space the windows further apart ({sp.name('every')})"
    if held_out_by == "validate" and (room is None or room >= need):
        return f"raise {sp.name('validate')}"
    if held_out_by == "validate":
        return f"{sp.longer_run('validate')} (the run ends {room} steps after the window)"
    capped = 0 < validate < need  # more steps alone stop at validate
    more = sp.longer_run("validate" if capped else None)
    return f"train longer after the window ({more})"


def _action(
    tau: float,
    predicted: float,
    realised: float,
    steps: int,
    band: tuple[float, float],
    inside: bool,
    consistent: bool,
    repeating: bool = False,
    placed_auto: bool = False,
    held_out_by: str = "steps",
    quantile: float | None = None,
    norms: int | None = None,
    room: int | None = None,
    validate: int = 0,
    sp: Spelling = ENGINE,
) -> str:
    low, high = band
    if inside:
        return (
            f"keep {sp.set('threshold', f'{tau:.4g}')}; re-check when the LR, data mixture or sequence length "
            f"change ({'the later windows do' if repeating else sp.name('every')})"
        )
    if consistent and low <= predicted <= high:
        need = math.ceil(20 / max(predicted, 1e-9))
        more = _more_held_out(need, held_out_by, room, validate, sp)
        return (
            f"too few validation steps to tell the ratio from the band ({steps}): {more}; "
            f"≈{need} steps see ~20 clips at {predicted:.1%}"
        )
    if consistent:
        need = min_band_window(band)
        short = norms is not None and norms < need
        lengthen = f"a window of ≥ {need} norms ({sp.name('window')}) predicts a ratio inside the band"
        if quantile is not None and math.isclose(quantile, band_quantile(band), rel_tol=1e-9):
            if short:
                return (
                    f"the window is too short to resolve the band: its {norms} norms give ratios in steps of "
                    f"{1 / norms:.1%} and τ = Quantile_{quantile:.3f} leaves {predicted:.1%} above it; {lengthen}"
                )
            return (
                f"τ = Quantile_{quantile:.3f} of the window leaves {predicted:.1%} above it: its norms repeat "
                "(ties at τ), which no quantile or window length resolves; set "
                f"{sp.name('threshold')} from the quantile table"
            )
        return (
            f"the window itself predicts {predicted:.1%}, outside the band: aim at the band with "
            f"{sp.set('quantile', sp.band)} (τ = Quantile_{band_quantile(band):.3f})"
            + (f"; and {lengthen}" if short else "")
        )
    if realised > predicted:
        again = (
            "see whether the later windows' τ moved (drift) or the rise was a burst; a longer window"
            if repeating
            else f"re-calibrate later or repeatedly ({sp.name('every')}) or with a longer window"
        )
        return (
            f"the norms rose after the window: {again}; clipping that stays above the band after warm-up "
            "points at the LR or loss scale"
        )
    later = (
        f"{sp.set('start', 'N')}, past the step the automatic placement chose"
        if placed_auto
        else f"{sp.set('start', sp.auto)} or a larger N"
    )
    return f"the norms fell after the window, which caught a transient: start it later ({later}) or lengthen it"
