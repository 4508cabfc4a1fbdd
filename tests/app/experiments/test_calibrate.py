"""End to end: calibrate into a temporary store, then check the run through the MLflow client."""

from __future__ import annotations

import json
import shutil
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from clipamp_engine import CANONICAL_COLUMNS
from sweep import app

from tests.app.helpers import TINY, compose_cfg

pytestmark = pytest.mark.slow  # end to end: real runs through the app


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, store_template):
    root = tmp_path_factory.mktemp("cal")
    (root / "mlruns").mkdir()
    shutil.copyfile(store_template, root / "mlruns" / "mlflow.db")
    uri = f"sqlite:///{root}/mlruns/mlflow.db"
    cfg = compose_cfg("+experiment=calibrate", *TINY, "steps=40", "calibrate.window=20",
                      "calibrate.quantile=0.9", f"tracking.uri={uri}", "tracking.plots=true",
                      "optim.lr=3e-3", "optim.warmup_steps=5")
    result = app.run(cfg, ["+experiment=calibrate"])
    return cfg, uri, result


def test_run_holds_params_metrics_and_artifacts(calibrated):
    cfg, uri, result = calibrated
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    for key in ("grad_norm_p50", "grad_norm_p90", "grad_norm_p95", "grad_norm_p99", "recommended_max_norm",
                "clip_ratio", "skip_ratio", "final_loss", "eval_loss"):
        assert key in m and math.isfinite(m[key]), key
    assert run.data.params["calibrate.window"] == "20" and run.data.params["model.name"] == "gpt"
    # what the run did: the engine's calibrated policy with these windows, never a fixed clip.max_norm
    assert (run.data.params["clip.mode"], run.data.params["clip.window"], run.data.params["clip.quantile"],
            run.data.params["clip.max_norm"], run.data.tags["clip"]) == ("calibrated", "20", "0.9", "None", "calibrated")
    assert run.data.tags["dtype"] == "bf16" and run.data.tags["device"] == "cpu"
    names = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"steps.csv", "config.yaml", "quantiles.json", "report.md", "plots"} <= names
    plots = {a.path for a in client.list_artifacts(result.run_id, "plots")}
    assert {"plots/grad_norm.png", "plots/grad_norm_hist.png", "plots/scaler_scale.png", "plots/loss.png"} <= plots
    history = client.get_metric_history(result.run_id, "grad_l2_pre_clip")
    assert sorted(h.step for h in history) == list(range(1, 41))  # per-step metrics, batched


def test_logged_quantiles_equal_numpy_over_the_csv(calibrated):
    cfg, uri, result = calibrated
    m = MlflowClient(uri).get_run(result.run_id).data.metrics
    df = pd.read_csv(result.csv_path)
    assert tuple(df.columns[:8]) == CANONICAL_COLUMNS
    assert df["step"].tolist() == list(range(1, 41))
    assert set(df["phase"]) == {"calibrate", "validate"}
    cal = df[(df["phase"] == "calibrate") & ~df["skipped"]]["grad_l2_pre_clip"]
    cal = cal[np.isfinite(cal)].to_numpy()
    for q in (50, 90, 95, 99):
        assert m[f"grad_norm_p{q}"] == pytest.approx(float(np.quantile(cal, q / 100)), rel=1e-9)
    assert m["recommended_max_norm"] == pytest.approx(float(np.quantile(cal, 0.9)), rel=1e-9)
    validate = df[df["phase"] == "validate"]
    assert np.allclose(validate["max_norm"], m["recommended_max_norm"], rtol=1e-12)
    assert df[df["phase"] == "calibrate"]["max_norm"].isna().all()  # no clipping in the window
    assert m["clip_ratio"] == pytest.approx(validate["clipped"].mean())


def test_learns_and_reports(calibrated):
    cfg, uri, result = calibrated
    df = pd.read_csv(result.csv_path)
    assert df["loss"].iloc[-10:].mean() < df["loss"].iloc[:5].mean()
    report = (Path(result.csv_path).parent / "report.md").read_text()
    assert "Recommended `clip.max_norm=" in report
    q = json.loads((Path(result.csv_path).parent / "quantiles.json").read_text())
    assert q["windows"][0]["recommended_max_norm"] == pytest.approx(result.metrics["recommended_max_norm"])


def test_mlflow_tracking_uri_env_wins_over_default(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/elsewhere/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg("+experiment=train", *TINY, "steps=3")
    result = app.run(cfg)
    assert MlflowClient(uri).get_run(result.run_id).info.status == "FINISHED"
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("model,data", [("gpt", "stdlib"), ("lstm", "stdlib"), ("linear", "synthetic")])
def test_train_smoke_each_task(store, model, data):
    cfg = compose_cfg("+experiment=train", f"model={model}", f"data={data}", *TINY, "steps=4",
                      f"tracking.uri={store}")
    result = app.run(cfg)
    assert len(pd.read_csv(result.csv_path)) == 4


def test_repeated_windows_report_drift(store):
    cfg = compose_cfg("+experiment=calibrate", *TINY, "steps=30", "calibrate.window=5", "calibrate.every=10",
                      "eval_every=10", f"tracking.uri={store}")
    result = app.run(cfg)
    assert [(w.start_step, w.end_step) for w in result.windows] == [(1, 5), (11, 15), (21, 25)]
    client = MlflowClient(store)
    drift = client.get_metric_history(result.run_id, "window_drift")
    assert sorted(h.step for h in drift) == [5, 15, 25] and drift[0].value == pytest.approx(1.0)
    taus = [w.recommended_max_norm for w in result.windows]
    assert result.metrics["drift"] == pytest.approx(taus[-1] / taus[0])
    df = pd.read_csv(result.csv_path)
    assert df.loc[df["step"].between(16, 20), "max_norm"].eq(taus[1]).all()  # each window's τ is adopted
    assert sorted(h.step for h in client.get_metric_history(result.run_id, "eval_loss")) == [10, 20, 30]
    assert "Drift across windows" in (Path(result.csv_path).parent / "report.md").read_text()
