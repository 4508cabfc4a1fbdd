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


@pytest.mark.parametrize("call", ["step", "step_deferred", "flush"])
def test_the_skip_rate_warning_points_at_the_users_call(call):
    """It named ``clipamp_engine/step.py:197`` (inside ``step``), whatever line of the user's loop stepped."""
    import inspect

    import torch
    import torch.nn.functional as F

    from clipamp_engine import AmpTrainState

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    monitor = SkipRateMonitor(window=100, warn_above=0.05)
    log_every = 1000 if call == "flush" else 7  # flush: no record materialised until the user's flush()
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp32", skip_monitor=monitor, log_every=log_every)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(120):
            x, y = torch.randn(8, 4), torch.randn(8, 2) * (float("nan") if i % 10 == 0 else 1.0)
            line = inspect.currentframe().f_lineno + 1
            state.step(x, y) if call == "step" else state.step_deferred(x, y)
        if call == "flush":
            line = inspect.currentframe().f_lineno + 1
            state.flush()
    (warning,) = [w for w in caught if w.category is SkipRateWarning]
    assert (warning.filename, warning.lineno) == (__file__, line)
