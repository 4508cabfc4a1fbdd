"""``bench/bench_step.py --threads N`` sets torch's thread count, as ``bench_pipeline.py --threads``
does (on a shared CPU, one thread keeps the engine/canonical ratio steady)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--d-model", "16", "--layers", "1", "--heads", "2", "--batch", "2", "--seq", "8"]
TINY += ["--steps", "1", "--rounds", "1"]


@pytest.mark.slow  # runs the benchmark in a subprocess
def test_threads_sets_torchs_thread_count(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="2")
    argv = [sys.executable, "bench/bench_step.py", *TINY, "--threads", "1", "--json", str(tmp_path / "step.json")]
    p = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert ", 1 threads," in p.stdout
    figures = json.loads((tmp_path / "step.json").read_text())
    assert figures["threads"] == 1 and figures["ratio_paired"] > 0
