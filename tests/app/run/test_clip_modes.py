"""`+experiment=train clip=MODE` runs for every mode in conf/clip/, and forensics reach the CSV."""

from __future__ import annotations

import math
import shutil

import pandas as pd
import pytest
from mlflow import MlflowClient

from clipamp_engine.clip import CLIP_MODES
from sweep import app
from tests.app.helpers import CONF, TINY, compose_cfg

pytestmark = pytest.mark.slow  # end to end: real runs through the app

MODES = sorted(p.stem for p in (CONF / "clip").glob("*.yaml"))


@pytest.fixture(scope="module")
def uri(tmp_path_factory, store_template):
    """One store for the module: creating a sqlite store costs more than a tiny run."""
    db = tmp_path_factory.mktemp("modes") / "mlflow.db"
    shutil.copyfile(store_template, db)
    return f"sqlite:///{db}"


def test_every_engine_mode_has_a_config():
    assert set(MODES) == set(CLIP_MODES)


@pytest.mark.parametrize("mode", MODES)
def test_train_runs_with_each_clip_mode(uri, mode):
    cfg = compose_cfg(
        "+experiment=train",
        f"clip={mode}",
        *TINY,
        "steps=6",
        "clip.warmup_steps=2" if mode == "zscore" else "steps=6",
        f"tracking.uri={uri}",
    )
    result = app.run(cfg)
    df = pd.read_csv(result.csv_path)
    assert df["step"].tolist() == list(range(1, 7)) and not df["skipped"].any()
    assert all(math.isfinite(x) for x in df["loss"])
    if mode == "update":
        assert {"update_l2_pre_clip", "update_l2_post_clip"} <= set(df.columns)
        assert (df["update_l2_post_clip"] <= 1.0 + 1e-4).all()
    if mode == "value":
        assert (df["grad_l2_post_clip"] <= df["grad_l2_pre_clip"] + 1e-6).all()


def test_forensic_columns(uri):
    cfg = compose_cfg(
        "+experiment=train",
        *TINY,
        "steps=4",
        "forensics.update_norm=true",
        "forensics.param_norm=true",
        "forensics.top_k=2",
        "forensics.zero_grads=true",
        f"tracking.uri={uri}",
    )
    df = pd.read_csv(app.run(cfg).csv_path)
    assert (df["update_norm"] > 0).all() and (df["param_norm"] > 0).all()
    assert df["top_grad_params"].str.count(";").eq(1).all()
    assert (df["zero_grad_count"] == 0).all()


@pytest.mark.parametrize("rho", [1e-4, 10.0])
def test_update_mode_says_how_many_updates_it_clipped(uri, capsys, rho):
    """clip=update bounds the update, never the gradient: the summary said "clipped 0.0%" while every
    update was cut to ρ."""
    cfg = compose_cfg(
        "+experiment=train", "clip=update", f"clip.max_update_norm={rho}", "model=linear", "data=synthetic",
        "steps=4", "progress=false", "tracking.plots=false", f"tracking.uri={uri}",
    )  # fmt: skip
    result = app.run(cfg)
    df = pd.read_csv(result.csv_path)
    share = (df["update_l2_pre_clip"] > rho).mean()  # the reference: updates over ρ
    assert share == (1.0 if rho < 1 else 0.0)
    out = " ".join(capsys.readouterr().out.split())
    assert f"updates clipped {share:.1%} (update_l2_post_clip < update_l2_pre_clip)" in out
    # and clip_ratio, which sweep.report's clipped column, report.md and the experiment's description show
    assert MlflowClient(uri).get_run(result.run_id).data.metrics["clip_ratio"] == share
    assert df["max_norm"].isna().all()  # the gradient itself is never clipped


def test_dpsgd_mode_records_clip_fraction_and_refuses_fp16(uri, capsys):
    cfg = compose_cfg(
        "+experiment=train", "clip=dpsgd", *TINY, "steps=3", "clip.noise_multiplier=0.0", f"tracking.uri={uri}"
    )
    result = app.run(cfg)
    df = pd.read_csv(result.csv_path)
    assert df["dp_clip_fraction"].between(0, 1).all()
    # the summary line says how many examples were clipped (it said "clipped 0.0%": the batch is never clipped)
    share = f"{df['dp_clip_fraction'].mean():.1%}"
    assert f"examples clipped {share} (mean dp_clip_fraction)" in " ".join(capsys.readouterr().out.split())
    clip_ratio = MlflowClient(uri).get_run(result.run_id).data.metrics["clip_ratio"]  # so does the table's column
    assert clip_ratio == pytest.approx(df["dp_clip_fraction"].mean(), abs=1e-12) and clip_ratio > 0
    bad = compose_cfg("+experiment=train", "clip=dpsgd", *TINY, "steps=3", "amp.dtype=fp16", f"tracking.uri={uri}")
    with pytest.raises(ValueError, match="needs accumulation_steps=1 and dtype bf16 or fp32"):
        app.run(bad)


def test_a_refused_clip_option_opens_no_run(uri):
    """The policy was built after the MLflow run opened: a refused option (here 3 τ for the app's 2 param
    groups) left an empty FAILED run, a row of dashes in sweep.report, and a printed steps.csv never written."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)

    def runs() -> int:
        return sum(len(client.search_runs([e.experiment_id])) for e in client.search_experiments())

    before = runs()
    cfg = compose_cfg(
        "+experiment=train", "clip=per_group", "clip.max_norms=[1,1,1]", "model=linear", "data=synthetic",
        "steps=2", "progress=false", "tracking.plots=false", f"tracking.uri={uri}",
    )  # fmt: skip
    with pytest.raises(ValueError, match="max_norms has 3 values but the optimizer has 2 param groups"):
        app.run(cfg)
    assert runs() == before
