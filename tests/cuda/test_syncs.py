"""Host syncs on CUDA: none between two flushes on the fused path (CUDA's sync debug mode raises on
any), and a fixed, small number per step on the default path (counted and recorded)."""

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine.scaling import LossScaler
from clipamp_engine.step import AmpTrainState

from .helpers import CUDA, Net, batch, count_syncs

pytestmark = CUDA

LOG_EVERY = 5


def _state(dtype: str, fused: bool | None, log_every: int | None = None, schedule: bool = True):
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4)) if schedule else None
    scaler = LossScaler("cuda", init_scale=2.0**10, growth_interval=3, enabled=dtype == "fp16")
    state = AmpTrainState(
        model,
        opt,
        F.mse_loss,
        dtype=dtype,
        max_norm=0.5,
        scheduler=sched,
        scaler=scaler,
        fused=fused,
        log_every=log_every,
    )
    return model, sched, state


def _faulty(i: int, model: Net) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``i``: a spike that clips at 1, an inf gradient at 2, a NaN loss at 3 (faults cost no sync)."""
    x, y = batch(i, scale=3.0 if i == 1 else 1.0)
    if i == 2:
        model.poison = float("inf")
    if i == 3:
        y = y * float("nan")
    return x, y


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fused_path_never_syncs_between_flushes(dtype):
    model, sched, state = _state(dtype, None, log_every=LOG_EVERY)
    assert state.pipeline == "fused"
    assert len(state.step_deferred(*batch(100))) == 0  # warm-up: lazy optimizer state, scaler init
    state.flush()
    records = []
    for rnd in range(2):
        for i in range(LOG_EVERY - 1):
            args = _faulty(i, model) if rnd == 0 else batch(10 + i)
            torch.cuda.set_sync_debug_mode("error")
            try:
                assert state.step_deferred(*args) == []
            finally:
                torch.cuda.set_sync_debug_mode("default")
        records += state.step_deferred(*batch(20 + rnd))  # the flush step: one transfer
    assert len(records) == 2 * LOG_EVERY
    assert [r.skip_reason for r in records[:4]] == ["", "", "nonfinite_grad", "nonfinite_loss"]
    assert records[1].clipped and not any(r.skipped for r in records[4:])
    assert sched.last_epoch == sum(not r.skipped for r in records) + 1  # schedule: taken steps only (+ warm-up)


@pytest.mark.parametrize("schedule", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_fused_flush_syncs(dtype, schedule, record_property):
    """A flush is one device→host transfer of every pending record; with a LambdaLR the LR window
    for the next steps goes back to the device (one blocking host→device copy)."""
    model, _, state = _state(dtype, None, log_every=LOG_EVERY, schedule=schedule)
    for i in range(2 * LOG_EVERY - 1):
        state.step_deferred(*batch(i))
    last = batch(9)  # built first: its host→device copy would count
    records, syncs = count_syncs(lambda: state.step_deferred(*last))
    record_property(f"fused_flush_syncs_{dtype}{'_lambdalr' if schedule else ''}", syncs)
    assert len(records) == LOG_EVERY
    assert syncs == (2 if schedule else 1)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_default_path_syncs_per_step(dtype, record_property):
    """The default path materialises each record at once: its syncs per step are the same on every
    clean step, and few (the loss check, the non-finite check, the record, GradScaler's step)."""
    model, _, state = _state(dtype, False)
    assert state.pipeline == "default"
    for i in range(3):
        state.step(*batch(i))
    batches = [batch(10 + i) for i in range(5)]  # built first: their host→device copies would count
    counts = [count_syncs(lambda b=b: state.step(*b))[1] for b in batches]
    record_property(f"default_path_syncs_per_step_{dtype}", counts[0])
    assert len(set(counts)) == 1, counts
    assert 1 <= counts[0] <= 8, counts
