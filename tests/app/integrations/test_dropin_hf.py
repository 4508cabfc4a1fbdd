"""``ClipampCallback(apply=False)`` leaves a Trainer run bit-identical to the same run without it."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainerCallback

from sweep.integrations.hf_trainer import ClipampCallback

from .test_hf_trainer import trainer

pytestmark = pytest.mark.slow  # each test trains a transformers.Trainer


def _compare(tmp_path, steps, tau):
    cb = ClipampCallback(tracking=None, csv_path=tmp_path / "steps.csv", verbose=False)
    ours = trainer(tmp_path / "a", [cb], steps=steps, max_grad_norm=tau, bf16=True)
    ref = trainer(tmp_path / "b", [], steps=steps, max_grad_norm=tau, bf16=True)
    ours.train(), ref.train()
    norms = [[h["grad_norm"] for h in t.state.log_history if "grad_norm" in h] for t in (ours, ref)]
    assert len(norms[1]) == steps
    assert norms[0] == norms[1]  # every logged grad_norm, exactly
    assert sum(n > tau for n in norms[1]) > steps / 2  # most steps clip: a last-bit difference would grow
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        assert torch.equal(p, q), name
    df = pd.read_csv(tmp_path / "steps.csv")
    assert df["grad_l2_pre_clip"].tolist() == norms[1]  # the callback's pre-clip norm is Trainer's grad_norm
    assert df["clipped"].tolist() == [n > tau for n in norms[1]]
    return cb


def test_apply_false_changes_nothing_in_a_short_bf16_run(tmp_path):
    _compare(tmp_path, steps=6, tau=0.3)


@pytest.mark.slow  # two 60-step Trainer runs
def test_apply_false_changes_nothing_in_a_60_step_bf16_accumulated_run(tmp_path):
    cb = _compare(tmp_path, steps=60, tau=0.3)
    assert cb.policy.placement is not None  # the runner's start=auto placed (or timed) the window


class InfGradAt(TrainerCallback):
    """An inf in the first rows of one gradient during the backward of optimizer step ``at``."""

    def __init__(self, at: int) -> None:
        self.at, self.step = at, 0

    def on_train_begin(self, args, state, control, model=None, **kw):
        p = model.model.layers[0].mlp.up_proj.weight
        p.register_hook(
            lambda g: g.clone().index_fill_(0, torch.tensor([0, 1]), math.inf) if self.step == self.at else g
        )

    def on_step_begin(self, args, state, control, **kw):
        self.step = state.global_step + 1


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN (``torch.equal`` counts NaN as unequal to itself)."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def test_apply_false_changes_nothing_on_a_step_with_an_inf_gradient(tmp_path):
    """Trainer's clip turns an inf gradient's finite elements to 0 and its infs to NaN (coefficient 0);
    with the callback the parameters after that step are the same, NaNs where Trainer's are."""
    runs = []
    for name, extra in (
        ("ours", [ClipampCallback(tracking=None, csv_path=tmp_path / "s.csv", verbose=False)]),
        ("ref", []),
    ):
        t = trainer(tmp_path / name, [InfGradAt(3), *extra], steps=3, max_grad_norm=0.3)
        t.train()
        runs.append(t.model)
    ours, ref = runs
    assert any(p.isnan().any() for p in ref.parameters()) and not all(p.isnan().all() for p in ref.parameters())
    for (name, p), q in zip(ref.named_parameters(), ours.parameters()):
        assert _same_bits(p, q), name
    df = pd.read_csv(tmp_path / "s.csv")
    assert df["skipped"].tolist() == [False] * 3  # Trainer applied it, as without the callback
    assert math.isnan(df["grad_l2_pre_clip"][2]) and df["grad_l2_pre_clip"][:2].notna().all()


def test_a_second_callback_is_refused_and_the_run_after_is_unchanged(tmp_path):
    """Two ClipampCallbacks (or one added twice) in one Trainer: the second measured the gradients the first
    had clipped (its pre-clip norms all at τ) and clipped them again, so the parameters moved off Trainer's.
    Refused before any step, ``args`` as they were; with one removed, the run equals the run without it."""
    tau = 0.3
    cb = ClipampCallback(tracking=None, csv_path=tmp_path / "steps.csv", verbose=False)
    second = ClipampCallback(tracking=None, csv_path=tmp_path / "second.csv", verbose=False)
    ours = trainer(tmp_path / "a", [cb, second], steps=3, max_grad_norm=tau)
    with pytest.raises(ValueError, match=r"^the Trainer holds two ClipampCallbacks: .* keep one"):
        ours.train()
    assert ours.args.max_grad_norm == tau and ours.state.global_step == 0
    ours.remove_callback(second)
    ours.train()
    ref = trainer(tmp_path / "b", [], steps=3, max_grad_norm=tau)
    ref.train()
    for (name, p), q in zip(ref.model.named_parameters(), ours.model.parameters()):
        assert torch.equal(p, q), name
    norms = [h["grad_norm"] for h in ref.state.log_history if "grad_norm" in h]
    assert pd.read_csv(tmp_path / "steps.csv")["grad_l2_pre_clip"].tolist() == norms

    same = trainer(tmp_path / "c", [cb, cb], steps=3, max_grad_norm=tau)
    with pytest.raises(ValueError, match=r"^the Trainer holds this ClipampCallback twice: "):
        same.train()
    assert same.args.max_grad_norm == tau


class SaveAt(TrainerCallback):
    """A checkpoint at step ``at`` (with ``save_strategy="no"`` otherwise)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_step_end(self, args, state, control, **kw):
        control.should_save = control.should_save or state.global_step == self.at


def test_a_checkpoints_training_args_are_the_users(tmp_path):
    """Trainer saves ``args`` with every checkpoint (``training_args.bin``) while the callback holds
    ``max_grad_norm`` at its norm-only τ: the file must hold the user's τ, as the run without the callback
    saves it (before: 3.39e38, a τ that never clips for whoever trains on from those arguments)."""
    saved = []
    for name, extra in (
        ("ours", [ClipampCallback(tracking=None, csv_path=tmp_path / "s.csv", verbose=False)]),
        ("ref", []),
    ):
        t = trainer(tmp_path / name, [SaveAt(2), *extra], steps=3, max_grad_norm=0.3)
        t.train()
        args = torch.load(tmp_path / name / "out" / "checkpoint-2" / "training_args.bin", weights_only=False)
        saved.append({k: v for k, v in args.to_dict().items() if k not in ("output_dir", "logging_dir")})
    ours, ref = saved
    assert ref["max_grad_norm"] == 0.3
    assert ours == ref


class ArgsAtBegin(TrainerCallback):
    """What a callback listed after ClipampCallback logs of ``args`` at train begin (as MLflowCallback and
    TensorBoardCallback log them)."""

    def on_train_begin(self, args, state, control, **kw):
        self.max_grad_norm = args.to_dict()["max_grad_norm"]


@pytest.mark.parametrize("apply", [False, True])
def test_a_callback_after_it_logs_the_users_max_grad_norm(tmp_path, apply):
    """``callbacks=[ClipampCallback(), MLflowCallback()]``: the arguments logged at train begin hold the user's
    τ, not the norm-only τ (before: 3.39e38); the run is the one without the callback."""
    cb = ClipampCallback(apply=apply, window=4, tracking=None, csv_path=tmp_path / "s.csv", verbose=False)
    logged, ref_logged = ArgsAtBegin(), ArgsAtBegin()
    ours = trainer(tmp_path / "ours", [cb, logged], steps=3, max_grad_norm=0.3)
    ref = trainer(tmp_path / "ref", [ref_logged], steps=3, max_grad_norm=0.3)
    ours.train(), ref.train()
    assert logged.max_grad_norm == ref_logged.max_grad_norm == 0.3
    assert all(torch.equal(p, q) for p, q in zip(ours.model.parameters(), ref.model.parameters()))
