"""``python -m sweep.report``: the runs as the store holds them (``mlflow.search_runs``), newest first,
τ used, percentages, ≤ 100 columns (``--wide``: every column), ``--experiment`` and ``--last N``."""

from __future__ import annotations

import re

import pandas as pd
import pytest
from mlflow import MlflowClient

from sweep.report import cli

RUNS = [  # name, clip, τ used, recommended τ, p95, clip ratio, skip ratio, final loss
    ("calibrate-gpt-bf16", "calibrated", "none → 2.458", 2.4581372833, 2.4095283508, 0.05, 0.0, 3.5494772911),
    ("train-gpt-bf16", "fixed", "1", 3.125, 2.75, 0.8125, 0.015625, 3.25),
    ("trial-12-fp16-0.5-with-a-rather-long-name", "fixed", "0.5", 1.5, 1.25, 1.0, 0.125, 4.0),
]


@pytest.fixture
def runs(store):
    """Three finished runs in experiment ``clipamp`` (oldest first) and one in ``other``."""
    client = MlflowClient(store)
    exp = client.create_experiment("clipamp")
    ids = []
    for i, (name, clip, used, tau, p95, clipped, skipped, loss) in enumerate(RUNS):
        run = client.create_run(
            exp,
            run_name=name,
            start_time=1_700_000_000_000 + i * 1000,
            tags={"clip": clip, "dtype": "bf16", "tau_used": used, "model": "gpt"},
        )
        for key, value in {
            "recommended_max_norm": tau,
            "grad_norm_p95": p95,
            "grad_norm_p50": p95 / 2,
            "grad_norm_p99": p95 * 1.5,
            "clip_ratio": clipped,
            "skip_ratio": skipped,
            "final_loss": loss,
        }.items():
            client.log_metric(run.info.run_id, key, value)
        client.set_terminated(run.info.run_id)
        ids.append(run.info.run_id)
    other = client.create_run(client.create_experiment("other"), run_name="elsewhere")
    client.set_terminated(other.info.run_id)
    return store, ids


def _report(capsys, *argv) -> list[str]:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out.splitlines()


def _cells(line: str) -> list[str]:
    return re.split(r"\s{2,}", line.strip())


def test_table_holds_the_stores_values_newest_first_in_100_columns(runs, capsys):
    store, ids = runs
    lines = _report(capsys, "--tracking-uri", store)
    assert _cells(lines[0]) == ["run", "clip", "dtype", "τ used", "τ rec.", "p95", "clipped", "skipped", "loss", "eval"]
    assert max(map(len, lines)) <= 100
    client = MlflowClient(store)
    body = lines[1:]
    assert len(body) == 3
    for line, run_id in zip(body, reversed(ids)):  # newest first
        run = client.get_run(run_id)
        m, t = run.data.metrics, run.data.tags
        cells = _cells(line)
        name = run.info.run_name
        assert name == cells[0] or (cells[0].endswith("…") and name.startswith(cells[0][:-1]))
        assert cells[1:4] == [t["clip"], t["dtype"], t["tau_used"]]
        assert [float(c) for c in cells[4:6]] == pytest.approx(
            [m["recommended_max_norm"], m["grad_norm_p95"]], rel=1e-3
        )
        assert [float(c.rstrip("%")) / 100 for c in cells[6:8]] == pytest.approx(
            [m["clip_ratio"], m["skip_ratio"]], abs=5e-4
        )
        assert float(cells[8]) == pytest.approx(m["final_loss"], rel=1e-3) and cells[9] == "—"  # no eval_loss


def test_wide_last_and_experiment(runs, capsys):
    store, ids = runs
    wide = _report(capsys, "--tracking-uri", store, "--wide", "--last", "2")
    assert len(wide) == 3 and "elsewhere" not in "\n".join(wide)
    header = _cells(wide[0])
    assert header[:3] == ["run", "run_id", "kind"]  # kind: the +experiment it ran; --experiment is MLflow's
    assert {"p50", "p90", "p99", "status", "model"} <= set(header)
    newest = MlflowClient(store).get_run(ids[-1])
    cells = dict(zip(header, _cells(wide[1])))
    assert cells["run"] == newest.info.run_name and cells["run_id"] == ids[-1]  # whole: what resume=, runs:/ take
    assert float(cells["p99"]) == pytest.approx(newest.data.metrics["grad_norm_p99"], rel=1e-3)
    assert cells["status"] == "FINISHED"
    other = _report(capsys, "--tracking-uri", store, "--experiment", "other")
    assert len(other) == 2 and other[1].startswith("elsewhere") and "—" in other[1]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--last", "0"], "error: --last 0 must be >= 1, e.g. --last 10"),
        (["--experiment", "nope"], "error: experiment 'nope' not found in the tracking store"),
    ],
)
def test_bad_filter_is_one_line_exit_2(runs, capsys, argv, message):
    store, _ = runs
    with pytest.raises(SystemExit) as e:
        cli.main(["--tracking-uri", store, *argv])
    err = capsys.readouterr()
    assert e.value.code == 2 and err.out == "" and len(err.err.splitlines()) == 1 and err.err.startswith(message)


def test_out_csv_holds_the_stores_values_and_md_the_table(runs, capsys, tmp_path):
    import pandas as pd

    store, ids = runs
    _report(capsys, "--tracking-uri", store, "--out", str(tmp_path / "runs.csv"))
    saved = pd.read_csv(tmp_path / "runs.csv")
    client = MlflowClient(store)
    for (_, row), run_id in zip(saved.iterrows(), reversed(ids)):
        m = client.get_run(run_id).data.metrics
        assert row["run_id"] == run_id and row["τ rec."] == m["recommended_max_norm"]  # unrounded
        assert (row["p95"], row["clipped"], row["skipped"]) == (m["grad_norm_p95"], m["clip_ratio"], m["skip_ratio"])
    _report(capsys, "--tracking-uri", store, "--out", str(tmp_path / "runs.md"))
    md = (tmp_path / "runs.md").read_text().splitlines()
    assert md[0].startswith("| run | run_id | kind |") and "| 81.2% |" in md[3]  # train-gpt-bf16, newest-but-one


@pytest.mark.parametrize("name", ["RUNS.MD", "runs.Md"])
def test_out_md_in_capitals_is_markdown_too(runs, capsys, tmp_path, name):
    store, _ = runs
    _report(capsys, "--tracking-uri", store, "--out", str(tmp_path / name))
    md = (tmp_path / name).read_text().splitlines()
    assert md[0].startswith("| run | run_id | kind |") and "| 81.2% |" in md[3]  # not the CSV's first line


@pytest.mark.parametrize("before", [None, "sqlite:////elsewhere/mlflow.db"])
def test_reading_runs_leaves_the_tracking_uri_of_later_runs_alone(runs, monkeypatch, before):
    """``mlflow.search_runs`` needs MLflow's global URI, whose setter also exports $MLFLOW_TRACKING_URI:
    after the read, a later run in this process or a child process resolves the store as before."""
    import os

    import mlflow

    from sweep.report.runs import frame
    from sweep.tracking.tracker import resolve_uri

    if before is None:
        monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    else:
        monkeypatch.setenv("MLFLOW_TRACKING_URI", before)
    store, ids = runs
    experiment_id = MlflowClient(store).get_run(ids[0]).info.experiment_id
    assert len(frame(store, experiment_id)) == 3
    assert os.environ.get("MLFLOW_TRACKING_URI") == before
    assert resolve_uri(None) == (before or "sqlite:///mlruns/mlflow.db")
    mlflow.set_tracking_uri(None)  # MLflow's in-process global, for the tests after this one


@pytest.mark.parametrize(
    "params,band",
    [
        ({"study.target_clip": "[0.02, 0.1]"}, (0.02, 0.1)),
        ({"study.target_clip_low": "0.01", "study.target_clip_high": "0.2"}, (0.01, 0.2)),  # older runs' params
        ({}, (0.0, 1.0)),
    ],
)
def test_a_sweeps_band_is_read_from_either_spelling_of_its_params(params, band):
    assert cli.logged_band(params) == band


def test_a_long_tau_history_is_shortened_before_the_run_name():
    """A calibrate run with repeated windows has a long ``τ used``; the name it is found by stays whole
    (it was cut to "ca…")."""
    from sweep.report.runs import text

    cells = pd.DataFrame(
        {
            "run": ["calibrate-gpt-bf16", "train-gpt-bf16"],
            "clip": ["calibrated", "norm"],
            "dtype": ["bf16", "bf16"],
            "τ used": ["none/0.8257–0.9861 → 0.8257–1.634 → 0.9083–1.634", "1"],
            "τ rec.": ["0.8257", "3.125"],
            "p95": ["0.7913", "2.75"],
            "clipped": ["4.2%", "81.2%"],
            "skipped": ["0.0%", "1.6%"],
            "loss": ["2.736", "3.25"],
            "eval": ["2.901", "—"],
        }
    )
    lines = text(cells).splitlines()
    assert max(map(len, lines)) <= 100
    assert [_cells(line)[0] for line in lines[1:]] == ["calibrate-gpt-bf16", "train-gpt-bf16"]
    assert _cells(lines[1])[3] == "none/0.8257–…"  # 12 characters


def test_a_shortened_run_name_keeps_its_unfinished_mark():
    """The ``*`` after an unfinished run's name survives when the name is cut to fit 100 columns."""
    from sweep.report.runs import text

    long = "trial-12-fp16-0.5-with-a-rather-long-name-of-its-own*"
    cells = pd.DataFrame({"run": [long], "clip": ["norm"], "τ used": ["x" * 40], "pad": ["y" * 40]})
    (line,) = text(cells).splitlines()[1:]
    assert len(line) == 100 and _cells(line)[0] == "trial-12-fp16-0.5-with-a-rather-long…*"  # the mark kept


def test_a_reading_tool_piped_into_head_ends_quietly():
    """``python -m sweep.report | head -3``: the rest of the table went to a closed pipe, and the tool ended with
    a ``BrokenPipeError`` traceback (then "Exception ignored … BrokenPipeError" from the exit's flush)."""
    import subprocess
    import sys

    tool = (
        "from sweep.startup import exit_interruptible\n"
        "def main():\n"
        "    for i in range(100_000):\n"
        "        print('run', i)\n"
        "    return 0\n"
        "exit_interruptible(main, 'interrupted')\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", tool], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "run 0\n"
    proc.stdout.close()  # as head does after its lines
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == ""
