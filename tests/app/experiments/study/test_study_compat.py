"""A named study resumed with another search (``clip.max_norm`` range, anchor band, clipping band) is refused
with that cause, both values and the overrides that resume it; another task is refused for its losses."""

from __future__ import annotations

import re
import shlex

import optuna
import pytest
from omegaconf import OmegaConf

from sweep.errors import UserError
from sweep.experiments.study.storage import load_study, task_key
from tests.app.helpers import compose_cfg


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    """One sqlite storage for the module (creating Optuna's tables is most of a test's time); a study per test."""
    return f"sqlite:///{tmp_path_factory.mktemp('studies')}/optuna.db"


def _refusal(storage: str, name: str, first: list[str], now: list[str], kept: list[str] | None = None) -> str:
    """The refusal of ``now`` after ``first``; its "pass …" overrides, added to the ``kept`` ones of ``now`` (all by
    default), resume the study."""
    cfg = compose_cfg("+experiment=sweep", f"study.name={name}", *first)
    study = load_study(cfg, storage, name)
    study.set_user_attr("task", task_key(cfg))  # as the sweep's set-up stores it
    assert load_study(cfg, storage, name).study_name == name  # the same settings: resumed
    with pytest.raises(UserError) as e:
        load_study(compose_cfg("+experiment=sweep", f"study.name={name}", *first, *now), storage, name)
    assert optuna.load_study(study_name=name, storage=storage).user_attrs["task"] == task_key(cfg)  # kept
    way_back = shlex.split(re.search(r": pass (.+?) to add trials to it", str(e.value)).group(1))
    back = compose_cfg("+experiment=sweep", f"study.name={name}", *first, *(now if kept is None else kept), *way_back)
    assert task_key(back) == task_key(cfg)
    assert load_study(back, storage, name).study_name == name  # the overrides it names resume the study
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
        "study draws its trials from one range: pass steps=150 study.max_norm_high=20.0 to add trials to it, or "
        "another study.name (without one, the study is named after its task)"
    )


def test_the_way_back_sets_a_changed_table_and_a_path_as_the_study_had_them(storage):
    """A setting that holds a table (``clip.patterns``) is restored whole, a path with a space quoted, and a setting
    the study left at its default is named with that default's value."""
    said = _refusal(
        storage,
        "table",
        ["clip=per_group", "+clip.patterns={attn: 0.5}", "data.path='/data/my corpus.txt'"],
        ["++clip.patterns={attn: 0.25, mlp: 1.0}", "data.path=/data/other.txt", "optim.weight_decay=0.5"],
    )
    assert "optim.weight_decay (study: 0.1, now: 0.5)" in said
    assert (
        "pass ++clip.patterns.attn=0.5 ~clip.patterns.mlp data.path='/data/my corpus.txt' optim.weight_decay=0.1 to add"
        in said
    )


@pytest.mark.parametrize(
    ("first", "now", "kept", "way_back"),
    [
        (["clip=per_group"], ["++clip.patterns.attn=0.5"], None, "~clip.patterns.attn"),
        # a table's entries cannot be set where it is null: the way back is without the now's entries
        (["clip=norm"], ["clip=per_group", "++clip.patterns.attn=0.5"], [], "clip.patterns=null"),
    ],
    ids=["empty", "none"],
)
def test_the_way_back_removes_a_table_the_study_did_not_have(storage, request, first, now, kept, way_back):
    said = _refusal(storage, request.node.callspec.id, first, now, kept)
    assert "clip.patterns.attn (study: not set, now: 0.5)" in said
    assert way_back in said.split(": pass ")[1].split(" to add trials")[0].split()


def test_the_way_back_to_another_clip_mode_selects_its_group(storage):
    """The study's ``clip=per_group`` holds an empty ``clip.patterns`` table, which no value override sets."""
    said = _refusal(storage, "mode", ["clip=per_group", "clip.max_norms=[2.0]"], ["clip=norm"])
    assert "clip.patterns (study: {}, now: None)" in said
    assert ": pass clip=per_group to add trials to it" in said


@pytest.mark.parametrize(
    ("first", "now", "way_back"),
    [
        (  # the study's entries set again in Hydra's dict form: a key path would split attn.c_proj in two
            [r"+clip.patterns={attn.c_proj: 0.5, h\.0\.mlp\ x: 2.0}"],
            [r"++clip.patterns={attn.c_proj: 0.25, h\.0\.mlp\ x: 1.0}"],
            r"'++clip.patterns={attn.c_proj:0.5,h\\.0\\.mlp\ x:2.0}'",
        ),
        (  # an entry the study did not have: no override removes a dotted key, so the table is set whole
            ["+clip.patterns={attn.c_proj: 0.5}"],
            ["++clip.patterns={mlp.c_fc: 1.0}"],
            """'clip.patterns="${oc.create:{attn.c_proj:0.5}}"'""",
        ),
        (["+clip.patterns={}"], ["++clip.patterns={mlp.c_fc: 1.0}"], """'clip.patterns="${oc.create:{}}"'"""),
    ],
    ids=["set", "removed", "emptied"],
)
def test_the_way_back_sets_a_table_whose_keys_hold_dots_as_the_study_had_it(storage, request, first, now, way_back):
    """Parameter-name patterns hold dots (``attn.c_proj``): the printed overrides, split as a shell splits them,
    give the study's table exactly (``_refusal`` composes them)."""
    said = _refusal(storage, f"dotted-{request.node.callspec.id}", ["clip=per_group", *first], now)
    assert f": pass {way_back} to add trials to it" in said


def test_a_table_key_no_override_writes_is_named_for_a_config_file(storage):
    """``^`` (a regex anchor) is no character of Hydra's dict keys: such a table came from a config file, and the
    way back says to set it there rather than print an override Hydra refuses."""
    cfg = compose_cfg("+experiment=sweep", "study.name=anchored", "clip=per_group", "+clip.patterns={mlp: 1.0}")
    study = load_study(cfg, storage, "anchored")
    stored = task_key(cfg)
    stored["clip"]["patterns"] = {"^h\\.0\\.attn": 0.5}  # as a config file sets it
    study.set_user_attr("task", stored)
    with pytest.raises(UserError) as e:
        load_study(cfg, storage, "anchored")
    assert (
        ': pass clip.patterns as the study had it, {"^h\\\\.0\\\\.attn": 0.5}, from a config file (no override '
        'writes the key "^h\\\\.0\\\\.attn") to add trials to it' in str(e.value)
    )
    # the table as shown, written into a config file (YAML), is the study's: not Python's repr, whose '\\\\.'
    # YAML's single quotes read as two backslashes
    shown = str(e.value).split("as the study had it, ", 1)[1].split(", from a config file", 1)[0]
    assert OmegaConf.to_container(OmegaConf.create(f"patterns: {shown}"))["patterns"] == {"^h\\.0\\.attn": 0.5}
