"""The experiment's description in the MLflow UI leads with a validated answer, not any run's quantile."""

from __future__ import annotations

import math

import pandas as pd

from sweep.report.notes import NO_WINDOW, experiment_note


def _runs(*rows):
    """``mlflow.search_runs``-shaped rows, newest first."""
    keys = ("tags.mlflow.runName", "metrics.recommended_max_norm", "metrics.window_clip_ratio_at_tau")
    return pd.DataFrame([dict(zip(keys, row)) for row in rows])


def test_the_headline_is_the_newest_run_with_a_calibration_window():
    """A 5-step train run after a calibrate run: its 'recommended τ' (16.57, a quantile of five warm-up
    norms) headed the experiment before."""
    note = experiment_note(_runs(("train-gpt-bf16", 16.57, math.nan), ("calibrate-gpt-bf16", 1.06, 0.03)))
    assert note.splitlines()[0].startswith("Latest: **calibrate-gpt-bf16**: recommended τ (`clip.max_norm`) **1.06**,")


def test_without_any_window_the_headline_says_what_its_number_is():
    note = experiment_note(_runs(("train-gpt-bf16", 16.57, math.nan)))
    assert note.splitlines()[0].startswith(
        f"Latest: **train-gpt-bf16**: recommended τ (`clip.max_norm`) **16.57** ({NO_WINDOW})"
    )


def test_a_studys_anchor_window_is_not_the_latest_answer(store):
    """After a sweep the newest run with a calibration window was its anchor-window run (tag
    ``sweep_role=anchor``): the headline named it. It names the newest calibrate run, read from the store."""
    from mlflow import MlflowClient

    from sweep.report.runs import frame

    client = MlflowClient(store)
    exp = client.create_experiment("clipamp")
    for start, name, tags, tau in (
        (1_000, "calibrate-gpt-bf16", {}, 1.06),
        (2_000, "anchor-window-bf16", {"sweep_role": "anchor", "study": "s"}, 2.5),
    ):
        run = client.create_run(exp, start_time=start, run_name=name, tags=tags)
        client.log_metric(run.info.run_id, "recommended_max_norm", tau)
        client.log_metric(run.info.run_id, "window_clip_ratio_at_tau", 0.03)
        client.set_terminated(run.info.run_id)
    runs = frame(store, exp)
    assert runs["tags.mlflow.runName"].iloc[0] == "anchor-window-bf16"  # the newest in the store
    first = experiment_note(runs).splitlines()[0]
    assert first.startswith("Latest: **calibrate-gpt-bf16**") and "**1.06**" in first
