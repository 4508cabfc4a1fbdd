"""Calibration windows: quantiles, their order-statistic confidence intervals, window lengths."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clipamp_engine.calibration import (
    NormCalibrator,
    min_window,
    order_statistic_ranks,
    quantile_ci,
    short_window_warning,
    window_for_width,
)
from clipamp_engine.clip import make_clip_policy
from clipamp_engine.records import SkipLog, StepLog

stats = pytest.importorskip("scipy.stats")

QS = (0.5, 0.9, 0.95, 0.99)


@pytest.mark.parametrize("q", QS)
@pytest.mark.parametrize("n", [40, 100, 400, 1000])
def test_interval_matches_scipys_quantile_test(q, n):
    """Same order statistics as scipy.stats.quantile_test(...).confidence_interval (Conover's method)."""
    x = np.random.default_rng(n).lognormal(0.0, 0.5, n)
    ci = quantile_ci(list(x), q)
    ref = stats.quantile_test(x, p=q).confidence_interval(0.95)
    assert ci.estimate == pytest.approx(np.quantile(x, q), rel=1e-12)
    for ours, theirs in ((ci.low, ref.low), (ci.high, ref.high)):
        if math.isfinite(theirs):
            assert ours == pytest.approx(theirs, rel=1e-12)
        else:
            assert math.isnan(ours)


@pytest.mark.parametrize("q", QS)
def test_coverage_of_a_nominal_95_interval_on_lognormal_draws(q):
    """The definition: over 200 windows of a known distribution, ≥ 90% of intervals hold the true quantile."""
    rng = np.random.default_rng(13)
    n = max(400, min_window(q))  # long enough that both bounds exist
    true = float(np.exp(0.5 * stats.norm.ppf(q)))  # Quantile_q of lognormal(0, 0.5)
    hits = 0
    for _ in range(200):
        ci = quantile_ci(list(rng.lognormal(0.0, 0.5, n)), q)
        assert ci.bounded and ci.coverage >= 0.95
        hits += ci.low <= true <= ci.high
    assert hits / 200 >= 0.90


@pytest.mark.parametrize("q", QS)
def test_exact_coverage_is_the_binomial_probability(q):
    n = 500
    r, s, coverage = order_statistic_ranks(n, q)
    pmf = stats.binom.pmf(np.arange(n + 1), n, q)
    assert coverage == pytest.approx(pmf[r:s].sum(), abs=1e-9)  # P(r <= B <= s - 1)
    assert coverage >= 0.95
    # tightest in the Conover sense: moving either rank inwards drops below α/2 on that side
    assert stats.binom.cdf(r, n, q) > 0.025 and stats.binom.cdf(s - 2, n, q) < 0.975


@pytest.mark.parametrize("q,expected", [(0.5, 6), (0.9, 36), (0.95, 72), (0.99, 368)])
def test_min_window_is_where_both_bounds_first_exist(q, expected):
    assert min_window(q) == expected
    r, s, _ = order_statistic_ranks(expected, q)
    assert r is not None and s is not None
    r, s, _ = order_statistic_ranks(expected - 1, q)
    assert r is None or s is None


def test_short_window_warns_for_p99_from_100_norms():
    norms = list(np.random.default_rng(0).lognormal(0.0, 0.3, 100))
    ci = quantile_ci(norms, 0.99)
    assert not ci.bounded and math.isnan(ci.high) and ci.low <= ci.estimate
    message = short_window_warning(ci)
    assert "p99 from 100 norms" in message and "≥ 368" in message and "upper" in message
    assert short_window_warning(quantile_ci(norms, 0.9)) is None


def test_window_for_width_extrapolates_like_one_over_sqrt_n():
    """The extrapolated length gives about the asked width when measured on that many draws."""
    rng = np.random.default_rng(1)
    ci = quantile_ci(list(rng.lognormal(0.0, 0.5, 200)), 0.9)
    need = window_for_width(ci.n, ci.rel_width, ci.rel_width / 2)
    assert need == pytest.approx(4 * ci.n, rel=0.01)
    widths = [quantile_ci(list(rng.lognormal(0.0, 0.5, need)), 0.9).rel_width for _ in range(20)]
    assert np.median(widths) == pytest.approx(ci.rel_width / 2, rel=0.35)
    assert window_for_width(100, math.nan, 0.1) is None
    assert window_for_width(400, 0.2, 0.4) == 400  # already narrow enough: no more norms needed
    assert window_for_width(400, 0.2, 0.4, minimum=1) == 100  # the 1/√n law extrapolated down


def _log(step, norm, skipped=False):
    if skipped:
        return SkipLog(
            step=step,
            lr=1e-3,
            grad_l2_pre_clip=math.inf,
            grad_l2_post_clip=math.nan,
            loss=2.0,
            scaler_scale=1.0,
            clipped=False,
        )
    return StepLog(
        step=step, lr=1e-3, grad_l2_pre_clip=norm, grad_l2_post_clip=norm, loss=2.0, scaler_scale=1.0, clipped=False
    )


def test_summary_carries_intervals_prediction_and_the_short_window_warning():
    norms = np.random.default_rng(2).lognormal(0.0, 0.3, 100)
    cal = NormCalibrator(quantile=0.99)
    for i, n in enumerate(norms):
        cal.add(_log(i + 1, float(n), skipped=(i == 50)))
    s = cal.summary()
    finite = np.delete(norms, 50)
    assert s.n_finite == 99 and s.n_skipped == 1
    assert s.recommended_max_norm == pytest.approx(np.quantile(finite, 0.99))
    assert set(s.cis) == {"p50", "p90", "p95", "p99"}
    assert s.tau_ci.estimate == s.recommended_max_norm
    assert s.predicted_clip_ratio == pytest.approx(np.mean(finite > s.recommended_max_norm))
    assert len(s.warnings) == 1 and "p99 from 99 norms" in s.warnings[0]
    d = s.as_dict()
    assert d["confidence_intervals"]["p50"]["low"] <= d["quantiles"]["p50"] <= d["confidence_intervals"]["p50"]["high"]


@pytest.mark.parametrize(
    "option,message",
    [
        (dict(confidence=1.5), r"confidence=1.5 must be in \(0, 1\)"),
        (dict(confidence=0), r"confidence=0 must be in \(0, 1\)"),
        (dict(candidates=[1.0, -1.0]), r"candidates=\[1.0, -1.0\] must be finite numbers > 0"),
        (dict(candidates=["x"]), r"candidates=\['x'\] must be finite numbers > 0"),
        (dict(candidates=[float("nan")]), r"candidates=\[nan\] must be finite numbers > 0"),
        (dict(candidates=[1.0, 2.0, 1]), r"^candidates=\[1.0, 2.0, 1\] lists 1 more than once: each is one threshold "),
    ],
)
def test_a_bad_confidence_or_candidate_is_refused_when_the_policy_is_built(option, message):
    """Not when the first window closes, hundreds of steps into the run."""
    with pytest.raises(ValueError, match=message):
        make_clip_policy("calibrated", **option)


NORMS = np.random.default_rng(3).lognormal(0.0, 0.3, 50)


def _summary(candidates):
    cal = NormCalibrator(quantile=0.95, candidates=candidates)
    for i, n in enumerate(NORMS):
        cal.add(_log(i + 1, float(n)))
    return cal.summary()


def test_candidates_are_a_set_of_thresholds_none_included():
    """``[]`` reports the clipping ratio at the window's quantiles and τ only, each as numpy counts it; the order
    of the candidates does not matter."""
    none, some = _summary([]), _summary([5.0, 0.5])
    assert some.candidate_clip_ratios == _summary([0.5, 5.0]).candidate_clip_ratios
    assert list(none.candidate_clip_ratios) == sorted(np.quantile(NORMS, QS).tolist())  # τ is p95 here
    for tau, ratio in none.candidate_clip_ratios.items():
        assert ratio == np.mean(NORMS > tau) == some.candidate_clip_ratios[tau]
    assert none.recommended_max_norm == some.recommended_max_norm and {0.5, 5.0} < set(some.candidate_clip_ratios)


def test_short_window_warning_counts_the_window_it_needs_in_steps():
    """calibrate.window counts steps: with a norm every 5th step, or every other step skipped, the 368 norms
    a p99 bound needs take 5× or 2× as many steps; every step logged and taken, the two counts agree."""
    norms = np.random.default_rng(3).lognormal(0.0, 0.3, 100)

    def warning(steps, skipped=()):
        cal = NormCalibrator(quantile=0.99)
        for i, (s, n) in enumerate(zip(steps, norms)):
            cal.add(_log(int(s), float(n)))
            if i in skipped:
                cal.add(_log(int(s) + 1, math.nan, skipped=True))
        return cal.summary().warnings[0]

    assert "needs ≥ 368 norms" in warning(range(1, 101)) and "window=N to ≥ 368 steps" in warning(range(1, 101))
    assert "window=N to ≥ 1840 steps" in warning(range(5, 501, 5))  # a log sampled every 5 steps
    assert "window=N to ≥ 736 steps" in warning(range(1, 201, 2), skipped=range(100))  # half skipped
