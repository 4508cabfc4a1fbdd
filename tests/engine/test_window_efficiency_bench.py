"""``bench/bench_window.py`` (the 50- vs 500-step window comparison of issue 13) on synthetic traces
with a known answer: a stationary trace lands within 15% or is called noise; a trace whose norms
triple across the window is called drift."""

from __future__ import annotations

import csv
import importlib.util
import math
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_window", ROOT / "bench" / "bench_window.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trace(path: Path, steps: int, drift: float, seed: int) -> Path:
    """20 warm-up steps (LR rising), a decaying burst, then lognormal(0, 0.3) norms × a linear drift."""
    gen = torch.Generator().manual_seed(seed)
    noise = torch.exp(0.3 * torch.randn(steps, generator=gen, dtype=torch.float64)).tolist()
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "lr", "grad_l2_pre_clip", "skipped"])
        for i in range(steps):
            lr = 1e-3 * min(1.0, (i + 1) / 20)
            burst = 1 + 8 * math.exp(-i / 8)
            w.writerow([i + 1, lr, burst * noise[i] * (1 + drift * i / steps), False])
    return path


def test_stationary_traces_agree_or_are_called_noise_and_drift_is_called_drift(tmp_path, capsys):
    bench = _bench()
    stationary = [_trace(tmp_path / f"s{seed}.csv", 620, 0.0, seed) for seed in range(3)]
    assert bench.main(["--csv", *map(str, stationary), "--short", "50", "200"]) == 0
    out = capsys.readouterr().out
    starts = [int(s) for s in re.findall(r"auto start: step (\d+)", out)]
    assert starts and all(s > 20 for s in starts)  # after the LR warm-up
    misses = out.count("NOT within 15%")
    assert out.count("why: noise") == misses and "why: drift" not in out
    summary = [l for l in out.splitlines() if l.startswith("τ(200) / τ(500) over 3 traces")]
    assert summary and summary[0].endswith("3 of 3 within 15%")
    assert bench.main(["--csv", str(_trace(tmp_path / "d.csv", 620, 2.0, 0)), "--short", "50"]) == 0
    assert "why: drift" in capsys.readouterr().out


def test_the_training_folder_is_removed_unless_kept_and_when_a_run_fails(tmp_path, monkeypatch):
    """Training (faked here: a written trace) happens in a clipamp-window-* temp folder, removed at
    the end, after a failed run too; --keep leaves it and prints where."""
    bench = _bench()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(bench, "train_trace", lambda steps, work, seed: _trace(work / "steps.csv", steps, 0.0, seed))
    assert bench.main(["--steps", "620"]) == 0
    assert list(tmp_path.glob("clipamp-window-*")) == []
    assert bench.main(["--steps", "620", "--keep"]) == 0
    (kept,) = tmp_path.glob("clipamp-window-*")
    assert (kept / "steps.csv").exists()
    kept.rename(tmp_path / "kept")

    def fails(steps, work, seed):
        (work / "mlflow.db").write_text("")
        raise subprocess.CalledProcessError(1, "sweep")

    monkeypatch.setattr(bench, "train_trace", fails)
    with pytest.raises(subprocess.CalledProcessError):
        bench.main([])
    assert list(tmp_path.glob("clipamp-window-*")) == []
