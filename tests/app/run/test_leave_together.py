"""Under torchrun the ranks leave the process group together after a run, and a failed rank does not
hold the others back (``Launch.close(together=True)``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.app.run.test_torchrun import ENV

SCRIPT = Path(__file__).with_name("leave_together.py")
ROOT = Path(__file__).resolve().parents[3]


def _torchrun(tmp_path: Path, mode: str) -> tuple[subprocess.CompletedProcess, list[tuple[float, float]]]:
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPT),
            str(tmp_path),
            mode,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    times = [tuple(map(float, (tmp_path / f"rank-{r}.txt").read_text().split())) for r in (0, 1)]
    return res, times


@pytest.mark.slow
def test_a_rank_that_finished_first_waits_for_rank_0_before_leaving(tmp_path):
    res, ((end0, left0), (end1, left1)) = _torchrun(tmp_path, "ok")
    assert res.returncode == 0, res.stderr[-2000:]
    assert end0 - end1 >= 2.5  # rank 0's work ran 3 s longer
    assert left1 >= end0  # rank 1 left the group only after rank 0 had finished


@pytest.mark.slow
def test_a_rank_0_failure_lets_the_other_rank_leave_at_once(tmp_path):
    res, ((end0, _), (_, left1)) = _torchrun(tmp_path, "fail")
    assert res.returncode != 0 and "rank 0 failed in its end-of-run phase" in res.stderr
    assert left1 - end0 < 20  # not the 60 s collective timeout
