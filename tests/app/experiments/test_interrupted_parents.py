"""Ctrl-C inside an experiment whose children take no ``resume=`` (the spike replay, the LR check):
the child that was training and the parent both end KILLED, and the command's line says to start
again, not to resume."""

from __future__ import annotations

import dataclasses
import importlib
import signal

import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from sweep import app
from sweep.__main__ import _interrupted_line
from sweep.run.loop import RunInterrupted
from tests.app.experiments.study.test_entangle import SMALL_GRID
from tests.app.helpers import TINY, compose_cfg


def _interrupt_call(monkeypatch, module, call: int, after_step: int) -> None:
    """``module.run_training``'s ``call``-th run is interrupted, as by Ctrl-C, right after ``after_step``."""
    real, calls = module.run_training, []

    def run_training(cfg, store, spec, hooks, *rest):
        calls.append(spec.name)
        if len(calls) == call:
            inner = hooks.step

            def step(log):
                if inner is not None:
                    inner(log)
                if log.step == after_step:
                    raise KeyboardInterrupt(f"killed after step {after_step}")

            hooks = dataclasses.replace(hooks, step=step)
        return real(cfg, store, spec, hooks, *rest)

    monkeypatch.setattr(module, "run_training", run_training)


def _statuses(uri: str) -> tuple[str, list[str]]:
    """The parent run's status, and its children's (sorted)."""
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return parent.info.status, sorted(r.info.status for r in children)


SPIKE = ["+experiment=spike", *TINY, "steps=130", "spike.at_step=30", "calibrate.window=10", "calibrate.every=0"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "module, args, children",
    [  # the LR check: the anchor window and the first trial finished, the second was training
        ("sweep.experiments.study.entangle", [*SMALL_GRID, "study.seeds=1"], ["FINISHED", "FINISHED", "KILLED"]),
        ("sweep.experiments.spike.arms", [*SPIKE, "spike.fp16=false"], ["FINISHED", "KILLED"]),
    ],
    ids=["lr-check", "spike"],
)
def test_ctrl_c_ends_the_child_it_was_training_and_the_parent_killed(store, monkeypatch, module, args, children):
    cfg = compose_cfg(*args, f"tracking.uri={store}")
    _interrupt_call(monkeypatch, importlib.import_module(module), call=2, after_step=5)
    with pytest.raises(KeyboardInterrupt) as e:
        app.run(cfg, [args[0]])
    parent, statuses = _statuses(store)
    assert parent == "KILLED"  # before: FAILED
    assert statuses == children
    what = "the LR check" if cfg.run == "sweep" else "the spike replay"
    assert _interrupted_line(e.value, OmegaConf.structured(cfg)) == (
        f"interrupted: {what} and the run it was training ended KILLED; re-run the same command to start it again"
    )


@pytest.mark.parametrize(
    "cfg, line",
    [
        (
            {"run": "spike"},
            "interrupted (SIGINT at step 7): the spike replay and the run it was training ended KILLED; re-run the "
            "same command to start it again",
        ),
        (
            {"run": "sweep", "study": {"mode": "pareto"}},
            "interrupted (SIGINT at step 7): the trial ended KILLED (its run's steps.csv keeps every completed step), "
            "the sweep's parent run too; re-run the same command to resume the study",
        ),
        (
            {"run": "train"},
            "interrupted (SIGINT at step 7): checkpoint written, run ended KILLED, steps.csv keeps every completed "
            "step; continue with the same command plus resume=true",
        ),
    ],
)
def test_the_line_after_a_handled_signal_names_what_continues(cfg, line):
    assert _interrupted_line(RunInterrupted(2, 7), OmegaConf.create(cfg)) == line


def test_a_spike_arm_that_finished_its_last_step_still_names_the_replay_killed():
    """SIGINT as an arm ended: the arm's end-of-run phase completed, but the replay stopped there (4 of 6 arms
    never ran, no figure, the parent KILLED); the line said "the run ended FINISHED with its summary"."""
    line = _interrupted_line(RunInterrupted(2, 80, finished=True), OmegaConf.create({"run": "spike"}))
    assert line == (
        "interrupted (SIGINT at step 80): the spike replay ended KILLED (the run it was training finished first); "
        "re-run the same command to start it again"
    )


@pytest.mark.slow
def test_ctrl_c_in_a_sweeps_anchor_window_names_the_window_not_a_trial(store, monkeypatch):
    """Ctrl-C during the anchor window said 'the trial ended KILLED', though no trial had started."""
    import optuna

    from sweep.experiments.study import space

    args = ["+experiment=sweep", *TINY, "steps=6", "calibrate.window=8", "study.n_trials=2"]
    cfg = compose_cfg(*args, f"tracking.uri={store}")
    _interrupt_call(monkeypatch, space, call=1, after_step=3)
    with pytest.raises(KeyboardInterrupt) as e:
        app.run(cfg, [args[0]])
    parent, statuses = _statuses(store)
    assert (parent, statuses) == ("KILLED", ["KILLED"])  # the window's run: the only child
    db = store.replace("mlflow.db", "optuna.db")
    (summary,) = optuna.get_all_study_summaries(db)
    assert summary.n_trials == 0
    assert _interrupted_line(e.value, OmegaConf.structured(cfg)) == (
        "interrupted: the anchor window's run ended KILLED before any trial ran; re-run the same command to "
        "resume the study (it runs the window again)"
    )


def test_a_sweep_stopped_at_a_phase_boundary_names_only_its_parent_run():
    """A signal the sweep took between its phases (``honour``: between trials, while its study opened) ended only
    the parent run, which has no steps.csv; the line said "run ended KILLED, steps.csv keeps every completed step"."""
    from types import SimpleNamespace

    from sweep.experiments.study.sweep import honour

    with pytest.raises(KeyboardInterrupt) as e:
        honour(SimpleNamespace(signum=signal.SIGINT))
    line = _interrupted_line(e.value, OmegaConf.create({"run": "sweep", "study": {"mode": "pareto"}}))
    assert line == (
        "interrupted (SIGINT): no trial was training: the sweep's parent run ended KILLED; re-run the same command "
        "to resume the study"
    )
    assert "steps.csv" not in line


@pytest.mark.parametrize(
    "error, ended",
    [
        (  # a second signal inside a trial's loop: the pipeline marks the run it ended
            KeyboardInterrupt("second signal 2"),
            "the trial ended KILLED (its run's steps.csv keeps every completed step), the sweep's parent run too",
        ),
        (
            RunInterrupted(2, 6, finished=False),
            "the trial's run ended KILLED in its end-of-run phase (cut short by a second signal: its steps.csv keeps "
            "every step, its summary is incomplete), the sweep's parent run too",
        ),
    ],
)
def test_a_sweep_stopped_inside_a_trial_names_the_trials_steps_csv(error, ended):
    """Only a trial's run has a steps.csv; the end-of-run case said "re-run without resume=", an option a sweep
    does not take."""
    if not isinstance(error, RunInterrupted):
        error.run_ended = "KILLED"
    head = f"interrupted ({error})" if isinstance(error, RunInterrupted) else "interrupted"
    line = _interrupted_line(error, OmegaConf.create({"run": "sweep", "study": {"mode": "constrained"}}))
    assert line == f"{head}: {ended}; re-run the same command to resume the study"


@pytest.mark.parametrize(
    "checkpointed, rest",
    [
        (None, "it wrote no checkpoint (checkpoint_every), so nothing to resume: re-run the same command"),
        (15, "resume=true continues from its checkpoint at step 15 (the steps after it run again)"),
    ],
)
def test_a_run_cut_inside_a_step_names_its_checkpoint_or_that_it_has_none(checkpointed, rest):
    """A second signal inside a step ends the run at once, without a checkpoint: the line said "resume=true
    continues from the last checkpoint" though with none written (a run cut before checkpoint_every steps)
    resume=true then failed with "no run named ... with a checkpoint"."""
    e = KeyboardInterrupt("second signal 15")
    e.run_ended, e.checkpointed = "KILLED", checkpointed
    line = _interrupted_line(e, OmegaConf.create({"run": "train"}))
    assert line == f"interrupted: run ended KILLED, steps.csv keeps every completed step; {rest}"
