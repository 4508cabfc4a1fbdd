"""ClipampCallback in a real Trainer under torchrun (2 gloo ranks): rank 0's records hold the step's loss
and token count over both ranks, equal to what Trainer logs and to the one-process run of the same
global batch."""

from __future__ import annotations

import os
import subprocess
import sys

import pandas as pd
import pytest

pytest.importorskip("transformers")

from tests.app.helpers import REPO

pytestmark = pytest.mark.slow

SCRIPT = """
import json, os, sys, torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from sweep.integrations.hf_trainer import ClipampCallback

torch.manual_seed(0)
cfg = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
ids = torch.randint(0, 96, (64, 16), generator=torch.Generator().manual_seed(0))
labels = ids.clone()
labels[:, 13:] = -100  # 12 predicted tokens per row after the causal shift
ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})
world = int(os.environ.get("WORLD_SIZE", 1))
out = sys.argv[1]
args = TrainingArguments(output_dir=out, max_steps=4, per_device_train_batch_size=4 // world,
    gradient_accumulation_steps=2, learning_rate=3e-3, use_cpu=True, ddp_backend="gloo" if world > 1 else None,
    logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True)
trainer = Trainer(model=AutoModelForCausalLM.from_config(cfg), args=args, train_dataset=ds,
                  callbacks=[ClipampCallback(tracking=None, csv_path=f"{out}/steps.csv", verbose=False)])
trainer.train()
if trainer.is_world_process_zero():
    logged = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    open(f"{out}/logged.json", "w").write(json.dumps(logged))
"""


def run(tmp_path, ranks: int) -> tuple[pd.DataFrame, list[float]]:
    out = tmp_path / f"ranks{ranks}"
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*launch, str(script), str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert (out / "logged.json").exists(), done.stderr[-3000:]
    return pd.read_csv(out / "steps.csv"), pd.read_json(out / "logged.json", typ="series").tolist()


def test_two_ranks_record_the_global_loss_and_tokens_trainer_logs(tmp_path):
    one, one_logged = run(tmp_path, 1)
    two, two_logged = run(tmp_path, 2)
    assert (one["token_count"] == 4 * 2 * 12).all() and (two["token_count"] == 4 * 2 * 12).all()
    assert two["loss"].tolist() == pytest.approx(two_logged, rel=1e-4)  # Trainer logs 4 significant digits
    assert one["loss"].tolist() == pytest.approx(one_logged, rel=1e-4)
    assert two["loss"].tolist() == pytest.approx(one["loss"].tolist(), rel=1e-5)
