"""Issue 12 item 7: a calibrate run resumed without its ``steps.csv`` keeps its threshold.

The refusal names the file and the fix, the run stays KILLED and no ``recommended_max_norm`` (or
window τ) is logged from anything but the window; with its CSV back, the resumed run's τ and every
row equal those of an uninterrupted control run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pandas as pd
import pytest
from mlflow import MlflowClient

from sweep.config.schema import calibrated
from sweep.experiments.training import run_single
from sweep.run.pipeline import RunHooks, RunSpec, run_training
from sweep.tracking.tracker import Store
from tests.app.helpers import TINY, compose_cfg, kill_after, run_cli
from tests.reliability.helpers import assert_one_line_error

pytestmark = pytest.mark.slow  # real runs through the app

# one window at steps 1-6 (τ adopted at 6), a checkpoint at 10, killed after step 13
RUN = [
    "+experiment=calibrate",
    *TINY,
    "steps=20",
    "calibrate.window=6",
    "calibrate.start=0",
    "checkpoint_every=10",
    "seed=3",
    "optim.schedule=constant",
    "optim.warmup_steps=3",
]


def _history(client, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_calibrate_resume_without_its_csv_is_refused_and_with_it_keeps_tau(tmp_path, store):
    cfg = compose_cfg(*RUN, f"tracking.uri={store}")
    s = Store.open(store, cfg.tracking.experiment)
    with pytest.raises(KeyboardInterrupt):
        run_training(
            calibrated(cfg), s, RunSpec("calibrate-gpt-bf16"), RunHooks(step=kill_after(13), announce=lambda m: None)
        )
    client = MlflowClient(store)
    (killed,) = client.search_runs([s.experiment_id])
    run_id = killed.info.run_id
    assert killed.info.status == "KILLED"
    window_tau = _history(client, run_id, "window_recommended_max_norm")
    assert len(window_tau) == 1 and window_tau[0][0] == 6  # the window's τ, logged when it closed
    csv = next((tmp_path / "mlruns").rglob(f"{run_id}/artifacts/steps.csv"))
    saved = csv.read_bytes()
    csv.unlink()  # the user lost (or moved) the run's steps.csv

    res = run_cli(*RUN, "resume=true", cwd=tmp_path)
    assert_one_line_error(res, run_id, "steps.csv", "does not hold steps 1–10", "restore steps.csv")
    run = client.get_run(run_id)
    assert run.info.status == "KILLED"
    assert "recommended_max_norm" not in run.data.metrics  # no threshold from outside the window
    assert _history(client, run_id, "window_recommended_max_norm") == window_tau
    assert (tmp_path / "mlruns" / "checkpoints" / run_id / "checkpoint.pt").exists()  # still resumable

    csv.write_bytes(saved)  # the CSV is back: the resume continues the run
    res = run_cli(*RUN, "resume=true", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    resumed = client.get_run(run_id)
    assert resumed.info.status == "FINISHED"

    local = (tmp_path / "control").as_uri()  # an uninterrupted control run with a local artifact folder
    control = run_single(cfg, dataclasses.replace(s, experiment_id=client.create_experiment("control", local)))
    assert resumed.data.metrics["recommended_max_norm"] == control.metrics["recommended_max_norm"]
    assert _history(client, run_id, "window_recommended_max_norm") == window_tau
    assert window_tau[0][1] == control.windows[0].recommended_max_norm
    a, b = pd.read_csv(csv), pd.read_csv(control.csv_path)
    assert a["step"].tolist() == list(range(1, 21))
    for col in ("loss", "grad_l2_pre_clip", "grad_l2_post_clip", "max_norm", "phase"):
        assert a[col].fillna(-1).tolist() == b[col].fillna(-1).tolist(), col
    assert Path(control.csv_path).exists()
