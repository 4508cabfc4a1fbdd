"""Passwords in storage/tracking URLs never reach logs, params, tags or reports; the UI binds loopback."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlflow import MlflowClient

from sweep.report.format import ui_command
from sweep.tracking.tracker import redact, redact_text
from tests.app.helpers import TINY, run_cli

SECRET = "hunter2"


def test_redaction():
    assert redact(f"postgresql://bob:{SECRET}@127.0.0.1:5432/optuna") == "postgresql://bob:***@127.0.0.1:5432/optuna"
    assert SECRET not in redact_text(f"could not reach http://bob:{SECRET}@127.0.0.1:5000 (refused)")
    assert "--host 127.0.0.1" in ui_command("sqlite:///mlruns/mlflow.db")


def test_the_ui_command_can_be_pasted_with_a_space_in_the_store_path():
    import shlex

    uri = "sqlite:////tmp/my runs/ü/mlruns/mlflow.db"
    argv = shlex.split(ui_command(uri).split("  → ")[0])
    assert Path(argv[0]).name == "mlflow" and argv[1:3] == ["ui", "--backend-store-uri"] and argv[3] == uri


@pytest.mark.parametrize("activated", [True, False])
def test_the_ui_command_names_an_mlflow_the_shell_finds(monkeypatch, activated):
    """After the README's set-up the venv is not activated: a bare ``mlflow`` was "command not found"."""
    import subprocess
    import sys

    own = Path(sys.executable).parent
    path = [p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != own]
    monkeypatch.setenv("PATH", os.pathsep.join([str(own), *path] if activated else path))
    command = ui_command("sqlite:///mlruns/mlflow.db").split(" ui ")[0]
    assert command == ("mlflow" if activated else str(own / "mlflow"))
    found = subprocess.run(["bash", "-c", f"command -v {command}"], capture_output=True, text=True)
    assert found.returncode == 0, f"{command} is not found by the shell"


@pytest.mark.slow
def test_password_never_reaches_run_or_terminal(tmp_path, store):
    res = run_cli(
        "+experiment=train", *TINY, "steps=3", f"study.storage=postgresql://bob:{SECRET}@127.0.0.1:1/x", cwd=tmp_path
    )
    assert res.returncode == 0, res.stderr
    assert SECRET not in res.stdout + res.stderr
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    run = client.search_runs([e.experiment_id for e in client.search_experiments()])[0]
    assert run.data.params["study.storage"] == "postgresql://bob:***@127.0.0.1:1/x"
    blob = str(run.data.params) + str(run.data.tags)
    assert SECRET not in blob
    artifacts = tmp_path / "mlruns" / "artifacts"
    for f in artifacts.rglob("*"):
        if f.is_file() and f.suffix in (".yaml", ".md", ".json", ".csv"):
            assert SECRET not in f.read_text(), f


@pytest.mark.slow
def test_unreachable_tracking_server_message_is_redacted(tmp_path):
    res = run_cli("+experiment=train", *TINY, "steps=3", f"tracking.uri=http://bob:{SECRET}@127.0.0.1:9/", cwd=tmp_path)
    assert res.returncode == 2 and "unreachable" in res.stderr and SECRET not in res.stderr


@pytest.mark.slow  # two fresh interpreters importing the app
@pytest.mark.parametrize("activated", [True, False])
def test_a_printed_python_command_runs_in_the_shell_as_it_is(tmp_path, activated):
    """A message's ``python -m sweep.report`` ran the shell's ``python``: without the venv activated (the
    README's set-up) that is the system's, "No module named sweep", or none at all."""
    import re
    import subprocess
    import sys

    own = Path(sys.executable).absolute().parent
    path = [p for p in os.environ["PATH"].split(os.pathsep) if Path(p) != own]
    env = {**os.environ, "PATH": os.pathsep.join([str(own), *path] if activated else path)}
    env.pop("PYTHONPATH", None)
    res = subprocess.run(
        [sys.executable, "-m", "sweep.recommend", "runs:/abc"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    hint = re.search(r"\((\S+ -m sweep\.report) --wide lists them\)", res.stderr)
    assert res.returncode == 2 and hint, res.stderr
    assert hint.group(1) == ("python -m sweep.report" if activated else f"{own / 'python'} -m sweep.report")
    pasted = subprocess.run(
        ["bash", "-c", f"{hint.group(1)} --help"], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert pasted.returncode == 0 and "usage: python -m sweep.report" in pasted.stdout, pasted.stderr
