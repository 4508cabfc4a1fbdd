"""A named study resumed with another search (``clip.max_norm`` range, anchor band, clipping band) is refused
with that cause, both values and the overrides that resume it; another task is refused for its losses."""

from __future__ import annotations

import optuna
import pytest

from sweep.errors import UserError
from sweep.experiments.study.storage import load_study, task_key
from tests.app.helpers import compose_cfg


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """One sqlite storage for the module (creating Optuna's tables is most of a test's time); a study per test."""
    return f"sqlite:///{tmp_path_factory.mktemp('studies')}/optuna.db"


def _refusal(storage: str, name: str, first: list[str], now: list[str]) -> str:
    cfg = compose_cfg("+experiment=sweep", f"study.name={name}", *first)
    study = load_study(cfg, storage, name)
    study.set_user_attr("task", task_key(cfg))  # as the sweep's set-up stores it
    assert load_study(cfg, storage, name).study_name == name  # the same settings: resumed
    with pytest.raises(UserError) as e:
        load_study(compose_cfg("+experiment=sweep", f"study.name={name}", *first, *now), storage, name)
    assert optuna.load_study(study_name=name, storage=storage).user_attrs["task"] == task_key(cfg)  # kept
    return str(e.value)


def test_another_fixed_range_is_refused_as_a_range_with_both_values_and_the_way_back(storage):
    said = _refusal(
        storage,
        "range",
        ["study.anchor=null", "study.max_norm_low=0.1", "study.max_norm_high=5.0"],
        ["study.max_norm_low=0.2"],
    )
    assert said == (
        "study.name='range' searched clip.max_norm over another range: study.max_norm_low (study: 0.1, now: 0.2); "
        "a study draws its trials from one range: pass study.max_norm_low=0.1 to add trials to it, or another "
        "study.name for the new range (without one, the study is named after its task and search)"
    )
    assert "not comparable" not in said  # the same task: its losses are comparable


def test_another_anchor_band_is_refused_as_a_range(storage):
    said = _refusal(storage, "anchor", [], ["study.anchor_low=0.25", "study.anchor_high=4"])
    assert said == (
        "study.name='anchor' searched clip.max_norm over another range: study.anchor_high (study: 2.0, now: 4.0); "
        "study.anchor_low (study: 0.5, now: 0.25); a study draws its trials from one range: pass "
        "study.anchor_high=2.0 study.anchor_low=0.5 to add trials to it, or another study.name for the new range "
        "(without one, the study is named after its task and search)"
    )


def test_another_clipping_band_is_refused_for_the_constraints_stored_against_it(storage):
    said = _refusal(storage, "band", ["study=constrained"], ["study.target_clip=[0.02,0.3]"])
    assert said == (
        "study.name='band' judged its trials against another clipping band: study.target_clip (study: [0.01, 0.2], "
        "now: [0.02, 0.3]); each trial's constraint (its clipping ratio inside the band) was stored against that "
        "band: pass study.target_clip=[0.01,0.2] to add trials to it, or another study.name for the new search "
        "(without one, the study is named after its task and search)"
    )


def test_another_task_and_range_name_both_causes(storage):
    said = _refusal(storage, "task", ["study.anchor=null"], ["steps=20", "study.max_norm_high=5.0"])
    assert said == (
        "study.name='task' holds the trials of another task: steps (study: 150, now: 20); their losses are not "
        "comparable; it searched clip.max_norm over another range: study.max_norm_high (study: 20.0, now: 5.0); a "
        "study draws its trials from one range: pass the study's settings to add trials to it, or another "
        "study.name (without one, the study is named after its task)"
    )
