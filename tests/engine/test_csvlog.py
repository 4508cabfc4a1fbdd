"""The canonical per-step CSV: column order, flush per row, survives SIGKILL, appends on reopen."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pandas as pd
import pytest

from clipamp_engine import CANONICAL_COLUMNS, SkipLog, StepCSVWriter, StepLog


def _log(step, **kw):
    base = dict(step=step, lr=1e-3, grad_l2_pre_clip=2.0, grad_l2_post_clip=1.0, loss=0.5,
                scaler_scale=1.0, clipped=True, token_count=100, max_norm=1.0)
    base.update(kw)
    return StepLog(**base)


def test_canonical_columns_first_and_values_roundtrip(tmp_path):
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path, extra_columns=("clipped", "token_count", "max_norm", "data_source")) as w:
        w.write(_log(1).with_extra(data_source="json"))
        w.write(SkipLog(step=2, lr=1e-3, grad_l2_pre_clip=float("inf"), grad_l2_post_clip=float("nan"),
                        loss=0.7, scaler_scale=32768.0, clipped=False, skip_reason="nonfinite_grad"))
    df = pd.read_csv(path)
    assert tuple(df.columns[:8]) == CANONICAL_COLUMNS
    assert df["step"].tolist() == [1, 2]
    assert df["skipped"].tolist() == [False, True]
    assert df["skip_reason"].fillna("").tolist() == ["", "nonfinite_grad"]
    assert df["grad_l2_pre_clip"].iloc[1] == float("inf")
    assert df["data_source"].iloc[0] == "json"


def test_reopen_appends_without_repeating_steps(tmp_path):
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path) as w:
        for s in (1, 2, 3):
            w.write(_log(s))
    with StepCSVWriter(path) as w:
        assert w.last_step == 3
        with pytest.raises(ValueError, match="step 3 is already in"):
            w.write(_log(3))
        w.write(_log(4))
    assert pd.read_csv(path)["step"].tolist() == [1, 2, 3, 4]


def test_reopen_for_resume_drops_rows_after_checkpoint_and_torn_tail(tmp_path):
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path) as w:
        for s in (1, 2, 3, 4):
            w.write(_log(s))
    with open(path, "a") as f:
        f.write("5,0.001,2.0")  # a row torn by SIGKILL
    with StepCSVWriter(path, truncate_after=2) as w:
        w.write(_log(3, loss=0.25))
    df = pd.read_csv(path)
    assert df["step"].tolist() == [1, 2, 3] and df["loss"].iloc[-1] == 0.25


def test_not_a_steps_csv_is_refused(tmp_path):
    path = tmp_path / "other.csv"
    path.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="is not a clipamp steps CSV"):
        StepCSVWriter(path)


def test_sigkill_keeps_every_completed_row(tmp_path):
    path = tmp_path / "steps.csv"
    script = textwrap.dedent(f"""
        import sys
        from clipamp_engine import StepCSVWriter, StepLog
        w = StepCSVWriter({str(path)!r})
        step = 0
        while True:
            step += 1
            w.write(StepLog(step=step, lr=1e-3, grad_l2_pre_clip=float(step), grad_l2_post_clip=1.0,
                            loss=1.0 / step, scaler_scale=1.0, clipped=True))
            if step == 50:
                print("ready", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    lines = path.read_text().split("\n")
    complete = [l for l in lines[1:-1]]  # the text after the last newline may be torn
    steps = [int(l.split(",")[0]) for l in complete]
    assert len(steps) >= 50 and steps == list(range(1, len(steps) + 1))
    for l in complete:
        assert float(l.split(",")[2]) == float(l.split(",")[0])  # every complete row is whole
    with StepCSVWriter(path) as w:  # and the run can go on where it stopped
        w.write(_log(len(steps) + 1))
