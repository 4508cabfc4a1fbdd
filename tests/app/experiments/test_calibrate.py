"""End to end: calibrate into a temporary store, then check the run through the MLflow client."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from clipamp_engine import CANONICAL_COLUMNS
from sweep import app
from tests.app.helpers import TINY, compose_cfg, store_in

pytestmark = pytest.mark.slow  # end to end: real runs through the app


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, store_template):
    root = tmp_path_factory.mktemp("cal")
    uri = store_in(root, store_template)
    cfg = compose_cfg(
        "+experiment=calibrate",
        *TINY,
        "steps=40",
        "calibrate.window=20",
        "calibrate.quantile=0.9",
        f"tracking.uri={uri}",
        "tracking.plots=true",
        "optim.lr=3e-3",
        "optim.warmup_steps=5",
    )
    result = app.run(cfg, ["+experiment=calibrate"])
    return cfg, uri, result


def test_run_holds_params_metrics_and_artifacts(calibrated):
    cfg, uri, result = calibrated
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    for key in (
        "grad_norm_p50",
        "grad_norm_p90",
        "grad_norm_p95",
        "grad_norm_p99",
        "recommended_max_norm",
        "clip_ratio",
        "skip_ratio",
        "final_loss",
        "eval_loss",
    ):
        assert key in m and math.isfinite(m[key]), key
    assert run.data.params["calibrate.window"] == "20" and run.data.params["model.name"] == "gpt"
    # what the run did: the engine's calibrated policy with these windows, never a fixed clip.max_norm
    assert (
        run.data.params["clip.mode"],
        run.data.params["calibrate.quantile"],
        run.data.params["clip.max_norm"],
        run.data.tags["clip"],
        m["tau_quantile"],
    ) == ("calibrated", "0.9", "None", "calibrated", 0.9)
    # the calibration's settings are logged once, as calibrate.*; no clip.* option is set
    assert {k: v for k, v in run.data.params.items() if k.startswith("clip.") and v != "None"} == {
        "clip.mode": "calibrated"
    }
    assert run.data.tags["dtype"] == "bf16" and run.data.tags["device"] == "cpu"
    names = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"steps.csv", "config.yaml", "quantiles.json", "report.md", "plots"} <= names
    plots = {a.path for a in client.list_artifacts(result.run_id, "plots")}
    assert {"plots/grad_norm.png", "plots/grad_norm_hist.png", "plots/scaler_scale.png", "plots/loss.png"} <= plots
    history = client.get_metric_history(result.run_id, "grad_l2_pre_clip")
    assert sorted(h.step for h in history) == list(range(1, 41))  # per-step metrics, batched
    per_step = {k for k in m if len(client.get_metric_history(result.run_id, k)) > 1}
    assert per_step == {"loss", "grad_l2_pre_clip", "grad_l2_post_clip", "lr", "scaler_scale", "clip_ratio_rolling"}


def test_run_carries_standard_tags_tau_per_phase_and_descriptions(calibrated):
    """MLflow's source/user/git tags; the τ each phase trained at, as steps.csv has it; the run's and the
    experiment's descriptions hold the answer."""
    import subprocess

    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE, MLFLOW_USER

    cfg, uri, result = calibrated
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    t, m = run.data.tags, run.data.metrics
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True)
    assert t[MLFLOW_GIT_COMMIT] == head.stdout.strip() and t[MLFLOW_SOURCE_TYPE] == "LOCAL"
    assert t[MLFLOW_USER] and t[MLFLOW_SOURCE_NAME]
    df = pd.read_csv(result.csv_path)
    for phase, rows in df.groupby("phase", sort=False):
        taus = rows["max_norm"].dropna().unique()
        assert t[f"tau.{phase}"] == ("none" if len(taus) == 0 else f"{taus[0]:.4g}"), phase
    assert t["tau.calibrate"] == "none" and t["tau.validate"] == f"{m['recommended_max_norm']:.4g}"
    assert t["tau_used"] == f"none → {m['recommended_max_norm']:.4g}"
    note = t["mlflow.note.content"]
    assert note.startswith(
        f"**Recommended τ (`clip.max_norm`) = {m['recommended_max_norm']:.4g}** · p95 = {m['grad_norm_p95']:.4g}"
    )
    assert "**Verdict:**" in note and "| p95 |" in note  # the verdict and the quantile table
    exp = client.get_experiment(run.info.experiment_id)
    assert exp.tags["mlflow.note.content"].startswith(
        f"Latest: **{run.info.run_name}**: recommended τ (`clip.max_norm`) **{m['recommended_max_norm']:.4g}**"
    )
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"


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
    text = (Path(result.csv_path).parent / "quantiles.json").read_text()
    q = json.loads(text, parse_constant=lambda c: pytest.fail(f"quantiles.json holds {c}, which JSON has not"))
    assert q["windows"][0]["recommended_max_norm"] == pytest.approx(result.metrics["recommended_max_norm"])


def test_non_finite_figures_are_written_as_null():
    from sweep.run.artifacts import finite_or_none

    value = {"a": math.nan, "b": [math.inf, 1.5, np.float32("nan"), np.float64(2.0)], "c": 3, "d": None}
    assert finite_or_none(value) == {"a": None, "b": [None, 1.5, None, 2.0], "c": 3, "d": None}
    json.dumps(finite_or_none(value), allow_nan=False)  # strict JSON


def test_mlflow_tracking_uri_env_wins_over_default(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/elsewhere/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    cfg = compose_cfg("+experiment=train", *TINY, "steps=3")
    result = app.run(cfg)
    assert MlflowClient(uri).get_run(result.run_id).info.status == "FINISHED"
    assert not (tmp_path / "mlruns").exists()


@pytest.mark.parametrize("model,data", [("gpt", "stdlib"), ("lstm", "stdlib"), ("linear", "synthetic")])
def test_train_smoke_each_task(store, model, data, capsys):
    cfg = compose_cfg("+experiment=train", f"model={model}", f"data={data}", *TINY, "steps=4", f"tracking.uri={store}")
    result = app.run(cfg)
    df = pd.read_csv(result.csv_path)
    assert len(df) == 4
    m = result.metrics  # a train run's closing line: its loss says what it averages, and its clipping ratio
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("final loss"))
    assert m["final_loss"] == pytest.approx(df["loss"].mean())  # 4 steps: the mean of all 4, and it says so
    assert line.startswith(f"final loss {m['final_loss']:.4g} (mean of all 4 taken steps), eval loss")
    assert f"clipped {df['clipped'].mean():.1%}, skip ratio 0.0%" in line and "**" not in line


def test_repeated_windows_report_drift(store, capsys):
    cfg = compose_cfg(
        "+experiment=calibrate",
        *TINY,
        "steps=30",
        "calibrate.window=5",
        "calibrate.every=10",
        "calibrate.start=0",
        "eval_every=10",
        f"tracking.uri={store}",
    )
    result = app.run(cfg)
    printed = capsys.readouterr().out
    assert "Windows (calibrate.every)" in printed  # each window's τ and interval in the terminal
    assert all(f"{w.start_step}–{w.end_step}" in printed for w in result.windows)
    assert [(w.start_step, w.end_step) for w in result.windows] == [(1, 5), (11, 15), (21, 25)]
    client = MlflowClient(store)
    drift = client.get_metric_history(result.run_id, "window_drift")
    assert sorted(h.step for h in drift) == [5, 15, 25] and drift[0].value == pytest.approx(1.0)
    lows = {h.step: h.value for h in client.get_metric_history(result.run_id, "window_tau_ci_low")}
    assert lows and lows == {
        w.end_step: pytest.approx(w.tau_ci.low) for w in result.windows if math.isfinite(w.tau_ci.low)
    }
    taus = [w.recommended_max_norm for w in result.windows]
    assert result.metrics["drift"] == pytest.approx(taus[-1] / taus[0])
    df = pd.read_csv(result.csv_path)
    assert df.loc[df["step"].between(16, 20), "max_norm"].eq(taus[1]).all()  # each window's τ is adopted
    assert sorted(h.step for h in client.get_metric_history(result.run_id, "eval_loss")) == [10, 20, 30]
    assert "Drift across windows" in (Path(result.csv_path).parent / "report.md").read_text()
    after = df[(df["step"] > 5) & ~df["skipped"]]  # clipped at τ1, τ2, τ3 in turn, later windows included
    assert result.metrics["clip_ratio"] == pytest.approx(after["clipped"].mean())
    held = df[df["step"].between(6, 15)]  # τ1 is in force until the second window closes
    assert result.metrics["validation_steps"] == 10
    assert result.metrics["validation_clip_ratio"] == pytest.approx((held["grad_l2_pre_clip"] > taus[0]).mean())


def test_auto_start_validation_and_what_the_run_logs(store):
    """start=auto waits for the warm-up and the transient; τ is judged on the held-out steps; params and
    quantiles.json say what was done; the figures agree with the CSV."""
    cfg = compose_cfg(
        "+experiment=calibrate",
        *TINY,
        "steps=120",
        "calibrate.window=30",
        "calibrate.validate=40",
        "optim.warmup_steps=10",
        f"tracking.uri={store}",
    )
    result = app.run(cfg)
    clip = result.calibration
    run = MlflowClient(store).get_run(result.run_id)
    m, params = run.data.metrics, run.data.params
    assert (params["clip.mode"], params["calibrate.start"], params["clip.max_norm"]) == ("calibrated", "auto", "None")
    assert params["calibrate.quantile"] == "None" and run.data.tags["clip"] == "calibrated"
    assert m["tau_quantile"] == pytest.approx(0.97)  # null: aimed at the middle of [1%, 5%]
    df = pd.read_csv(result.csv_path)
    s = clip.placement.start
    assert clip.placement.warmup_end == 11 and s > clip.placement.warmup_end and m["window_start"] == s
    assert (df["phase"][: s - 1] == "settle").all() and (df["phase"][s - 1 : s + 29] == "calibrate").all()
    assert (df["phase"][s + 29 : s + 69] == "validate").all() and (df["phase"][s + 69 :] == "train").all()
    window = df[df["phase"] == "calibrate"]["grad_l2_pre_clip"].to_numpy()
    assert m["recommended_max_norm"] == pytest.approx(float(np.quantile(window, 0.97)), rel=1e-9)
    held = df[df["phase"] == "validate"]
    assert m["validation_clip_ratio"] == pytest.approx(held["clipped"].mean())
    assert m["predicted_clip_ratio"] == pytest.approx(float(np.mean(window > m["recommended_max_norm"])))
    q = json.loads((Path(result.csv_path).parent / "quantiles.json").read_text())
    assert q["calibration"]["placement"]["rule"] in ("auto", "deadline")
    assert q["calibration"]["windows"][0]["band_check"]["steps"] == 40
    report = (Path(result.csv_path).parent / "report.md").read_text()
    assert "**Window placement** (`calibrate.start=auto`)" in report and "## Validation on held-out steps" in report


def test_resume_restores_the_calibration_from_the_checkpoint_alone(store):
    """Stopped mid-window and resumed: the same rows and windows as an uninterrupted run, even with the
    CSV's earlier norms overwritten (the policy state comes from the checkpoint, not from CSV replay)."""
    from sweep.config.schema import calibrated
    from sweep.run.loop import StopRun
    from sweep.run.pipeline import RunHooks, RunSpec, run_training
    from sweep.tracking.tracker import Store

    args = [
        "+experiment=calibrate",
        *TINY,
        "steps=60",
        "calibrate.window=20",
        "calibrate.start=auto",
        "optim.schedule=constant",
        "optim.warmup_steps=5",
        f"tracking.uri={store}",
    ]
    full = app.run(compose_cfg(*args))

    def stop_after_30(log):
        if log.step == 31:
            raise StopRun("stop")

    cfg = calibrated(compose_cfg(*args, "checkpoint_every=30"))
    st = Store.open(cfg.tracking.uri, cfg.tracking.experiment)
    spec = RunSpec("calibrate-resumable")
    with pytest.raises(StopRun):
        run_training(cfg, st, spec, RunHooks(step=stop_after_30, announce=lambda s: None))
    csv = _csv_of(st, "calibrate-resumable")
    df = pd.read_csv(csv)
    df.loc[df["step"] <= 30, "grad_l2_pre_clip"] = 1e6  # garbage: a CSV replay would change the window
    df.to_csv(csv, index=False)
    resumed = run_training(calibrated(compose_cfg(*args, "resume=true")), st, spec, RunHooks(announce=lambda s: None))
    a, b = full.calibration, resumed.calibration
    assert b.placement == a.placement and a.placement.start <= 30 < a.summaries[0].end_step  # killed mid-window
    assert [s.as_dict() for s in b.summaries] == [s.as_dict() for s in a.summaries]
    tail_a = pd.read_csv(full.csv_path).query("step > 30").drop(columns=["wall_s"], errors="ignore")
    tail_b = pd.read_csv(resumed.csv_path).query("step > 30").drop(columns=["wall_s"], errors="ignore")
    pd.testing.assert_frame_equal(tail_a.reset_index(drop=True), tail_b.reset_index(drop=True))


def _csv_of(st, name):
    run = st.client.search_runs([st.experiment_id], filter_string=f"attributes.run_name = '{name}'")[0]
    return Path(run.info.artifact_uri.replace("file://", "")) / "steps.csv"


def test_plain_progress_lines_mark_the_phases_where_steps_csv_and_the_report_do(tmp_path, store_template):
    """Outside a terminal a calibrate run prints a line where the phase changes: at the window's first step
    (calibrate) and at the first step after it (validate, τ in force), the steps where steps.csv's phase column
    changes and that bound the report's window; docs/calibration.md's example says the same of its window."""
    import re

    from tests.app.helpers import csv_of, run_cli

    uri = store_in(tmp_path, store_template)
    tiny = [t for t in TINY if t != "progress=false"]
    args = ["steps=40", "calibrate.window=10", "calibrate.validate=5", "calibrate.start=12", f"tracking.uri={uri}"]
    r = run_cli("+experiment=calibrate", *tiny, *args, "progress_every=50", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    shown = {int(step): phase for step, phase in re.findall(r"^calibrate-\S+  (\d+)/40  \d+s  (\w+)", r.stdout, re.M)}
    rows = pd.read_csv(csv_of(r.stdout))
    changes = {int(s): p for s, p, before in zip(rows.step, rows.phase, [None, *rows.phase[:-1]]) if p != before}
    start, end = map(int, re.search(r"Calibration window, steps (\d+)–(\d+)", r.stdout).groups())
    assert (start, end) == (13, 22)
    assert changes == {1: "settle", 13: "calibrate", 23: "validate", 28: "train"}
    assert {s: shown[s] for s in changes} == changes and set(shown) == {*changes, 40}
    docs = (Path(__file__).parents[3] / "docs" / "calibration.md").read_text()
    said = re.search(r"`(\d+)/500 … calibrate` and `(\d+)/500 … validate` for the window (\d+)–(\d+)", docs)
    assert said, "docs/calibration.md gives the progress lines of a window"
    first, after, w_start, w_end = map(int, said.groups())
    assert (first, after) == (w_start, w_end + 1)
