"""Window placement (calibrate.start=auto) on synthetic traces: after warm-up, after the transient."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clipamp_engine.placement import StartDetector, auto_window_start, fixed_placement, warmup_end


def _trace(n=400, warmup=20, burst=9.0, decay=15.0, sigma=0.3, seed=0, growth=0.0):
    """LR: linear warm-up then constant; norms: a warm-up burst decaying to 1, lognormal noise."""
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1)
    lr = np.minimum(steps / max(warmup, 1), 1.0) * 3e-3 if warmup else np.full(n, 3e-3)
    level = (1.0 + burst * np.exp(-steps / decay)) * np.exp(growth * steps)
    norms = level * rng.lognormal(0.0, sigma, n)
    return [(int(s), float(a), float(b)) for s, a, b in zip(steps, lr, norms)], level


def test_window_starts_after_warmup_and_after_the_transient():
    trace, level = _trace()
    p = auto_window_start(trace)
    assert p.rule == "auto" and p.warmup_end == 21  # step 21 is the first whose LR did not rise
    assert p.start == p.settled_at + 1 >= p.warmup_end + 20 + 20 - 1
    # the transient is over where the window starts: the noise-free level is within 10% of its floor ...
    assert level[p.start - 1] < 1.1
    # ... so the window's median is the stationary one, while a window from step 1 overstates it
    norms = np.array([t[2] for t in trace])
    stationary = np.median(norms[200:])
    assert np.median(norms[p.start - 1 : p.start + 99]) == pytest.approx(stationary, rel=0.1)
    assert np.quantile(norms[:100], 0.95) > 1.5 * np.quantile(norms[p.start - 1 : p.start + 99], 0.95)


def test_the_rule_is_online_a_prefix_gives_the_same_start():
    trace, _ = _trace(seed=3)
    p = auto_window_start(trace)
    assert auto_window_start(trace[: p.settled_at]) == p
    assert auto_window_start(trace[: p.settled_at - 1]) is None


def test_isolated_spikes_do_not_delay_the_window():
    trace, _ = _trace(seed=1)
    spiked = [(s, lr, n * 50 if s % 25 == 0 else n) for s, lr, n in trace]  # ≤ 1 bad batch per median
    assert abs(auto_window_start(spiked).start - auto_window_start(trace).start) <= 2


def test_without_warmup_a_stationary_trace_starts_as_soon_as_the_medians_fill():
    trace, _ = _trace(warmup=0, burst=0.0, sigma=0.1)
    p = auto_window_start(trace, span=20, patience=20)
    assert p.warmup_end == 2  # the LR of step 2 did not rise
    assert p.start == 2 + 19 + 19 + 1  # 20 norms for the first median, 20 medians in band


def test_a_trend_never_settles_and_the_deadline_says_so():
    trace, _ = _trace(burst=0.0, growth=0.02, sigma=0.05)  # ×1.49 every 20 steps: never within 25%
    assert auto_window_start(trace) is None
    p = auto_window_start(trace, latest=150)
    assert p.rule == "deadline" and p.start == 150 and p.settled_at is None
    assert "still varied by more than 25%" in p.reason
    rising = [(s, 1e-3 * s, 1.0) for s in range(1, 100)]  # an LR still warming up at the deadline
    assert "LR was still rising" in auto_window_start(rising, latest=50).reason


def test_skipped_steps_feed_the_lr_but_not_the_medians():
    trace, _ = _trace(seed=2)
    holes = [(s, lr, math.inf if s % 7 == 0 else n) for s, lr, n in trace]
    p, q = auto_window_start(trace), auto_window_start(holes)
    assert q.warmup_end == p.warmup_end and q.start >= p.start  # fewer norms: never earlier


def test_state_dict_resumes_the_decision_exactly():
    trace, _ = _trace(seed=4)
    whole = auto_window_start(trace)
    a = StartDetector()
    for s, lr, n in trace[:50]:
        a.update(s, lr, n)
    b = StartDetector()
    b.load_state_dict(a.state_dict())
    for s, lr, n in trace[50:]:
        if b.update(s, lr, n) is not None:
            break
    assert b.placement == whole


def test_fixed_placement_and_warmup_end():
    assert fixed_placement(0).start == 1 and "includes any LR warm-up" in fixed_placement(0).reason
    assert fixed_placement(40).start == 41
    assert warmup_end([1, 2, 3, 3, 2]) == 4 and warmup_end([1, 2, 3]) is None and warmup_end([2, 1]) == 2


def test_records_without_an_lr_are_placed_by_the_norms_and_say_so():
    """No LR (NaN, a log without one): the same window as a constant LR gives, but the reason says the norms alone
    placed it, not that an LR stopped rising; a constant LR still reads as a schedule without warm-up."""
    trace, _ = _trace(warmup=0)
    constant = auto_window_start(trace)
    unknown = auto_window_start([(s, math.nan, n) for s, _, n in trace])
    assert (unknown.start, unknown.warmup_end, unknown.settled_at) == (constant.start, 2, constant.settled_at)
    assert "LR warm-up over at step 2 (the LR stopped rising)" in constant.reason
    assert "no LR in the records, so no warm-up to wait for: placed by the norms alone from step 2" in unknown.reason
    assert "LR" not in unknown.reason.replace("no LR in the records", "")
    trend = [(s, math.nan, math.exp(0.02 * s)) for s in range(1, 200)]
    assert "(no LR in the records)" in auto_window_start(trend, latest=150).reason
    a = StartDetector()
    for s, _, n in trace[:30]:
        a.update(s, math.nan, n)
    b = StartDetector()
    b.load_state_dict(a.state_dict())
    for s, _, n in trace[30:]:
        if b.update(s, math.nan, n) is not None:
            break
    assert b.placement == unknown


def test_the_reason_names_the_steps_the_medians_span_not_their_count():
    """A norm every 3rd step: the 20 medians in band span 58 steps, not 20; every step: 20 steps."""
    trace, _ = _trace(seed=5)
    dense = auto_window_start(trace)
    first = dense.settled_at - 19
    assert f"over its last 20 values (steps {first}–{dense.settled_at}," in dense.reason
    sparse = auto_window_start(trace[2::3])  # steps 3, 6, 9, …
    first = sparse.settled_at - 3 * 19
    assert f"over its last 20 values (steps {first}–{sparse.settled_at}," in sparse.reason
    assert "20 steps" not in sparse.reason
