"""A pruned trial's child run says the τ it clipped at, as a finished one does: its ``tau_used`` and
``tau.<phase>`` tags are those of its own steps.csv (``tau_tags``), so ``sweep.report`` shows "τ used"."""

from __future__ import annotations

import re

import numpy as np
import optuna
import pytest
from mlflow import MlflowClient

from sweep import app
from sweep.report import cli
from sweep.run.summary import read_rows, tau_tags
from tests.app.experiments.study.test_pruning import BAND_SWEEP
from tests.app.experiments.study.test_sweep import children, optuna_study, sweep_cfg


@pytest.mark.slow
def test_pruned_trials_carry_the_tau_tags_of_their_steps(tmp_path, store, capsys):
    """τ in [0.01, 0.02], far below the tiny task's norms (~1): every step clips, every trial is pruned
    above the band [0, 0.05] after a few steps."""
    uri = store  # the default store, migrated already
    cfg = sweep_cfg(uri, *BAND_SWEEP, "study.max_norm_low=0.01", "study.max_norm_high=0.02", "study.n_trials=2")
    result = app.run(cfg, ["+experiment=sweep"])
    trials = optuna_study(result, tmp_path).get_trials()
    pruned = [t for t in trials if t.state == optuna.trial.TrialState.PRUNED]
    assert pruned, [t.state for t in trials]
    client = MlflowClient(uri)
    kids = {k.data.tags["trial"]: k for k in children(client, result.parent_run_id) if "trial" in k.data.tags}
    for t in pruned:
        run = kids[str(t.number)]
        rows = read_rows(client.download_artifacts(run.info.run_id, "steps.csv"))
        assert rows and all(r["phase"] == "train" for r in rows)
        expected = tau_tags(rows)
        assert expected["tau_used"] == f"{t.params['max_norm']:.4g}"  # the trial's τ, at every step
        assert {k: run.data.tags.get(k) for k in expected} == expected
    # sweep.report: each pruned trial's p95 and τ rec. over the steps it ran (before: —), marked as not finished
    capsys.readouterr()  # the sweep's own output
    assert cli.main(["--tracking-uri", uri, "--wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = re.split(r"\s{2,}", lines[0])
    table = [c for c in (re.split(r"\s{2,}", line) for line in lines[1:]) if len(c) == len(head)]  # not the legend
    shown = {c[1]: dict(zip(head, c)) for c in table}
    for t in pruned:
        run = kids[str(t.number)]
        rows = [r for r in read_rows(client.download_artifacts(run.info.run_id, "steps.csv")) if not r["skipped"]]
        p95 = np.quantile([r["grad_l2_pre_clip"] for r in rows], 0.95)  # calibrate.quantile: 0.95
        cells = shown[run.info.run_id]
        assert cells["run"].endswith("*") and cells["status"] == "KILLED"
        assert (float(cells["p95"]), float(cells["τ rec."])) == pytest.approx((p95, p95), rel=5e-4)
