"""A param group added mid-run (progressive unfreezing) is normed, checked and clipped from its first step.

The engine fixed its parameter list when it was built: a group added later with
``optimizer.add_param_group`` was updated by the optimizer but left out of the norm, the clip and the
non-finite check, so its gradients went in unclipped and a NaN among them reached the weights.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import clip_grad_norm_

from clipamp_engine import AmpTrainState

TAU = 0.5
AUTOCAST = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batches(n=6):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), 5 * torch.randn(8, 1, generator=g)) for _ in range(n)]


def _unfreeze_body(optimizer, model):
    optimizer.add_param_group({"params": list(model[0].parameters())})


def canonical(dtype, data, unfreeze_at):
    """The canonical loop, head first, then the body added as a second group."""
    model = _model()
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    norms = []
    for i, (x, y) in enumerate(data):
        if i == unfreeze_at:
            _unfreeze_body(optimizer, model)
        with torch.autocast("cpu", dtype=AUTOCAST[dtype], enabled=dtype != "fp32"):
            loss = F.mse_loss(model(x), y)
        loss.backward()
        held = [p for g in optimizer.param_groups for p in g["params"]]
        norms.append(clip_grad_norm_([p for p in model.parameters() if any(p is h for h in held)], TAU))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return torch.stack(norms), model


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_an_added_group_trains_as_the_canonical_loop_bit_for_bit(dtype):
    data = _batches()
    ref_norms, ref_model = canonical(dtype, data, unfreeze_at=2)
    model = _model()
    optimizer = torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)
    state = AmpTrainState(model, optimizer, F.mse_loss, dtype=dtype, max_norm=TAU)
    logs = []
    for i, (x, y) in enumerate(data):
        if i == 2:
            _unfreeze_body(optimizer, model)
        logs.append(state.step(x, y))
    assert all(log.clipped for log in logs[2:])  # the body's gradients take the norm above τ
    assert [log.grad_l2_pre_clip for log in logs] == ref_norms.tolist()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref_model.parameters()))


@pytest.mark.parametrize("fused", [False, True])
def test_a_nan_in_an_added_group_is_a_skip_that_leaves_every_parameter_untouched(fused):
    model = _model()
    optimizer = torch.optim.AdamW(model[2].parameters(), lr=1e-2, fused=fused)
    state = AmpTrainState(model, optimizer, F.mse_loss, dtype="bf16", max_norm=TAU)
    assert state.pipeline == ("fused" if fused else "default")
    (x, y), *_ = _batches(1)
    state.step(x, y)
    _unfreeze_body(optimizer, model)
    before = [p.detach().clone() for p in model.parameters()]
    hook = model[0].weight.register_hook(lambda g: g * float("nan"))
    log = state.step(x, y)
    hook.remove()
    assert log.skipped and log.skip_reason == "nonfinite_grad"
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(optimizer.state[p] == {} or int(optimizer.state[p]["step"]) == 0 for p in model[0].parameters())


def test_the_fused_path_follows_an_added_group():
    data = _batches()
    runs = {}
    for fused in (None, False):
        model = _model()
        optimizer = torch.optim.AdamW(model[2].parameters(), lr=1e-2, fused=True)
        state = AmpTrainState(model, optimizer, F.mse_loss, dtype="fp32", max_norm=TAU, fused=fused)
        logs = []
        for i, (x, y) in enumerate(data):
            if i == 2:
                _unfreeze_body(optimizer, model)
            logs.append(state.step(x, y))
        runs[state.pipeline] = logs, model
    (ref_logs, ref_model), (logs, model) = runs["default"], runs["fused"]
    assert all(log.clipped for log in ref_logs[2:])
    assert [log.grad_l2_pre_clip for log in logs] == pytest.approx([r.grad_l2_pre_clip for r in ref_logs], rel=1e-6)
    for a, b in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("fused", [False, True])
def test_a_group_the_scheduler_was_not_built_for_is_refused_before_the_step(fused):
    """torch's schedulers step only the groups they were built with (``LambdaLR.step()`` raises after the
    optimizer updated); the engine says so before it runs anything."""
    model = _model()
    optimizer = torch.optim.AdamW(model[2].parameters(), lr=1e-2, fused=fused)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (s + 1))
    state = AmpTrainState(model, optimizer, F.mse_loss, dtype="fp32", max_norm=TAU, scheduler=schedule)
    (x, y), *_ = _batches(1)
    state.step(x, y)
    _unfreeze_body(optimizer, model)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        ValueError, match=r"now has 2 param groups and its scheduler \(LambdaLR\) was built for 1: .* scheduler=None"
    ):
        state.step(x, y)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert state.step_count == 1


def test_a_group_the_fused_path_cannot_take_is_refused_before_the_step():
    model = _model()
    optimizer = torch.optim.AdamW(model[2].parameters(), lr=1e-2, fused=True)
    state = AmpTrainState(model, optimizer, F.mse_loss, dtype="fp32", max_norm=TAU)
    (x, y), *_ = _batches(1)
    state.step(x, y)
    optimizer.add_param_group({"params": list(model[0].parameters()), "fused": False})
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"param groups changed and the fused path cannot run .* fused=False"):
        state.step(x, y)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert state.step_count == 1
