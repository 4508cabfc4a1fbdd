"""A sweep whose ``mlflow server`` dies (SIGKILL) between trials or during one: the sweep stops (docs/sweeps.md)
with exit status 1, no traceback and one ``error:`` line naming the trial it marked FAIL in the study (none is
left RUNNING) and each folder whose ``pending.json`` keeps what the server did not take, with the
``python -m sweep.resend`` command that sends it; no line says the server answers again."""

from __future__ import annotations

import re
import time
from pathlib import Path

import optuna
import pytest

from tests.app.helpers import TINY
from tests.mlflow_server import MlflowServer
from tests.reliability.helpers import assert_one_line_error, finish, start_cli

pytestmark = pytest.mark.slow  # a real server, a real sweep

ARGS = [
    "+experiment=sweep",
    *TINY,
    "study=pareto",
    "study.n_trials=3",
    "steps=200",
    "calibrate.window=8",
    "optim.warmup_steps=2",
    "tracking.flush_every=10",
    "tracking.reconnect_s=1",
]


def test_a_sweep_stops_with_one_line_when_its_server_dies(tmp_path):
    server = MlflowServer(f"sqlite:///{tmp_path}/server/db.sqlite", tmp_path / "server", artifacts=tmp_path / "art")
    server.start()
    try:
        env = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}  # a refused connection fails at once, not after back-offs
        proc = start_cli(*ARGS, f"tracking.uri={server.uri}", cwd=tmp_path, env=env)
        deadline = time.time() + 300
        for line in proc.stdout:
            assert time.time() < deadline, "trial 0 did not complete"
            if re.match(r"trial +0 COMPLETE", line):
                break
        else:
            raise AssertionError(finish(proc).stderr[-3000:])
        server.kill()
        res = finish(proc)
    finally:
        server.kill()
    line = assert_one_line_error(res, "stopped answering", "so the sweep stops", "marked FAIL", status=1)
    assert "answers again" not in res.stderr, res.stderr[-3000:]
    number = int(re.search(r"trial (\d+) is marked FAIL", line).group(1))
    storage = f"sqlite:///{tmp_path}/mlruns/optuna.db"
    (name,) = optuna.get_all_study_names(storage)
    states = {t.number: t.state for t in optuna.load_study(study_name=name, storage=storage).trials}
    assert states[0] == optuna.trial.TrialState.COMPLETE and states[number] == optuna.trial.TrialState.FAIL, states
    assert optuna.trial.TrialState.RUNNING not in states.values(), states
    kept = re.findall(r"`\S*python -m sweep\.resend (\S+)`", line)  # `.venv/bin/python` when not activated
    assert kept and all((Path(folder) / "pending.json").is_file() for folder in kept), line
