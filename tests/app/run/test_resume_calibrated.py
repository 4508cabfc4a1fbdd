"""A calibrate run killed after a checkpoint resumes with its calibration state from the checkpoint
alone (``CalibratedClip.state_dict``; no CSV replay) and ends exactly where an uninterrupted run ends."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest

from sweep.config.schema import calibrated
from sweep.experiments.training import run_single
from sweep.run.pipeline import RunHooks, RunSpec, run_training
from sweep.tracking.tracker import Store
from tests.app.helpers import TINY, compose_cfg, kill_after

pytestmark = pytest.mark.slow  # end to end: real runs through the app

# windows at steps 1-6 and 13-18; the checkpoint at step 15 falls inside the second one
RUN = [
    "+experiment=calibrate",
    *TINY,
    "steps=24",
    "calibrate.window=6",
    "calibrate.every=12",
    "checkpoint_every=15",
    "calibrate.start=0",
    "seed=2",
    "optim.schedule=constant",
    "optim.warmup_steps=3",
]


def test_resumed_calibrate_run_equals_an_uninterrupted_one(store):
    cfg = compose_cfg(*RUN, f"tracking.uri={store}")
    s = Store.open(store, cfg.tracking.experiment)
    name = "calibrate-gpt-bf16"
    with pytest.raises(KeyboardInterrupt) as e:
        run_training(calibrated(cfg), s, RunSpec(name), RunHooks(step=kill_after(17), announce=lambda m: None))
    assert (e.value.run_ended, e.value.checkpointed) == ("KILLED", 15)  # the exit line names that checkpoint
    resumed = run_single(dataclasses.replace(cfg, resume="true"), s)
    local = (
        Path(store.removeprefix("sqlite:///")).parent / "fresh"
    ).as_uri()  # a local artifact folder, like the store's
    fresh = run_single(cfg, dataclasses.replace(s, experiment_id=s.client.create_experiment("fresh", local)))
    a, b = pd.read_csv(resumed.csv_path), pd.read_csv(fresh.csv_path)
    assert a["step"].tolist() == list(range(1, 25))
    for col in ("loss", "grad_l2_pre_clip", "grad_l2_post_clip", "max_norm", "phase"):
        assert a[col].fillna(-1).tolist() == b[col].fillna(-1).tolist(), col
    assert [w.as_dict() for w in resumed.windows] == [w.as_dict() for w in fresh.windows]
    assert len(resumed.windows) == 2 and resumed.metrics == pytest.approx(fresh.metrics, nan_ok=True)
    params = s.client.get_run(resumed.run_id).data.params
    assert (params["clip.mode"], params["calibrate.window"], params["calibrate.every"]) == ("calibrated", "6", "12")
    assert params["clip.max_norm"] == "None"  # it never clipped at a fixed 1.0
