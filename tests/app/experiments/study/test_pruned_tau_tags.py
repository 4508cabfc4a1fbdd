"""A pruned trial's child run says the τ it clipped at, as a finished one does: its ``tau_used`` and
``tau.<phase>`` tags are those of its own steps.csv (``tau_tags``), so ``sweep.report`` shows "τ used"."""

from __future__ import annotations

import optuna
import pytest
from mlflow import MlflowClient

from sweep import app
from sweep.run.summary import read_rows, tau_tags
from tests.app.experiments.study.test_pruning import BAND_SWEEP
from tests.app.experiments.study.test_sweep import children, optuna_study, sweep_cfg


@pytest.mark.slow
def test_pruned_trials_carry_the_tau_tags_of_their_steps(tmp_path):
    """τ in [0.01, 0.02], far below the tiny task's norms (~1): every step clips, every trial is pruned
    above the band [0, 0.05] after a few steps."""
    uri = f"sqlite:///{tmp_path}/mlruns/mlflow.db"
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
