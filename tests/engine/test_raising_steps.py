"""A step that raises: before its update it is as if the batch had never been given (no step number,
no record, the calibration window closes where it would have); after its update (a scheduler past its
table's end) the exception carries the step's record and the loss scaler is left ready for the next."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from clipamp_engine import AmpTrainState, make_clip_policy
from clipamp_engine.scaling import LossScaler

STEPS, BAD, WINDOW = 40, 20, 20  # the bad batch would be the window's last step


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [(x, x.sum(1, keepdim=True).sin()) for x in (torch.randn(16, 8, generator=g) for _ in range(n))]


def run(data, dtype: str, fused: bool, bad: int | None):
    """Train over ``data``; the ``bad``-th call of the loss raises ``OutOfMemoryError``, which the loop
    catches and goes on, as out-of-memory-tolerant loops do. Returns (model, records, policy)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    clip = make_clip_policy("calibrated", window=WINDOW, quantile=0.9, total_steps=STEPS)
    calls = 0

    def loss_fn(out, y):
        nonlocal calls
        calls += 1
        if calls == bad:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return nn.functional.mse_loss(out, y)

    state = AmpTrainState(model, opt, loss_fn, dtype=dtype, clip=clip, fused=fused)
    records = []
    for x, y in data:
        try:
            records.append(state.step(x, y))
        except torch.OutOfMemoryError:
            continue
    return model, records, clip


@pytest.mark.parametrize(("dtype", "fused"), [("fp32", False), ("bf16", True)])
def test_a_step_that_raises_before_its_update_is_as_if_its_batch_was_never_given(dtype, fused):
    data = batches(STEPS + 1)
    model, records, clip = run(data, dtype, fused, bad=BAD)
    ref_model, ref_records, ref_clip = run(data[: BAD - 1] + data[BAD:], dtype, fused, bad=None)
    assert [r.step for r in records] == list(range(1, STEPS + 1))
    assert records == ref_records
    assert [s.as_state() for s in clip.summaries] == [s.as_state() for s in ref_clip.summaries]
    assert clip.summaries[0].end_step == WINDOW and clip.tau is not None  # the window closed on time
    assert any(r.clipped for r in records[WINDOW:])  # and its τ clips from the next step
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("fused", [False, True])
def test_a_scheduler_that_raises_after_the_update_leaves_its_record_and_a_ready_scaler(fused):
    """A LambdaLR table of 5 factors: its 5th step() raises IndexError after step 5's update, as torch's does.
    The exception carries step 5's record on both paths, and the scaler has had its update."""
    table = [1.0, 0.8, 0.6, 0.4, 0.2]
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: table[s])
    scaler = LossScaler("cpu", init_scale=2.0**8)  # no overflow: every step is taken and scheduled
    state = AmpTrainState(model, opt, nn.functional.mse_loss, dtype="fp16", scheduler=sched, scaler=scaler, fused=fused)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(6)]
    records = [state.step(x, y) for x, y in data[:4]]
    before = model.weight.detach().clone()
    with pytest.raises(IndexError) as raised:
        state.step(*data[4])
    assert not torch.equal(before, model.weight)  # step 5 updated the model
    record = raised.value.records[-1]
    assert record.step == 5 and not record.skipped and record.lr == pytest.approx(0.1 * table[4])
    assert [r.step for r in records] == [1, 2, 3, 4]
    if not fused:  # the default path steps state.scheduler: the user drops the exhausted one and goes on
        state.scheduler = None
        assert state.step(*data[5]).step == 6  # fp16: the scaler was updated before the schedule raised
