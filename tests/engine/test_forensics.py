"""Step forensics: each column against a direct computation, flags, and the AmpTrainState hook."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from clipamp_engine import AmpTrainState
from clipamp_engine.clip import make_clip_policy
from clipamp_engine.forensics import FORENSICS_COLUMNS, StepForensics
from clipamp_engine.norms import grads_of


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)
        self.unused = nn.Linear(3, 3)  # in the optimizer, never in the graph: grad None
        self.frozen = nn.Linear(2, 2)  # requires_grad=False: not trainable, not counted
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _manual_step(forensics, model, opt, x, y):
    """What AmpTrainState does around the optimizer update, by hand."""
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    grads = grads_of(params)
    forensics.before_step(params, grads, opt)
    opt.step()
    return forensics.after_step(params, opt)


def test_columns_match_direct_computation_with_adamw():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.3)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    before = {n: p.detach().clone() for n, p in trainable.items()}

    # reference: grads of this batch, and AdamW's update with the decay removed
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    grad_norms = {n: p.grad.norm().item() for n, p in trainable.items() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    cols = _manual_step(StepForensics(model.named_parameters(), top_k=2), model, opt, x, y)
    assert set(cols) == set(FORENSICS_COLUMNS)

    has_grad = [n for n in trainable if n in grad_norms]
    u = torch.cat([(trainable[n].detach() - before[n] * (1 - 0.1 * 0.3)).flatten() for n in has_grad])
    assert cols["update_norm"] == pytest.approx(u.norm().item(), rel=1e-5)
    total = torch.cat([trainable[n].detach().flatten() for n in trainable])
    assert cols["param_norm"] == pytest.approx(total.norm().item(), rel=1e-6)
    top = sorted(grad_norms.items(), key=lambda kv: -kv[1])[:2]
    names = [part.split(":")[0] for part in cols["top_grad_params"].split(";")]
    assert names == [n for n, _ in top]
    value = float(cols["top_grad_params"].split(";")[0].split(":")[1])
    assert value == pytest.approx(top[0][1], rel=1e-3)
    assert cols["zero_grad_count"] == 2  # unused.weight and unused.bias have no gradient


def test_update_norm_with_plain_sgd_is_lr_times_grad_norm():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, weight_decay=0.0)
    x, y = torch.randn(6, 4), torch.randint(0, 2, (6,))
    nn.functional.cross_entropy(model(x), y).backward()
    g = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).norm().item()
    cols = _manual_step(StepForensics(update_norm=True, param_norm=False, top_k=0, zero_grads=False), model, opt, x, y)
    assert cols == {"update_norm": pytest.approx(0.5 * g, rel=1e-5)}


def test_exactly_zero_gradient_is_counted_and_unnamed_params_get_indices():
    p, q = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p, q], lr=0.1)
    (p.sum() * 0.0 + q.sum()).backward()  # p's gradient is exactly zero
    forensics = StepForensics(update_norm=False, param_norm=False, top_k=1)
    forensics.before_step([p, q], grads_of([p, q]), opt)
    opt.step()
    cols = forensics.after_step([p, q], opt)
    assert cols["zero_grad_count"] == 1
    assert cols["top_grad_params"] == f"param1:{math.sqrt(2):.4g}"


def test_flags_off_produce_nothing():
    f = StepForensics(update_norm=False, param_norm=False, top_k=0, zero_grads=False)
    assert f.columns == ()
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    opt = torch.optim.SGD([p], lr=0.1)
    f.before_step([p], [p.grad], opt)
    opt.step()
    assert f.after_step([p], opt) == {}
    with pytest.raises(ValueError, match="top_k=-1"):
        StepForensics(top_k=-1)


def test_through_amp_train_state_with_update_clipping():
    """The update norm the forensics see is the one applied: ρ when ``update`` mode clipped it."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, weight_decay=0.1)
    clip = make_clip_policy("update", max_update_norm=1e-3)
    state = AmpTrainState(
        model, opt, nn.functional.cross_entropy, dtype="bf16", clip=clip, forensics=StepForensics(model)
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        rec = state.step(torch.randn(8, 4, generator=gen), torch.randint(0, 2, (8,), generator=gen))
        assert set(rec.extra) >= set(FORENSICS_COLUMNS)
        assert rec.extra["update_norm"] == pytest.approx(1e-3, rel=1e-3)
        assert clip.last_update_norm.item() > 1e-3  # it was clipped
        assert rec.row()["zero_grad_count"] == 2


def test_tiny_but_nonzero_gradient_is_not_counted_as_zero():
    """1e-25 entries square to 0 in fp32 (an L2 test would call them zero); L1 does not."""
    p = nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 1e-25)
    opt = torch.optim.SGD([p], lr=0.1)
    f = StepForensics(update_norm=False, param_norm=False, top_k=0)
    f.before_step([p], [p.grad], opt)
    assert f.after_step([p], opt) == {"zero_grad_count": 0}
