"""``model=custom`` is checked in training mode too (one line, before any run), the check leaves the
model and RNG exactly as they were, and a ``model.loss_target`` that raises is blamed on itself."""

from __future__ import annotations

import pytest
import torch

from sweep.config.schema import DataConfig, ModelConfig
from sweep.errors import UserError
from sweep.tasks.build import build_task
from tests.app.helpers import TINY, run_cli
from tests.reliability.helpers import assert_one_line_error

LM = DataConfig(name="stdlib", batch_size=2, seq_len=16, max_files=20, eval_batches=1)
KW = {"d": 16, "hidden": 32}


def _custom(target: str, **extra) -> ModelConfig:
    return ModelConfig(name="custom", _target_=f"tests.reliability.custom_modes.{target}", kwargs=dict(KW), **extra)


@pytest.mark.parametrize(
    "target,message",
    [
        (
            "TrainShape",
            "model._target_='tests.reliability.custom_modes.TrainShape' returned (2, 15, 256) in training mode "
            "(model.train()) for inputs of shape (2, 16); expected logits of shape (batch, seq_len, 256) = "
            "(2, 16, 256)",
        ),
        (
            "Detached",
            "model._target_='tests.reliability.custom_modes.Detached': in training mode its loss does not depend "
            "on its parameters (the output is detached from autograd",
        ),
    ],
)
def test_a_model_wrong_only_in_training_mode_is_one_line(target, message):
    with pytest.raises(UserError) as e:
        build_task(_custom(target), LM, seed=0)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_a_raising_loss_target_is_blamed_on_itself():
    with pytest.raises(UserError) as e:
        build_task(_custom("Normed", loss_target="tests.reliability.custom_modes.broken_loss"), LM, seed=0)
    assert str(e.value).startswith(
        "model.loss_target='tests.reliability.custom_modes.broken_loss' raised NameError: name 'undefined_name' is "
        "not defined (on the model's output (2, 16, 256) and targets of shape (2, 16)): fix the loss function"
    ), str(e.value)


def test_the_training_mode_check_changes_nothing(monkeypatch):
    """Buffers (BatchNorm statistics), parameters, gradients and the RNG stream after the build equal a
    control build without the training-mode check."""
    import sweep.tasks.custom as custom

    def build():
        torch.manual_seed(5)
        task = build_task(_custom("Normed"), LM, seed=0)
        return task, torch.rand(3)

    checked, after = build()
    monkeypatch.setattr(custom, "check_custom_training", lambda *args, **kwargs: None)
    control, control_after = build()
    assert torch.equal(after, control_after)
    for (n, a), (_, b) in zip(checked.model.state_dict().items(), control.model.state_dict().items()):
        assert torch.equal(a, b), n
    assert all(p.grad is None for p in checked.model.parameters()) and checked.model.training


@pytest.mark.slow
def test_cli_training_mode_failure_is_one_line_exit_2(tmp_path):
    res = run_cli(
        "+experiment=train",
        *TINY,
        "steps=2",
        "model=custom",
        "model._target_=tests.reliability.custom_modes.Detached",
        "+model.kwargs.d=16",
        cwd=tmp_path,
    )
    assert_one_line_error(res, "in training mode its loss does not depend on its parameters")
