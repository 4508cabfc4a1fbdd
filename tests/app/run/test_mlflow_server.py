"""A real `mlflow server` (sqlite backend, served artifacts) on 127.0.0.1 as the tracking store."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from sweep import app
from sweep.report.format import ui_command
from tests.app.helpers import TINY, compose_cfg
from tests.mlflow_server import MlflowServer

pytestmark = pytest.mark.slow  # end to end: real runs through the app


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("server")
    srv = MlflowServer(f"sqlite:///{root}/db.sqlite", root, artifacts=root / "artifacts")
    srv.start()
    try:
        yield srv.uri, root
    finally:
        srv.stop()


def test_run_tracked_on_a_server_uploads_its_artifacts(server):
    uri, root = server
    cfg = compose_cfg("+experiment=calibrate", *TINY, "steps=8", "calibrate.window=4", f"tracking.uri={uri}")
    result = app.run(cfg)
    client = MlflowClient(uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED" and "recommended_max_norm" in run.data.metrics
    names = {a.path for a in client.list_artifacts(result.run_id)}
    assert {"steps.csv", "report.md", "quantiles.json"} <= names
    stored = list((root / "artifacts").rglob("steps.csv"))
    assert len(stored) == 1 and stored[0].read_text().count("\n") == 9  # header + 8 steps
    assert ui_command(uri, run.info.experiment_id) == (
        f"open {uri}/#/experiments/{run.info.experiment_id}/runs"
        "?workflowType=machine_learning&viewStateShareKey=clipamp"
    )
