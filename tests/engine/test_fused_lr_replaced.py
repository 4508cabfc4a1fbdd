"""The fused path runs a ``LambdaLR`` on the device, the groups' ``lr`` being 0-dim tensors it writes. An
optimizer restored after the state was built (``optimizer.load_state_dict`` of a checkpoint saved with float
LRs, by a loop before ``AmpTrainState`` or on the default path), or an LR set by hand, puts a float back: the
step after it used to update the parameters and then raise ``AttributeError: 'float' object has no attribute
'copy_'``, its record lost. Now the float serves that step and the schedule goes on, as on the default path
(and in a plain loop: ``optimizer.step()`` with the group's LR, then ``scheduler.step()``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clipamp_engine import AmpTrainState


def _build(fused: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (s + 1))
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp32", scheduler=sched, fused=None if fused else False)
    return opt, state


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


@pytest.mark.parametrize("how", ["optimizer restored", "lr set by hand"])
def test_a_float_lr_put_back_after_building_serves_one_step_as_on_the_default_path(how):
    runs = {}
    for fused in (True, False):
        opt, state = _build(fused)
        assert state.pipeline == ("fused" if fused else "default")
        records = [state.step(*_batch(0))]
        if how == "optimizer restored":
            saved = opt.state_dict()
            saved["param_groups"][0]["lr"] = 0.025
            opt.load_state_dict(saved)
        else:
            opt.param_groups[0]["lr"] = 0.025
        records += [state.step(*_batch(i)) for i in (1, 2, 3)]
        runs[fused] = [(r.step, r.lr) for r in records]
    assert runs[True] == runs[False] == [(1, 0.1), (2, 0.025), (3, 0.1 / 3), (4, 0.1 / 4)]
