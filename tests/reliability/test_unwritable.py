"""Item 13 (part): a read-only artifact folder gives one line, exit 2, and the run is not left RUNNING."""

from __future__ import annotations

import os
import subprocess

import pytest
from mlflow import MlflowClient

from sweep.tracking.tracker import Store
from tests.app.helpers import TINY
from tests.reliability.helpers import assert_one_line_error, finish, start_cli


@pytest.mark.slow
def test_read_only_artifact_folder_is_one_line_and_the_run_ends_failed(tmp_path):
    store = Store.open(f"sqlite:///{tmp_path}/mlruns/mlflow.db", "clipamp")
    artifacts = tmp_path / "mlruns" / "artifacts"
    artifacts.mkdir()
    # a read-only file system (root ignores permission bits, so chmod would prove nothing)
    if (
        os.geteuid() != 0
        or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(artifacts)], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("needs root and mount(8) to make a read-only file system")
    try:
        res = finish(start_cli("+experiment=train", *TINY, "steps=2", cwd=tmp_path))
    finally:
        subprocess.run(["umount", str(artifacts)], check=True)
    assert_one_line_error(res, "cannot write the run's artifacts", "Read-only file system")
    (run,) = MlflowClient(store.uri).search_runs([store.experiment_id])
    assert run.info.status == "FAILED"
