"""``python -m sweep.recommend`` on the logs users point it at as their tools leave them: a Lightning
``CSVLogger`` folder, a loop's own CSV with gaps."""

from __future__ import annotations

import numpy as np
import pytest

from clipamp_engine.diagnosis import diagnose
from sweep.errors import UserError
from tests.app.recommend.test_recommend import main, numpy_tau, parse, trace, write_csv


def _lightning_csv(folder, steps, lr, norms):
    """A ``CSVLogger`` metrics.csv: Lightning's epoch and grad_2.0_norm_total, logged at global_step = step − 1."""
    folder.mkdir(parents=True)
    (folder / "hparams.yaml").write_text("{}\n")
    columns = {"epoch": [0] * len(steps), "grad_2.0_norm_total": norms, "lr-AdamW": lr, "step": steps - 1}
    return write_csv(folder / "metrics.csv", columns)


def test_a_csvlogger_folder_is_read_as_its_metrics_csv(tmp_path, capsys):
    steps, lr, norms = trace()
    csv = _lightning_csv(tmp_path / "lightning_logs" / "version_0", steps, lr, norms)
    args = ["--start", "60", "--window", "120"]
    rec = parse([str(csv.parent), *args])
    assert rec.tau == pytest.approx(numpy_tau(steps, norms, 61, 180), rel=1e-12, abs=0)
    assert rec.tau == parse([str(csv), *args]).tau


def test_a_folder_of_several_csv_runs_names_each_and_each_named_path_runs(tmp_path, capsys):
    steps, lr, norms = trace()
    for version in ("version_0", "version_1"):
        _lightning_csv(tmp_path / "lightning_logs" / version, steps, lr, norms)
    with pytest.raises(UserError) as e:
        parse([str(tmp_path / "lightning_logs")])
    message = str(e.value)
    assert "\n" not in message and "pass one of them" in message
    named = [w for w in message.split() if w.endswith("metrics.csv")]
    assert named == [str(tmp_path / "lightning_logs" / v / "metrics.csv") for v in ("version_0", "version_1")]
    for path in named:  # the paths the message names, pasted
        assert main([path]) == 0


def test_steps_a_csv_does_not_log_are_not_diagnosed_as_non_finite(tmp_path, capsys):
    steps, lr, norms = trace()
    logged = (steps < 301) | (steps > 350)  # rows lost (a crash, a filter): no value, not a NaN
    path = write_csv(tmp_path / "log.csv", {"step": steps[logged], "lr": lr[logged], "grad_norm": norms[logged]})
    rec = parse([str(path), "--start", "60", "--window", "120"])
    assert rec.tau == pytest.approx(numpy_tau(steps, norms, 61, 180), rel=1e-12, abs=0)
    rows = [
        {"step": int(s), "lr": float(r), "grad_l2_pre_clip": float(x), "skipped": False}
        for s, r, x in zip(steps, lr, norms)
    ]
    expected = [f.kind for f in diagnose([r for r, kept in zip(rows, logged) if kept])]
    assert [f.kind for f in rec.findings] == expected
    assert "nonfinite" not in expected


HF_NOTE = "Trainer logs grad_norm before clipping"


@pytest.mark.parametrize("trainer", [False, True])
def test_only_a_trainers_tensorboard_log_is_said_to_be_the_trainers(tmp_path, trainer):
    """A loop of one's own logging train/grad_norm with SummaryWriter is not told that Trainer logged it (nor
    spared the running-mean caution); HF's callback's log (its train/epoch beside it) is."""
    from torch.utils.tensorboard import SummaryWriter

    steps, lr, norms = trace()
    with SummaryWriter(str(tmp_path / "run")) as writer:
        for s, x in zip(steps, norms):
            writer.add_scalar("train/grad_norm", x, s)
            if trainer:
                writer.add_scalar("train/epoch", s / len(steps), s)
    rec = parse([str(tmp_path / "run")])
    assert (HF_NOTE in (rec.series.pre_clip or "")) is trainer
    w = rec.clip.summaries[0]
    assert rec.tau == pytest.approx(numpy_tau(steps, norms, w.start_step, w.end_step), rel=1e-6)  # float32 events


@pytest.mark.parametrize("trainer", [False, True])
def test_only_a_trainers_mlflow_run_is_said_to_be_the_trainers(store, trainer):
    from mlflow import MlflowClient
    from mlflow.entities import Metric, Param

    steps, lr, norms = trace()
    client = MlflowClient(store)
    run = client.create_run(client.create_experiment("own"))
    params = [Param("logging_steps", "1"), Param("max_grad_norm", "1e9")] if trainer else []
    metrics = [Metric("grad_norm", float(x), 0, int(s)) for s, x in zip(steps, norms)]
    client.log_batch(run.info.run_id, metrics=metrics, params=params)
    rec = parse([f"runs:/{run.info.run_id}", "--tracking-uri", store])
    assert (HF_NOTE in (rec.series.pre_clip or "")) is trainer


def test_a_sparse_logs_last_window_of_one_norm_gives_no_tau(tmp_path):
    """Logged every 3 steps to step 600, windows of 99 every 99 from step 103: the last (598–696) is cut to
    598–600, three steps of the run (which keeps it) but one norm of the log: no τ is read from one norm."""
    steps, lr, norms = trace(600)
    every3 = steps % 3 == 0
    path = write_csv(tmp_path / "log.csv", {"step": steps[every3], "lr": lr[every3], "grad_norm": norms[every3]})
    rec = parse([str(path), "--window", "99", "--every", "99", "--start", "102", "--quantile", "0.9"])
    spans = [(w.start_step, w.end_step, w.n_finite) for w in rec.clip.summaries]
    assert spans == [(s + 2, s + 98, 33) for s in (103, 202, 301, 400, 499)]
    x, s = norms[every3], steps[every3]
    assert rec.clip.tau == pytest.approx(numpy_tau(s, x, 499, 597, 0.9), rel=1e-12)
    assert any("the last window (steps 598–600, cut by the log's end) holds one logged norm" in n for n in rec.notes)


def test_a_last_window_with_steps_logged_as_nan_is_kept_as_the_run_keeps_it(tmp_path):
    steps, lr, norms = trace(600)
    norms[[598, 599]] = np.nan  # steps 599 and 600 logged, not finite: the run's window 598–600 has one norm
    path = write_csv(tmp_path / "log.csv", {"step": steps, "lr": lr, "grad_norm": norms})
    rec = parse([str(path), "--window", "99", "--every", "99", "--start", "102", "--quantile", "0.9"])
    last = rec.clip.summaries[-1]
    assert (last.start_step, last.end_step, last.n_finite) == (598, 600, 1)
    assert rec.clip.tau == norms[597]


def test_text_in_the_norm_column_is_said_naming_a_cell(tmp_path):
    """A stray word was read as NaN without a word (then diagnosed "likely overflow"); a column of logged
    tensors said "holds no number: pass --norm COLUMN", the wrong fix: both now name a cell."""
    steps, lr, norms = trace()
    cells = [repr(float(v)) for v in norms]
    cells[99], cells[150] = "bad", "nan"  # a word, and a logged NaN (a skipped step, as documented)
    csv = write_csv(tmp_path / "log.csv", {"step": steps, "lr": lr, "grad_norm": cells})
    rec = parse([str(csv), "--start", "60", "--window", "120"])
    said = "1 cell(s) of 'grad_norm' are text, not numbers (e.g. 'bad' at step 100): read as skipped steps, left out"
    assert any(n.startswith(said) for n in rec.notes)
    # the diagnosis counts the logged NaN, not the word: an unreadable cell is no overflow
    nonfinite = [f for f in rec.findings if f.kind == "nonfinite"]
    assert [f.steps for f in nonfinite] == [[151]] and nonfinite[0].evidence["count"] == 1
    kept = np.ones(len(steps), bool)
    kept[[99, 150]] = False
    assert rec.tau == pytest.approx(numpy_tau(steps[kept], norms[kept], 61, 180), rel=1e-12, abs=0)

    cells[150] = "abc"
    words = parse([str(write_csv(tmp_path / "words.csv", {"step": steps, "lr": lr, "grad_norm": cells}))])
    assert not [f for f in words.findings if f.kind == "nonfinite"]

    tensors = write_csv(tmp_path / "tensors.csv", {"step": steps, "grad_norm": [f"tensor({v:.4f})" for v in norms]})
    with pytest.raises(UserError) as e:
        parse([str(tensors)])
    assert str(e.value) == (
        f"{tensors}: column 'grad_norm' holds no number (e.g. 'tensor({norms[0]:.4f})' at step 1): log the norm as "
        "a number (float(norm), norm.item()), or pass --norm COLUMN of another column"
    )
