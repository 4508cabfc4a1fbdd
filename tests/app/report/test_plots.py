"""The report's figures say nothing on the terminal: a study whose trials all failed (nothing to label)
gets its figure and no matplotlib warning."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
from PIL import Image

from sweep.report.plots import plot_sweep


@pytest.mark.parametrize("states", [["FAIL", "FAIL"], ["FAIL", "PRUNED"]])
def test_a_study_with_no_complete_trial_plots_without_a_warning(tmp_path, states):
    df = pd.DataFrame(
        {
            "trial": range(len(states)),
            "state": states,
            "dtype": ["bf16", "fp32"],
            "max_norm": [0.5, 1.0],
            "clip_ratio": [float("nan")] * len(states),
            "eval_loss": [float("nan")] * len(states),
        }
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_sweep(df, None, tmp_path / "sweep.png", band=(0.01, 0.05), title="s")
    assert Image.open(path).size[0] > 0


def test_an_lr_check_with_no_cell_to_mark_plots_without_a_warning(tmp_path):
    """Every trial of the LR check failed: no best clipped cell, no unclipped match to mark."""
    from sweep.experiments.study.entangle import Verdict
    from sweep.report.entangle import plot_entangle

    nan = float("nan")
    cells = pd.DataFrame(
        {
            "lr": [1e-3, 1e-3, 2e-3, 2e-3],
            "tau": ["none", "p90", "none", "p90"],
            "max_norm": [nan, 0.8, nan, 0.8],
            "mean": [nan] * 4,
            "sd": [nan] * 4,
            "n": [0] * 4,
        }
    )
    verdict = Verdict("undecided", "no finite eval loss", nan, None, None, None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_entangle(cells, verdict, tmp_path / "entangle.png", title="lr check")
    assert Image.open(path).size[0] > 0
