"""One real loss-scaled iteration, shared by the scaler tests."""

from __future__ import annotations

import math

import torch
from torch import nn


def iteration(scaler, overflow: bool) -> None:
    """One real iteration (scale → backward → unscale_ → step → update), reading nothing back."""
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler.scale((p * (math.inf if overflow else 1.0)).sum()).backward()
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()


def scale_after(scaler, overflow: bool) -> float:
    """``iteration``, then the scale (a host read)."""
    iteration(scaler, overflow)
    return scaler.get_scale()
