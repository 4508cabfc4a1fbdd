"""The fused path refuses optimizers whose groups are not fused, and records a float LR exactly."""

import pytest
import torch
import torch.nn.functional as F

from clipamp_engine.step import AmpTrainState


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def test_a_fused_optimizer_with_an_unfused_group_takes_the_default_path():
    """torch steps a group with fused=None unfused, and asserts when handed grad_scale/found_inf."""
    m = _model()
    opt = torch.optim.AdamW([{"params": [m.weight], "fused": None}, {"params": [m.bias]}], lr=1e-2, fused=True)
    state = AmpTrainState(m, opt, F.mse_loss, dtype="bf16")
    assert state.pipeline == "default"
    assert not state.step(torch.randn(8, 4), torch.randn(8, 1)).skipped
    with pytest.raises(
        ValueError, match=r"fused=True: the fused path cannot run: param groups \[0\] of AdamW say fused=None"
    ):
        AmpTrainState(m, opt, F.mse_loss, dtype="bf16", fused=True)


def test_the_fused_path_records_the_lr_the_optimizer_was_given():
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=True)  # 3e-4 is not an fp32 number
    state = AmpTrainState(m, opt, F.mse_loss, dtype="bf16")
    assert state.pipeline == "fused"
    assert state.step(torch.randn(8, 4), torch.randn(8, 1)).lr == 3e-4
