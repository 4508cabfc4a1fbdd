"""From a config to a running engine: optimizer, LR schedule, clip policy, ``AmpTrainState``."""

from __future__ import annotations

import math

import torch

from clipamp_engine import AmpTrainState, ClipPolicy, HysteresisScaler, make_clip_policy
from clipamp_engine.forensics import StepForensics
from sweep.config.schema import Config, OptimConfig, forensics_on
from sweep.config.spelling import APP_SPELLING
from sweep.config.validate import clip_options
from sweep.errors import UserError
from sweep.run.faults import FaultInjector
from sweep.startup import resume_gc


def fused_supported(params: list[torch.Tensor]) -> bool:
    """Whether torch's fused optimizer kernels run on these parameters (device and dtype)."""
    from clipamp_engine.fused import fused_kernel_devices as _get_fused_kernels_supported_devices  # torch's own list

    return bool(params) and all(
        p.device.type in _get_fused_kernels_supported_devices() and torch.is_floating_point(p) for p in params
    )


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW/Adam/SGD over the trainable parameters; no weight decay on 1-D params (biases, norms).

    Fused kernels where the device supports them: the engine then folds unscale and clip into
    the optimizer's own pass (``clipamp_engine.fused``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    fused = fused_supported(params)
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=fused)
    if cfg.name == "adam":  # coupled L2: Adam adds weight_decay·θ to the gradient in its step, after the clip
        return torch.optim.Adam(groups, lr=cfg.lr, betas=tuple(cfg.betas), fused=fused)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=fused)


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


def build_clip_policy(
    cfg: Config,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    total_steps: int | None = None,
) -> ClipPolicy:
    """The clip policy ``cfg.clip`` names, with its options (``calibrate.*`` for ``clip=calibrated``)."""
    mode = cfg.clip.mode
    try:
        return make_clip_policy(
            mode,
            named_params=named_model(model),
            optimizer=optimizer,
            total_steps=total_steps,
            spelling=APP_SPELLING,
            **clip_options(cfg),
        )
    except ValueError as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"clip={mode}: {e}") from None


def named_model(model: torch.nn.Module | None) -> torch.nn.Module | None:
    """The module whose parameter names ``clip.patterns`` / ``clip.exclude`` are written against, as
    ``model.freeze``'s are: without DDP's ``module.`` or the own-loss wrapper's ``model.`` prefix (the same
    parameters, so the policy clips them wherever they are trained)."""
    from sweep.tasks.own_loss import OwnLossModel

    while isinstance(model, (torch.nn.parallel.DistributedDataParallel, OwnLossModel)):
        model = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model.model
    return model


def build_state(cfg: Config, model: torch.nn.Module, loss_fn, *, total_steps: int | None = None) -> AmpTrainState:
    """The engine for ``cfg``: optimizer, LR schedule, the clip policy ``cfg.clip`` describes, scaler."""
    total_steps = total_steps or cfg.steps
    optimizer = build_optimizer(cfg.optim, model)
    clip = build_clip_policy(cfg, model, optimizer, total_steps)
    scheduler = build_scheduler(cfg.optim, optimizer, total_steps)
    amp = cfg.amp
    f = cfg.forensics
    forensics = None
    if forensics_on(f):
        forensics = StepForensics(
            model, update_norm=f.update_norm, param_norm=f.param_norm, top_k=f.top_k, zero_grads=f.zero_grads
        )
    try:
        scaler = HysteresisScaler(
            model_device(model),
            init_scale=amp.init_scale,
            growth_factor=amp.growth_factor,
            backoff_factor=amp.backoff_factor,
            growth_interval=amp.growth_interval,
            enabled=amp.dtype == "fp16",
            hysteresis=amp.hysteresis,
            consecutive_hysteresis=amp.consecutive_hysteresis,
            min_scale=amp.min_scale,
            max_scale=amp.max_scale,
        )
        return AmpTrainState(
            model,
            optimizer,
            loss_fn,
            dtype=amp.dtype,
            clip=clip,
            scheduler=scheduler,
            accumulation_steps=cfg.accumulation_steps,
            scaler=scaler,
            forensics=forensics,
        )
    except ValueError as e:
        raise UserError(str(e)) from None


def build_faulted_state(cfg: Config, model: torch.nn.Module, loss_fn) -> tuple[AmpTrainState, FaultInjector]:
    """``build_state`` with the faults ``cfg.faults`` injects into ``model`` (its hooks) and ``loss_fn``.

    The end of a run's start-up: the model, its data and the optimizer are built (torch's optimizer
    imports ``torch._dynamo``), so the garbage collector's full collections come back on (``resume_gc``)."""
    faults = FaultInjector(cfg.faults, model, loss_fn)
    state = build_state(cfg, model, faults.loss_fn if faults.active else loss_fn)
    resume_gc()
    return state, faults


def model_device(model: torch.nn.Module) -> str:
    return next(model.parameters()).device.type
