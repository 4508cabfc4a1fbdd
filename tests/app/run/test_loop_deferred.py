"""The app loop on the engine's deferred records: the CSV, metrics and callbacks get the same rows, later."""

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from clipamp_engine import AmpTrainState, HysteresisScaler, StepCSVWriter
from sweep.run.loop import APP_COLUMNS, RunRecords, run_steps
from tests.engine.test_fused import _script
from tests.engine.test_step import Tiny


class MetricLog:
    def __init__(self):
        self.steps, self.flushes = [], 0

    def add_step(self, step, metrics):
        self.steps.append((step, metrics))

    def flush(self):
        self.flushes += 1


def _run(tmp_path, log_every, checkpoint_every=0):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    scaler = HysteresisScaler("cpu", init_scale=2.0**10, hysteresis=2)
    state = AmpTrainState(
        model, opt, F.mse_loss, dtype="fp16", max_norm=0.5, scheduler=sched, scaler=scaler, log_every=log_every
    )
    assert state.pipeline == "fused"

    def batches():
        for i in range(12):
            x, y = _script(i, model)
            yield SimpleNamespace(inputs=x, targets=y, data_source=f"batch{i}")

    seen, ckpts = [], []

    def checkpoint(step):
        ckpts.append((step, state.state_dict()["step_count"], len(seen)))  # raises if records were pending

    tracker, records = MetricLog(), RunRecords()
    path = tmp_path / f"steps{log_every}.csv"
    with StepCSVWriter(path, APP_COLUMNS) as writer:
        run_steps(
            state,
            batches(),
            range(1, 13),
            writer=writer,
            tracker=tracker,
            records=records,
            on_record=seen.append,
            progress=False,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
        )
    return path.read_text(), tracker.steps, [r.step for r in seen], ckpts


def test_rows_metrics_and_callbacks_equal_with_deferred_records(tmp_path):
    csv1, metrics1, seen1, _ = _run(tmp_path, 1)
    csv5, metrics5, seen5, ckpts = _run(tmp_path, 5, checkpoint_every=4)
    assert csv5 == csv1 and "nonfinite_loss" in csv1 and "nonfinite_grad" in csv1
    assert repr(metrics5) == repr(metrics1)  # NaN losses compare by their text
    assert seen5 == seen1 == list(range(1, 13))
    # a checkpoint at a step boundary comes after every record up to that step was handed out
    assert ckpts == [(4, 4, 4), (8, 8, 8), (12, 12, 12)]
