"""The study's database going away mid-sweep (a PostgreSQL server stopped, say): the sweep stops with one
line naming the storage and the fix, exit status 1, its runs FAILED; once the database answers, the same
command recovers the trial it left RUNNING at once. Before, a 300-line SQLAlchemy traceback, and the re-run
said the trial was "running in other live workers" until its heartbeat went stale."""

from __future__ import annotations

import dataclasses

import optuna
import pytest
import sqlalchemy
from mlflow import MlflowClient
from sqlalchemy import orm

from sweep import app
from sweep.experiments.study import sweep as sweep_module
from sweep.experiments.study import trial as trial_module
from sweep.experiments.study.storage import StorageLost, open_storage
from sweep.experiments.study.workers import recover_dead_workers
from sweep.tracking.tracker import Store
from tests.app.experiments.study.test_sweep import sweep_cfg

#: Nothing listens on port 1: every connection is refused, as by a stopped server.
GONE = "postgresql+psycopg://clipamp@127.0.0.1:1/optuna"


def _database_goes_away(storage) -> None:
    """From now on the storage's sessions connect to a server that is not there (a real driver error)."""
    storage.engine = sqlalchemy.create_engine(GONE, connect_args={"connect_timeout": 2})
    storage.scoped_session = orm.scoped_session(orm.sessionmaker(bind=storage.engine))


@pytest.mark.slow
def test_a_lost_study_database_is_one_line_and_the_rerun_recovers_its_trial(tmp_path, monkeypatch):
    opened, real_open = [], sweep_module.open_storage

    def open_(*a, **k):
        opened.append(real_open(*a, **k))
        return opened[-1]

    real_train = trial_module.run_training

    def run_training(cfg, store, spec, hooks, *rest):  # trial 1: the database goes away after its step 5
        if spec.name.startswith("trial-1-"):
            inner = hooks.step

            def step(log):
                if log.step == 5:
                    _database_goes_away(opened[0])
                inner(log)

            hooks = dataclasses.replace(hooks, step=step)
        return real_train(cfg, store, spec, hooks, *rest)

    monkeypatch.setattr(sweep_module, "open_storage", open_)
    monkeypatch.setattr(trial_module, "run_training", run_training)
    uri, db = f"sqlite:///{tmp_path}/mlruns/mlflow.db", f"sqlite:///{tmp_path}/mlruns/optuna.db"
    cfg = sweep_cfg(uri, "study.n_trials=3", "study.anchor=null", "study.heartbeat_interval=1")
    with pytest.raises(StorageLost) as lost:
        app.run(cfg, ["+experiment=sweep"])
    line = str(lost.value)
    assert lost.value.status == 1 and "\n" not in line
    assert line.startswith("the Optuna storage sqlite:///") and "Connection refused" in line
    assert "re-run the same command" in line
    client = MlflowClient(uri)
    runs = {r.info.run_name.split("-")[0] + r.data.tags.get("trial", ""): r for r in client.search_runs(["1"])}
    assert {k: r.info.status for k, r in runs.items()} == {"sweep": "FAILED", "trial0": "FINISHED", "trial1": "FAILED"}
    assert runs["trial1"].data.tags["error"].startswith("the Optuna storage stopped answering: connection failed")

    # the database answers again: the same command's recovery fails trial 1 at once and queues its parameters
    study = optuna.load_study(study_name=cfg.study.name or optuna.get_all_study_names(db)[0], storage=open_storage(db))
    assert [t.state.name for t in study.trials] == ["COMPLETE", "RUNNING"]
    lines: list[str] = []
    assert recover_dead_workers(study, Store.open(uri, "clipamp"), lines.append) == [1]
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "WAITING"]
    assert trials[2].params == trials[1].params
    assert trials[1].user_attrs["run_id"] and "outcome" not in trials[1].user_attrs  # FAILED, as its run
