"""A sweep trial stopped by a tracking store another process held locked: the trial FAILs with the condition
as its reason, not MLflow's message quoting SQLAlchemy's statement, and the study goes on."""

from __future__ import annotations

import dataclasses
import sqlite3

import optuna
import pytest
import sqlalchemy
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import TEMPORARILY_UNAVAILABLE

from sweep import app
from sweep.experiments.study import trial as trial_module
from sweep.tracking.busy import LOCK_WAIT_S
from tests.app.experiments.study.test_sweep import sweep_cfg


def locked_error(tmp_path) -> MlflowException:
    """sqlite's "database is locked" through SQLAlchemy, wrapped as MLflow's sessions wrap it."""
    db = tmp_path / "locked.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("CREATE TABLE metrics (key TEXT, value REAL)")
    holder.execute("BEGIN EXCLUSIVE")
    engine = sqlalchemy.create_engine(f"sqlite:///{db}", connect_args={"timeout": 0.05})
    try:
        with engine.begin() as con:
            con.execute(sqlalchemy.text("INSERT INTO metrics VALUES (:k, :v)"), {"k": "loss", "v": 2.5})
    except sqlalchemy.exc.OperationalError as e:
        error = MlflowException(message=e, error_code=TEMPORARILY_UNAVAILABLE)
    finally:
        holder.close()
        engine.dispose()
    assert "[SQL: INSERT INTO metrics" in str(error)
    return error


@pytest.mark.slow  # a two-trial sweep
def test_a_trial_the_locked_store_stopped_fails_with_the_condition_and_the_study_goes_on(tmp_path, monkeypatch, capsys):
    error, real_train = locked_error(tmp_path), trial_module.run_training

    def run_training(cfg, store, spec, hooks, *rest):  # trial 0: the store stays locked at its step 3
        if spec.name.startswith("trial-0-"):
            inner = hooks.step

            def step(log):
                inner(log)
                if log.step == 3:
                    raise error

            hooks = dataclasses.replace(hooks, step=step)
        return real_train(cfg, store, spec, hooks, *rest)

    monkeypatch.setattr(trial_module, "run_training", run_training)
    uri, db = f"sqlite:///{tmp_path}/mlruns/mlflow.db", f"sqlite:///{tmp_path}/mlruns/optuna.db"
    app.run(sweep_cfg(uri, "study.n_trials=2", "study.anchor=null"), ["+experiment=sweep"])
    reason = f"the tracking store stayed locked by another process for over {LOCK_WAIT_S:.0f} s (database is locked)"
    (name,) = optuna.get_all_study_names(db)
    trials = optuna.load_study(study_name=name, storage=db).get_trials()
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE"]
    assert trials[0].user_attrs["error"] == reason
    run = MlflowClient(uri).get_run(trials[0].user_attrs["run_id"])
    assert run.info.status == "FAILED" and run.data.tags["error"] == reason
    out = capsys.readouterr().out
    assert reason in out and "SQL" not in out
