"""Skip-rate alarm and rolling clipping ratio."""

import warnings

import pytest

from clipamp_engine import SkipRateExceeded
from clipamp_engine.monitors import RollingRate, SkipRateMonitor, SkipRateWarning


def test_rolling_rate_matches_a_direct_window_count():
    events = [(i % 7 == 0) or (i % 11 == 3) for i in range(500)]
    r = RollingRate(50)
    for i, e in enumerate(events):
        r.add(e)
        window = events[max(0, i - 49) : i + 1]
        assert r.rate == pytest.approx(sum(window) / len(window))
    assert r.total == 500 and r.hits == sum(events)


def test_warns_once_above_threshold_then_rearms():
    m = SkipRateMonitor(window=100, warn_above=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(100):
            m.update(i < 6, step=i + 1)  # 6% skipped
        for i in range(100, 300):
            m.update(False, step=i + 1)
    assert [w.category for w in caught] == [SkipRateWarning]
    assert "6.0% over the last 100 steps exceeds 5.0%" in str(caught[0].message)
    assert not m.alarm


@pytest.mark.filterwarnings("ignore::clipamp_engine.monitors.SkipRateWarning")
def test_fail_fast_needs_a_full_window():
    m = SkipRateMonitor(window=1000, fail_window=100, fail_above=0.5)
    for i in range(99):
        m.update(True, step=i)
    with pytest.raises(SkipRateExceeded, match="over the last 100 steps exceeds the fail-fast threshold 50.0%"):
        m.update(True, step=99)


@pytest.mark.filterwarnings("ignore::clipamp_engine.monitors.SkipRateWarning")
def test_state_roundtrip():
    m = SkipRateMonitor(window=10, fail_window=5)
    for i in range(23):
        m.update(i % 3 == 0)
    m2 = SkipRateMonitor(window=10, fail_window=5)
    m2.load_state_dict(m.state_dict())
    assert m2.state_dict() == m.state_dict() and m2.rate == m.rate
