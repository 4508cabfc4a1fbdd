"""``resume=true steps=N`` below the run's length: the run ends at N only where its remaining steps train as the
run as started trains them; otherwise (an LR schedule or a calibration layout that follows ``steps``) the resume
is refused in one line naming both lengths, and the run stays KILLED with its checkpoint and ``steps.csv``."""

from __future__ import annotations

import dataclasses
import re

import pandas as pd
import pytest

from sweep.config.schema import calibrated
from sweep.errors import UserError
from sweep.run.build import build_clip_policy
from sweep.run.checkpoint import checkpoint_path
from sweep.run.pipeline import RunHooks, RunSpec, run_training
from sweep.run.resume_length import check_resume_steps, resumed_length_tags
from sweep.tracking.tracker import Store
from tests.app.helpers import TINY, compose_cfg, kill_after

RUN = ["+experiment=train", *TINY, "steps=12", "checkpoint_every=4", "optim.warmup_steps=2", "seed=1"]
QUIET = RunHooks(announce=lambda m: None)


def _killed(store, *overrides, run=RUN, spec="train"):
    """A run of ``run`` stopped after step 7 (KILLED, its checkpoint at step 4): (cfg, Store, run id, its CSV rows)."""
    cfg = compose_cfg(*run, *overrides, f"tracking.uri={store}")
    s = Store.open(store, cfg.tracking.experiment)
    with pytest.raises(KeyboardInterrupt) as e:
        run_training(cfg, s, RunSpec(spec), RunHooks(step=kill_after(7), announce=lambda m: None))
    assert (e.value.run_ended, e.value.checkpointed) == ("KILLED", 4)
    run_id = s.client.search_runs([s.experiment_id])[0].info.run_id
    return cfg, s, run_id, s.client.get_run(run_id).info.artifact_uri.removeprefix("file://") + "/steps.csv"


@pytest.mark.parametrize(
    ("steps", "line"),
    [
        (
            9,
            "steps=9 is lower than the run's steps=12, and optim.schedule=cosine would change the LR of step 5 "
            "(x0.9141 of optim.lr, now x0.8306): a resume ends a run sooner only where its remaining steps train as "
            "they would have; resume with steps=12 or more, or start a new run with steps=9 (drop resume=)",
        ),
        (
            3,
            "steps=3 is not above the checkpoint's step 4 (the run's steps=12): nothing is left to train; resume "
            "with steps=12 or more to train further, or start a new run with steps=3 (drop resume=)",
        ),
    ],
)
def test_a_lower_steps_that_trains_otherwise_is_refused_and_the_run_kept(store, steps, line):
    cfg, s, run_id, csv = _killed(store)
    before = open(csv, "rb").read()
    with pytest.raises(UserError) as e:
        run_training(dataclasses.replace(cfg, steps=steps, resume="true"), s, RunSpec("train"), QUIET)
    assert str(e.value) == f"resume={run_id}: {line}"
    assert s.client.get_run(run_id).info.status == "KILLED"
    assert checkpoint_path(store, run_id).exists() and open(csv, "rb").read() == before


def test_a_lower_steps_under_a_constant_lr_ends_the_run_as_started(store):
    cfg, s, run_id, csv = _killed(store, "optim.schedule=constant")
    started = pd.read_csv(csv)  # steps 1-7 of the run as started (12 steps)
    result = run_training(dataclasses.replace(cfg, steps=9, resume="true"), s, RunSpec("train"), QUIET)
    ended = pd.read_csv(result.csv_path)
    assert ended["step"].tolist() == list(range(1, 10))
    for col in ("lr", "loss", "grad_l2_pre_clip", "grad_l2_post_clip"):
        assert ended[col][:7].tolist() == started[col].tolist(), col  # steps 5-7 trained again, alike
    assert s.client.get_run(run_id).info.status == "FINISHED"


CALIBRATE = ["+experiment=calibrate", "steps=400", "optim.schedule=constant", "calibrate.window=50"]


@pytest.mark.parametrize(
    ("start", "refused"),
    [
        ("auto", "calibrate.start=auto has not placed its window yet and would place it by step 201, not 301"),
        ("0", None),  # the window at steps 1-50, then clipping at its τ: the same steps up to 300
    ],
)
def test_a_lower_steps_is_refused_where_it_moves_the_calibration(start, refused):
    cfg = calibrated(compose_cfg(*CALIBRATE, f"calibrate.start={start}"))
    ckpt = {"step": 10, "steps": 400, "engine": {"clip": build_clip_policy(cfg, total_steps=400).state_dict()}}
    lower = dataclasses.replace(cfg, steps=300)
    if refused is None:
        check_resume_steps(lower, ckpt, "r")
        return
    with pytest.raises(UserError) as e:
        check_resume_steps(lower, ckpt, "r")
    assert f"steps=300 is lower than the run's steps=400, and {refused}" in str(e.value)


def test_a_lower_steps_below_the_window_is_the_resumes_own_refusal(store):
    """``resume=true steps=N`` below a calibrate run's window: the config check does not tell the user to lower
    calibrate.window (a resume refuses another window); the resume's refusal names both lengths and what works."""
    from sweep.config.validate import validate

    window = ["+experiment=calibrate", *RUN[1:], "calibrate.window=10", "calibrate.start=0", "optim.schedule=constant"]
    cfg, s, run_id, csv = _killed(store, run=window, spec="calibrate")
    lower = dataclasses.replace(cfg, steps=6, resume="true")
    validate(lower)  # the resume decides
    with pytest.raises(UserError) as e:
        run_training(lower, s, RunSpec("calibrate"), QUIET)
    assert str(e.value) == (
        f"resume={run_id}: steps=6 is lower than the run's steps=12, and calibrate.window=10 (from step 1) would "
        "not close by step 6: a resume ends a run sooner only where its remaining steps train as they would have; "
        "resume with steps=12 or more, or start a new run with steps=6 and a calibrate.window that fits in it "
        "(drop resume=)"
    )
    assert s.client.get_run(run_id).info.status == "KILLED"
    assert checkpoint_path(store, run_id).exists()
    with pytest.raises(UserError, match="lower calibrate.window, or raise steps"):
        validate(dataclasses.replace(cfg, steps=6))  # a new run still may lower the window


def test_a_raised_steps_is_in_the_runs_tags_and_report_as_an_integrations(store):
    """MLflow's param ``steps`` keeps the first length (params cannot change): a resume to another length records
    it in the tags an integration's resume writes (``resumed.total_steps``, ``resumed.earlier_lengths``), which
    ``python -m sweep.recommend`` reads as the run's length, and the report names both lengths."""
    from sweep.recommend.run_config import run_params
    from sweep.report.run import run_report_markdown

    cfg, s, run_id, csv = _killed(store, "optim.schedule=constant")
    result = run_training(dataclasses.replace(cfg, steps=16, resume="true"), s, RunSpec("train"), QUIET)
    run = s.client.get_run(run_id)
    assert run.data.params["steps"] == "12"
    assert run.data.tags["resumed.total_steps"] == "16"
    assert run.data.tags["resumed.earlier_lengths"] == "[{'through_step': 4, 'total_steps': 12}]"
    assert run_params(run.data.params, run.data.tags)["total_steps"] == "16"
    report = run_report_markdown(dataclasses.replace(cfg, steps=16), result)
    assert "- steps: 16 (resumed: steps=12 through step 4; MLflow tag resumed.total_steps, param steps the " in report
    tags = {k: run.data.tags[k] for k in ("resumed.total_steps", "resumed.earlier_lengths")}
    assert resumed_length_tags({}, {"step": 4, "steps": 12}, 12) == {}  # the length unchanged: no tags
    assert resumed_length_tags(tags, {"step": 8, "steps": 16}, 12) == {  # lowered again: the tags follow
        "resumed.total_steps": "12",
        "resumed.earlier_lengths": "[{'through_step': 4, 'total_steps': 12}, {'through_step': 8, 'total_steps': 16}]",
    }


def test_the_way_on_from_a_steps_with_nothing_left_is_a_length_the_resume_takes():
    """``steps=`` at or below the checkpoint's step is refused naming the run's length as the way on: that length
    resumes, where a mere raise (``steps=8``, still below the cosine run's 12) is refused in turn."""
    cfg = compose_cfg(*RUN)
    ckpt = {"step": 4, "steps": 12}
    with pytest.raises(UserError) as e:
        check_resume_steps(dataclasses.replace(cfg, steps=3), ckpt, "r")
    said = re.search(r"resume with steps=(\d+) or more", str(e.value))
    assert said, str(e.value)
    check_resume_steps(dataclasses.replace(cfg, steps=int(said.group(1))), ckpt, "r")
    with pytest.raises(UserError, match="steps=8 is lower than the run's steps=12"):
        check_resume_steps(dataclasses.replace(cfg, steps=8), ckpt, "r")
