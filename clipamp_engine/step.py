"""``AmpTrainState``: one safe mixed-precision optimizer step, in the textbook order.

autocast forward → fp32 loss → finite-loss check (before backward) → scaled backward (per
micro-batch) → unscale → non-finite check → clip → optimizer step → scaler update (skips
included) → LR schedule → ``zero_grad(set_to_none=True)``. A step that raises before its update
uses no step number; one that raises after it carries its record (the exception's ``record``).

Two update paths, chosen automatically (``AmpTrainState.pipeline``): with a fused optimizer and
a global-coefficient clip the unscale and the clip are folded into the optimizer's own pass
and nothing syncs with the host between flushes (``clipamp_engine.fused_step``); otherwise the
canonical passes run and each step is materialised at once.

References:
    Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740.
    Pascanu, Mikolov, Bengio, arXiv:1211.5063 (global-norm clipping).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .checks import (
    check_accumulation,
    check_arguments,
    check_checkpoint_fits,
    check_scheduler,
    check_scheduler_groups,
    check_scheduler_untouched,
    check_setup,
    check_sharding,
    dtype_hint,
    model_device_type,
    scheduler_mark,
)
from .clip.base import ClipPolicy
from .clip.fixed import GlobalNormClip
from .clip.registry import whole_param_modes
from .distributed import GlobalBatchLoss, replicas_of, unwrap
from .forensics import NoForensics
from .fused import RecordBuffer, factor_recipe, flush_window, fused_path_refusal, refit_recipe
from .fused_step import fused_step
from .gradients import GradientSource, ScaledBackward
from .micro_batches import batch_size as _batch_size
from .micro_batches import split as _split
from .model_loss import loss_function
from .monitors import ClipRatioMonitor, SkipRateExceeded, SkipRateMonitor
from .norms import full_tensor, grads_of, scale_grads_, total_norm
from .param_order import optimizer_params_in_model_order, param_groups_key
from .records import SkipLog, StepLog
from .scaling import LossScaler

DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

LossFn = Callable[[Any, Any], torch.Tensor | tuple[torch.Tensor, torch.Tensor]]

_SCALED_BACKWARD = ScaledBackward()


def parse_dtype(dtype: str) -> torch.dtype:
    """``"bf16" | "fp16" | "fp32"`` → torch dtype; anything else is a ``ValueError`` listing them (``dtype_hint``)."""
    try:
        return DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}{dtype_hint(dtype, DTYPES)}") from None


class AmpTrainState:
    """Model, optimizer, loss scaler and monitors; ``.step(inputs, targets)`` is one update.

    Args:
        model: the module; its parameters' device type is the autocast device.
        optimizer: any ``torch.optim.Optimizer`` over (a subset of) the model's parameters.
        loss_fn: ``loss_fn(model(inputs), targets)`` → a mean loss, or ``(loss_sum, token_count)``
            in which case the step's loss is the token mean over the whole accumulated batch.
            ``None``: the model computes its own loss from the targets — ``model(inputs, targets)``
            (or ``model(**inputs, labels=targets)``) returns ``(logits, loss)``, a dict with
            ``"loss"`` or an object with ``.loss`` (see ``clipamp_engine.model_loss``).
        dtype: ``"bf16"`` (default), ``"fp16"`` (with dynamic loss scaling) or ``"fp32"``.
        max_norm: τ for the default global-norm policy (ignored when ``clip`` is given).
        clip: a ``ClipPolicy`` (see ``make_clip_policy``); default ``GlobalNormClip(max_norm)``.
        scheduler: optional LR scheduler of ``optimizer``, stepped with no argument on taken steps only
            (a metric-driven one such as ``ReduceLROnPlateau`` is refused: step it yourself).
        accumulation_steps: micro-batches per step; gradients are clipped once, after accumulation.
        device_type: must agree with the model's parameters when given.
        scaler: a ``LossScaler`` (or ``HysteresisScaler``) carrying every loss-scale setting
            (``init_scale``, ``growth_factor``, ``backoff_factor``, ``growth_interval``, …); by
            default ``LossScaler(device, enabled=dtype == "fp16")`` with ``GradScaler``'s defaults.
        skip_monitor: a ``SkipRateMonitor`` (default: 1,000-step window, warn above 5%).
        clip_window: steps in the rolling clipping-ratio window.
        forensics: optional probe with ``before_step(params, grads, optimizer)`` and
            ``after_step(params, optimizer) -> dict`` whose columns land in ``record.extra``
            (see ``clipamp_engine.forensics``); ``None`` costs nothing.
        fused: ``None`` (default) runs the fused path whenever it can (see
            ``clipamp_engine.fused``), ``False`` always runs the canonical passes, ``True``
            raises ``ValueError`` (with the reason) when the fused path cannot run. ``pipeline``
            says which runs, ``fused_recipe`` how (``clipamp_engine.fused.FACTOR_RECIPES``).
        log_every: on the fused path, ``step_deferred`` materialises records (one transfer)
            every ``log_every`` steps; default 1 on CPU (a sync is free there), 50 elsewhere.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn | None = None,
        *,
        dtype: str = "bf16",
        max_norm: float = 1.0,
        clip: ClipPolicy | None = None,
        scheduler: Any = None,
        accumulation_steps: int = 1,
        device_type: str | None = None,
        scaler: LossScaler | None = None,
        skip_monitor: SkipRateMonitor | None = None,
        clip_window: int = 1000,
        forensics: Any = None,
        fused: bool | None = None,
        log_every: int | None = None,
        **unknown: Any,
    ) -> None:
        check_setup(model, optimizer, loss_fn, max_norm, clip, clip_window, unknown)
        self.autocast_dtype = parse_dtype(dtype)
        self.dtype = dtype
        self.device_type = model_device_type(model)
        check_arguments(self.device_type, device_type, dtype, accumulation_steps, scaler)
        check_scheduler(scheduler, optimizer)
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self._loss_of = loss_function(model, loss_fn)  # (x, y) -> the micro-batch's loss
        self.clip = clip if clip is not None else GlobalNormClip(max_norm)
        self.clip.bind_model(unwrap(model))  # e.g. agc built without named_params: the model's names
        self.replicas = replicas_of(model)
        refusal = self.gradients.refusal(
            has_loss_fn=loss_fn is not None,
            accumulation_steps=accumulation_steps,
            dtype=dtype,
            world_size=self.replicas.size,
            world_kind=self.replicas.kind,
        )
        if refusal is not None:
            raise ValueError(refusal)
        check_sharding(self.replicas.kind, self.clip, forensics is not None, whole_param_modes())
        self.scheduler = scheduler
        self.accumulation_steps = accumulation_steps
        self.scaler = scaler if scaler is not None else LossScaler(self.device_type, enabled=dtype == "fp16")
        self.skip_monitor = skip_monitor if skip_monitor is not None else SkipRateMonitor()
        self.clip_monitor = ClipRatioMonitor(clip_window)
        self.forensics = forensics if forensics is not None else NoForensics()
        self.params = optimizer_params_in_model_order(model, optimizer)  # the sum order of clip_grad_norm_
        self._groups_key = param_groups_key(optimizer)
        self.step_count, self._updated = 0, False  # optimizer steps attempted (taken + skipped)
        self._init_pipeline(fused, log_every, forensics is not None)

    def _init_pipeline(self, fused: bool | None, log_every: int | None, forensics: bool) -> None:
        refusal = fused_path_refusal(self.optimizer, self.clip, forensics)
        if refusal is None and self.replicas.size > 1:
            refusal = (
                f"{self.replicas.kind} over {self.replicas.size} ranks: the default path agrees on skips and records"
            )
        if fused and refusal is not None:
            raise ValueError(f"fused=True: the fused path cannot run: {refusal}")
        self.pipeline = "fused" if fused is not False and refusal is None else "default"
        self.fused_recipe = factor_recipe(self.params) if self.pipeline == "fused" else None
        self._pending = RecordBuffer()  # fused path: device rows not yet materialised
        self._ready: list[StepLog] = []  # default path: records materialised at once
        self.log_every = log_every if log_every is not None else (1 if self.device_type == "cpu" else 50)

    @property
    def log_every(self) -> int:
        """Steps between the fused path's flushes (the class's ``log_every``); may be set between flushes."""
        return self._log_every

    @log_every.setter
    def log_every(self, value: int) -> None:
        self._log_every, self._device_lr = flush_window(value, len(self._pending), self.pipeline, self.scheduler)
        self._scheduler_seen = scheduler_mark(self.scheduler)  # where the next step expects the scheduler

    @property
    def gradients(self) -> GradientSource:
        """Where the gradients come from: the clip policy's own source (DP-SGD) or the scaled backward."""
        return self.clip.gradient_source or _SCALED_BACKWARD

    # -- the step -------------------------------------------------------------------------
    def autocast(self):
        return torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.dtype != "fp32")

    def step(self, inputs: Any, targets: Any) -> StepLog:
        """Run one optimizer step over ``(inputs, targets)``; return a ``StepLog`` or ``SkipLog``.

        The record is materialised at once (one host sync on the fused path); see
        ``step_deferred`` for the sync-free loop. Raises ``SkipRateExceeded`` (with the step's
        record as ``.record``) when the fail-fast skip-rate check trips, and the clip policy's
        ``ValueError`` from ``observe`` (e.g. a ``CalibrationError``), also with ``.record``.
        """
        if len(self._pending):
            raise RuntimeError(f"{len(self._pending)} records are pending: call flush() before step()")
        self._run(inputs, targets)
        return self.flush()[-1]

    def step_deferred(self, inputs: Any, targets: Any) -> list[StepLog]:
        """Run one optimizer step; return the records materialised by this call, oldest first.

        Fused path: ``[]`` between flushes, at a flush (every ``log_every`` steps, or earlier when
        ``needs_records`` asks) the records since the last. Default path: this step's. Then ``flush()``.
        """
        self._run(inputs, targets)
        due = len(self._pending) + len(self._ready) >= self.log_every or self.clip.needs_records(self.step_count)
        due = due or (self._device_lr is not None and len(self._pending) >= self._device_lr.known)
        return self.flush() if due or self._ready else []

    def flush(self) -> list[StepLog]:
        """Materialise the pending records (one transfer) and feed them to the monitors.

        Each record then goes to the clip policy's ``observe`` and the monitors, in step order.
        Raises ``SkipRateExceeded`` (or the policy's ``ValueError``) with ``.record`` (the step
        that raised) and ``.records`` (every record of this flush, to be written by the caller).
        """
        records, self._ready = self._ready + self._pending.drain(), []
        self.scaler.poll()  # a device-side scaler's counters (and its floor warning) reach the host
        if self._device_lr is not None and records:
            try:  # the LR lambda raises here where LambdaLR.step() would raise (past the end of a schedule)
                self._device_lr.sync(self._device_lr.start + sum(not r.skipped for r in records))
            except Exception as e:
                e.records = records  # type: ignore[attr-defined]
                raise
        self._scheduler_seen = scheduler_mark(self.scheduler)
        for record in records:
            try:
                self.clip.observe(record)  # e.g. a calibration window closes
            except ValueError as e:
                e.record, e.records = record, records
                raise
            if not record.skipped:
                self.clip_monitor.add(record.clipped)
            try:
                self.skip_monitor.update(record.skipped, step=record.step)
            except SkipRateExceeded as e:
                e.record, e.records = record, records
                raise
        return records

    def _run(self, inputs: Any, targets: Any) -> None:
        check_scheduler_untouched(self.scheduler, self._scheduler_seen)
        if param_groups_key(self.optimizer) != self._groups_key:
            self._follow_param_groups()
        self.step_count, self._updated = self.step_count + 1, False  # _updated: its optimizer pass ran
        try:
            if self.pipeline == "fused":
                fused_step(self, inputs, targets)
            else:
                lr = float(self.optimizer.param_groups[0]["lr"])
                scale = self.scaler.get_scale()  # sync (fp16 on an accelerator only): the scale this step uses
                self._ready.append(self._step(inputs, targets, lr, scale))
        except BaseException:
            if not self._updated:  # raised before the update (an OOM in forward, say): no step, no number used
                self.step_count -= 1
            raise
        finally:
            self.replicas.zero_grad(self.optimizer, aborted=not self._updated)  # FSDP2: unreduced ones too
            self._scheduler_seen = scheduler_mark(self.scheduler)

    def _follow_param_groups(self) -> None:
        """The optimizer's parameters changed since the last step (``add_param_group``, say): norm, check
        and clip exactly the parameters it now updates. A group the scheduler was not built for, or (on the
        fused path) one the fused kernels cannot take, is a ``ValueError`` before anything runs."""
        check_scheduler_groups(self.scheduler, self.optimizer)
        params = optimizer_params_in_model_order(self.model, self.optimizer)
        if self.pipeline == "fused":
            self.fused_recipe = refit_recipe(self.optimizer, self.clip, params)
        self.params, self._groups_key = params, param_groups_key(self.optimizer)

    def _step(self, inputs: Any, targets: Any, lr: float, scale: float) -> StepLog:
        """The default path: per micro-batch one (global) finite-loss check before backward, then the
        canonical passes. Under DDP/FSDP2 the check, the loss and the token count are global. After a
        non-finite loss, later micro-batches are forwarded without backward: the skip records the batch's
        tokens and draws the RNG as the fused path does."""
        k, world, bad = self.accumulation_steps, self.replicas, False
        acc = GlobalBatchLoss(_batch_size(inputs), k, world)
        for i, (x, y) in enumerate(self._micro_batches(inputs, targets)):
            with world.micro_batch(last=i == k - 1):  # DDP no_sync / FSDP2 no reduce-scatter before the last
                loss = acc.add(self._forward(x, y), _batch_size(x))  # sync: the finite-loss check, global
                bad = bad or loss is None  # a non-finite loss on some rank never reaches backward on any rank
                if not bad:
                    self._backward(loss, x, y)
        if bad:
            self.scaler.back_off()
            return self._skip("nonfinite_loss", lr, scale, acc)
        acc.check_tokens()
        return self._update(acc, lr, scale)

    def _micro_batches(self, inputs: Any, targets: Any):
        k = self.accumulation_steps
        check_accumulation(_batch_size(inputs), k)
        return zip(_split(inputs, k), _split(targets, k)) if k > 1 else [(inputs, targets)]

    def _forward(self, x: Any, y: Any) -> Any:
        with self.autocast(), torch.set_grad_enabled(self.gradients.builds_graph):
            return self._loss_of(x, y)  # checked: clipamp_engine.checks.checked_loss

    def _backward(self, loss: torch.Tensor, x: Any, y: Any) -> None:
        self.gradients.backward(loss, self.scaler, self.model, self.loss_fn, x, y)

    def _update(self, acc: GlobalBatchLoss, lr: float, scale: float) -> StepLog:
        """The canonical passes after backward: unscale → check → clip → step → schedule → scaler."""
        self.scaler.unscale_(self.optimizer)
        params = [p for p in self.params if p.grad is not None]
        grads = grads_of(params)
        if acc.tokens is not None and acc.ref != acc.tokens:
            scale_grads_(grads, acc.ref / acc.tokens)  # exact token mean of the accumulated (global) batch
        pre = total_norm(grads)  # global: DDP gradients are all-reduced, FSDP2 shards reduced over the mesh
        if not bool(torch.isfinite(pre)):  # sync: refuse the update, state untouched (same on every rank)
            self.scaler.update()  # fp16: the recorded inf check backs the scale off
            return self._skip("nonfinite_grad", lr, scale, acc, pre)

        post = self.clip.clip_(params, grads, pre, self.step_count)
        self.forensics.before_step(params, grads, self.optimizer)
        self.clip.before_step(params, self.optimizer)
        self.scaler.step(self.optimizer)
        self._updated = True
        clip_extra = self.clip.after_step(params, self.optimizer) or {}  # e.g. update_l2_pre_clip (0-dim)
        extra = self.forensics.after_step(params, self.optimizer)
        self.scaler.update()
        names = list(clip_extra)
        added = (full_tensor(torch.as_tensor(clip_extra[n], dtype=pre.dtype)).to(pre.device) for n in names)
        pre_f, post_f, *values = torch.stack([pre, post, *added]).tolist()  # sync: the record
        log = StepLog(
            step=self.step_count,
            lr=lr,
            grad_l2_pre_clip=pre_f,
            grad_l2_post_clip=post_f,
            loss=acc.loss,
            scaler_scale=scale,
            clipped=post_f < pre_f,
            token_count=acc.token_count,
            max_norm=self.clip.threshold,
            extra={**dict(zip(names, values)), **extra},
        )
        if self.scheduler is not None:
            try:  # after the update: a scheduler that raises (past a table's end) leaves the step's record
                self.scheduler.step()
            except Exception as e:
                e.record, e.records = log, [log]  # type: ignore[attr-defined]
                raise
        return log

    def _skip(
        self, reason: str, lr: float, scale: float, acc: GlobalBatchLoss, pre: torch.Tensor | None = None
    ) -> SkipLog:
        pre_f = float("nan") if pre is None else float(pre)  # sync: the record
        return SkipLog(
            step=self.step_count,
            lr=lr,
            grad_l2_pre_clip=pre_f,
            grad_l2_post_clip=float("nan"),
            loss=acc.loss,
            scaler_scale=scale,
            clipped=False,
            token_count=acc.token_count,
            max_norm=self.clip.threshold_at(self.step_count),
            skip_reason=reason,
        )

    # -- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything a resumed run needs, model and optimizer included (a DDP model as its module)."""
        if len(self._pending):
            raise RuntimeError(f"{len(self._pending)} records are pending: call flush() before state_dict()")
        return {
            "model": unwrap(self.model).state_dict(),
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
        """Restore ``state_dict()`` if it fits (``check_checkpoint_fits``); ``model``/``optimizer`` entries
        missing are left alone (FSDP2 shards are restored through ``torch.distributed.checkpoint``)."""
        check_checkpoint_fits(state, self.dtype, self.scheduler is not None, self.clip)
        if "model" in state:
            unwrap(self.model).load_state_dict(state["model"])
        if "optimizer" in state:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.clip.load_state_dict(state["clip"])
        self.skip_monitor.load_state_dict(state["skip_monitor"])
        self.clip_monitor.load_state_dict(state["clip_monitor"])
        self.step_count = state["step_count"]
        self._pending, self._ready = RecordBuffer(), []
        self.log_every = self._log_every  # the device LR window follows the loaded schedule
