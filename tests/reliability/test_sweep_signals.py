"""SIGINT/SIGTERM anywhere in a sweep, outside a trial's training loop too (recovery, the last trial's
end-of-run phase, the parent's report, the summary): exit 130, one line that says what ended how and
what to do next, the parent run never left RUNNING, and no finished trial lost."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from sweep.commands import python_command
from tests.app.helpers import TINY, store_in
from tests.reliability.helpers import finish, start_cli

pytestmark = pytest.mark.slow  # real sweep processes

TRIALS = 2
ARGS = [
    "+experiment=sweep",
    *TINY,
    "steps=4",
    "optim.warmup_steps=1",
    "study.anchor=null",
    "study.dtypes=[bf16]",
    f"study.n_trials={TRIALS}",
]
RESUME = (  # before: "…, steps.csv keeps every completed step; …", though no run of the sweep had one yet
    "interrupted (SIGTERM): no trial was training: the sweep's parent run ended KILLED; re-run the same command to "
    "resume the study"
)
ALL_ENDED = (
    f"interrupted: every trial this command ran ({TRIALS}) finished and its parent run ended {{}}; "
    f"`{python_command('sweep.report')}` gives the study's pick (re-running the command would add new trials)"
)


def _interrupt(tmp: Path, store_template: Path, phase: str, sig: int):
    """A sweep signalled once while ``phase`` runs: the process's result, the parent run's status, the
    trials' run statuses and the study's trial states."""
    uri = store_in(tmp, store_template)
    marker = tmp / "held"
    env = {"CLIPAMP_TEST_MARKER": str(marker), "CLIPAMP_TEST_TRIALS": str(TRIALS)}
    proc = start_cli(phase, *ARGS, cwd=tmp, env=env, module="tests.reliability.paused_sweep")
    deadline = time.time() + 240
    while not marker.exists():
        assert time.time() < deadline and proc.poll() is None, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.02)
    proc.send_signal(sig)
    res = finish(proc)
    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in runs if r.data.tags.get("sweep_role") == "parent"]
    trials = sorted(r.info.status for r in runs if r.data.tags.get("sweep_role") == "trial")
    storage = f"sqlite:///{tmp}/mlruns/optuna.db"
    (name,) = optuna.get_all_study_names(storage)
    states = [t.state.name for t in optuna.load_study(study_name=name, storage=storage).trials]
    return res, parent.info.status, trials, states


@pytest.mark.parametrize(
    "phase, sig, parent, trials, line",
    [
        ("recovery", signal.SIGTERM, "KILLED", 0, RESUME),  # before: exit -15, the parent RUNNING
        ("last-trial-end", signal.SIGTERM, "KILLED", TRIALS, ALL_ENDED.format("KILLED")),  # before: exit 0
        ("report", signal.SIGTERM, "KILLED", TRIALS, ALL_ENDED.format("KILLED")),  # before: -15, RUNNING
        ("report", signal.SIGINT, "KILLED", TRIALS, ALL_ENDED.format("KILLED")),  # before: "…resume the study"
        ("summary", signal.SIGTERM, "FINISHED", TRIALS, ALL_ENDED.format("FINISHED")),  # before: exit -15
    ],
    ids=["sigterm-recovery", "sigterm-last-trial-end", "sigterm-report", "sigint-report", "sigterm-summary"],
)
def test_a_signal_outside_the_trials_ends_the_sweep_in_one_line(
    tmp_path, store_template, phase, sig, parent, trials, line
):
    res, status, runs, states = _interrupt(tmp_path, store_template, phase, sig)
    assert res.returncode == 130 and "Traceback" not in res.stderr, (res.returncode, res.stderr[-2000:])
    assert [x for x in res.stderr.splitlines() if x.strip()] == [line]
    assert status == parent
    assert runs == ["FINISHED"] * trials  # every trial that ran kept, none left RUNNING
    assert states == ["COMPLETE"] * trials
