"""``python -m sweep.recommend`` on the logs of a real, unmodified ``Trainer.train()`` (its checkpoint's
``trainer_state.json`` and its own TensorBoard events), and as a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("transformers")
from transformers import Trainer, TrainingArguments

from tests.app.helpers import REPO
from tests.app.integrations.test_hf_trainer import dataset, tiny_llama
from tests.app.recommend.test_recommend import main, parse, trace, write_csv

STEPS, EVERY, WINDOW = 60, 3, 30


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    """A 60-step Trainer run clipping at 0.5, logging every 3 steps to its state and to TensorBoard."""
    out = tmp_path_factory.mktemp("hf") / "out"
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        warmup_steps=10,
        max_grad_norm=0.5,
        logging_steps=EVERY,
        report_to=["tensorboard"],
        save_strategy="steps",
        save_steps=STEPS,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    Trainer(model=tiny_llama(0), args=args, train_dataset=dataset()).train()
    state = json.loads((out / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    logged = [h for h in state["log_history"] if "grad_norm" in h]
    return out, np.array([h["step"] for h in logged]), np.array([h["grad_norm"] for h in logged])


@pytest.mark.slow
def test_trainer_checkpoint_gives_the_calibrate_tau_with_the_sampling_caveat(trainer_run, capsys):
    out, steps, norms = trainer_run
    assert steps.tolist() == list(range(EVERY, STEPS + 1, EVERY))
    assert (norms > 0.5).any()  # Trainer clipped at 0.5, yet grad_norm is the pre-clip norm
    argv = [str(out), "--start", "0", "--window", str(WINDOW)]  # the output_dir: its newest checkpoint
    assert main(argv) == 0
    text = capsys.readouterr().out
    tau = float(np.quantile(norms[steps <= WINDOW], 0.95))
    rec = parse(argv)
    assert rec.series.source.startswith(str(out / f"checkpoint-{STEPS}" / "trainer_state.json"))
    assert rec.clip.summaries[0].n_finite == WINDOW // EVERY
    assert rec.tau == pytest.approx(tau, rel=1e-12)
    assert f"max_grad_norm={tau:.4g}" in text
    assert "grad_norm is logged every 3 steps: a 1-in-3 sample" in text
    assert "Trainer logs grad_norm before clipping" in text and "LR from learning_rate" in text


@pytest.mark.slow
def test_trainers_tensorboard_events_give_the_same_tau(trainer_run):
    out, steps, norms = trainer_run
    rec = parse([str(out / "runs"), "--start", "0", "--window", str(WINDOW)])
    assert rec.series.name == "train/grad_norm" and rec.series.lr_name == "train/learning_rate"
    stored = norms.astype(np.float32).astype(np.float64)  # event files hold float32
    assert rec.tau == pytest.approx(float(np.quantile(stored[steps <= WINDOW], 0.95)), rel=1e-12)


@pytest.mark.slow
def test_module_command_prints_the_report_or_one_line(tmp_path):
    steps, lr, norms = trace()
    path = write_csv(tmp_path / "log.csv", {"step": steps, "lr": lr, "grad_norm": norms})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MLFLOW_TRACKING_URI", None)
    ok = subprocess.run(
        [sys.executable, "-m", "sweep.recommend", str(path), "--start", "100", "--window", "100", "--quantile", "0.95"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    tau = float(np.quantile(norms[100:200], 0.95))
    assert f"max_grad_norm={tau:.4g}" in ok.stdout and "Candidate thresholds" in ok.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "sweep.recommend", str(tmp_path / "nope.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.splitlines() == [
        f"error: {tmp_path / 'nope.json'}: no such file or folder (pass a "
        "trainer_state.json, an event file, a CSV or runs:/ID)"
    ]
