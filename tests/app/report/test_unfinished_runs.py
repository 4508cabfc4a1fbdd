"""``python -m sweep.report`` on runs that did not finish (a signal, SIGKILL, pruning, a calibration window
that never closed): the figures their steps.csv supports, checked against numpy over its rows, the run
marked, and a legend line that says how it stands. Before, every figure of such a run was —."""

from __future__ import annotations

import contextlib
import csv
import io
import re
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from clipamp_engine.records import CANONICAL_COLUMNS
from sweep.report import cli
from sweep.run.checkpoint import checkpoint_path
from sweep.run.loop import APP_COLUMNS
from tests.app.helpers import store_in

STEPS = 40
MARK, OPEN = "*", "open"  # after an unfinished run's name; where its window never closed


def _rows(seed: int, phases: list[str], max_norm: float | None = 1.0) -> list[dict]:
    """Steps as a run writes them: lognormal norms, two fp16 overflows (skipped, inf), clipped above τ."""
    rng = np.random.default_rng(seed)
    rows = []
    for i, phase in enumerate(phases, 1):
        norm, skipped = float(rng.lognormal(0.0, 0.5)), i in (4, 9)
        tau = max_norm if phase in ("train", "validate") else None
        pre = float("inf") if skipped else norm
        clipped = not skipped and tau is not None and pre > tau
        rows.append(
            {
                "step": i,
                "lr": 1e-3,
                "grad_l2_pre_clip": pre,
                "grad_l2_post_clip": min(pre, tau) if clipped else pre,
                "loss": float(5 - i / 20 + rng.normal(0, 0.1)),
                "skipped": skipped,
                "skip_reason": "non_finite_grad" if skipped else "",
                "scaler_scale": 1024.0,
                "clipped": clipped,
                "token_count": 128,
                "max_norm": "" if tau is None else tau,
                "phase": phase,
                "data_source": "x",
                "grad_l2_token_normalised": "",
                "scaler_at_floor": False,
            }
        )
    return rows


def _run(client, exp, name, status, rows, tags=None, params=None, metrics=None) -> str:
    run = client.create_run(exp, run_name=name, tags={"clip": "norm", "dtype": "fp16", **(tags or {})})
    run_id = run.info.run_id
    for k, v in {"steps": STEPS, "calibrate.quantile": 0.9, "calibrate.window": 20, **(params or {})}.items():
        client.log_param(run_id, k, v)
    for k, v in (metrics or {}).items():
        client.log_metric(run_id, k, v[0], step=v[1]) if isinstance(v, tuple) else client.log_metric(run_id, k, v)
    folder = Path(run.info.artifact_uri.removeprefix("file://"))
    folder.mkdir(parents=True)
    with open(folder / "steps.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(CANONICAL_COLUMNS) + list(APP_COLUMNS))
        w.writeheader()
        w.writerows(rows)
        f.write("41,0.001,1.2")  # a row cut by SIGKILL: no figure counts it
    if status != "RUNNING":
        client.set_terminated(run_id, status=status)
    return run_id


def _expected(rows: list[dict], q: float, after: int = 0) -> dict[str, float]:
    """numpy over the rows: quantiles of the taken steps' finite norms, ratios, loss of the last 10 taken."""
    taken = [r for r in rows if not r["skipped"]]
    norms = np.array([r["grad_l2_pre_clip"] for r in taken])
    p50, p95, p99, tau = np.quantile(norms, [0.5, 0.95, 0.99, q])
    return {
        "p50": p50,
        "p95": p95,
        "p99": p99,
        "τ rec.": tau,
        "clipped": np.mean([r["clipped"] for r in taken if r["step"] > after]),
        "skipped": np.mean([r["skipped"] for r in rows]),
        "loss": np.mean([r["loss"] for r in taken][-10:]),
    }


def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


@pytest.fixture(scope="module")
def report(store_template, tmp_path_factory):
    """The runs, and ``sweep.report --wide``'s table as {run name: {column: cell}} and its legend lines (once
    for the module: the checks below read the same report)."""
    tmp_path = tmp_path_factory.mktemp("unfinished")
    store = store_in(tmp_path, store_template)
    client = MlflowClient(store)
    exp = client.create_experiment("clipamp", artifact_location=str(tmp_path / "artifacts"))
    train = _rows(0, ["train"] * 30)
    killed = _run(client, exp, "train-killed", "KILLED", train, {"run": "train"})
    checkpoint_path(store, killed).parent.mkdir(parents=True)
    checkpoint_path(store, killed).touch()  # its SIGTERM checkpoint: resumable
    gone = _run(client, exp, "train-sigkilled", "RUNNING", _rows(1, ["train"] * 12), {"run": "train"})
    lock = checkpoint_path(store, gone).with_name("run.lock")
    lock.parent.mkdir(parents=True)
    lock.touch()  # held while it trained; free: the process is gone
    pruned = _rows(2, ["train"] * 6, max_norm=0.5)
    stored = {"clip_ratio": 1.0, "skip_ratio": 1 / 6, "final_loss": 4.0}  # what the pruned trial's run holds
    tags = {"run": "sweep", "pruned": "true", "pruned_by": "clipping ratio 4/4: ends above the band"}
    _run(client, exp, "trial-3-fp16-0.5", "KILLED", pruned, {**tags, "tau_used": "0.5"}, metrics=stored)
    window = _rows(3, ["settle"] * 5 + ["calibrate"] * 9)
    _run(client, exp, "calibrate-open", "KILLED", window, {"run": "calibrate", "clip": "calibrated"})
    closed = _rows(4, ["calibrate"] * 20 + ["validate"] * 10, max_norm=1.3)
    first = {"window_recommended_max_norm": 1.3, "window_p50": 1.0, "window_p90": 1.8, "window_p95": 1.9}
    metrics = {k: (v, 20) for k, v in (first | {"window_p99": 1.98}).items()}  # logged as the window closed
    tags = {"run": "calibrate", "clip": "calibrated"}
    calibrated = _run(client, exp, "calibrate-closed", "KILLED", closed, tags, metrics=metrics)
    client.log_metric(calibrated, "window_p95", 1.25, step=30)  # a later window's: not the run's figure
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["--tracking-uri", store, "--wide"]) == 0
    lines = out.getvalue().splitlines()
    head = _cells(lines[0])
    table = {c[0]: dict(zip(head, c)) for c in map(_cells, lines[1:6])}
    rows = {"killed": train, "pruned": pruned, "window": window, "closed": closed}
    return table, lines[6:], rows, killed, store


def _number(cell: str) -> float:
    return float(cell[:-1]) / 100 if cell.endswith("%") else float(cell)


def test_a_killed_run_shows_what_its_steps_support(report):
    table, legend, rows, killed, _ = report
    cells = table[f"train-killed{MARK}"]
    expected = _expected(rows["killed"], 0.9)
    assert {k: _number(cells[k]) for k in expected} == pytest.approx(expected, rel=5e-4, abs=5e-4)
    assert cells["τ used"] == "1" and cells["status"] == "KILLED"
    assert legend[0].startswith(f"{MARK} not finished: figures over the steps its steps.csv holds so far")
    assert (
        f"  train-killed {killed[:8]}: KILLED after 30 of {STEPS} steps; resumable: its command plus resume={killed}"
        in legend
    )


def test_a_run_killed_by_sigkill_is_running_with_its_lock_free(report):
    table, legend, *_ = report
    assert table[f"train-sigkilled{MARK}"]["status"] == "RUNNING"
    line = next(x for x in legend if "train-sigkilled" in x)
    assert "RUNNING in the store, but its process is gone" in line and f"12 of {STEPS} steps" in line
    assert "resumable" not in line  # no checkpoint was written


def test_a_pruned_trial_gets_its_quantiles_and_keeps_its_stored_ratios(report):
    table, legend, rows, *_ = report
    cells = table[f"trial-3-fp16-0.5{MARK}"]
    expected = _expected(rows["pruned"], 0.9)
    assert _number(cells["p95"]) == pytest.approx(expected["p95"], rel=5e-4)
    assert _number(cells["τ rec."]) == pytest.approx(expected["τ rec."], rel=5e-4)
    assert (cells["clipped"], cells["loss"]) == ("100.0%", "4")  # the run's own figures win
    assert any("trial-3-fp16-0.5" in x and "pruned after 6 of 40 steps (clipping ratio 4/4" in x for x in legend)


def test_an_open_calibration_window_says_open_not_a_quantile_of_part_of_it(report):
    table, legend, rows, *_ = report
    cells = table[f"calibrate-open{MARK}"]
    assert [cells[k] for k in ("τ rec.", "p50", "p95", "p99", "clipped")] == [OPEN] * 4 + ["—"]
    assert cells["τ used"] == "none"
    assert _number(cells["skipped"]) == pytest.approx(2 / 14, abs=5e-4)  # steps 4 and 9
    assert any(
        "calibrate-open" in x and f"window never closed: τ rec. and the quantiles are {OPEN}" in x for x in legend
    )


def test_a_closed_window_gives_the_first_windows_logged_figures(report):
    table, _, rows, *_ = report
    cells = table[f"calibrate-closed{MARK}"]
    assert [cells[k] for k in ("τ rec.", "p50", "p90", "p95", "p99")] == ["1.3", "1", "1.8", "1.9", "1.98"]
    after = [r for r in rows["closed"] if r["step"] > 20 and not r["skipped"]]
    assert _number(cells["clipped"]) == pytest.approx(np.mean([r["clipped"] for r in after]), abs=5e-4)
    assert cells["τ used"] == "none → 1.3"


def test_the_experiments_note_in_the_mlflow_ui_shows_them_as_sweep_report_does(report):
    """The experiment's description holds "the table sweep.report prints" (docs/tracking.md): the same cells."""
    from sweep.report.notes import TABLE_ROWS, experiment_note
    from sweep.report.runs import frame
    from sweep.report.unfinished import fill

    table, *_, store = report
    client = MlflowClient(store)
    runs = frame(store, client.get_experiment_by_name("clipamp").experiment_id)
    note = experiment_note(runs, fill(runs.head(TABLE_ROWS), store, client))
    row = next(line for line in note.splitlines() if line.startswith(f"| train-killed{MARK} |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4:9] == [table[f"train-killed{MARK}"][k] for k in ("τ rec.", "p95", "clipped", "skipped", "loss")]
    assert "\\* not finished: figures over the steps its steps.csv holds so far" in note


def test_a_runs_end_reads_only_the_steps_csv_files_on_this_disk(tmp_path):
    """The experiment note each run's end writes fills unfinished runs from local files only: a tracking
    server's run with no copy in mlruns/uploads/ is left as stored, not downloaded (``sweep.report``
    downloads it)."""
    import pandas as pd

    from sweep.report.unfinished import steps_csv

    class Server:
        def __init__(self, csv: Path) -> None:
            self.csv, self.asked = csv, []

        def download_artifacts(self, run_id, path, dst):
            self.asked.append(run_id)
            return str(self.csv)

    served = tmp_path / "served.csv"
    served.write_text("step\n1\n")
    server = Server(served)
    run = pd.Series({"run_id": "0" * 32, "artifact_uri": "mlflow-artifacts:/1/" + "0" * 32 + "/artifacts"})
    assert steps_csv(run, str(tmp_path), server, download=False) is None and server.asked == []
    assert steps_csv(run, str(tmp_path), server) == served and server.asked == [run["run_id"]]
