"""A ``LambdaLR`` defined up to the end of the run works on the fused path as it does in torch.

torch's ``LambdaLR`` asks its lambda for ``lr_lambda(0 … N)`` over N steps. The fused path keeps a
window of factors ahead on the device; it asked for up to ``log_every`` steps past the run, so a table
schedule (``factors[s]``) or an asserting one raised on the last step, after its update.
"""

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine import AmpTrainState

N = 10


def _batches(n):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _run(fused, log_every, data, nan_at=None):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    factors = [min(1.0, (s + 1) / 3) for s in range(N + 1)]  # lr_lambda(0 … N): exactly what N steps ask for
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: factors[s])
    state = AmpTrainState(
        model, optimizer, F.mse_loss, dtype="fp32", scheduler=schedule, fused=fused, log_every=log_every
    )
    logs = []
    for i, (x, y) in enumerate(data):
        y = y * float("nan") if i == nan_at else y
        logs += state.step_deferred(x, y)
    logs += state.flush()
    return state, logs, model


@pytest.mark.parametrize("log_every", [1, 4, 50])
@pytest.mark.parametrize("nan_at", [None, 3])
def test_a_schedule_defined_to_the_last_step_runs_every_step(log_every, nan_at):
    data = _batches(N + (nan_at is not None))  # a skipped step leaves the schedule where it was
    ref_state, ref_logs, ref_model = _run(False, 1, data, nan_at)
    state, logs, model = _run(None, log_every, data, nan_at)
    assert state.pipeline == "fused" and ref_state.pipeline == "default"
    assert [log.step for log in logs] == list(range(1, len(data) + 1))
    assert [log.skipped for log in logs] == [log.skipped for log in ref_logs]
    assert [log.lr for log in logs] == pytest.approx([log.lr for log in ref_logs], rel=1e-12)
    assert state.scheduler.last_epoch == ref_state.scheduler.last_epoch == N
    assert state.scheduler.get_last_lr() == pytest.approx(ref_state.scheduler.get_last_lr(), rel=1e-12)
    torch.testing.assert_close(model.weight, ref_model.weight, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("log_every", [1, 4])
def test_a_step_past_the_schedule_raises_as_lambdalr_does_and_keeps_its_record(log_every):
    data = _batches(N + 1)
    with pytest.raises(IndexError):
        _run(False, 1, data)  # the default path: LambdaLR.step() after the update of step N + 1
    with pytest.raises(IndexError) as raised:
        _run(None, log_every, data)
    assert raised.value.records[-1].step == N + 1  # the flush that raised hands over the records it drained
