"""A copied or moved sqlite store: MLflow keeps the absolute artifact path each experiment was created with,
so a run in the copy writes its artifacts into the old folder. One line says so, and where to keep them."""

from __future__ import annotations

import shutil

from sweep.tracking.tracker import RunTracker, Store
from tests.app.helpers import store_in


def _run_artifacts(uri: str, experiment: str):
    store = Store.open(uri, experiment)
    with RunTracker(store.client, store.experiment_id, "r") as run:
        return run.artifact_dir


def test_a_copied_store_says_its_runs_artifacts_go_to_the_old_folder(tmp_path, store_template, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    uri = store_in(old, store_template)
    assert old / "mlruns" in _run_artifacts(uri, "clipamp").parents
    assert capsys.readouterr().err == ""  # the store's own folder: nothing to say
    shutil.copytree(old / "mlruns", new / "mlruns")

    copied = f"sqlite:///{new}/mlruns/mlflow.db"
    where = _run_artifacts(copied, "clipamp")
    assert old / "mlruns" / "artifacts" / "clipamp" in where.parents  # what the line says happens
    assert capsys.readouterr().err == (
        f"warning: experiment 'clipamp' of {new}/mlruns/mlflow.db keeps its artifacts in "
        f"{old}/mlruns/artifacts/clipamp, outside {new}/mlruns (MLflow records the path a store was created with; "
        "a copied or moved store keeps the old one): this run's artifacts go there; to keep them beside this "
        "store, pass tracking.experiment=ANOTHER_NAME\n"
    )
    assert new / "mlruns" in _run_artifacts(copied, "another").parents  # the fix it names keeps them here
    assert capsys.readouterr().err == ""
