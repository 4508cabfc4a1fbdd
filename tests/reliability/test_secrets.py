"""Item 1: a password in any URL form never reaches a file, a tag, a param or the terminal."""

from __future__ import annotations

import os

import pytest
from mlflow import MlflowClient

from sweep.secrets import hide_argv, redact_text
from tests.app.helpers import TINY, compose_cfg
from tests.reliability.helpers import finish, start_cli

FORMS = {  # what a user types (or Hydra writes back) → what may be shown
    "postgresql://bob:S1cret@db:5432/optuna": "postgresql://bob:***@db:5432/optuna",
    r"study.storage=postgresql\://bob\:S1cret@db\:5432/optuna": r"study.storage=postgresql\://bob\:***@db\:5432/optuna",
    "postgresql://db/optuna?user=bob&password=S1cret&sslmode=require": "postgresql://db/optuna?user=bob&password=***&sslmode=require",
    "http://h:5000/?Token=S1cret": "http://h:5000/?Token=***",
}


@pytest.mark.parametrize("text", FORMS)
def test_redaction_sees_every_url_form(text):
    assert redact_text(text) == FORMS[text]
    assert (
        redact_text("sqlite:///mlruns/mlflow.db http://127.0.0.1:5000")
        == "sqlite:///mlruns/mlflow.db http://127.0.0.1:5000"
    )


def test_argv_carries_no_password_yet_the_config_gets_it(monkeypatch):
    env: dict[str, str] = {}
    url = "postgresql://bob:S1cret@db:5432/optuna?password=S2cret"
    argv = hide_argv(["+experiment=train", f"study.storage='{url}'"], env)
    assert "S1cret" not in str(argv) and "S2cret" not in str(argv)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert compose_cfg(*argv).study.storage == url


def _all_bytes(*roots) -> list[tuple[str, bytes]]:
    return [(str(f), f.read_bytes()) for root in roots for f in root.rglob("*") if f.is_file()]


@pytest.mark.slow
def test_no_file_or_stream_holds_a_password(tmp_path):
    """``-m`` over a userinfo and a ``?password=`` URL, then an uncaught crash: grep everything written."""
    work, tmp = tmp_path / "work", tmp_path / "tmp"
    work.mkdir(), tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    storages = 'postgresql://bob:S1cret@127.0.0.1:1/x,"postgresql://127.0.0.1:1/x?password=S2cret"'
    multirun = start_cli("-m", "+experiment=train", *TINY, "steps=2", f"study.storage={storages}", cwd=work, env=env)
    crash = start_cli(
        "+experiment=train",
        *TINY,
        "steps=2",
        "model=custom",
        "model._target_=tests.reliability.crashing.Boom",
        "study.storage=postgresql://bob:S3cret@127.0.0.1:1/x",
        "tracking.uri=sqlite:///crash/mlflow.db",
        cwd=work,
        env=env,
    )
    results = [finish(multirun), finish(crash)]
    assert results[0].returncode == 0, results[0].stderr[-2000:]
    assert results[1].returncode == 1 and "Error executing job with overrides" in results[1].stderr
    assert list(work.glob("multirun/*/*/multirun.yaml"))  # Hydra did write its files
    client = MlflowClient(f"sqlite:///{work}/mlruns/mlflow.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert sorted(r.data.params["study.storage"] for r in runs) == [
        "postgresql://127.0.0.1:1/x?password=***",
        "postgresql://bob:***@127.0.0.1:1/x",
    ]
    assert all(r.info.status == "FINISHED" for r in runs)
    for secret in ("S1cret", "S2cret", "S3cret"):
        for res in results:
            assert secret not in res.stdout + res.stderr
        leaks = [name for name, data in _all_bytes(work, tmp) if secret.encode() in data]
        assert not leaks, (secret, leaks)
    assert not [k for k in os.environ if k.startswith("CLIPAMP_SECRET_")]  # only the child processes had them
