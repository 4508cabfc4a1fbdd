"""Ctrl-C inside an experiment whose children take no ``resume=`` (the spike replay, the LR check):
the child that was training and the parent both end KILLED, and the command's line says to start
again, not to resume."""

from __future__ import annotations

import dataclasses

import pytest
from mlflow import MlflowClient
from omegaconf import OmegaConf

from sweep import app
from sweep.__main__ import _interrupted_line
from sweep.run.loop import RunInterrupted
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


@pytest.mark.slow
def test_ctrl_c_in_the_lr_check_ends_the_child_and_the_parent_killed(store, monkeypatch):
    from sweep.experiments.study import entangle as E

    cfg = compose_cfg(
        "+experiment=sweep",
        "study=entangle",
        *TINY,
        "steps=12",
        "calibrate.window=6",
        "study.lr_factors=[0.5,1.0]",
        "study.entangle_quantiles=[p50]",
        "study.seeds=1",
        f"tracking.uri={store}",
    )
    _interrupt_call(monkeypatch, E, call=2, after_step=5)
    with pytest.raises(KeyboardInterrupt) as e:
        app.run(cfg)
    parent, children = _statuses(store)
    assert parent == "KILLED"  # before: FAILED
    assert children == ["FINISHED", "FINISHED", "KILLED"]  # the anchor window, the first trial, the second
    line = _interrupted_line(e.value, OmegaConf.create({"run": "sweep", "study": {"mode": "entangle"}}))
    assert line == (
        "interrupted: the LR check and the run it was training ended KILLED; re-run the same command to start it again"
    )


@pytest.mark.slow
def test_ctrl_c_in_the_spike_replay_ends_the_arm_and_the_parent_killed(store, monkeypatch):
    from sweep.experiments.spike import arms as A

    cfg = compose_cfg(
        "+experiment=spike",
        *TINY,
        "steps=130",
        "spike.at_step=30",
        "calibrate.window=10",
        "calibrate.every=0",
        "spike.fp16=false",
        f"tracking.uri={store}",
    )
    _interrupt_call(monkeypatch, A, call=2, after_step=3)
    with pytest.raises(KeyboardInterrupt):
        app.run(cfg, ["+experiment=spike"])
    parent, children = _statuses(store)
    assert parent == "KILLED"  # before: FAILED
    assert children == ["FINISHED", "KILLED"]


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
            "interrupted (SIGINT at step 7): the trial ended KILLED; re-run the same command to resume the study",
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
