"""Issue 12 item 18: the demo and the report CLI refuse bad arguments in one line, exit 2, and keep data."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from clipamp_engine import demo


def _demo(capsys, *argv):
    rc = demo.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_rerun_with_the_same_csv_replaces_it(tmp_path, capsys):
    path = tmp_path / "steps.csv"
    assert _demo(capsys, "--csv", str(path), "--steps", "7")[0] == 0
    first = pd.read_csv(path)
    rc, _, err = _demo(capsys, "--csv", str(path), "--steps", "7")
    assert rc == 0 and err == ""
    again = pd.read_csv(path)
    assert again["step"].tolist() == list(range(1, 8))  # one run's rows, not two runs' appended
    pd.testing.assert_frame_equal(first, again)  # the same seed gives the same run


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "0"], "error: --steps 0 must be >= 1, e.g. --steps 20"),
        (["--max-norm", "-1"], "error: --max-norm -1.0 must be a finite number > 0, e.g. --max-norm 1.0"),
        (["--max-norm", "nan"], "error: --max-norm nan must be a finite number > 0, e.g. --max-norm 1.0"),
        (["--csv", "/proc/nope/steps.csv"], "error: --csv /proc/nope/steps.csv: cannot write there"),
    ],
)
def test_bad_argument_is_one_line_exit_2(capsys, argv, message):
    rc, out, err = _demo(capsys, *argv)
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_csv_that_is_not_a_steps_csv_is_kept(tmp_path, capsys):
    path = tmp_path / "mine.csv"
    path.write_text("a,b\n1,2\n")
    rc, _, err = _demo(capsys, "--csv", str(path))
    assert rc == 2 and err.strip() == f"error: --csv {path} exists and is not a clipamp steps CSV: pass a new path"
    assert path.read_text() == "a,b\n1,2\n"


@pytest.mark.slow  # a `python -m sweep` subprocess: seconds of imports
def test_report_out_into_a_missing_folder(tmp_path, store):
    """The folder is created; an impossible one fails before anything is printed."""
    from mlflow import MlflowClient

    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("clipamp"), run_name="train-gpt-bf16")
    client.log_metric(run.info.run_id, "final_loss", 2.5)
    client.set_terminated(run.info.run_id)
    env_uri = ["--tracking-uri", store]
    out = tmp_path / "reports" / "new" / "table.md"
    p = subprocess.run(
        [sys.executable, "-m", "sweep.report", *env_uri, "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert out.exists() and f"saved {out}" in p.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "sweep.report", *env_uri, "--out", "/proc/nope/table.md"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and bad.stdout == "" and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "error: --out /proc/nope/table.md: cannot create /proc/nope/ (No such file or directory): "
        "pass a path in a writable folder"
    ]
