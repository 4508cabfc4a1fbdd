"""The sweep's terminal table marks a Pareto front only for a study that has one."""

from __future__ import annotations

import pandas as pd
import pytest
from rich.console import Console

from sweep.report.sweep import sweep_table


@pytest.mark.parametrize("pareto", [True, False])
def test_the_pareto_mark_and_legend_belong_to_two_objective_studies(pareto):
    df = pd.DataFrame(
        {"trial": [0, 1], "state": ["COMPLETE", "COMPLETE"], "eval_loss": [2.5, 2.6], "clip_ratio": [0.03, 0.3]}
    )
    df["pareto"], df["in_band"] = [True, True], [True, False]
    console = Console(record=True, width=200)
    console.print(sweep_table(df, None, "Study s", pareto=pareto))
    text = console.export_text()
    rows = [line for line in text.splitlines() if line.strip().startswith(("│ 0", "│ 1"))]
    marks = [[cell.strip() for cell in line.strip().strip("│").split("│")][-1] for line in rows]
    assert marks == (["PB", "P"] if pareto else ["B", ""])
    assert ("P Pareto front" in text) is pareto


def test_a_trial_a_signal_stopped_is_killed_with_the_steps_it_ran(store):
    """Ctrl-C during a trial ends its child run KILLED before any outcome or summary: the table said
    'failed' and 'steps 0' for a trial that had run 11 steps."""
    from mlflow import MlflowClient

    from sweep.report.cli import sweeps_tables

    client = MlflowClient(store)
    exp = client.create_experiment("clipamp")
    done = client.create_run(exp, tags={"sweep_role": "trial", "study": "s", "trial": "0", "outcome": "complete"})
    client.log_metric(done.info.run_id, "steps_run", 20)
    client.set_terminated(done.info.run_id)
    killed = client.create_run(exp, tags={"sweep_role": "trial", "study": "s", "trial": "1"})
    for step in range(1, 12):
        client.log_metric(killed.info.run_id, "loss", 3.0, step=step)
    client.set_terminated(killed.info.run_id, status="KILLED")
    failed = client.create_run(exp, tags={"sweep_role": "trial", "study": "s", "trial": "2"})
    client.set_terminated(failed.info.run_id, status="FAILED")
    [(name, df, *_)] = sweeps_tables(client, "clipamp")
    assert name == "s"
    assert df[["state", "steps_run"]].values.tolist() == [["COMPLETE", 20], ["KILLED", 11], ["FAIL", 0]]


def test_a_running_or_died_trial_has_the_steps_of_its_loss_history(store, tmp_path):
    """A trial whose worker died (its lock free on this host) or that is still running has no summary:
    the table said 'steps 0' for a died trial whose loss history had 750 steps."""
    import socket

    from mlflow import MlflowClient

    from sweep.report.cli import sweeps_tables

    client = MlflowClient(store)
    exp = client.create_experiment("clipamp")
    lock = tmp_path / "worker.lock"
    lock.write_text("")
    dead = client.create_run(
        exp,
        tags={"sweep_role": "parent", "study": "s", "worker_host": socket.gethostname(), "worker_lock": str(lock)},
    )
    alive = client.create_run(exp, tags={"sweep_role": "parent", "study": "s"})
    for number, parent, steps in ((0, dead, 17), (1, alive, 9)):
        run = client.create_run(
            exp, tags={"sweep_role": "trial", "study": "s", "trial": str(number), "sweep_parent": parent.info.run_id}
        )
        for step in range(1, steps + 1):
            client.log_metric(run.info.run_id, "loss", 3.0, step=step)
    [(_, df, *_)] = sweeps_tables(client, "clipamp")
    assert df[["state", "steps_run"]].values.tolist() == [["DIED", 17], ["RUNNING", 9]]
