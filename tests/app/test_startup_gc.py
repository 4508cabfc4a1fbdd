"""Start-up holds the garbage collector's full collections back until the run's model and optimizer
are built (``sweep.startup``): they used to rescan the imports' objects eight or nine times, 15–20% of
a short run's CPU time; afterwards the collector is as Python set it, start-up's objects frozen."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest

import sweep.startup as startup
from tests.app.helpers import REPO, run_cli_here

RUN = ("+experiment=train", "steps=2", "model=linear", "data=synthetic")  # what bench/bench_startup.py times


@pytest.fixture
def collector():
    """This process's collector as it was, after the test (thresholds, frozen objects, the module's state)."""
    thresholds, frozen, enabled = gc.get_threshold(), gc.get_freeze_count(), gc.isenabled()
    yield
    startup._held.clear()
    startup._deferred[0] = False
    gc.set_threshold(*thresholds)
    if gc.get_freeze_count() > frozen:
        gc.unfreeze()  # back to the oldest generation: collectable again
    (gc.enable if enabled else gc.disable)()


def test_defer_then_resume_restores_the_thresholds_and_freezes_once(collector, monkeypatch):
    freezes, freeze = [], gc.freeze
    monkeypatch.setattr(gc, "freeze", lambda: (freezes.append(gc.get_threshold()), freeze())[1])
    before = gc.get_threshold()
    startup.defer_gc()
    assert gc.isenabled() and gc.get_threshold()[:2] == before[:2]  # young collections as usual
    assert gc.get_threshold()[2] > 10**6  # no full collection
    startup.defer_gc()  # a second call (``clipamp`` then ``cli``) changes nothing
    startup.resume_gc()
    assert gc.get_threshold() == before
    assert len(freezes) == 1 and gc.get_freeze_count() > 0  # frozen while full collections were held back
    startup.resume_gc()  # once per process: a second run's start-up (a study's trial) freezes nothing
    startup.defer_gc()
    assert gc.get_threshold() == before
    startup.resume_gc()
    assert len(freezes) == 1 and gc.get_threshold() == before  # (the frozen count itself drops as objects die)


def test_resume_without_defer_leaves_the_collector_alone(collector):
    """An in-process caller (tests, a notebook) never deferred: its objects are not frozen."""
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    startup.resume_gc()
    assert gc.get_threshold() == before and gc.get_freeze_count() == frozen


def test_defer_leaves_a_disabled_collector_disabled(collector):
    gc.disable()
    before = gc.get_threshold()
    startup.defer_gc()
    startup.resume_gc()
    assert not gc.isenabled() and gc.get_threshold() == before


@pytest.mark.slow  # a real run in this process (model, store, report)
def test_a_run_turns_full_collections_back_on_once_its_optimizer_is_built(collector, tmp_path, capsys, monkeypatch):
    before, frozen = gc.get_threshold(), gc.get_freeze_count()
    startup.defer_gc()
    res = run_cli_here(*RUN, cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    assert res.returncode == 0, res.stderr[-2000:]
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() > frozen


_COUNT_FULL = """
import gc, runpy, sys
full = []
gc.callbacks.append(lambda phase, info: phase == "start" and info["generation"] == 2 and full.append(1))
sys.argv = ["sweep", *sys.argv[1:]]
runpy.run_module("sweep", run_name="__main__", alter_sys=True)
print("FULL", len(full), gc.get_threshold()[2])
"""


@pytest.mark.slow  # a fresh interpreter: start-up as a user's command has it
def test_python_m_sweep_makes_at_most_one_full_collection(tmp_path):
    """Before: 8–9 full collections in this run before it exits (3 in ``import torch`` alone), the last ones scanning
    ~600,000 objects each; now the report's (after the frozen start-up) at most, and the threshold is back."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    out = subprocess.run(
        [sys.executable, "-c", _COUNT_FULL, *RUN],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = [x for x in out.stdout.splitlines() if x.startswith("FULL ")][-1]
    count, threshold = map(int, line.split()[1:])
    assert count <= 1, line
    assert threshold < 10**6  # restored
