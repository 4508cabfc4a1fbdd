"""The app loop on the engine's deferred records: the CSV, metrics and callbacks get the same rows, later."""

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine import AmpTrainState, HysteresisScaler, StepCSVWriter
from sweep.run.loop import APP_COLUMNS, RunRecords, run_steps
from tests.engine.test_fused import _script
from tests.engine.test_step import Tiny, _batch


class MetricLog:
    def __init__(self):
        self.steps, self.flushes = [], 0

    def add_step(self, step, metrics):
        self.steps.append((step, metrics))

    def flush(self):
        self.flushes += 1

    def hold_after(self, step):
        self.flush()


def _run(tmp_path, log_every, checkpoint_every=0, clip=None, flush_after=None):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    scaler = HysteresisScaler("cpu", init_scale=2.0**10, hysteresis=2)
    state = AmpTrainState(
        model,
        opt,
        F.mse_loss,
        dtype="fp16",
        clip=clip() if clip else None,
        max_norm=None if clip else 0.5,
        scheduler=sched,
        scaler=scaler,
        log_every=log_every,
    )
    assert state.pipeline == "fused"

    def batches():
        for i in range(12):
            x, y = _script(i, model)
            yield SimpleNamespace(inputs=x, targets=y, data_source=f"batch{i}")

    seen, ckpts, at_record = [], [], []

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
            on_record=lambda log: (seen.append(log), at_record.append((log.step, state.step_count))),
            progress=False,
            checkpoint=checkpoint,
            checkpoint_every=checkpoint_every,
            phase_of=state.clip.phase if clip else (lambda step: "train"),
            flush_after=flush_after,
        )
    return path.read_text(), tracker.steps, [r.step for r in seen], ckpts, at_record


def test_rows_metrics_and_callbacks_equal_with_deferred_records(tmp_path):
    csv1, metrics1, seen1, _, _ = _run(tmp_path, 1)
    csv5, metrics5, seen5, ckpts, _ = _run(tmp_path, 5, checkpoint_every=4)
    assert csv5 == csv1 and "nonfinite_loss" in csv1 and "nonfinite_grad" in csv1
    assert repr(metrics5) == repr(metrics1)  # NaN losses compare by their text
    assert seen5 == seen1 == list(range(1, 13))
    # a checkpoint at a step boundary comes after every record up to that step was handed out
    assert ckpts == [(4, 4, 4), (8, 8, 8)]  # none at the last step: the run ends there, nothing to resume


def test_phases_of_an_auto_placed_window_are_those_of_per_step_records(tmp_path):
    """start=auto places the window when the records are observed, at a flush: the phase column is read
    then, so deferred records label the window's steps as per-step records do."""
    from clipamp_engine.clip import make_clip_policy

    clip = lambda: make_clip_policy("calibrated", window=3, start="auto", quantile=0.5, total_steps=12)  # noqa: E731
    csv1, *_ = _run(tmp_path, 1, clip=clip)
    csv8, *_ = _run(tmp_path, 8, clip=clip)
    assert ",calibrate," in csv1 and csv8 == csv1


def test_flush_after_hands_out_a_steps_record_before_the_next_step(tmp_path):
    """An eval step's record (and the eval hook it runs) sees the model of that step, not of a later flush."""
    *_, at_record = _run(tmp_path, 5, flush_after=lambda step: step % 3 == 0)
    assert {step: count for step, count in at_record if step % 3 == 0} == {3: 3, 6: 6, 9: 9, 12: 12}
    *_, deferred = _run(tmp_path, 5)
    assert dict(deferred)[3] == 5  # without it, step 3's record comes out at the flush of step 5


def test_a_window_that_cannot_calibrate_keeps_every_row_of_its_flush(tmp_path):
    """Every step of the window skipped: CalibrationError at the flush that closes it, after its rows
    (and the rows before them) reached the CSV."""
    from clipamp_engine.calibration import CalibrationError
    from clipamp_engine.clip import make_clip_policy

    for log_every in (1, 4):
        torch.manual_seed(0)
        model = Tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        clip = make_clip_policy("calibrated", window=3, start=2, total_steps=12)
        state = AmpTrainState(model, opt, F.mse_loss, dtype="bf16", clip=clip, log_every=log_every)

        def batches(model=model):
            for i in range(12):
                x, y = _script(i, model)
                yield SimpleNamespace(inputs=x * math.nan if 3 <= i + 1 <= 5 else x, targets=y, data_source="b")

        path = tmp_path / f"s{log_every}.csv"
        with StepCSVWriter(path, APP_COLUMNS) as writer, pytest.raises(CalibrationError):
            run_steps(
                state,
                batches(),
                range(1, 13),
                writer=writer,
                tracker=MetricLog(),
                records=RunRecords(),
                progress=False,
                phase_of=clip.phase,
            )
        rows = path.read_text().splitlines()[1:]
        assert [int(r.split(",")[0]) for r in rows] == [1, 2, 3, 4, 5], log_every


def test_a_stop_seen_at_a_flush_still_records_the_steps_that_ran_after_it(tmp_path):
    """Records every 5 steps, the callback stops the run at step 2 (as a pruner does): steps 3–5 ran
    before the flush showed step 2, so their rows are written too and travel on the StopRun."""
    from sweep.run.loop import StopRun

    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="bf16", max_norm=0.5, log_every=5)
    seen = []

    def on_record(log):
        seen.append(log.step)
        if log.step == 2:
            raise StopRun("pruned at step 2")

    batches = (SimpleNamespace(inputs=x, targets=y, data_source="b") for x, y in map(_batch, range(12)))
    tracker, records = MetricLog(), RunRecords()
    path = tmp_path / "steps.csv"
    with pytest.raises(StopRun) as e, StepCSVWriter(path, APP_COLUMNS) as writer:
        run_steps(
            state, batches, range(1, 13), writer=writer, tracker=tracker, records=records,
            on_record=on_record, progress=False, phase_of=lambda step: "train",
        )  # fmt: skip
    assert seen == [1, 2] and [log.step for log in e.value.late] == [3, 4, 5]
    assert [int(line.split(",")[0]) for line in path.read_text().splitlines()[1:]] == [1, 2, 3, 4, 5]  # before: 1, 2
    assert [step for step, _ in tracker.steps] == [1, 2, 3, 4, 5] and state.step_count == 5
