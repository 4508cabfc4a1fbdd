"""HysteresisScaler against its two references (issue 11, items 3 and 4).

References:
    ``torch.amp.GradScaler`` (torch 2.13), run side by side on the same iterations: its growth
    count (grow after ``growth_interval`` consecutive clean steps) and its refusal to grow the
    scale past the fp32 range (``_amp_update_scale_``: a growth to inf leaves the scale as is).
    DeepSpeed ``deepspeed/runtime/fp16/loss_scaler.py`` ``DynamicLossScaler.update_scale``
    (deepspeedai/DeepSpeed, read at commit 18fd4c97), transcribed below: the overflow rule with
    ``delayed_shift`` (hysteresis) and ``consecutive_hysteresis``, and its growth condition
    ``stable_interval = cur_iter − last_overflow_iter − 1 > 0 and stable_interval %
    scale_window == 0``. The Megatron/apex ``DynamicLossScaler`` it was taken from grows when
    ``(cur_iter − last_overflow_iter) % scale_window == 0``, which counts as GradScaler does.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from clipamp_engine import HysteresisScaler
from tests.engine.scaler_steps import scale_after


class _DeepSpeedScaler:
    """DeepSpeed's ``DynamicLossScaler.update_scale`` (scale_factor 2, no error at the floor).

    ``stable_offset=1`` is DeepSpeed's growth condition; ``0`` is Megatron/apex's original one.
    """

    def __init__(self, init_scale, scale_window, min_scale, delayed_shift, consecutive_hysteresis, stable_offset=1):
        self.cur_scale, self.cur_iter, self.last_overflow_iter = init_scale, 0, -1
        self.scale_window, self.min_scale = scale_window, min_scale
        self.delayed_shift = self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis, self.stable_offset = consecutive_hysteresis, stable_offset

    def update_scale(self, overflow: bool) -> float:
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                self.cur_scale = max(self.cur_scale / 2.0, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable_interval = (self.cur_iter - self.last_overflow_iter) - self.stable_offset
            if stable_interval > 0 and stable_interval % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= 2.0
        self.cur_iter += 1
        return self.cur_scale


def _overflows(n: int, p: float, seed: int) -> list[bool]:
    return (np.random.default_rng(seed).random(n) < p).tolist()


# -- item 3: never past the fp32 range ---------------------------------------------------------


@pytest.mark.parametrize("max_scale", [math.inf, 1e39])
def test_growth_that_would_overflow_fp32_is_refused_like_gradscaler(max_scale):
    """The issue's case: init 1e38, growth ×16 every clean step. GradScaler keeps 1e38
    (1.6e39 is not an fp32 number); so does HysteresisScaler, whatever max_scale says."""
    ours = HysteresisScaler("cpu", init_scale=1e38, growth_factor=16.0, growth_interval=1, max_scale=max_scale)
    ref = torch.amp.GradScaler("cpu", init_scale=1e38, growth_factor=16.0, growth_interval=1)
    for _ in range(3):
        got, want = scale_after(ours, False), scale_after(ref, False)
        assert math.isfinite(got) and got == want == float(torch.tensor(1e38, dtype=torch.float32))


def test_growth_up_to_the_fp32_edge_then_refused_like_gradscaler():
    ours = HysteresisScaler("cpu", init_scale=2.0**120, growth_interval=2, max_scale=math.inf, hysteresis=1)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**120, growth_interval=2)
    got = [scale_after(ours, False) for _ in range(24)]
    want = [scale_after(ref, False) for _ in range(24)]
    assert got == want and max(got) == 2.0**127 and all(math.isfinite(s) for s in got)


# -- item 4: growth counted as GradScaler counts it -------------------------------------------


@pytest.mark.parametrize("growth_interval", [1, 3, 7])
def test_without_hysteresis_the_scale_follows_gradscaler_step_for_step(growth_interval):
    kw = dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=growth_interval)
    ours = HysteresisScaler("cpu", **kw, hysteresis=1, min_scale=2.0**-24, max_scale=math.inf)
    ref = torch.amp.GradScaler("cpu", **kw)
    flags = _overflows(80, 0.15, seed=growth_interval)
    assert [scale_after(ours, f) for f in flags] == [scale_after(ref, f) for f in flags]


@pytest.mark.parametrize("window", [1, 2, 5])
def test_first_growth_comes_one_clean_step_before_deepspeeds(window):
    """After an overflow, GradScaler and HysteresisScaler grow at clean steps W, 2W, 3W;
    DeepSpeed with scale_window = W at W+1, 2W+1, 3W+1: the same spacing, one step later."""
    ours = HysteresisScaler("cpu", init_scale=2.0**10, growth_interval=window, hysteresis=1, max_scale=math.inf)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=window)
    ds = _DeepSpeedScaler(2.0**10, window, 1.0, delayed_shift=1, consecutive_hysteresis=False)
    n = 3 * window + 1
    flags = [True] + [False] * n
    series = {
        name: [step(f) for f in flags]
        for name, step in [
            ("ours", lambda f: scale_after(ours, f)),
            ("torch", lambda f: scale_after(ref, f)),
            ("deepspeed", ds.update_scale),
        ]
    }

    def growth_steps(scales):  # clean steps after the overflow at which the scale grew
        return [i for i in range(1, len(scales)) if scales[i] > scales[i - 1]]

    assert growth_steps(series["ours"]) == growth_steps(series["torch"]) == list(range(window, n + 1, window))
    assert growth_steps(series["deepspeed"]) == list(range(window + 1, n + 1, window))


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize("hysteresis", [2, 3])
def test_overflow_rule_is_deepspeeds_with_gradscalers_growth_count(hysteresis, consecutive):
    """DeepSpeed's update_scale, step for step, once its growth condition counts clean steps
    as GradScaler (and Megatron/apex) do; the actual DeepSpeed condition differs only there."""
    kw = dict(
        init_scale=2.0**20,
        growth_interval=4,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_scale=1.0,
        max_scale=math.inf,
    )
    ours = HysteresisScaler("cpu", **kw)
    oracle = _DeepSpeedScaler(2.0**20, 4, 1.0, hysteresis, consecutive, stable_offset=0)
    deepspeed = _DeepSpeedScaler(2.0**20, 4, 1.0, hysteresis, consecutive, stable_offset=1)
    flags = _overflows(120, 0.2, seed=hysteresis + 10 * consecutive)
    got = [scale_after(ours, f) for f in flags]
    assert got == [oracle.update_scale(f) for f in flags]
    assert got != [deepspeed.update_scale(f) for f in flags]  # the growth count is what differs
    assert min(got) > 1.0 and len(set(got)) > 3  # the sequence backs off and grows, never at the floor
