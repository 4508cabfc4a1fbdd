"""fp16 on CUDA: the loss scaler's skips, back-offs and growth against torch's GradScaler recipe, and the
skip paths (non-finite loss, non-finite gradient) leaving parameters and optimizer state untouched."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine.scaling import HysteresisScaler, LossScaler
from clipamp_engine.step import AmpTrainState

from .helpers import CUDA, Net, batch, params_of

pytestmark = CUDA

MAX_NORM = 0.5
GROWTH = 3


def _overflow_script(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets ×40 at steps 16 and 17: the scaled fp16 gradients overflow at the scale grown by then."""
    return batch(i, scale=40.0 if i in (16, 17) else 1.0)


def _reference(model, opt, scaler, steps):
    """The canonical recipe (torch AMP docs): autocast, scaled backward, unscale_, clip_grad_norm_, step, update."""
    scales, skipped = [], []
    for i in range(steps):
        x, y = _overflow_script(i)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.mse_loss(model(x), y)
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        scales.append(before)
        skipped.append(scaler.get_scale() < before)
    return scales, skipped


@pytest.mark.parametrize("pipeline", ["default", "fused"])
def test_fp16_skips_backoff_and_growth_match_gradscaler(pipeline, record_property):
    """From 2^20 the scaled gradients overflow fp16 until the scale is low enough: each overflow is a
    skip that halves the scale; 3 clean steps double it; a later spike overflows again. The engine's
    decisions, the scale in every record and the parameters equal torch's GradScaler recipe."""
    torch.manual_seed(0)
    base = Net().cuda()
    fused = pipeline == "fused"
    steps = 24

    ref_model = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    ref_scaler = torch.amp.GradScaler("cuda", init_scale=2.0**20, growth_interval=GROWTH)
    ref_scales, ref_skipped = _reference(ref_model, ref_opt, ref_scaler, steps)

    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused, foreach=None if fused else True)
    scaler = LossScaler("cuda", init_scale=2.0**20, growth_interval=GROWTH)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp16", max_norm=MAX_NORM, scaler=scaler, fused=fused)
    assert state.pipeline == pipeline
    records = [state.step(*_overflow_script(i)) for i in range(steps)]

    assert [r.scaler_scale for r in records] == ref_scales
    assert [r.skipped for r in records] == ref_skipped
    assert {r.skip_reason for r in records if r.skipped} == {"nonfinite_grad"}
    assert state.scaler.get_scale() == ref_scaler.get_scale()
    assert all(not math.isfinite(r.grad_l2_pre_clip) for r in records if r.skipped)
    grew = [i for i in range(1, steps) if ref_scales[i] > ref_scales[i - 1]]
    assert sum(ref_skipped[:4]) == 4 and grew and any(ref_skipped[i] for i in range(grew[0], steps))
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    record_property("fp16_scale_trace", [(r.step, r.scaler_scale, r.skipped) for r in records])


def test_hysteresis_scaler_absorbs_overflows_on_cuda():
    """DeepSpeed's rule (hysteresis 2): the first overflow is absorbed (skip, scale kept), the second backs off."""
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = HysteresisScaler("cuda", init_scale=2.0**10, growth_interval=100, hysteresis=2)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp16", scaler=scaler)
    logs = [state.step(*batch(0))]
    for _ in range(2):
        model.poison = float("inf")
        logs.append(state.step(*batch(1)))
    logs.append(state.step(*batch(2)))
    assert [r.skipped for r in logs] == [False, True, True, False]
    assert [r.scaler_scale for r in logs] == [2.0**10, 2.0**10, 2.0**10, 2.0**9]
    assert scaler.overflows == 2 and scaler.backoffs == 1


@pytest.mark.parametrize("pipeline", ["default", "fused"])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("fault", ["inf_grad", "nan_grad", "nan_loss"])
def test_skip_leaves_parameters_and_optimizer_state_untouched(fault, dtype, pipeline):
    """A skipped step equals not stepping: parameters and AdamW state bit-equal to a control copy;
    the reason is recorded; fp16 backs the scale off (a refused loss included), bf16 keeps scale 1."""
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = LossScaler("cuda", init_scale=2.0**8, growth_interval=1000, enabled=dtype == "fp16")
    state = AmpTrainState(model, opt, F.mse_loss, dtype=dtype, scaler=scaler, fused=pipeline == "fused")
    for i in range(3):
        assert not state.step(*batch(i)).skipped
    control_params, control_opt = params_of(model), copy.deepcopy(opt.state_dict())
    scale_before = state.scaler.get_scale()
    x, y = batch(99)
    if fault == "nan_loss":
        y = y * float("nan")
    else:
        model.poison = float("inf") if fault == "inf_grad" else float("nan")
    log = state.step(x, y)

    assert log.skipped and log.skip_reason == ("nonfinite_loss" if fault == "nan_loss" else "nonfinite_grad")
    assert log.scaler_scale == scale_before
    for p, q in zip(model.parameters(), control_params):
        assert torch.equal(p, q) and p.grad is None
    after = opt.state_dict()["state"]
    for k, s in control_opt["state"].items():
        for name, v in s.items():
            assert torch.equal(torch.as_tensor(after[k][name]), torch.as_tensor(v)), name
    assert state.scaler.get_scale() == (scale_before * 0.5 if dtype == "fp16" else 1.0)
    assert not state.step(*batch(3)).skipped  # and the run goes on
