"""A host's run stopped between two checkpoints (``Trainer`` ``save_steps``, a Lightning or accelerate checkpoint)
and resumed from the earlier one: MLflow holds each later step once, with the resumed run's values, as
``steps.csv`` does; the first attempt's values of those steps never reach the store (``RunTracker.hold_after``)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from mlflow import MlflowClient

from sweep.integrations import recorder
from sweep.integrations.recorder import StepRecorder
from sweep.run.loop import STEP_METRICS

SAVE, KILL = 6, 8  # the host saves at step 6; the window (steps 5-8) closes after it


def _steps(rec: StepRecorder, steps: range, scale: float, lr: float) -> dict | None:
    """Record ``steps`` (gradient ``scale`` × step, every send made at once); the state saved at SAVE."""
    p, saved = torch.nn.Parameter(torch.zeros(3)), None
    for step in steps:
        p.grad = torch.full((3,), scale * step)
        rec.record(step, lr * step, rec.measure([p], step, host_clips=False, loss=torch.tensor(scale / step)))
        if step == SAVE:
            saved = json.loads(json.dumps(rec.checkpoint_state()))
        rec.tracker.flush()  # what flush_every does in a longer run: nothing unsent when it stops
    return saved


def test_steps_after_the_hosts_checkpoint_hold_the_resumed_values(tmp_path, store):
    make = lambda: StepRecorder(calibrate={"window": 4, "start": 4}, verbose=False, tracking=store)  # noqa: E731
    first = make()
    first.begin(total_steps=12, user_tau=0.5, default_csv=tmp_path / "unused.csv")
    saved = _steps(first, range(1, KILL + 1), 0.1, 1e-3)
    first.abort("KILLED")  # Ctrl-C: what the process's exit handler does
    again = make()  # resumed with a longer run (another LR) and other gradients for steps 7-8
    again.begin(total_steps=16, user_tau=0.5, default_csv=tmp_path / "unused.csv", resume=saved)
    _steps(again, range(SAVE + 1, 17), 0.3, 2e-3)
    again.end(16)
    client, run_id = MlflowClient(store), saved["run_id"]
    rows = again.records.rows
    assert [r["step"] for r in rows] == list(range(1, 17))
    for key in STEP_METRICS:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(r["step"], float(r[key])) for r in rows if math.isfinite(r[key])], key
    [window] = again.policy.summaries
    tau = [(m.step, m.value) for m in client.get_metric_history(run_id, "window_recommended_max_norm")]
    assert tau == [(KILL, window.recommended_max_norm)]


def test_a_signal_in_the_recorders_end_leaves_the_run_killed_at_the_hosts_checkpoint(tmp_path, store, monkeypatch):
    """Ctrl-C while ``end`` summarises (before the run's end sends the steps after the host's checkpoint): the
    process's exit handler still ends the run KILLED, its store holding no step after the checkpoint, which a
    resume from that checkpoint trains again; not left RUNNING."""
    handlers: list = []  # the process's exit handlers (``atexit``), run below as the interpreter would at exit
    fake = SimpleNamespace(register=handlers.append, unregister=lambda f: handlers.remove(f) if f in handlers else None)
    monkeypatch.setattr(recorder, "atexit", fake)
    rec = StepRecorder(calibrate={"window": 4, "start": 4}, verbose=False, tracking=store)
    rec.begin(total_steps=12, user_tau=0.5, default_csv=tmp_path / "unused.csv")
    saved = _steps(rec, range(1, KILL + 1), 0.1, 1e-3)

    def signal(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(recorder, "summary_metrics", signal)
    with pytest.raises(KeyboardInterrupt):
        rec.end(KILL)
    for handler in handlers:
        handler()
    client, run_id = MlflowClient(store), saved["run_id"]
    assert client.get_run(run_id).info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(1, SAVE + 1))
