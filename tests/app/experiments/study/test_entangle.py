"""The LR check (study=entangle): the verdict on synthetic trial tables, and its figure."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from sweep import app
from sweep.experiments.study.entangle import NONE, cell_table, entangle_verdict
from sweep.report.entangle import plot_entangle
from tests.app.helpers import TINY, compose_cfg

TAUS = {NONE: math.nan, "p90": 2.0, "p50": 1.0}
#: An LR check at TINY size: the anchor window, then 2 LRs × {none, p50} × study.seeds (2) child runs.
SMALL_GRID = [
    "+experiment=sweep",
    "study=entangle",
    *TINY,
    "steps=12",
    "calibrate.window=6",
    "study.lr_factors=[0.5,1.0]",
    "study.entangle_quantiles=[p50]",
]


def _table(loss, lrs=(1e-3, 3e-3, 1e-2), seeds=2, sd=0.005, seed=0):
    """Trials whose eval loss is ``loss(lr, tau)`` plus seed noise of SD ``sd``."""
    rng = np.random.default_rng(seed)
    rows = [
        {"lr": lr, "tau": t, "max_norm": m, "seed": s, "eval_loss": loss(lr, t) + rng.normal(0, sd)}
        for lr in lrs
        for t, m in TAUS.items()
        for s in range(seeds)
    ]
    return pd.DataFrame(rows)


def test_cells_are_seed_means_and_the_noise_is_the_pooled_sd():
    df = _table(lambda lr, t: 2.0)
    cells = cell_table(df)
    assert len(cells) == 9 and (cells["n"] == 2).all()
    ref = df.groupby(["lr", "tau"])["eval_loss"].mean()
    assert np.allclose(cells.set_index(["lr", "tau"])["mean"].sort_index(), ref.sort_index())
    v = entangle_verdict(df)
    pooled = math.sqrt((df.groupby(["lr", "tau"])["eval_loss"].var()).mean())
    assert v.noise == pytest.approx(2 * pooled * math.sqrt(2 / 2))


def test_clipping_that_only_shortens_the_step_is_matched_by_a_lower_lr():
    # the loss depends only on the effective step lr·s, with s = 1 unclipped, 0.5 at p90, 0.33 at p50
    shrink = {NONE: 1.0, "p90": 0.5, "p50": 1 / 3}
    v = entangle_verdict(_table(lambda lr, t: 2.0 + 40 * abs(lr * shrink[t] - 3e-3)))
    assert v.kind == "step-length-cap"
    assert v.best_clipped.lr == 1e-2 and v.match.lr == 3e-3 and v.match.tau == NONE
    assert v.line.startswith("clipping acts as a step-length cap: unclipped lr=0.003")


def test_a_gain_no_lower_lr_reproduces_is_more_than_a_step():
    # clipping at p50 helps at every LR by 0.1; no LR change buys that
    v = entangle_verdict(_table(lambda lr, t: 2.0 + 20 * abs(lr - 3e-3) - (0.1 if t == "p50" else 0)))
    assert v.kind == "more-than-step" and v.best_clipped.tau == "p50" and v.best_clipped.lr == 3e-3


def test_no_gain_and_unclipped_best():
    # clipping changes nothing: "no-gain" in most draws; calling a gain is the ~5% false alarm of a 2-SE rule
    kinds = [entangle_verdict(_table(lambda lr, t: 2.0 + 20 * abs(lr - 3e-3), seed=k)).kind for k in range(40)]
    assert kinds.count("no-gain") >= 34
    hurt = entangle_verdict(_table(lambda lr, t: 2.0 + (0.2 if t != NONE else 0)))
    assert hurt.kind == "unclipped-best"


@pytest.mark.parametrize(
    "loss", [lambda lr, t: 2.0 + (0.2 if t != NONE else 0), lambda lr, t: 2.0 - (0.1 if t == "p50" else 0)]
)
def test_one_seed_gives_no_verdict_only_the_ranking(loss):
    """Without a second seed the gaps cannot be told from noise: neither "no clipping needed" nor
    "more than a step" is claimed."""
    v = entangle_verdict(_table(loss, seeds=1))
    assert v.kind == "undecided" and math.isnan(v.noise)
    assert "with 1 seed per cell the noise between seeds is unknown: pass study.seeds=2 or more" in v.line


def test_figure_is_written(tmp_path):
    df = _table(lambda lr, t: 2.0 + 10 * lr)
    path = plot_entangle(cell_table(df), entangle_verdict(df), tmp_path / "entangle.png", title="t")
    assert path.stat().st_size > 5000


@pytest.mark.slow
def test_entangle_study_end_to_end(store):
    """A small grid through the app: anchor window + 2 LRs × {none, p50} × 2 seeds as child runs of one parent,
    whose verdict tag is the verdict of its own trials table."""
    from mlflow import MlflowClient

    cfg = compose_cfg(*SMALL_GRID, f"tracking.uri={store}")
    verdict = app.run(cfg)
    client = MlflowClient(store)
    parent = client.search_runs(
        [e.experiment_id for e in client.search_experiments()], filter_string="tags.sweep_role = 'entangle'"
    )[0]
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'"
    )
    roles = sorted(r.data.tags["sweep_role"] for r in children)
    assert roles == ["anchor"] + ["entangle_trial"] * 8
    assert parent.data.tags["entangle_verdict"] == verdict.kind and parent.data.tags["entangle_line"] == verdict.line
    trials = pd.read_csv(client.download_artifacts(parent.info.run_id, "trials.csv"))
    assert entangle_verdict(trials).line == verdict.line
    clipped = trials[trials["tau"] != NONE]
    assert (clipped["clip_ratio"] > 0).any() and (trials[trials["tau"] == NONE]["clip_ratio"] == 0).all()
    assert "plots/entangle.png" in {a.path for a in client.list_artifacts(parent.info.run_id, "plots")}
    text = Path(client.download_artifacts(parent.info.run_id, "verdict.json")).read_text()
    saved = json.loads(text, parse_constant=lambda c: pytest.fail(f"verdict.json holds a bare {c}"))  # strict JSON
    cell = saved["same_lr_unclipped"]
    assert saved["kind"] == verdict.kind and (cell is None or cell["max_norm"] is None)  # unclipped: no τ
