"""The app loop adds no host sync between the engine's flushes, and its ``scaler_at_floor`` column is
the scaler's floor state after each step (as a per-step read of ``HysteresisScaler.at_floor`` gives)."""

import csv
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine import AmpTrainState, HysteresisScaler, StepCSVWriter
from sweep.run.loop import APP_COLUMNS, RunRecords, run_steps
from tests.app.run.test_loop_deferred import MetricLog
from tests.engine.test_fused import SYNCS, _batch
from tests.engine.test_step import Tiny

pytestmark = pytest.mark.filterwarnings("ignore::clipamp_engine.scaling.LossScaleFloorWarning")  # reached on purpose

STEPS = 16
OVERFLOWS = {2, 3, 9, 10, 11}  # 0-based batches whose gradient is inf: the scale backs off to its floor twice
MIN_SCALE = 2.0**8  # init 2**10: two back-offs reach it; growth_interval=3 clean steps leave it


def _state(log_every):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = HysteresisScaler("cpu", init_scale=2.0**10, min_scale=MIN_SCALE, growth_interval=3, hysteresis=1)
    state = AmpTrainState(model, opt, F.mse_loss, dtype="fp16", max_norm=0.5, scaler=scaler, log_every=log_every)
    assert state.pipeline == "fused"
    return model, state


def _batches(model, per_step=None, calls=None):
    for i in range(STEPS):
        if per_step is not None:  # what the loop's previous iteration read back
            per_step.append(list(calls))
            calls.clear()
        x, y = _batch(i)
        if i in OVERFLOWS:
            model.poison = float("inf")
        yield SimpleNamespace(inputs=x, targets=y, data_source=f"batch{i}")


def _loop(tmp_path, log_every, monkeypatch=None):
    model, state = _state(log_every)
    calls, per_step = [], []
    if monkeypatch is not None:
        for name in SYNCS:
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(
                torch.Tensor, name, lambda self, *a, _o=orig, _n=name, **k: (calls.append(_n), _o(self, *a, **k))[1]
            )
    path = tmp_path / f"steps{log_every}.csv"
    with StepCSVWriter(path, APP_COLUMNS) as writer:
        run_steps(
            state,
            _batches(model, per_step, calls),
            range(1, STEPS + 1),
            writer=writer,
            tracker=MetricLog(),
            records=RunRecords(),
            progress=False,
        )
    per_step.append(list(calls))  # the last step and the final flush
    if monkeypatch is not None:
        monkeypatch.undo()
    with path.open() as f:
        rows = list(csv.DictReader(f))
    return rows, per_step[1:], state


def test_the_loop_reads_nothing_back_between_flushes(tmp_path, monkeypatch):
    rows, per_step, _ = _loop(tmp_path, 4, monkeypatch)
    assert len(rows) == STEPS and sum(r["skipped"] == "True" for r in rows) == len(OVERFLOWS)
    flushes = [i for i in range(STEPS) if (i + 1) % 4 == 0]
    assert [c for i, c in enumerate(per_step) if i not in flushes] == [[]] * (STEPS - len(flushes))
    # a flush: the engine's records and scaler counters, then the loop's floor flags, one transfer each
    assert [c for i, c in enumerate(per_step) if i in flushes] == [["tolist"] * 3] * len(flushes)


def test_scaler_at_floor_is_the_floor_state_after_each_step(tmp_path):
    rows, _, state = _loop(tmp_path, 4)
    column = [r["scaler_at_floor"] == "True" for r in rows]
    # control from the scale trace: the scale after step t is the one step t + 1 ran at
    after = [float(r["scaler_scale"]) for r in rows[1:]] + [state.scaler.get_scale()]
    assert column == [s <= MIN_SCALE for s in after]
    assert sum(a != b for a, b in zip([False, *column], column)) == 4 and not column[-1]  # reached twice, left twice
    # and what reading the scaler's counter after every step gives (one sync per step)
    model, ref = _state(1)
    read = []
    for b in _batches(model):
        ref.step(b.inputs, b.targets)
        read.append(ref.scaler.at_floor)
    assert column == read
