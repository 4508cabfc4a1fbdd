"""``AmpTrainState``: one safe mixed-precision optimizer step, in the textbook order.

autocast forward → fp32 loss → finite-loss check (before backward) → scaled backward (per
micro-batch) → unscale → non-finite check → clip → optimizer step → LR schedule → scaler
update (skips included) → ``zero_grad(set_to_none=True)``.

References:
    Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740.
    Pascanu, Mikolov, Bengio, arXiv:1211.5063 (global-norm clipping).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .clip.base import ClipPolicy
from .clip.fixed import GlobalNormClip
from .monitors import ClipRatioMonitor, SkipRateExceeded, SkipRateMonitor
from .norms import grads_of, scale_grads_, total_norm
from .records import SkipLog, StepLog
from .scaling import LossScaler

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

LossFn = Callable[[Any, Any], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]


def parse_dtype(dtype: str) -> torch.dtype:
    """``"bf16" | "fp16" | "fp32"`` → torch dtype; anything else is a ``ValueError`` listing them."""
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}") from None


def _model_device_type(model: nn.Module) -> str:
    types = {p.device.type for p in model.parameters()}
    if len(types) != 1:
        raise ValueError(f"model parameters live on {sorted(types) or 'no device'}: expected exactly one device type")
    return types.pop()


def _split(batch: Any, k: int) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, k))
    if isinstance(batch, (tuple, list)):
        parts = [_split(b, k) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(k)]
    if isinstance(batch, dict):
        parts = {key: _split(v, k) for key, v in batch.items()}
        return [{key: v[i] for key, v in parts.items()} for i in range(k)]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into micro-batches")


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (tuple, list)):
        return _batch_size(batch[0])
    return _batch_size(next(iter(batch.values())))


class _NoForensics:
    """Forensics off: no snapshots, no extra columns."""

    columns: tuple[str, ...] = ()

    def before_step(self, params, grads, optimizer) -> None:
        pass

    def after_step(self, params, optimizer) -> dict[str, Any]:
        return {}


class AmpTrainState:
    """Model, optimizer, loss scaler and monitors; ``.step(inputs, targets)`` is one update.

    Args:
        model: the module; its parameters' device type is the autocast device.
        optimizer: any ``torch.optim.Optimizer`` over (a subset of) the model's parameters.
        loss_fn: ``loss_fn(model(inputs), targets)`` → a mean loss, or ``(loss_sum, token_count)``
            in which case the step's loss is the token mean over the whole accumulated batch.
        dtype: ``"bf16"`` (default), ``"fp16"`` (with dynamic loss scaling) or ``"fp32"``.
        max_norm: τ for the default global-norm policy (ignored when ``clip`` is given).
        clip: a ``ClipPolicy`` (see ``make_clip_policy``); default ``GlobalNormClip(max_norm)``.
        scheduler: optional LR scheduler, stepped only on taken steps.
        accumulation_steps: micro-batches per step; gradients are clipped once, after accumulation.
        device_type: must agree with the model's parameters when given.
        scaler: a ``LossScaler``; by default one enabled only for fp16 with the settings below.
        init_scale, growth_factor, backoff_factor, growth_interval: ``GradScaler`` settings.
        skip_monitor: a ``SkipRateMonitor`` (default: 1,000-step window, warn above 5%).
        clip_window: steps in the rolling clipping-ratio window.
        forensics: optional probe with ``before_step(params, grads, optimizer)`` and
            ``after_step(params, optimizer) -> dict`` whose columns land in ``record.extra``
            (see ``clipamp_engine.forensics``); ``None`` costs nothing.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        dtype: str = "bf16",
        max_norm: float = 1.0,
        clip: ClipPolicy | None = None,
        scheduler: Any = None,
        accumulation_steps: int = 1,
        device_type: str | None = None,
        scaler: LossScaler | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        skip_monitor: SkipRateMonitor | None = None,
        clip_window: int = 1000,
        forensics: Any = None,
    ) -> None:
        self.autocast_dtype = parse_dtype(dtype)
        self.dtype = dtype
        model_device = _model_device_type(model)
        if device_type is not None and device_type != model_device:
            raise ValueError(
                f"device_type={device_type!r} disagrees with the model's parameters on {model_device!r}: "
                f"autocast must run on the optimizer's device (pass device_type={model_device!r} or move the model)")
        self.device_type = model_device
        if dtype != "fp32" and not torch.amp.is_autocast_available(model_device):
            raise ValueError(f"dtype={dtype!r}: autocast is not available on device {model_device!r}; use dtype='fp32'")
        if not isinstance(accumulation_steps, int) or accumulation_steps < 1:
            raise ValueError(f"accumulation_steps={accumulation_steps!r} must be an integer >= 1")
        if scaler is not None and not isinstance(scaler, LossScaler):
            raise ValueError("scaler must be a clipamp_engine.LossScaler (a GradScaler that can back off on refused losses)")
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self.clip = clip if clip is not None else GlobalNormClip(max_norm)
        if self.clip.per_sample and (accumulation_steps != 1 or dtype == "fp16"):
            raise ValueError(f"clip mode {self.clip.mode!r} computes per-example gradients: it needs "
                             f"accumulation_steps=1 and dtype bf16 or fp32 (got {accumulation_steps}, {dtype!r})")
        self.scheduler = scheduler
        self.accumulation_steps = accumulation_steps
        self.scaler = scaler if scaler is not None else LossScaler(
            model_device, init_scale=init_scale, growth_factor=growth_factor,
            backoff_factor=backoff_factor, growth_interval=growth_interval, enabled=dtype == "fp16")
        self.skip_monitor = skip_monitor if skip_monitor is not None else SkipRateMonitor()
        self.clip_monitor = ClipRatioMonitor(clip_window)
        self.forensics = forensics if forensics is not None else _NoForensics()
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.step_count = 0  # optimizer steps attempted (taken + skipped)

    # -- the step -------------------------------------------------------------------------
    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.dtype != "fp32")

    def step(self, inputs: Any, targets: Any) -> StepLog:
        """Run one optimizer step over ``(inputs, targets)``; return a ``StepLog`` or ``SkipLog``.

        Raises ``SkipRateExceeded`` (with the step's record as ``.record``) when the fail-fast
        skip-rate check trips, and the clip policy's ``ValueError`` from ``observe`` (e.g. a
        ``CalibrationError``), also with ``.record``.
        """
        self.step_count += 1
        lr = float(self.optimizer.param_groups[0]["lr"])
        scale = self.scaler.get_scale()  # sync (fp16 on an accelerator only): the scale this step uses
        try:
            record = self._step(inputs, targets, lr, scale)
        finally:
            self.optimizer.zero_grad(set_to_none=True)
        try:
            self.clip.observe(record)  # e.g. a calibration window closes
        except ValueError as e:
            e.record = record
            raise
        if not record.skipped:
            self.clip_monitor.add(record.clipped)
        try:
            self.skip_monitor.update(record.skipped, step=record.step)
        except SkipRateExceeded as e:
            e.record = record
            raise
        return record

    def _step(self, inputs: Any, targets: Any, lr: float, scale: float) -> StepLog:
        k = self.accumulation_steps
        micro = zip(_split(inputs, k), _split(targets, k)) if k > 1 else [(inputs, targets)]
        total = _batch_size(inputs)
        loss_acc = tokens = ref = None
        per_sample = self.clip.per_sample  # DP-SGD: gradients from clipped per-example gradients
        for x, y in micro:
            with self.autocast(), torch.set_grad_enabled(not per_sample):
                result = self.loss_fn(self.model(x), y)
            if isinstance(result, tuple):  # (loss_sum, token_count): token mean over the whole batch
                loss_sum, count = result[0].float(), result[1]
                if ref is None:
                    ref = count.float() * k  # provisional normaliser, corrected after accumulation
                loss = loss_sum / ref
                loss_acc = loss_sum if loss_acc is None else loss_acc + loss_sum
                tokens = count if tokens is None else tokens + count
            else:  # mean loss: weight each micro-batch by its share of the samples
                loss = result.float() * (_batch_size(y) / total) if k > 1 else result.float()
                loss_acc = loss if loss_acc is None else loss_acc + loss
            if not bool(torch.isfinite(loss)):  # sync: a non-finite loss never reaches backward
                self.scaler.back_off()
                return self._skip("nonfinite_loss", lr, scale, loss_acc, tokens)
            if per_sample:
                self.clip.backward(self.model, self.loss_fn, x, y)
            else:
                self.scaler.scale(loss).backward()

        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.params if p.grad is not None]
        grads = grads_of(params)
        if tokens is not None and k > 1:
            scale_grads_(grads, ref / tokens.float())  # exact token mean of the accumulated batch
        pre = total_norm(grads)
        mean_loss = loss_acc / tokens.float() if tokens is not None else loss_acc
        if not bool(torch.isfinite(pre)):  # sync: refuse the update, state untouched
            self.scaler.update()  # fp16: the recorded inf check backs the scale off
            return self._skip("nonfinite_grad", lr, scale, loss_acc, tokens, pre)

        post = self.clip.clip_(params, grads, pre, self.step_count)
        self.forensics.before_step(params, grads, self.optimizer)
        self.clip.before_step(params, self.optimizer)
        self.scaler.step(self.optimizer)
        clip_extra = self.clip.after_step(params, self.optimizer) or {}  # e.g. update_l2_pre_clip (0-dim)
        extra = self.forensics.after_step(params, self.optimizer)
        if self.scheduler is not None:
            self.scheduler.step()
        self.scaler.update()
        names = list(clip_extra)
        values = torch.stack([pre, post, mean_loss.detach(), self._tokens_or_nan(tokens).to(pre.device),
                              *(torch.as_tensor(clip_extra[n], dtype=torch.float32).to(pre.device) for n in names)]
                             ).tolist()  # sync: the record
        pre_f, post_f, loss_f, tok_f = values[:4]
        extra = {**dict(zip(names, values[4:])), **extra}
        return StepLog(step=self.step_count, lr=lr, grad_l2_pre_clip=pre_f, grad_l2_post_clip=post_f,
                       loss=loss_f, scaler_scale=scale, clipped=post_f < pre_f,
                       token_count=None if math.isnan(tok_f) else int(tok_f),
                       max_norm=self.clip.threshold, extra=extra)

    @staticmethod
    def _tokens_or_nan(tokens: torch.Tensor | None) -> torch.Tensor:
        return tokens.float() if tokens is not None else torch.tensor(float("nan"))

    def _skip(self, reason: str, lr: float, scale: float, loss_acc: torch.Tensor,
              tokens: torch.Tensor | None, pre: torch.Tensor | None = None) -> SkipLog:
        if tokens is not None:
            loss_acc = loss_acc / tokens.float()
        nan = torch.tensor(float("nan"))
        pre = nan if pre is None else pre
        pre_f, loss_f, tok_f = torch.stack([pre.float().cpu(), loss_acc.detach().float().cpu(),
                                            self._tokens_or_nan(tokens).cpu()]).tolist()  # sync: the record
        return SkipLog(step=self.step_count, lr=lr, grad_l2_pre_clip=pre_f, grad_l2_post_clip=float("nan"),
                       loss=loss_f, scaler_scale=scale, clipped=False,
                       token_count=None if math.isnan(tok_f) else int(tok_f),
                       max_norm=self.clip.threshold, skip_reason=reason)

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs besides model and optimizer (which are included)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "scaler": self.scaler.state_dict(),
            "clip": self.clip.state_dict(),
            "skip_monitor": self.skip_monitor.state_dict(),
            "clip_monitor": self.clip_monitor.state_dict(),
            "step_count": self.step_count,
            "dtype": self.dtype,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.clip.load_state_dict(state["clip"])
        self.skip_monitor.load_state_dict(state["skip_monitor"])
        self.clip_monitor.load_state_dict(state["clip_monitor"])
        self.step_count = state["step_count"]
