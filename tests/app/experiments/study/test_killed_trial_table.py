"""A trial a signal stopped is the same trial in both tables: the sweep's own (Optuna user attrs,
``trials_table``) and ``sweep.report``'s (MLflow): KILLED, the steps it ran, its run id, its figures.
Before, the sweep's said 'failed, 0 steps, no run id' and sweep.report 'killed, N steps'; then
sweep.report showed '—' for the clipping/skip ratios and training loss the sweep's table gave, and
the run had no ``tau_used`` tag, which every other trial's run has."""

from __future__ import annotations

import dataclasses

import pytest
from mlflow import MlflowClient

from sweep import app
from sweep.experiments.study import trial as trial_module
from sweep.report.cli import sweeps_tables
from sweep.results.study import trials_table
from sweep.run.summary import read_rows, tau_tags
from tests.app.experiments.study.test_sweep import sweep_cfg


@pytest.mark.slow
def test_a_killed_trial_is_killed_with_its_steps_and_run_in_both_tables(tmp_path, store, monkeypatch):
    import optuna

    real, calls = trial_module.run_training, []

    def run_training(cfg, store, spec, hooks, *rest):  # the second trial: Ctrl-C after step 5
        calls.append(spec.name)
        if len(calls) == 2:
            inner = hooks.step

            def step(log):
                inner(log)
                if log.step == 5:
                    raise KeyboardInterrupt("killed after step 5")

            hooks = dataclasses.replace(hooks, step=step)
        return real(cfg, store, spec, hooks, *rest)

    monkeypatch.setattr(trial_module, "run_training", run_training)
    uri = store  # the default store, migrated already
    cfg = sweep_cfg(uri, "study.n_trials=2")
    with pytest.raises(KeyboardInterrupt):
        app.run(cfg, ["+experiment=sweep"])
    client = MlflowClient(uri)
    [(name, report, *_)] = sweeps_tables(client, "clipamp")
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path}/mlruns/optuna.db")
    own = trials_table(study, (0.0, 1.0))
    cols = ["trial", "state", "steps_run", "run_id"]
    assert own[cols].values.tolist() == report[cols].values.tolist()
    killed = own[own["state"] == "KILLED"]
    assert len(killed) == 1
    run_id = killed["run_id"].iloc[0]
    assert client.get_run(run_id).info.status == "KILLED"
    assert killed["steps_run"].iloc[0] == max(m.step for m in client.get_metric_history(run_id, "loss")) == 5
    # the same figures in both tables, those of the run's own steps.csv, and its τ tags
    figures = ["clip_ratio", "skip_ratio", "final_loss"]
    assert own[figures].values.ravel().tolist() == pytest.approx(report[figures].values.ravel().tolist())
    rows = read_rows(client.download_artifacts(run_id, "steps.csv", str(tmp_path)))
    assert len(rows) == 5
    taken = [r for r in rows if not r["skipped"]]
    expected = [sum(bool(r["clipped"]) for r in taken) / len(taken), 1 - len(taken) / len(rows)]
    expected.append(sum(r["loss"] for r in taken) / len(taken))  # mean training loss, last 10 taken steps
    assert killed[figures].values.tolist()[0] == pytest.approx(expected)
    tags = client.get_run(run_id).data.tags
    assert {k: tags.get(k) for k in tau_tags(rows)} == tau_tags(rows)
    assert tags["tau_used"] == f"{killed['max_norm'].iloc[0]:.4g}"
