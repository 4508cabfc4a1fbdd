"""The sweep's terminal table marks a Pareto front only for a study that has one."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from mlflow.entities import Metric
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


def test_a_sigkilled_trial_has_the_steps_its_steps_csv_holds_in_both_tables(store, tmp_path):
    """A worker SIGKILLed at step 77 of a trial: its steps.csv held 77 rows (written as each step ends), but
    the per-step metrics go to the store in batches of 50, and the study table (sweep.report's, and the
    sweep's own from the recovery's ``steps_run``) said 50 steps beside the legend's '77 of 120 steps'."""
    import socket

    from mlflow import MlflowClient

    from clipamp_engine import StepCSVWriter, StepLog
    from sweep.experiments.study.workers import _trial_run
    from sweep.report.cli import sweeps_tables

    client = MlflowClient(store)
    exp = client.create_experiment("clipamp", artifact_location=str(tmp_path / "artifacts"))
    lock = tmp_path / "worker.lock"  # free: its worker is gone
    lock.write_text("")
    parent = client.create_run(
        exp, tags={"sweep_role": "parent", "study": "s", "worker_host": socket.gethostname(), "worker_lock": str(lock)}
    )
    trial = client.create_run(
        exp, tags={"sweep_role": "trial", "study": "s", "trial": "0", "mlflow.parentRunId": parent.info.run_id}
    )
    client.log_batch(trial.info.run_id, metrics=[Metric("loss", 3.0, 0, s) for s in range(1, 51)])
    csv_path = Path(trial.info.artifact_uri) / "steps.csv"
    csv_path.parent.mkdir(parents=True)
    with StepCSVWriter(csv_path) as csv:
        for step in range(1, 78):
            csv.write(
                StepLog(
                    step=step,
                    lr=1e-3,
                    grad_l2_pre_clip=1.0,
                    grad_l2_post_clip=1.0,
                    loss=3.0,
                    scaler_scale=1.0,
                    clipped=False,
                )
            )
    with open(csv_path, "a", encoding="utf-8") as f:
        f.write("78,0.001,1.0")  # the row being written when the SIGKILL came: not a step done
    [(_, df, *_)] = sweeps_tables(client, "clipamp")
    assert df[["state", "steps_run"]].values.tolist() == [["DIED", 77]]
    assert _trial_run(client, exp, parent.info.run_id, 0)["steps_run"] == 77.0
    csv_path.unlink()  # no steps.csv on this disk (a server's run): the store's last step
    assert _trial_run(client, exp, parent.info.run_id, 0)["steps_run"] == 50.0


def test_the_band_is_the_studys_while_a_newer_worker_has_not_logged_its_config(store):
    """A second worker's parent run logs its config only once it holds the study lock (after the first worker's
    anchor window), and one killed while waiting never does. sweep.report took the band from the newest parent:
    'band [0, 1]', no mode, and a pick by eval loss alone (a trial clipping 60% of its steps, outside the
    study's band [1%, 20%]). The table now reads the newest parent that logged its config."""
    from mlflow import MlflowClient

    from sweep.pick import pick_trial
    from sweep.report.cli import sweeps_tables

    client = MlflowClient(store)
    exp = client.create_experiment("clipamp")
    first = client.create_run(exp, tags={"sweep_role": "parent", "study": "s"})
    client.log_param(first.info.run_id, "study.target_clip", "[0.01, 0.2]")
    client.log_param(first.info.run_id, "study.mode", "constrained")
    for number, (eval_loss, clip) in enumerate([(2.4, 0.6), (2.5, 0.05)]):
        run = client.create_run(
            exp,
            tags={
                **{"sweep_role": "trial", "study": "s", "trial": str(number), "outcome": "complete"},
                "sweep_parent": first.info.run_id,
            },
        )
        for key, value in (("eval_loss", eval_loss), ("clip_ratio", clip), ("skip_ratio", 0.0), ("steps_run", 20)):
            client.log_metric(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id)
    client.set_terminated(first.info.run_id)
    client.create_run(exp, tags={"sweep_role": "parent", "study": "s"})  # waiting for the lock: no params yet
    [(_, df, pick, band, mode)] = sweeps_tables(client, "clipamp")
    assert (band, mode) == ((0.01, 0.2), "constrained")
    assert pick.trial == pick_trial(df, (0.01, 0.2)).trial == 1  # in the band, not the lowest eval loss


def _diverged_table() -> pd.DataFrame:
    """Figures of a diverged sweep (optim.lr=30): τ ≈ 1.8e8, training loss ≈ 3e4."""
    df = pd.DataFrame(
        {
            "trial": [0, 1],
            "state": ["COMPLETE", "FAIL"],
            "dtype": ["bf16", "fp16"],
            "max_norm": [185330959.2, 82387129.15],
            "eval_loss": [2180.51, float("nan")],
            "clip_ratio": [0.467, 0.0],
            "skip_ratio": [0.0, 0.967],
            "final_loss": [30063.29, 5.452],
            "steps_run": [30, 30],
        }
    )
    df["pareto"], df["in_band"] = [True, False], [False, False]
    return df


@pytest.mark.parametrize("width", [80, 70])
def test_no_figure_is_cut_to_another_number_on_a_narrow_console(width):
    """On an 80-column console (a pipe, a log file) rich cut τ 1.853e+08 to '1.853e…' and a training
    loss of 3.006e+04 to '3.006…', which reads as 3.006: every figure is printed whole (folded)."""
    console = Console(record=True, width=width)
    console.print(sweep_table(_diverged_table(), None, "Study s"))
    text = console.export_text()
    assert "…" not in text
    body = [line.strip().strip("│").split("│") for line in text.splitlines() if line.startswith("│")]
    columns = ["".join(cells[i].strip() for cells in body) for i in range(len(body[0]))]  # folded cells rejoined
    assert columns[3] == "1.853e+088.239e+07"  # τ
    assert columns[4] == "2181—"  # eval
    assert columns[5:8] == ["46.7%0.0%", "0.0%96.7%", "3.006e+045.452"]  # clip, skip, train


def test_the_sweep_summary_prints_its_table_unwrapped_into_a_log():
    """The sweep's summary printed into a pipe or log file (not a terminal, 80 columns): one line per trial."""
    import io

    from sweep.report.sweep import print_sweep_summary
    from sweep.results.study import SweepResult

    out = io.StringIO()
    result = SweepResult("s", "sqlite:///x.db", "pareto", "r" * 32, _diverged_table(), None, 2, 0, 1, 60, 60, 0, 0, 1)
    print_sweep_summary(result, uri="sqlite:///x.db", experiment_id="1", console=Console(file=out, width=80))
    rows = [line for line in out.getvalue().splitlines() if line.startswith("│")]
    assert len(rows) == 2  # one line per trial
    assert "1.853e+08" in rows[0] and "3.006e+04" in rows[0]
