"""Shared fixtures of the clip-policy tests: parameters with gradients, a small engine per mode."""

from __future__ import annotations

import torch
from torch import nn

from clipamp_engine import AmpTrainState
from clipamp_engine.clip import make_clip_policy
from clipamp_engine.norms import grads_of, total_norm


def _params_with_grads(*grads: torch.Tensor, values: list[torch.Tensor] | None = None) -> list[nn.Parameter]:
    ps = []
    for i, g in enumerate(grads):
        p = nn.Parameter(values[i].clone() if values else torch.zeros_like(g))
        p.grad = g.clone()
        ps.append(p)
    return ps


def _clip(policy, params, step=1):
    grads = grads_of(params)
    pre = total_norm(grads)
    post = policy.clip_(params, grads, pre, step)
    return pre, post


# -- every mode inside AmpTrainState --------------------------------------------------------------

MODE_OPTIONS = {
    "norm": {"max_norm": 0.5},
    "none": {},
    "value": {"clip_value": 0.05},
    "staged": {"stages": [[0, 0.5], [2, 0.1]]},
    "per_group": {"max_norms": [0.5, 0.1]},
    "agc": {"clip_factor": 0.01},
    "update": {"max_update_norm": 1e-3},
    "quantile": {"quantile": 0.5, "history": 10},
    "zscore": {"warmup_steps": 2, "z_thresh": 1.0},
    "dpsgd": {"max_norm": 0.5, "noise_multiplier": 0.0},
    "calibrated": {"window": 2, "quantile": 0.5},
}


def _state(mode, fp64=False, **kw):
    """A small two-group MLP in ``AmpTrainState`` with clip mode ``mode``: bf16 autocast, or an fp64
    model without autocast (``fp64``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    model = model.double() if fp64 else model
    opt = torch.optim.AdamW(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=1e-2, weight_decay=0.1
    )
    clip = make_clip_policy(mode, named_params=model, optimizer=opt, **MODE_OPTIONS[mode])
    return AmpTrainState(model, opt, nn.functional.cross_entropy, dtype="fp32" if fp64 else "bf16", clip=clip, **kw)


def _batches(n, fp64=False):
    gen = torch.Generator().manual_seed(1)
    dtype = torch.float64 if fp64 else torch.float32
    return [
        (torch.randn(8, 8, generator=gen, dtype=dtype) * 3, torch.randint(0, 3, (8,), generator=gen)) for _ in range(n)
    ]
