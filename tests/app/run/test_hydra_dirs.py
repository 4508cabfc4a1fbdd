"""Hydra's folders as Hydra users expect them: ``hydra.run.dir=X`` puts Hydra's files in X,
``hydra.job.chdir=true`` runs the job in X, ``-m`` gives each job its folder, and the MLflow store
stays where the command ran (the printed ``mlflow ui`` command names it by its absolute path)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from tests.app.helpers import TINY, run_cli

pytestmark = pytest.mark.slow
RUN = ["+experiment=train", "steps=3", *TINY]
SECRET = "S3cretPW"


def printed_store(stdout: str) -> str:
    (uri,) = set(re.findall(r"--backend-store-uri (\S+)", stdout))
    return uri


def runs_in(db: Path) -> list:
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("clipamp")
    return client.search_runs([exp.experiment_id]) if exp else []


def hydra_files(folder: Path) -> dict:
    return {f.name: yaml.safe_load(f.read_text()) for f in (folder / ".hydra").glob("*.yaml")}


def test_run_dir_and_chdir_keep_the_store_where_the_command_ran(tmp_path):
    db = tmp_path / "mlruns" / "mlflow.db"
    # an unused password-bearing override: it must reach none of Hydra's files
    storage = f"study.storage=postgresql://bob:{SECRET}@127.0.0.1:9/optuna"
    chdir = run_cli(*RUN, "seed=1", storage, "hydra.run.dir=out/x", "hydra.job.chdir=true", cwd=tmp_path)
    assert chdir.returncode == 0, chdir.stderr[-2000:]
    plain_dir = run_cli(*RUN, "seed=2", "hydra.run.dir=out/y", cwd=tmp_path)
    assert plain_dir.returncode == 0, plain_dir.stderr[-2000:]
    control = run_cli(*RUN, "seed=3", cwd=tmp_path)
    assert control.returncode == 0, control.stderr[-2000:]

    for out in (chdir, plain_dir, control):
        assert printed_store(out.stdout) == f"sqlite:///{db}"
    assert sorted(r.data.params["seed"] for r in runs_in(db)) == ["1", "2", "3"]
    assert not (tmp_path / "out" / "x" / "mlruns").exists(), "hydra.job.chdir=true made a second store"
    for folder, seed in (("x", 1), ("y", 2)):
        files = hydra_files(tmp_path / "out" / folder)
        assert set(files) == {"config.yaml", "hydra.yaml", "overrides.yaml"}
        assert files["config.yaml"]["seed"] == seed and f"seed={seed}" in files["overrides.yaml"]
        assert files["hydra.yaml"]["hydra"]["job"]["name"] == "clipamp"
    assert hydra_files(tmp_path / "out" / "x")["hydra.yaml"]["hydra"]["job"]["chdir"] is True
    assert not (tmp_path / ".hydra").exists(), "a plain run left Hydra's files in the working folder"
    leaked = [str(f) for f in tmp_path.rglob("*") if f.is_file() and SECRET.encode() in f.read_bytes()]
    assert not leaked, f"the password reached {leaked}"


def test_multirun_jobs_land_in_one_store(tmp_path):
    out = run_cli("-m", *RUN, "seed=4,5", "hydra.job.chdir=true", "hydra.sweep.dir=multi", cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    db = tmp_path / "mlruns" / "mlflow.db"
    assert printed_store(out.stdout) == f"sqlite:///{db}"
    assert sorted(r.data.params["seed"] for r in runs_in(db)) == ["4", "5"]
    for job, seed in ((0, 4), (1, 5)):
        assert hydra_files(tmp_path / "multi" / str(job))["config.yaml"]["seed"] == seed
        assert not (tmp_path / "multi" / str(job) / "mlruns").exists()
    assert (tmp_path / "multi" / "multirun.yaml").is_file()
