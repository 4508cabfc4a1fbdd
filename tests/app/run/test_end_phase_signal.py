"""A second signal in the end-of-run phase (eval, artifacts, plots) ends the run KILLED with its latest periodic
checkpoint: the store holds no step after that checkpoint, so ``resume=true`` (here with a raised ``steps=``,
whose LR schedule retrains those steps otherwise) leaves MLflow's per-step history equal to ``steps.csv``."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest
from omegaconf import OmegaConf

from sweep.__main__ import _interrupted_line
from sweep.run.checkpoint import checkpoint_path
from sweep.run.loop import RunInterrupted
from sweep.run.pipeline import RunHooks, RunSpec, run_training
from sweep.tracking.tracker import Store
from tests.app.helpers import TINY, compose_cfg

TRAIN = OmegaConf.create({"run": "train"})  # what the CLI line reads of the config
RUN = ["+experiment=train", *TINY, "steps=6", "checkpoint_every=4", "optim.warmup_steps=2", "seed=1"]


def _second_signal(cfg, tracker, result):
    """The artifacts hook, which reads the store (``sweep.report.notes``), then a second signal in it."""
    read.update(tracker.client.get_run(tracker.run_id).data.metrics)
    raise KeyboardInterrupt("second signal 2")  # as StopRequest raises it inside the end-of-run phase


read: dict[str, float] = {}  # the run's metrics as the artifacts hook read them from the store


def _cut_short(store, *overrides):
    """A run of ``RUN`` whose end-of-run phase a second signal cut short: (cfg, Store, run id, the interrupt)."""
    cfg = compose_cfg(*RUN, *overrides, f"tracking.uri={store}")
    s = Store.open(store, cfg.tracking.experiment)
    with pytest.raises(RunInterrupted) as e:
        run_training(cfg, s, RunSpec("train"), RunHooks(artifacts=_second_signal, announce=lambda m: None))
    assert e.value.finished is False
    return cfg, s, s.client.search_runs([s.experiment_id])[0].info.run_id, e.value


def test_a_second_signal_in_the_end_phase_leaves_the_steps_after_the_checkpoint_to_the_resume(store):
    _, s, run_id, e = _cut_short(store)
    assert s.client.get_run(run_id).info.status == "KILLED" and checkpoint_path(store, run_id).exists()
    assert [m.step for m in s.client.get_metric_history(run_id, "loss")] == [1, 2, 3, 4]  # 5-6 train again
    assert e.checkpointed == 4
    assert {"final_loss", "eval_loss", "grad_norm_p95"} <= set(read)  # the summary, for the experiment's notes
    assert _interrupted_line(e, TRAIN) == (
        "interrupted (SIGINT at step 6) during the end-of-run phase: cut short by a second signal; the run ended "
        "KILLED: steps.csv holds every step, but summary metrics and artifacts are incomplete (resume=true "
        "continues from its checkpoint at step 4 (the steps after it run again) and completes them)"
    )


@pytest.mark.slow  # end to end: two runs
def test_a_resume_after_a_second_signal_in_the_end_phase_leaves_mlflow_equal_to_steps_csv(store):
    cfg, s, run_id, _ = _cut_short(store)
    more = dataclasses.replace(cfg, steps=9, resume="true")  # the cosine LR of steps 5-6 changes
    resumed = run_training(more, s, RunSpec("train"), RunHooks(announce=lambda m: None))
    assert resumed.run_id == run_id and s.client.get_run(run_id).info.status == "FINISHED"
    rows = pd.read_csv(resumed.csv_path)
    assert rows["step"].tolist() == list(range(1, 10))
    for key in ("loss", "lr"):
        history = sorted((m.step, m.value) for m in s.client.get_metric_history(run_id, key))
        assert history == list(zip(rows["step"], rows[key].astype(float))), key


def test_a_second_signal_in_the_end_phase_of_a_run_without_checkpoint_sends_every_step(store):
    _, s, run_id, e = _cut_short(store, "checkpoint_every=0")
    assert [m.step for m in s.client.get_metric_history(run_id, "loss")] == list(range(1, 7))
    assert _interrupted_line(e, TRAIN) == (
        "interrupted (SIGINT at step 6) during the end-of-run phase: cut short by a second signal; the run ended "
        "KILLED: steps.csv holds every step, but summary metrics and artifacts are incomplete (nothing to resume: "
        "re-run without resume= for them)"
    )
