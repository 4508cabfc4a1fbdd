"""Item 5: a space or a non-ASCII character in the project path: artifacts land in the run's folder."""

from __future__ import annotations

import csv

import pytest
from mlflow import MlflowClient

from tests.app.helpers import TINY
from tests.reliability.helpers import finish, start_cli


@pytest.mark.slow
def test_space_and_non_ascii_in_the_path_keep_artifacts_in_the_run(tmp_path):
    work = tmp_path / "with space ü"
    work.mkdir()
    res = finish(start_cli("+experiment=train", *TINY, "steps=3", cwd=work))
    assert res.returncode == 0, res.stderr[-2000:]
    assert not [p for p in tmp_path.rglob("*") if "%" in p.name]  # no `with%20space%20%C3%BC` sibling
    client = MlflowClient(f"sqlite:///{work}/mlruns/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
    listed = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"steps.csv", "config.yaml", "quantiles.json", "report.md"} <= listed
    local = client.download_artifacts(run.info.run_id, "steps.csv", str(tmp_path))
    with open(local) as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [1, 2, 3]
