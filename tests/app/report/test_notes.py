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
