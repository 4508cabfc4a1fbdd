"""What the MLflow UI opens on: the training-runs view of the experiment with the answer's columns.

MLflow 3's UI opens an experiment on its GenAI pages; ``?workflowType=machine_learning`` and the
experiment tag ``mlflow.experimentKind=custom_model_development`` put it on training runs. The runs
table shows no metric until the user picks columns, so each experiment carries a shared view
(experiment tag ``mlflow.sharedViewState.<key>``, the UI's own "Share" format: the table state as
JSON) that shows the recommended τ, the norm quantiles, the τ used and the ratios, and whose chart
view opens on one section of the charts that matter (the other metrics' charts in a collapsed
section); the printed link names it with ``viewStateShareKey``.
"""

from __future__ import annotations

import json

KIND_TAG = "mlflow.experimentKind"
KIND = "custom_model_development"  # the UI's "Machine learning" experiment type
VIEW_KEY = "clipamp"
VIEW_TAG = f"mlflow.sharedViewState.{VIEW_KEY}"
NOTE_TAG = "mlflow.note.content"  # a run's or experiment's description in the UI

#: The runs table's columns, in this order (MLflow's column ids: ``kind.`name```).
COLUMNS = [
    ("metrics", "recommended_max_norm"),
    ("metrics", "grad_norm_p95"),
    ("tags", "tau_used"),
    ("metrics", "clip_ratio"),
    ("metrics", "skip_ratio"),
    ("metrics", "final_loss"),
    ("metrics", "eval_loss"),
    ("metrics", "grad_norm_p50"),
    ("metrics", "grad_norm_p99"),
    ("tags", "clip"),
    ("tags", "dtype"),
    ("tags", "model"),
    ("attributes", "Source"),
]


#: The chart view's first section: bars of the answer, then the per-step series (pre/post norm together).
CHARTS = [
    ("BAR", ["recommended_max_norm"]),
    ("BAR", ["grad_norm_p95"]),
    ("LINE", ["grad_l2_pre_clip", "grad_l2_post_clip"]),
    ("LINE", ["clip_ratio_rolling"]),
    ("LINE", ["loss"]),
    ("LINE", ["lr"]),
    ("LINE", ["scaler_scale"]),
]
SECTION = "Gradient clipping"
OTHERS = "Model metrics"  # the UI's section for every other metric: collapsed


def _chart(kind: str, keys: list[str]) -> dict:
    """One chart card as the UI stores it (its ``RunsChartsBarCardConfig``/``RunsChartsLineCardConfig`` fields)."""
    card = {
        "type": kind,
        "uuid": f"clipamp-{keys[0]}",
        "metricSectionId": "clipamp",
        "isGenerated": False,
        "deleted": False,
        "metricKey": keys[0],
        "displayName": keys[0],
    }
    if kind == "LINE":
        card.update(
            selectedMetricKeys=keys,
            lineSmoothness=0,
            xAxisScaleType="linear",
            scaleType="linear",
            range={},
            xAxisKey="step",
            selectedXAxisMetricKey="",
            yAxisKey="metric",
            yAxisExpressions=[],
            ignoreOutliers=False,
            useGlobalXaxisKey=True,
            useGlobalLineSmoothing=True,
        )
    return card


def view_state() -> str:
    """The shared view's JSON: the runs table's columns in order, the chart view's cards and sections."""
    ids = [f"{kind}.`{name}`" for kind, name in COLUMNS]
    sections = [
        {"uuid": "clipamp", "name": SECTION, "display": True, "isReordered": False},
        {"uuid": "clipamp-others", "name": OTHERS, "display": False, "isReordered": False},
    ]
    return json.dumps(
        {
            "selectedColumns": ids,
            "columnOrder": ids,
            "compareRunSections": sections,
            "compareRunCharts": [_chart(kind, keys) for kind, keys in CHARTS],
        },
        separators=(",", ":"),
    )


def experiment_ui_tags(existing: dict[str, str]) -> dict[str, str]:
    """The experiment tags to set so the UI opens on training runs with the answer in view (a user's
    own experiment kind is kept)."""
    wanted = {VIEW_TAG: view_state()}
    if KIND_TAG not in existing:
        wanted[KIND_TAG] = KIND
    return {k: v for k, v in wanted.items() if existing.get(k) != v}


def runs_page(experiment_id: str | None) -> str:
    """The UI route of the experiment's training runs with the shared view (all experiments if None)."""
    if experiment_id is None:
        return "#/experiments"
    return f"#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={VIEW_KEY}"
