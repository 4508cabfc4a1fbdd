"""``AmpTrainState(scheduler=...)`` steps the scheduler after each taken update. A loop that keeps its own
``scheduler.step()`` (the habit of every PyTorch loop) ran the schedule twice as fast without a word
(lr 1.0, 0.25, 0.0625 … under ``StepLR(gamma=0.5)`` instead of 1.0, 0.5, 0.25 …): the next step is refused,
before anything runs, on every path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from clipamp_engine import AmpTrainState


def _build(fused: bool, kind: str, log_every: int):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    if kind == "lambda":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)  # the fused path runs it on the device
    else:
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # stepped on the host
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp32", scheduler=sched, fused=fused, log_every=log_every)
    return model, sched, state


def _batch(i: int):
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


CASES = [(False, "lambda", 1), (False, "step", 1), (True, "lambda", 1), (True, "lambda", 3), (True, "step", 1)]


@pytest.mark.parametrize(("fused", "kind", "log_every"), CASES, ids=lambda v: str(v))
def test_a_loop_that_steps_the_scheduler_too_is_refused_before_the_next_step(fused, kind, log_every):
    model, sched, state = _build(fused, kind, log_every)
    assert state.pipeline == ("fused" if fused else "default")
    records = state.step_deferred(*_batch(1)) + state.step_deferred(*_batch(2))
    sched.step()  # the user's own call, kept from the loop before AmpTrainState
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError) as e:
        state.step_deferred(*_batch(3))
    assert str(e.value) == (
        f"scheduler={type(sched).__name__} was stepped or restored outside AmpTrainState (last_epoch "
        f"{sched.last_epoch}, the state left it at {sched.last_epoch - 1}): the state steps it after each taken "
        "update, so drop your scheduler.step() (or pass scheduler=None and step it yourself), and restore it "
        "before building the state or through state.load_state_dict"
    )
    assert state.step_count == 2 and all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    records += state.flush()
    assert [r.step for r in records] == [1, 2]  # nothing of the first two steps is lost


@pytest.mark.parametrize(("fused", "kind", "log_every"), CASES, ids=lambda v: str(v))
def test_a_schedule_restored_behind_the_states_back_is_refused_and_load_state_dict_runs_on(fused, kind, log_every):
    """Restoring the scheduler after building the state (``sched.load_state_dict``, not the state's): the
    fused path's device schedule did not follow it (lr 0.05 where the restored schedule gives 0.00625).
    Refused on every path; the state's own ``load_state_dict`` continues as the run that never stopped."""
    model, sched, state = _build(fused, kind, log_every)
    ref_model, _, ref = _build(fused, kind, log_every)
    want = [r for i in range(6) for r in ref.step_deferred(*_batch(i))] + ref.flush()
    assert [r.lr for r in want] == [0.1 * 0.5**s for s in range(6)]

    _, saved_sched, saved = _build(fused, kind, log_every)
    for i in range(3):
        saved.step_deferred(*_batch(i))
    saved.flush()
    sched.optimizer.load_state_dict(saved_sched.optimizer.state_dict())
    sched.load_state_dict(saved_sched.state_dict())
    with pytest.raises(
        ValueError, match=r"stepped or restored outside AmpTrainState \(last_epoch 3, the state left it at 0\)"
    ):
        state.step_deferred(*_batch(3))
    assert state.step_count == 0

    model, sched, state = _build(fused, kind, log_every)
    state.load_state_dict(saved.state_dict())
    got = [r for i in range(3, 6) for r in state.step_deferred(*_batch(i))] + state.flush()
    assert [r.lr for r in got] == [r.lr for r in want[3:]]
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref_model.parameters()))
