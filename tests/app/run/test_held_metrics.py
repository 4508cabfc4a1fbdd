"""Per-step metrics after a run's latest checkpoint stay out of the store until the next checkpoint or a
resumable end: a resume trains those steps again, and the store keeps the first value of a step it holds."""

from __future__ import annotations

import pytest

from sweep.tracking.tracker import RunTracker, Store


@pytest.mark.parametrize(("status", "sent"), [("KILLED", [1, 2]), ("FINISHED", [1, 2, 3, 4]), ("FAILED", [1, 2, 3, 4])])
def test_steps_after_the_checkpoint_reach_the_store_unless_the_run_is_resumable(store, status, sent):
    s = Store.open(store, "clipamp")
    run = RunTracker(s.client, s.experiment_id, "r", flush_every=1)
    run.hold_after(0)  # a run with checkpoints, none written yet
    for step in (1, 2, 3):
        run.add_step(step, {"loss": float(step)})
    assert s.client.get_metric_history(run.run_id, "loss") == []
    run.hold_after(2)  # a checkpoint at step 2
    run.add_step(4, {"loss": 4.0})
    run.end(status)
    assert sorted((m.step, m.value) for m in s.client.get_metric_history(run.run_id, "loss")) == [
        (k, float(k)) for k in sent
    ]


def test_a_killed_run_without_a_checkpoint_keeps_every_step(store):
    s = Store.open(store, "clipamp")
    run = RunTracker(s.client, s.experiment_id, "r")
    run.hold_after(0)
    run.add_step(1, {"loss": 1.0})
    run.end("KILLED")  # nothing to resume from: nothing trains step 1 again
    assert [m.step for m in s.client.get_metric_history(run.run_id, "loss")] == [1]
