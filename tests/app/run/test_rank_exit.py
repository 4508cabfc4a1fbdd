"""A process under torchrun ends as Python would end it, less the teardown (``rank_exit.run_then_leave``).

Each case runs one small program twice in a fresh interpreter: once as plain Python runs it (the
reference), once through ``run_then_leave``. Exit status, stdout and stderr must be the same,
including output still buffered in a pipe, a non-daemon thread that finishes after ``main`` and an
``atexit`` handler, except for the one line a module-level object prints when the interpreter
tears down, which only the reference may print. End to end, the app run in torchrun's environment
ends that way too, and outside torchrun as plain Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pandas as pd
import pytest
from mlflow import MlflowClient

from tests.app.helpers import REPO, TINY, csv_of, repo_pythonpath, store_in

PROGRAM = textwrap.dedent(
    """
    import atexit, sys, threading, time

    class Teardown:
        def __del__(self):
            print("teardown ran")

    KEPT = Teardown()  # freed only when the interpreter tears its modules down

    def late():
        time.sleep(0.3)
        print("thread finished")

    def main():
        atexit.register(lambda: print("atexit ran"))
        threading.Thread(target=late).start()
        print("main ran")  # stdout is a pipe: block-buffered, not yet written
        {ending}

    if sys.argv[1] == "leave":
        from sweep.distributed.rank_exit import run_then_leave
        run_then_leave(main)
    else:
        main()
    """
)

ENDINGS = {
    "return": "return",
    "exit 2": "sys.exit(2)",
    "exit None": "sys.exit(None)",
    "exit message": "sys.exit('bad value: steps=-1')",
    "raise": "raise RuntimeError('injected')",
    "Ctrl-C": "raise KeyboardInterrupt",
}


def _run(ending: str, how: str) -> subprocess.CompletedProcess:
    program = PROGRAM.format(ending=ENDINGS[ending])
    return subprocess.run([sys.executable, "-c", program, how], cwd=REPO, capture_output=True, text=True, timeout=60)


#: Two fresh interpreters per ending: one (an exception) stays in the fast subset, the rest are slow.
@pytest.mark.parametrize("ending", [e if e == "raise" else pytest.param(e, marks=pytest.mark.slow) for e in ENDINGS])
def test_leaving_is_python_s_own_ending_without_the_teardown(ending):
    reference, left = _run(ending, "plain"), _run(ending, "leave")
    assert "teardown ran" in reference.stdout  # the check below can fail: plain Python does tear down
    assert left.returncode == reference.returncode
    assert left.stdout == reference.stdout.replace("teardown ran\n", "")
    assert left.stdout.splitlines() == ["main ran", "thread finished", "atexit ran"]
    # a traceback's last line (the error), or a message; the frames above it differ by run_then_leave's own
    assert left.stderr.splitlines()[-1:] == reference.stderr.splitlines()[-1:]


@pytest.mark.slow  # six fresh interpreters
def test_the_statuses_are_the_ones_python_gives():
    statuses = {ending: _run(ending, "leave").returncode for ending in ENDINGS}
    assert statuses == {"return": 0, "exit 2": 2, "exit None": 0, "exit message": 1, "raise": 1, "Ctrl-C": -2}
    assert "bad value: steps=-1" in _run("exit message", "leave").stderr
    assert "RuntimeError: injected" in _run("raise", "leave").stderr


CLI = textwrap.dedent(
    """
    import sys

    class Teardown:
        def __del__(self):
            print("teardown ran")

    KEPT = Teardown()
    sys.argv = ["clipamp", *sys.argv[1:]]
    from sweep.__main__ import cli

    cli()
    """
)


def _app(tmp_path, torchrun: bool) -> tuple[subprocess.CompletedProcess, pd.DataFrame, dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = repo_pythonpath(env)
    if torchrun:  # torchrun's environment with one process: the app runs as one process
        env.update(TORCHELASTIC_RUN_ID="test", WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
    res = subprocess.run(
        [
            sys.executable,
            "-c",
            CLI,
            "+experiment=calibrate",
            *TINY,
            "steps=8",
            "calibrate.window=4",
            "calibrate.start=0",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    client = MlflowClient(f"sqlite:///{tmp_path}/mlruns/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("clipamp").experiment_id])
    return res, pd.read_csv(csv_of(res.stdout)), {"status": run.info.status, **run.data.metrics}


@pytest.mark.slow
def test_the_app_in_torchrun_s_environment_ends_without_teardown_and_keeps_everything(tmp_path, store_template):
    for folder in ("plain", "torchrun"):
        store_in(tmp_path / folder, store_template)  # the default store, migrated already
    plain, plain_rows, plain_run = _app(tmp_path / "plain", torchrun=False)
    left, rows, run = _app(tmp_path / "torchrun", torchrun=True)
    assert "teardown ran" in plain.stdout and "teardown ran" not in left.stdout
    assert len(rows) == 8
    pd.testing.assert_frame_equal(rows, plain_rows)  # every step, as one process writes them
    assert run == plain_run and run["status"] == "FINISHED"  # every summary metric, and the run ended
