"""A run whose server was away when it stopped kept its unsent values in ``pending.json``; resuming it
(``resume=true``) once the server is back sends them with the rest: window and eval metrics are
not re-sent from ``steps.csv`` by the resume, so without this they were lost."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric

from sweep.tracking.outbox import PENDING
from sweep.tracking.tracker import RunTracker
from tests.app.run.test_mlflow_server import server  # noqa: F401

pytestmark = pytest.mark.slow  # a real mlflow server


def test_a_resume_sends_what_pending_json_kept_up_to_the_checkpoint(server, tmp_path, monkeypatch):  # noqa: F811
    uri, _ = server
    monkeypatch.chdir(tmp_path)  # a remote store's run folder is ./mlruns/uploads/RUN_ID
    client = MlflowClient(uri)
    first = RunTracker(client, client.create_experiment("pending"), "r")
    for step in (1, 2, 3):
        first.add_step(step, {"loss": 3.0 - step})
    first.flush()
    # the server was away for the rest: what the run could not send, kept as its end keeps it
    box = first.outbox
    box.metrics += [Metric("loss", 0.5, 4, 4), Metric("window_tau", 1.25, 4, 4), Metric("eval_loss", 2.5, 6, 6)]
    box.tags["note"] = "kept while away"
    box._keep("KILLED", first.artifact_dir, "the tracking server did not answer by the end of the run")
    pending = first.artifact_dir / PENDING
    assert pending.exists()

    again = RunTracker.reopen(client, first.run_id, upto=5)  # the checkpoint is at step 5: 6 is trained again
    assert pending.exists()  # kept until what it holds is sent
    again.add_step(5, {"loss": 0.25})
    again.flush()
    assert not pending.exists() and first.artifact_dir.exists()  # sent: a later resend has nothing stale
    again.end("FINISHED")
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["note"] == "kept while away"
    history = {k: [(m.step, m.value) for m in client.get_metric_history(first.run_id, k)] for k in run.data.metrics}
    assert sorted(history["loss"]) == [(1, 2.0), (2, 1.0), (3, 0.0), (4, 0.5), (5, 0.25)]  # before: no step 4
    assert history["window_tau"] == [(4, 1.25)]
    assert "eval_loss" not in history  # past the checkpoint: the resume trains step 6 again
    assert not first.artifact_dir.exists()  # uploaded: the local folder, pending.json with it, went
