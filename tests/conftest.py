"""Fixtures shared by the app and reliability suites: a temporary MLflow store (see helpers.py for the rest)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.app.helpers import store_in


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
    return store_in(tmp_path, store_template)
