"""A calibrate run stopped after a window closed but before its next checkpoint: the window's figures (and an
eval's) are the resume's to send, like the per-step metrics it holds (``RunTracker.hold_after``), so MLflow's
history holds each of them once, with the values of the run that continued."""

from __future__ import annotations

import dataclasses

import pytest

from sweep.config.schema import calibrated
from sweep.run.pipeline import RunHooks, RunSpec, run_training
from sweep.run.summary import window_metrics
from sweep.tracking.tracker import RunTracker, Store
from tests.app.helpers import TINY, compose_cfg, kill_after

slow = pytest.mark.slow  # end to end: two real runs

# the window is steps 1-5 and an eval runs at step 4; checkpoints at 3 and 6; the run is stopped after step 5
RUN = [
    "+experiment=calibrate",
    *TINY,
    "steps=8",
    "calibrate.window=5",
    "calibrate.start=0",
    "checkpoint_every=3",
    "eval_every=4",
    "optim.warmup_steps=1",
    "seed=2",
]


@slow
def test_window_and_eval_metrics_of_a_stopped_run_are_the_resumes(store):
    cfg = compose_cfg(*RUN, f"tracking.uri={store}")
    s = Store.open(store, cfg.tracking.experiment)
    hooks = RunHooks(step=kill_after(5), announce=lambda m: None)
    with pytest.raises(KeyboardInterrupt) as e:
        run_training(calibrated(cfg), s, RunSpec("calibrate-gpt-bf16"), hooks)
    assert (e.value.run_ended, e.value.checkpointed) == ("KILLED", 3)
    run_id = s.client.search_runs([s.experiment_id])[0].info.run_id
    first = s.client.get_run(run_id).data.metrics
    assert not {k for k in first if k.startswith("window_") or k == "eval_loss"}  # held with steps 4-5
    # a raised steps= changes the cosine LR of steps 4-5: the window's norms and the eval differ from the first try's
    more = dataclasses.replace(calibrated(cfg), steps=12, resume="true")
    resumed = run_training(more, s, RunSpec("calibrate-gpt-bf16"), RunHooks(announce=lambda m: None))
    assert resumed.run_id == run_id and len(resumed.windows) == 1
    want = window_metrics(resumed.windows[0], resumed.windows[0])
    for key, value in want.items():
        assert [(m.step, m.value) for m in s.client.get_metric_history(run_id, key)] == [(5, value)], key
    assert [m.step for m in s.client.get_metric_history(run_id, "eval_loss")] == [4, 8, 12]


def test_a_metric_after_the_held_step_waits_and_ends_with_a_resumable_run(store):
    s = Store.open(store, "clipamp")
    run = RunTracker(s.client, s.experiment_id, "r")
    run.hold_after(3)  # a checkpoint at step 3
    run.log_metrics({"window_p50": 1.0}, step=5)
    run.log_metrics({"tau_quantile": 0.9}, step=2)  # at or before the checkpoint: sent at once
    assert [m.step for m in s.client.get_metric_history(run.run_id, "tau_quantile")] == [2]
    assert s.client.get_metric_history(run.run_id, "window_p50") == []
    run.end("KILLED")
    assert s.client.get_metric_history(run.run_id, "window_p50") == []
    again = RunTracker.reopen(s.client, run.run_id)
    again.log_metrics({"window_p50": 2.0, "tau_quantile": 0.5}, step=5)
    again.log_metrics({"tau_quantile": 0.7}, step=2)  # held by the run already: never sent twice
    again.end("FINISHED")
    history = {
        k: [(m.step, m.value) for m in s.client.get_metric_history(run.run_id, k)]
        for k in ("window_p50", "tau_quantile")
    }
    assert history == {"window_p50": [(5, 2.0)], "tau_quantile": [(2, 0.9), (5, 0.5)]}
