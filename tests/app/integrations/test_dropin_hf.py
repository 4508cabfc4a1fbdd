"""``ClipampCallback(apply=False)`` leaves a Trainer run bit-identical to the same run without it."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

pytest.importorskip("transformers")

from sweep.integrations.hf_trainer import ClipampCallback

from .test_hf_trainer import trainer


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
