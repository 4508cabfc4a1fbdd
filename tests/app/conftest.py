"""Shared fixtures: a temporary MLflow store (helpers for configs and the CLI are in helpers.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def store_template(tmp_path_factory) -> Path:
    """An empty, migrated MLflow sqlite store, made once: migrations cost seconds per new store."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def store(tmp_path, store_template, monkeypatch):
    """A fresh sqlite store at tmp_path/mlruns/mlflow.db (the default location for cwd=tmp_path); its URI."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    db = tmp_path / "mlruns" / "mlflow.db"
    db.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(store_template, db)
    return f"sqlite:///{db}"
