"""HysteresisScaler's device-side rule against the host rule it replaces, on the same overflow sequences.

The reference below is the host implementation (Python floats, the result written into the fp32
scale tensor with ``fill_``): the device rule must give bit-identical scales, growth counts and
counters, and warn at the same arrivals at the floor.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torch import nn

from clipamp_engine import HysteresisScaler
from clipamp_engine.scaling import FP32_MAX, LossScaleFloorWarning
from tests.engine.scaler_steps import iteration


class HostRule:
    """The host rule: reads the scale as a Python float, applies DeepSpeed's hysteresis and
    GradScaler's growth count in float64, writes the result into an fp32 tensor (``fill_``)."""

    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval, hysteresis, consecutive, lo, hi):
        self.scale_t = torch.full((), init_scale, dtype=torch.float32)
        self.tracker = 0
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.hysteresis = self.hysteresis_left = hysteresis
        self.consecutive_hysteresis, self.min_scale, self.max_scale = consecutive, lo, hi
        self.at_floor, self.overflows, self.overflow_streak, self.backoffs, self.warnings = False, 0, 0, 0, 0

    def apply(self, overflow: bool) -> None:
        scale, tracker = float(self.scale_t), self.tracker
        if overflow:
            self.overflows += 1
            self.overflow_streak += 1
            tracker = 0
            if self.hysteresis == 1 or self.hysteresis_left <= 1:
                new = max(scale * self.backoff_factor, self.min_scale)
                self.backoffs += new < scale
                scale = new
            else:
                self.hysteresis_left -= 1
        else:
            self.overflow_streak = 0
            if self.consecutive_hysteresis:
                self.hysteresis_left = self.hysteresis
            tracker += 1
            if tracker >= self.growth_interval:
                if not self.consecutive_hysteresis:
                    self.hysteresis_left = self.hysteresis
                grown = min(scale * self.growth_factor, self.max_scale)
                if grown <= FP32_MAX:
                    scale = grown
                tracker = 0
        self.scale_t.fill_(scale)
        self.tracker = tracker
        floor = scale <= self.min_scale
        if floor and overflow and not self.at_floor:
            self.warnings += 1
        self.at_floor = floor

    def counters(self):
        return (self.hysteresis_left, self.overflows, self.overflow_streak, self.backoffs, self.at_floor)


SETTINGS = [
    # init, growth, backoff, interval, hysteresis, consecutive, min, max
    (2.0**16, 2.0, 0.5, 3, 1, False, 1.0, 2.0**24),
    (2.0**10, 2.0, 0.5, 2, 3, False, 1.0, 2.0**24),
    (2.0**10, 2.0, 0.5, 2, 2, True, 1.0, 2.0**12),
    (1000.0, 1.7, 0.3, 2, 2, False, 0.7, 3e4),  # factors that round: the fp32 write decides the bits
    (3.0, 1.1, 0.9, 1, 1, True, 2.5, 4.0),  # a narrow range: floor and cap every few steps
    (1e38, 16.0, 0.5, 1, 2, False, 1.0, math.inf),  # growth past fp32 is refused
]


@pytest.mark.parametrize("settings", SETTINGS, ids=[f"s{i}" for i in range(len(SETTINGS))])
@pytest.mark.parametrize("p_overflow", [0.1, 0.5])
def test_device_rule_equals_the_host_rule_bit_for_bit(settings, p_overflow):
    init, growth, backoff, interval, hyst, consecutive, lo, hi = settings
    ours = HysteresisScaler(
        "cpu",
        init_scale=init,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        hysteresis=hyst,
        consecutive_hysteresis=consecutive,
        min_scale=lo,
        max_scale=hi,
    )
    ref = HostRule(init, growth, backoff, interval, hyst, consecutive, lo, hi)
    rng = np.random.default_rng(int(p_overflow * 100) + interval)
    flags = (rng.random(200) < p_overflow).tolist()
    warned = 0
    for i, overflow in enumerate(flags):
        refused_before_backward = overflow and i % 7 == 3  # back_off(): the same rule, before backward
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours.back_off() if refused_before_backward else iteration(ours, overflow)
            ref.apply(overflow)
            got = torch.tensor(ours.get_scale(), dtype=torch.float32)
        warned += sum(issubclass(w.category, LossScaleFloorWarning) for w in caught)
        assert got.view(torch.int32) == ref.scale_t.view(torch.int32), (i, float(got), float(ref.scale_t))
        assert ours.state_dict()["_growth_tracker"] == ref.tracker, i
        counters = (ours.hysteresis_left, ours.overflows, ours.overflow_streak, ours.backoffs, ours.at_floor)
        assert counters == ref.counters(), i
    assert warned == ref.warnings
    assert sum(flags) > 5 and len(set(flags)) == 2


def test_floor_warning_arrives_at_the_next_read_once_per_arrival():
    scaler = HysteresisScaler("cpu", init_scale=4.0, hysteresis=1, min_scale=1.0)
    for _ in range(3):  # 4 → 2 → 1 (arrival) → 1: nothing read in between
        iteration(scaler, True)
    with pytest.warns(LossScaleFloorWarning, match=r"floor min_scale=1 \(3 overflows so far\)"):
        scaler.poll()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.poll()
        assert scaler.at_floor and scaler.get_scale() == 1.0


def test_update_does_not_read_the_device():
    """The rule itself never brings a tensor to the host (the counters wait for a read)."""
    scaler = HysteresisScaler("cpu", init_scale=2.0**10, hysteresis=2, growth_interval=2)
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler.scale(p.sum()).backward()
    scaler.unscale_(opt)
    reads = []
    original = torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__
    try:
        torch.Tensor.tolist = lambda t: (reads.append("tolist"), original[0](t))[1]
        torch.Tensor.item = lambda t: (reads.append("item"), original[1](t))[1]
        torch.Tensor.__bool__ = lambda t: (reads.append("bool"), original[2](t))[1]
        scaler.update()
    finally:
        torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__ = original
    assert reads == []
    assert scaler.get_scale() == 2.0**10 and scaler.state_dict()["_growth_tracker"] == 1


@pytest.mark.filterwarnings("ignore::clipamp_engine.scaling.LossScaleFloorWarning")
def test_floor_flag_is_at_floor_without_a_read():
    """``floor_flag()`` per step, read only at the end, equals the host rule's ``at_floor`` after each step."""
    scaler = HysteresisScaler("cpu", init_scale=8.0, hysteresis=2, growth_interval=2, min_scale=1.0)
    ref = HostRule(8.0, 2.0, 0.5, 2, 2, False, 1.0, 2.0**24)
    flags, expected = [], []
    for overflow in [True] * 6 + [False] * 3 + [True, True, False, False, False]:
        iteration(scaler, overflow)
        ref.apply(overflow)
        flags.append(scaler.floor_flag())
        expected.append(ref.at_floor)
    assert [bool(f) for f in flags] == expected and True in expected and expected[-1] is False
    assert HysteresisScaler("cpu", enabled=False).floor_flag() is False
