"""A trial as a torchrun job (``study.nproc_per_trial=N``): launched by the sweep process, read back from MLflow.

The sweep process stays one Optuna worker (ask, tell, heartbeats) and runs each trial as
``torchrun --standalone --nproc_per_node=N -m sweep.experiments.study.trial_job JOB.json``: N ranks
train the trial's exact config (``sweep.distributed.launch``: DDP, or FSDP2 with dist.strategy=fsdp2) and
rank 0 records the child run under the sweep's parent run. The trial's objective is that run's
logged metrics and its steps.csv, never recomputed. This composes with a shared PostgreSQL study:
each worker is an ordinary Optuna worker whose trials are its own torchrun jobs (``--standalone``
gives each job a free port). The sweep process sees no step of the job, so it cannot prune.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import sweep
from sweep.config.convert import as_yaml
from sweep.config.schema import Config
from sweep.errors import UserError
from sweep.run.loop import RunRecords
from sweep.run.pipeline import RunResult, RunSpec
from sweep.run.summary import read_rows
from sweep.secrets import seal
from sweep.tracking.tracker import Store, fetch_artifact


def run_job(cfg: Config, spec: RunSpec, store: Store, nproc: int, beat: Callable[[], None], every: float) -> RunResult:
    """Train ``cfg`` as ``spec`` on ``nproc`` torchrun ranks; ``beat()`` every ``every`` s while it runs.

    Returns the child run's logged metrics and rows; a user mistake in the job raises ``UserError``
    (the sweep stops, as in one process), a failed job ``RuntimeError`` with its one line, Ctrl-C
    ``KeyboardInterrupt`` (the job is stopped first: torchrun forwards SIGTERM to its ranks).
    """
    with tempfile.TemporaryDirectory(prefix="clipamp-trial-") as tmp:
        job, outcome, err_path = Path(tmp) / "job.json", Path(tmp) / "outcome.json", Path(tmp) / "stderr.txt"
        env = _env()
        job.write_text(
            seal(
                json.dumps(
                    {
                        "config": as_yaml(cfg),
                        "name": spec.name,
                        "parent_run_id": spec.parent_run_id,
                        "tags": spec.tags,
                        "store_tags": store.tags,
                        "uri": store.uri,
                        "outcome": str(outcome),
                    }
                ),
                env,
            )
        )  # passwords (tracking.uri, study.storage) go to the job's environment, never to the file
        job.chmod(0o600)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "sweep.experiments.study.trial_job",
            str(job),
        ]
        with err_path.open("w") as err:
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env)
            try:
                while True:
                    try:
                        proc.wait(timeout=every)
                        break
                    except subprocess.TimeoutExpired:
                        beat()  # this worker is alive while its job trains
            except BaseException:
                proc.terminate()
                proc.wait()
                raise
        result = json.loads(outcome.read_text()) if outcome.exists() else None
        tail = " ".join(err_path.read_text().split()[-40:])
    return _result(store, result, proc.returncode, tail)


def _result(store: Store, outcome: dict | None, returncode: int, tail: str) -> RunResult:
    """The job's run as a ``RunResult`` (metrics from MLflow, rows from its steps.csv), or the job's failure."""
    if outcome is None:  # rank 0 died before it could say how the job ended
        raise RuntimeError(f"torchrun job exited {returncode} without an outcome: {tail[-400:]}")
    kind = outcome["kind"]
    if kind == "user":
        raise UserError(outcome["line"])
    if kind == "interrupted":
        raise KeyboardInterrupt(outcome.get("line", "trial job interrupted"))
    if kind != "ok":
        raise RuntimeError(outcome["line"])
    run_id = outcome["run_id"]
    metrics = dict(store.client.get_run(run_id).data.metrics)
    return RunResult(run_id, None, metrics, records=RunRecords(_rows(store, run_id)))


def _rows(store: Store, run_id: str) -> list[dict]:
    """The rows of the run's steps.csv artifact (fetched from any store, without MLflow's progress bar)."""
    with tempfile.TemporaryDirectory(prefix="clipamp-trial-csv-") as tmp:
        return read_rows(fetch_artifact(store.client, run_id, "steps.csv", tmp))


def _env() -> dict[str, str]:
    """This environment, with the ``sweep`` package this process runs importable by the job's ranks."""
    root = str(Path(sweep.__file__).resolve().parents[1])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else "")}
