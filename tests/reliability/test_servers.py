"""Items 12 and 18: the documented server URL forms work — ``http://user:pw@host`` (basic auth) and a
``postgresql://`` tracking store (psycopg 3) — and an uploaded run leaves no temporary folder behind."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from tests.app.experiments.study.test_postgres import SECRET as PG_SECRET
from tests.app.experiments.study.test_postgres import postgres  # noqa: F401  (fixture)
from tests.app.helpers import TINY
from tests.app.run.test_mlflow_server import server  # noqa: F401  (fixture)
from tests.reliability.helpers import finish, start_cli

pytestmark = pytest.mark.slow  # real servers, real runs


def test_userinfo_url_and_postgresql_store_track_runs(tmp_path, server, postgres):  # noqa: F811
    uri, _ = server
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    http_user = uri.replace("http://", "http://bob:S1cret@")
    procs = [
        start_cli(
            "+experiment=train", *TINY, "steps=3", f"tracking.uri={target}", cwd=tmp_path, env={"TMPDIR": str(tmp)}
        )
        for target in (http_user, postgres)
    ]
    results = [finish(p) for p in procs]
    for res, target, secret in zip(results, (uri, postgres), ("S1cret", PG_SECRET)):
        assert res.returncode == 0, res.stderr[-2000:]
        assert secret not in res.stdout + res.stderr
        client = MlflowClient(target)
        (run,) = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
        assert run.info.status == "FINISHED" and "final_loss" in run.data.metrics
        assert {"steps.csv", "config.yaml"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
        assert secret not in str(run.data.params) + str(run.data.tags)
    assert not list(tmp.glob("clipamp-artifacts-*"))  # the upload's temporary copy is removed
