"""``model=custom model.loss_target=model``: a nanoGPT-shaped model that computes its own loss trains in the runner."""

from __future__ import annotations

import pytest
import torch

from sweep.errors import UserError
from sweep.tasks.build import build_task
from tests.app.helpers import TINY, compose_cfg, run_cli

TARGET = "tests.engine.nanogpt_shaped.NanoGPTShaped"
KWARGS = "+model.kwargs={vocab: 256, block: 32, d: 16, n_layer: 1, n_head: 2}"
DATA = ["data.seq_len=32", "data.batch_size=4", "data.max_files=20", "data.eval_batches=1"]


def _task(*overrides):
    cfg = compose_cfg("+experiment=train", "model=custom", f"model._target_={TARGET}", KWARGS, *DATA, *overrides)
    return build_task(cfg.model, cfg.data, seed=cfg.seed)


def test_the_runners_loss_is_the_models_own():
    task = _task("model.loss_target=model")
    batch = next(task.train_batches)
    loss_sum, count = task.loss_fn(task.model(batch.inputs), batch.targets)
    _, own = task.model.model(batch.inputs, batch.targets)
    assert count == batch.targets.numel()
    torch.testing.assert_close(loss_sum / count, own)


def test_without_loss_target_the_refusal_names_loss_target_model():
    with pytest.raises(UserError, match=r"model\.loss_target=model when its forward\(inputs, targets\) computes"):
        _task()


@pytest.mark.slow  # a CLI run
def test_a_train_run_of_a_model_computing_its_own_loss(tmp_path, store):  # the default store, migrated already
    done = run_cli(
        "+experiment=train",
        "model=custom",
        f"model._target_={TARGET}",
        "model.loss_target=model",
        KWARGS,
        *DATA,
        *TINY[4:],
        "steps=4",
        cwd=tmp_path,
        env={"PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[3])},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "error" not in done.stderr.lower()


def test_freeze_patterns_name_the_models_own_parameters():
    """``model.freeze`` under ``loss_target=model`` matches the user's names (``^wte``), as without the option;
    it matched the runner's wrapper's (``model.wte.weight``) and refused ``^wte``."""
    task = _task("model.loss_target=model", "model.freeze=['^wte']")
    frozen = [n for n, p in task.model.model.named_parameters() if not p.requires_grad]
    assert frozen == ["wte.weight"] and any(p.requires_grad for p in task.model.parameters())
