"""A study resumed with other ``study.dtypes`` is refused in one line before any trial runs (Optuna would
refuse the changed categorical inside each trial, leaving it RUNNING)."""

from __future__ import annotations

import optuna
import pytest

from sweep.errors import UserError
from sweep.experiments.study.storage import load_study
from tests.app.helpers import compose_cfg


@pytest.mark.slow  # creates and reopens Optuna studies in sqlite
def test_other_dtypes_for_an_existing_study_are_refused_naming_the_stored_ones(tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    first = compose_cfg("+experiment=sweep", "study.dtypes=[fp16,bf16]")
    study = load_study(first, storage, "s")
    trial = study.ask()
    trial.suggest_categorical("dtype", list(first.study.dtypes))
    study.tell(trial, [1.0] * len(study.directions))
    assert load_study(first, storage, "s").study_name == "s"  # the same dtypes: resumed
    with pytest.raises(UserError) as e:
        load_study(compose_cfg("+experiment=sweep", "study.dtypes=[fp16]"), storage, "s")
    assert str(e.value) == (
        "study.name='s' was run with study.dtypes=[fp16,bf16], not ['fp16']: pass study.dtypes=[fp16,bf16] "
        "to add trials to it, or another study.name"
    )
    states = [t.state for t in optuna.load_study(study_name="s", storage=storage).trials]
    assert states == [optuna.trial.TrialState.COMPLETE]  # nothing left RUNNING


def test_a_named_study_of_another_task_is_refused_naming_what_differs(tmp_path):
    """``study.name=`` reused with other steps (or model, LR, …): its trials' losses are not comparable with the
    study's, and the pick would compare them; before, the trials were added and the stored task overwritten."""
    from sweep.experiments.study.storage import task_key

    storage = f"sqlite:///{tmp_path}/optuna.db"
    first = compose_cfg("+experiment=sweep", "study.name=mine", "steps=40")
    study = load_study(first, storage, "mine")
    study.set_user_attr("task", task_key(first))  # as the sweep's set-up stores it
    assert load_study(first, storage, "mine").user_attrs["task"] == task_key(first)  # the same task: resumed
    other = compose_cfg("+experiment=sweep", "study.name=mine", "steps=20", "optim.lr=0.001")
    with pytest.raises(UserError) as e:
        load_study(other, storage, "mine")
    assert str(e.value) == (
        "study.name='mine' holds the trials of another task: optim.lr (study: 0.003, now: 0.001); steps (study: "
        "40, now: 20); their losses are not comparable: pass optim.lr=0.003 steps=40 to add trials to it, or "
        "another study.name (without one, the study is named after its task)"
    )
    assert optuna.load_study(study_name="mine", storage=storage).user_attrs["task"] == task_key(first)  # kept
