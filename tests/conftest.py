"""Fixtures shared by the app and reliability suites: a temporary MLflow store, the SIGTERM handler kept, a
dead pid (see helpers.py for the rest); modules ``-m`` leaves nothing to run in are not imported."""

from __future__ import annotations

import gc
import os

# One torch intra-op thread for the suite and every process it starts (the CLI, torchrun's ranks), unless
# the caller set OMP_NUM_THREADS: its models are tiny, and with two pytest workers and their children on
# two cores, threads spinning at their barriers burn most of the CPU. Set before torch is first imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.helpers import store_in
from tests.marks import can_select, module_marks
from tests.schedule import slow_first


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Skip importing a test module whose module-level marks ``-m`` rules out for all its tests (``-m "not
    slow"`` and ``pytestmark = pytest.mark.slow``): its imports are a worker's seconds, each worker collects
    every module, and none of its tests would run."""
    markexpr = config.option.markexpr
    if markexpr and collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        marks = module_marks(collection_path)
        if marks and not can_select(markexpr, marks):
            return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Files with the most slow tests first (``tests/schedule.py``: the order ``scripts/test``'s workers take
    them in)."""
    items[:] = slow_first(items)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left alive (the imports of every test module: torch, transformers, Hydra, …):
    the garbage collector's full collections, which the tests' allocations and the libraries' own
    ``gc.collect()`` calls start (accelerate's after each ``Trainer.train``), skip those objects instead of
    rescanning them each time. Objects the tests create stay collectable."""
    gc.freeze()


@pytest.fixture(scope="session")
def store_template(tmp_path_factory) -> Path:
    """An empty, migrated MLflow sqlite store, made once per test session (shared by its pytest-xdist
    workers, under a lock: two processes migrating one new store race): migrations cost seconds per store."""
    from filelock import FileLock
    from mlflow import MlflowClient

    folder = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = folder.parent  # the session's folder, above each worker's own
    db = folder / "store-template" / "mlflow.db"
    db.parent.mkdir(exist_ok=True)
    with FileLock(db.with_suffix(".lock")):
        if not db.exists():
            fresh = db.with_suffix(".new")
            MlflowClient(f"sqlite:///{fresh}").search_experiments()
            os.replace(fresh, db)
    return db


@pytest.fixture
def store(tmp_path, store_template, monkeypatch):
    """A fresh sqlite store at tmp_path/mlruns/mlflow.db (the default location for cwd=tmp_path); its URI."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    return store_in(tmp_path, store_template)


@pytest.fixture
def sigterm_restored():
    """The SIGTERM handler as it was before the test (the run installs its own)."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid
