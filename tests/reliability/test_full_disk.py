"""Issue 12 item 13 (rest): the disk fills up mid-run.

A real full disk: ``mlruns/`` (store, artifacts, checkpoints) on a 3 MiB tmpfs the run fills with
its CSV rows, metrics and checkpoints, so every writer meets ENOSPC as it would on a full volume.
Outcome: one ``error:`` line naming what could not be written and the fix, exit 2, no traceback, the
run KILLED (resumable), the CSV rows on disk intact; once space is freed, ``resume=true`` finishes
the run with every step exactly once."""

from __future__ import annotations

import contextlib
import csv
import shutil
import subprocess

import pytest
from mlflow import MlflowClient

from tests.app.helpers import TINY
from tests.reliability.helpers import assert_one_line_error, finish, small_tmpfs, start_cli

STEPS = 1000
RUN = [
    "+experiment=train",
    *TINY,
    f"steps={STEPS}",
    "checkpoint_every=50",
    "optim.schedule=constant",
    "optim.warmup_steps=2",
    "tracking.flush_every=10",
]


@pytest.mark.slow
def test_a_full_disk_stops_the_run_resumable_in_one_line(tmp_path, store_template):
    mlruns = tmp_path / "mlruns"
    mlruns.mkdir()
    with small_tmpfs(mlruns, "size=3m", "for a small file system to fill"):
        shutil.copyfile(store_template, mlruns / "mlflow.db")
        res = finish(start_cli(*RUN, cwd=tmp_path))
        line = assert_one_line_error(
            res, "no space left on the device while writing", "free space there and resume with resume=true"
        )
        client = MlflowClient(f"sqlite:///{mlruns}/mlflow.db")
        (run,) = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
        assert run.info.status == "KILLED", line
        run_id = run.info.run_id
        csv_path = next(mlruns.rglob(f"{run_id}/artifacts/steps.csv"))
        with open(csv_path, newline="") as f:
            rows = list(csv.DictReader(f))
        whole = [r for r in rows if r["scaler_scale"] not in ("", None)]  # a torn last line, if any
        assert len(rows) - len(whole) <= 1 and 50 <= len(whole) < STEPS
        assert [int(r["step"]) for r in whole] == list(range(1, len(whole) + 1))
        assert (mlruns / "checkpoints" / run_id / "checkpoint.pt").exists()
        assert not list(mlruns.rglob("*.tmp")) and not list(mlruns.rglob("space.reserve"))

        subprocess.run(["mount", "-o", "remount,size=64m", str(mlruns)], check=True)  # space freed
        res = finish(start_cli(*RUN, "resume=true", cwd=tmp_path))
        assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-2000:]
        assert client.get_run(run_id).info.status == "FINISHED"
        with open(csv_path, newline="") as f:
            assert [int(r["step"]) for r in csv.DictReader(f)] == list(range(1, STEPS + 1))
        history = [m.step for m in client.get_metric_history(run_id, "loss")]
        assert len(history) == len(set(history))  # no step's metric sent twice


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, key",
    [
        (["hydra.run.dir=outputs/run"], "hydra.run.dir=outputs/run"),
        (["-m", "hydra.sweep.dir=outputs/multi"], "hydra.sweep.dir=outputs/multi"),
        (["-m"], "hydra.sweep.dir=multirun"),  # Hydra's default multirun/DATE/TIME, in a full working folder
    ],
)
def test_a_full_disk_under_hydras_folder_is_one_line_before_anything_runs(tmp_path, args, key):
    """Hydra writes its .hydra/ files before the job: on a full disk that was its OSError traceback, exit 1."""
    outputs = tmp_path / "outputs"
    outputs.mkdir()
    with small_tmpfs(outputs, "size=1m", "for a small file system to fill"):
        with open(outputs / "fill", "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
        cwd = outputs if key.endswith("=multirun") else tmp_path
        res = finish(
            start_cli(*args, "+experiment=train", *TINY, "steps=2", f"tracking.uri=sqlite:///{tmp_path}/m.db", cwd=cwd)
        )
        assert_one_line_error(
            res, key, "no space left on the device", f"free space there or pass another {key.split('=')[0]}"
        )
        assert sorted(p.name for p in outputs.iterdir()) == ["fill"]
        assert not (tmp_path / "m.db").exists()  # refused before any run started
