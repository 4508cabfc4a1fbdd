"""From a config to a running engine: optimizer, LR schedule, clip policy, ``AmpTrainState``."""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from clipamp_engine import AmpTrainState, ClipPolicy, make_clip_policy
from clipamp_engine.clipping import CLIP_MODES

from .config import Config, OptimConfig
from .errors import UserError


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW/Adam/SGD over the trainable parameters; no weight decay on 1-D params (biases, norms)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    if cfg.name == "adam":  # coupled L2: weight decay is added to the gradient (and clipped with it)
        return torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas))
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


def lr_factor(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warmup to 1, then cosine/linear decay to ``min_lr_ratio`` (or constant)."""
    warm = cfg.warmup_steps
    if warm and step < warm:
        return (step + 1) / warm
    if cfg.schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warm) / max(1, total_steps - warm))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: OptimConfig, optimizer, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


def clip_options(mode: str, options: dict[str, Any], max_norm: float | None) -> dict[str, Any]:
    """The constructor options of ``mode``'s policy taken from the config; unknown ones refused."""
    try:
        cls = CLIP_MODES[mode]
    except KeyError:
        raise UserError(f"clip={mode!r} is not one of {', '.join(CLIP_MODES)}") from None
    accepted = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "named_params")]
    opts = {k: v for k, v in dict(options).items() if v is not None}
    unknown = sorted(set(opts) - set(accepted))
    if unknown:
        raise UserError(f"clip.options has {unknown} that clip={mode} does not take; it takes {accepted or 'none'}")
    if "max_norm" in accepted and max_norm is not None:
        opts["max_norm"] = max_norm
    return opts


def build_clip_policy(mode: str, options: dict[str, Any], max_norm: float | None,
                      model: torch.nn.Module | None = None) -> ClipPolicy:
    opts = clip_options(mode, options, max_norm)
    if model is not None and "named_params" in inspect.signature(CLIP_MODES[mode].__init__).parameters:
        opts["named_params"] = list(model.named_parameters())
    try:
        return make_clip_policy(mode, **opts)
    except ValueError as e:
        raise UserError(f"clip={mode}: {e}") from None


def build_state(cfg: Config, model: torch.nn.Module, loss_fn, clip: ClipPolicy, *,
                total_steps: int | None = None) -> AmpTrainState:
    optimizer = build_optimizer(cfg.optim, model)
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps or cfg.steps)
    amp = cfg.amp
    try:
        return AmpTrainState(
            model, optimizer, loss_fn, dtype=amp.dtype, clip=clip, scheduler=scheduler,
            accumulation_steps=cfg.accumulation_steps, init_scale=amp.init_scale,
            growth_factor=amp.growth_factor, backoff_factor=amp.backoff_factor,
            growth_interval=amp.growth_interval)
    except ValueError as e:
        raise UserError(str(e)) from None
