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
    base = dict(
        step=step,
        lr=1e-3,
        grad_l2_pre_clip=2.0,
        grad_l2_post_clip=1.0,
        loss=0.5,
        scaler_scale=1.0,
        clipped=True,
        token_count=100,
        max_norm=1.0,
    )
    base.update(kw)
    return StepLog(**base)


def test_canonical_columns_first_and_values_roundtrip(tmp_path):
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path, extra_columns=("clipped", "token_count", "max_norm", "data_source")) as w:
        w.write(_log(1).with_extra(data_source="json"))
        w.write(
            SkipLog(
                step=2,
                lr=1e-3,
                grad_l2_pre_clip=float("inf"),
                grad_l2_post_clip=float("nan"),
                loss=0.7,
                scaler_scale=32768.0,
                clipped=False,
                skip_reason="nonfinite_grad",
            )
        )
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
    with StepCSVWriter(path, mode="resume") as w:
        assert w.last_step == 3
        with pytest.raises(ValueError, match="step 3 is already in"):
            w.write(_log(3))
        w.write(_log(4))
    assert pd.read_csv(path)["step"].tolist() == [1, 2, 3, 4]


def test_a_refused_resume_names_the_fix_that_keeps_the_rows_before_the_checkpoint(tmp_path):
    """A run resumed from a checkpoint at step 3 while rows 4–5 were written: the refusal names
    truncate_after=3, and following it keeps steps 1–3 (mode='overwrite' would lose them)."""
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path) as w:
        for s in range(1, 6):
            w.write(_log(s))
    before = path.read_bytes()
    with StepCSVWriter(path, mode="resume") as w, pytest.raises(ValueError) as refused:
        w.write(_log(4))
    assert path.read_bytes() == before
    message = str(refused.value)
    assert message.endswith(
        "resuming from a checkpoint at step 3, pass truncate_after=3 to drop the rows after it "
        "(mode='overwrite' replaces the whole file)"
    )
    with StepCSVWriter(path, truncate_after=int(message.split("truncate_after=")[1].split()[0])) as w:
        w.write(_log(4, loss=0.25))
    df = pd.read_csv(path)
    assert df["step"].tolist() == [1, 2, 3, 4] and df["loss"].iloc[-1] == 0.25


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


@pytest.mark.slow  # a subprocess killed mid-write
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
    with StepCSVWriter(path, mode="resume") as w:  # and the run can go on where it stopped
        w.write(_log(len(steps) + 1))


def test_a_row_with_new_columns_widens_the_header_and_keeps_earlier_rows(tmp_path):
    """A skipped first step has no update columns; the next row brings them: the header grows once,
    the earlier row's new fields are empty, a quoted newline survives the rewrite, and a reopened
    file keeps the widened header."""
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path, extra_columns=("clipped", "data_source")) as w:
        w.write(
            SkipLog(
                step=1,
                lr=1e-3,
                grad_l2_pre_clip=float("inf"),
                grad_l2_post_clip=float("nan"),
                loss=0.7,
                scaler_scale=65536.0,
                clipped=False,
                skip_reason="nonfinite_grad",
            ).with_extra(data_source="file\nwith newline")
        )
        w.write(_log(2).with_extra(data_source="b", update_l2_pre_clip=0.25, update_l2_post_clip=0.125))
        w.write(_log(3).with_extra(data_source="c", update_l2_pre_clip=0.5, update_l2_post_clip=0.25))
    assert not list(tmp_path.glob("*.widen"))
    df = pd.read_csv(path)
    assert list(df.columns) == [
        *CANONICAL_COLUMNS,
        "clipped",
        "data_source",
        "token_count",
        "max_norm",
        "update_l2_pre_clip",
        "update_l2_post_clip",
    ]
    assert df["step"].tolist() == [1, 2, 3] and df["data_source"].tolist() == ["file\nwith newline", "b", "c"]
    assert df["update_l2_pre_clip"].isna().tolist() == [True, False, False]
    assert df["update_l2_post_clip"].tolist()[1:] == [0.125, 0.25]
    with StepCSVWriter(path, mode="resume") as w:
        assert w.columns == list(df.columns)
        w.write(_log(4).with_extra(update_l2_pre_clip=1.0, update_l2_post_clip=0.5))
    assert pd.read_csv(path)["update_l2_pre_clip"].tolist()[1:] == [0.25, 0.5, 1.0]


#: Options for each clip mode that adds record columns (the test below checks this is all of them).
_MODES_WITH_COLUMNS = {"update": {"max_update_norm": 1e-3}, "dpsgd": {"max_norm": 0.5, "noise_multiplier": 0.0}}


def test_the_modes_with_columns_are_all_tested():
    from clipamp_engine.clip.registry import CLIP_MODES

    assert {m for m, cls in CLIP_MODES.items() if cls.columns} == set(_MODES_WITH_COLUMNS)


@pytest.mark.parametrize("mode", sorted(_MODES_WITH_COLUMNS))
def test_every_clip_modes_columns_reach_the_default_writer(tmp_path, mode):
    """The README's loop (``StepCSVWriter("steps.csv")``, no columns listed) with a mode that adds
    its own record columns: every step written, the mode's columns equal the engine's records."""
    import torch

    from clipamp_engine import AmpTrainState
    from clipamp_engine.clip import make_clip_policy

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = AmpTrainState(
        model, opt, torch.nn.functional.mse_loss, dtype="fp32", clip=make_clip_policy(mode, **_MODES_WITH_COLUMNS[mode])
    )
    logs = []
    with StepCSVWriter(tmp_path / "steps.csv") as w:
        for _ in range(3):
            logs.append(state.step(torch.randn(16, 8), torch.randn(16, 4)))
            w.write(logs[-1])
    df = pd.read_csv(tmp_path / "steps.csv")
    mode_columns = state.clip.columns
    assert mode_columns and set(mode_columns) <= set(df.columns)
    for c in mode_columns:
        assert df[c].tolist() == pytest.approx([log.row()[c] for log in logs])


def test_a_tail_torn_inside_a_quoted_field_is_dropped_and_a_bad_middle_row_is_refused(tmp_path):
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path, extra_columns=("data_source",)) as w:
        for step in (1, 2):
            w.write(_log(step).with_extra(data_source=f"a\nb{step}"))
    whole = path.read_bytes()
    path.write_bytes(whole + b'3,0.001,2.0,1.0,0.5,False,,1.0,"torn\n')  # killed inside step 3's quoted field
    with StepCSVWriter(path, mode="resume") as w:
        assert w.last_step == 2
    assert path.read_bytes() == whole
    lines = whole.decode().split("\n")
    path.write_text("\n".join([lines[0], "1,0.001", *lines[3:]]))  # a hand-cut row before step 2
    with pytest.raises(ValueError, match="data row 1 has 2 fields, the header 12; fix or remove that row"):
        StepCSVWriter(path, mode="resume")


def test_a_repeated_extra_column_is_one_column(tmp_path):
    """``extra_columns=("clipped", "clipped")`` wrote a header ``clipped,clipped`` that pandas reads as
    ``clipped, clipped.1``."""
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path, extra_columns=("clipped", "max_norm", "clipped")) as w:
        w.write(_log(1))
    assert list(pd.read_csv(path).columns)[8:] == ["clipped", "max_norm", "token_count"]  # the row widens it


def test_a_row_without_a_step_is_named_and_changes_nothing(tmp_path):
    """A mapping without ``step`` raised a bare ``KeyError: 'step'``."""
    path = tmp_path / "steps.csv"
    with StepCSVWriter(path) as w:
        w.write(_log(1))
        before = path.read_bytes()
        with pytest.raises(ValueError, match=r"^a row without a step: got columns loss, lr; write a StepLog"):
            w.write({"loss": 0.5, "lr": 1e-3})
        assert path.read_bytes() == before
        w.write(_log(2))
    assert pd.read_csv(path)["step"].tolist() == [1, 2]


def test_numpy_scalars_and_one_element_tensors_are_written_as_numbers(tmp_path):
    """A mapping row (or a forensics column) holding ``np.float64(0.1)`` or ``torch.tensor(0.25)`` was written as
    their repr, ``np.float64(0.1)`` and ``tensor(0.2500)``: no number for any CSV reader, and rounded to 4 digits."""
    import numpy as np
    import torch

    path = tmp_path / "steps.csv"
    third = float(torch.tensor(1 / 3, dtype=torch.float32))
    with StepCSVWriter(path) as w:
        w.write({"step": np.int64(1), "lr": np.float64(0.1), "loss": torch.tensor(1 / 3), "val": np.float32(1.5)})
        w.write(_log(2).with_extra(val=torch.tensor([2.5], dtype=torch.float64), flag=np.bool_(True)))
    df = pd.read_csv(path)
    assert df["step"].tolist() == [1, 2] and df["lr"].tolist() == [0.1, 1e-3]
    assert df["loss"].iloc[0] == third  # every digit of the fp32 value, not 0.3333
    assert df["val"].tolist() == [1.5, 2.5] and df["flag"].iloc[1] == True  # noqa: E712


@pytest.mark.parametrize(
    "misuse, message",
    [
        ("after close", r"is closed: write inside the `with StepCSVWriter\(...\)` block, or reopen it with .*resume"),
        ("a float", r"^write takes a StepLog/SkipLog or a mapping of columns, not a float \(the file is unchanged\)$"),
        ("a bad step", r"^step='one' is not a step number \(the file is unchanged\)$"),
    ],
)
def test_a_misused_writer_says_what_to_do_and_changes_nothing(tmp_path, misuse, message):
    """Writing after ``close`` read ``I/O operation on closed file.``; a float ``'float' object is not iterable``;
    a step that is no number ``invalid literal for int() with base 10``."""
    path = tmp_path / "steps.csv"
    writer = StepCSVWriter(path)
    writer.write(_log(1))
    if misuse == "after close":
        writer.close()
    before = path.read_bytes()
    record = {"after close": _log(2), "a float": 3.0, "a bad step": {"step": "one", "loss": 1.0}}[misuse]
    with pytest.raises(ValueError, match=message):
        writer.write(record)
    writer.close()
    assert path.read_bytes() == before
