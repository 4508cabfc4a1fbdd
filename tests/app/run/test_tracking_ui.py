"""What a run gives the MLflow UI: the τ per phase, the per-step clipping ratio, the experiment's view tags."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from mlflow import MlflowClient

from sweep.run.loop import ROLLING, STEP_METRICS, RunRecords
from sweep.run.summary import tau_tags
from sweep.tracking.tracker import ensure_experiment
from sweep.tracking.ui import CHARTS, COLUMNS, KIND, KIND_TAG, OTHERS, SECTION, VIEW_TAG


def _rows(phases, taus):
    return [{"phase": p, "max_norm": t} for p, t in zip(phases, taus)]


@pytest.mark.parametrize(
    "phases,taus,expected",
    [
        (
            ["calibrate"] * 3 + ["validate"] * 2 + ["train"] * 2,
            [None] * 3 + [2.4581] * 4,
            {"tau.calibrate": "none", "tau.validate": "2.458", "tau.train": "2.458", "tau_used": "none → 2.458"},
        ),
        (["train"] * 4, [1.0] * 4, {"tau.train": "1", "tau_used": "1"}),
        (["train"] * 4, [None] * 4, {"tau.train": "none", "tau_used": "none"}),
        (["train"] * 4, [0.52, 2.1, 1.0, float("nan")], {"tau.train": "none/0.52–2.1", "tau_used": "none/0.52–2.1"}),
        (
            ["settle", "calibrate", "validate", "calibrate", "validate"],
            [0.5, 0.5, 2.0, 2.0, 3.0],
            {"tau.settle": "0.5", "tau.calibrate": "0.5–2", "tau.validate": "2–3", "tau_used": "0.5 → 0.5–2 → 2–3"},
        ),
    ],
)
def test_tau_per_phase(phases, taus, expected):
    assert tau_tags(_rows(phases, taus)) == expected


def test_rolling_clip_ratio_equals_pandas_over_the_taken_steps():
    rng = np.random.default_rng(0)
    n = 3 * ROLLING
    clipped, skipped = rng.random(n) < 0.3, rng.random(n) < 0.1
    skipped[60 : 60 + ROLLING] = True  # a stretch of skipped steps: no ratio (NaN, not sent)
    records = RunRecords()
    got = []
    for i in range(n):
        records.rows.append(
            {
                "loss": 1.0,
                "grad_l2_pre_clip": 1.0,
                "grad_l2_post_clip": 1.0,
                "lr": 1e-3,
                "scaler_scale": 1.0,
                "clipped": bool(clipped[i] and not skipped[i]),
                "skipped": bool(skipped[i]),
            }
        )
        got.append(records.step_metrics()["clip_ratio_rolling"])
    taken = pd.Series(np.where(skipped, np.nan, clipped & ~skipped), dtype=float)
    want = taken.rolling(ROLLING, min_periods=1).mean()
    np.testing.assert_allclose(got, want.to_numpy(), rtol=1e-12, equal_nan=True)
    assert np.isnan(got[60 + ROLLING - 1]) and set(records.step_metrics()) == {
        "loss",
        "grad_l2_pre_clip",
        "grad_l2_post_clip",
        "lr",
        "scaler_scale",
        "clip_ratio_rolling",
    }


def test_experiment_opens_on_training_runs_with_the_answer_columns(store):
    client = MlflowClient(store)
    exp_id = ensure_experiment(client, "clipamp", store)
    tags = client.get_experiment(exp_id).tags
    assert tags[KIND_TAG] == KIND
    view = json.loads(tags[VIEW_TAG])
    assert view["selectedColumns"][:2] == ["metrics.`recommended_max_norm`", "metrics.`grad_norm_p95`"]
    assert view["columnOrder"] == view["selectedColumns"] == [f"{k}.`{n}`" for k, n in COLUMNS]
    # an experiment made elsewhere gets the view; a kind the user chose stays
    mine = client.create_experiment("mine", tags={KIND_TAG: "genai_development"})
    assert ensure_experiment(client, "mine", store) == mine
    tags = client.get_experiment(mine).tags
    assert tags[KIND_TAG] == "genai_development" and tags[VIEW_TAG] == json.dumps(view, separators=(",", ":"))


def test_chart_view_opens_on_the_answer_and_every_per_step_series():
    """The first chart section: τ and p95 bars, then a line chart of every per-step metric the run sends;
    the UI's own section for the rest is collapsed."""
    from sweep.tracking.ui import view_state

    view = json.loads(view_state())
    assert [(s["name"], s["display"]) for s in view["compareRunSections"]] == [(SECTION, True), (OTHERS, False)]
    cards = view["compareRunCharts"]
    assert [c["metricKey"] for c in cards if c["type"] == "BAR"] == ["recommended_max_norm", "grad_norm_p95"]
    lines = [k for c in cards if c["type"] == "LINE" for k in c["selectedMetricKeys"]]
    assert sorted(lines) == sorted([*STEP_METRICS, "clip_ratio_rolling"])
    assert len({c["uuid"] for c in cards}) == len(cards) == len(CHARTS)
    assert {c["metricSectionId"] for c in cards} == {view["compareRunSections"][0]["uuid"]}
