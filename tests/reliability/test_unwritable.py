"""Item 13 (part): a read-only artifact folder gives one line, exit 2, and the run is not left RUNNING."""

from __future__ import annotations

import pytest
from mlflow import MlflowClient

from sweep.tracking.tracker import Store
from tests.app.helpers import TINY
from tests.reliability.helpers import assert_one_line_error, finish, small_tmpfs, start_cli


@pytest.mark.slow
def test_read_only_artifact_folder_is_one_line_and_the_run_ends_failed(tmp_path, store):
    store = Store.open(store, "clipamp")  # the default store, migrated already
    artifacts = tmp_path / "mlruns" / "artifacts"
    artifacts.mkdir()
    with small_tmpfs(artifacts, "ro,size=1m", "to make a read-only file system"):
        res = finish(start_cli("+experiment=train", *TINY, "steps=2", cwd=tmp_path))
    assert_one_line_error(res, "cannot write the run's artifacts", "Read-only file system")
    (run,) = MlflowClient(store.uri).search_runs([store.experiment_id])
    assert run.info.status == "FAILED"
