"""The app's loop on CUDA: no host sync between two of the engine's flushes (CUDA's sync debug mode
raises on any), fp16 with the device-side ``HysteresisScaler`` whose floor flags are read at flushes."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine import AmpTrainState, HysteresisScaler, StepCSVWriter
from sweep.run.loop import APP_COLUMNS, RunRecords, run_steps
from tests.app.run.test_loop_deferred import MetricLog

from .helpers import CUDA, Net, batch

pytestmark = [*CUDA, pytest.mark.filterwarnings("ignore::clipamp_engine.scaling.LossScaleFloorWarning")]

LOG_EVERY = 5
STEPS = 3 * LOG_EVERY
OVERFLOWS = {6, 7}  # 0-based: inf gradients in the second interval; the scale reaches its floor


def test_app_loop_never_syncs_between_flushes(tmp_path):
    torch.manual_seed(0)
    model = Net().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = HysteresisScaler("cuda", init_scale=2.0**10, min_scale=2.0**8, growth_interval=100, hysteresis=1)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp16", max_norm=0.5, scaler=scaler, log_every=LOG_EVERY)
    assert state.pipeline == "fused"
    data = [batch(i) for i in range(STEPS)]  # on the device before any step: no copy inside the loop
    torch.cuda.synchronize()
    checked = []

    def batches():
        for i, (x, y) in enumerate(data):
            torch.cuda.set_sync_debug_mode("default")
            model.poison = float("inf") if i in OVERFLOWS else None
            # the first interval warms up (lazy optimizer state, scaler init); a flush step reads back
            quiet = i >= LOG_EVERY and (i + 1) % LOG_EVERY != 0
            checked.append(quiet)
            item = SimpleNamespace(inputs=x, targets=y, data_source=f"batch{i}")
            if quiet:
                torch.cuda.set_sync_debug_mode("error")  # until the loop asks for the next batch
            yield item

    path = tmp_path / "steps.csv"
    try:
        with StepCSVWriter(path, APP_COLUMNS) as writer:
            records = RunRecords()
            run_steps(
                state,
                batches(),
                range(1, STEPS + 1),
                writer=writer,
                tracker=MetricLog(),
                records=records,
                progress=False,
            )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sum(checked) == 2 * (LOG_EVERY - 1)
    rows = records.rows
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["skipped"] for r in rows] == [i in OVERFLOWS for i in range(STEPS)]
    after = [r["scaler_scale"] for r in rows[1:]] + [state.scaler.get_scale()]
    assert [r["scaler_at_floor"] for r in rows] == [s <= 2.0**8 for s in after]
    assert any(r["scaler_at_floor"] for r in rows)
