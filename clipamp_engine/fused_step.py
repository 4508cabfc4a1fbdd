"""The fused path of ``AmpTrainState``: forward, scaled backward and one sync-free update.

``fused_step(state, inputs, targets)`` is one optimizer step on the fused path: the forward and
scaled backward per micro-batch (a non-finite loss is caught with the gradients, not before
backward), then ``fused_update``: the norm of the scaled gradients, the skip flag and the clip
coefficient on the device, one fused optimizer pass that unscales, clips and steps (or skips),
then the scaler and the schedule; the step's record joins the device rows materialised at the
next flush (``clipamp_engine.fused.RecordBuffer``). Nothing here syncs with the host, except a
scheduler other than ``LambdaLR`` (stepped on taken steps only).

References:
    Micikevicius et al., "Mixed Precision Training", arXiv:1710.03740 (loss scaling).
    Pascanu, Mikolov, Bengio, arXiv:1211.5063 (global-norm clipping).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .checks import is_number
from .fused import apply_factor_and_step, global_coefficient, is_fusable
from .micro_batches import batch_size
from .norms import grads_of, record_dtype, total_norm

if TYPE_CHECKING:
    from .step import AmpTrainState

__all__ = ["forward_backward", "fused_step", "fused_update"]


def fused_step(state: AmpTrainState, inputs: Any, targets: Any) -> None:
    """One optimizer step on the fused path; its record is left pending in ``state``.

    Raises ``ValueError`` when ``state.clip`` was replaced by a policy that is not one global
    coefficient after the path was chosen.
    """
    if not is_fusable(state.clip):
        raise ValueError(
            f"clip mode {state.clip.mode!r} was set after the fused path was chosen and "
            "needs the default path: build AmpTrainState with fused=False"
        )
    loss_acc, tokens, ref = forward_backward(state, inputs, targets)
    fused_update(state, loss_acc, tokens, ref)


def forward_backward(state: AmpTrainState, inputs: Any, targets: Any):
    """The forward and scaled backward per micro-batch → ``(loss_acc, tokens, ref)`` on the device.

    ``loss_acc`` is the mean loss (or, for a ``(loss_sum, token_count)`` loss, the summed loss with
    ``tokens`` the summed count and ``ref`` the provisional normaliser the backward divided by).
    No sync: a non-finite loss is caught with the gradients.
    """
    k = state.accumulation_steps
    total = batch_size(inputs)
    loss_acc = tokens = ref = None
    host_tokens: float | None = 0.0  # the counts' total while every count is a Python number
    for x, y in state._micro_batches(inputs, targets):
        result = state._forward(x, y)
        if isinstance(result, tuple):  # (loss_sum, token_count): token mean over the whole batch
            loss_sum = result[0].float()
            count = torch.as_tensor(result[1], device=loss_sum.device)  # an int count too
            host_tokens = host_tokens + result[1] if host_tokens is not None and is_number(result[1]) else None
            # provisional normaliser, corrected after accumulation: from the first micro-batch with tokens
            # (one without has a zero sum, divided by 1)
            first = count.float() * k
            ref = first if ref is None else torch.where(ref > 0, ref, first)
            loss = loss_sum / torch.where(ref > 0, ref, torch.ones_like(ref))
            part = loss_sum.detach().to(record_dtype(loss_sum.device))
            tokens = count if tokens is None else tokens + count
        else:  # mean loss: weight each micro-batch by its share of the samples
            rows = batch_size(x)
            loss = result.float() / (total / rows) if k > 1 else result.float()  # loss / k
            part = result.detach().float().to(record_dtype(result.device)) * rows
        # the record's loss, summed wide as the default path sums it (GlobalBatchLoss): the same value
        loss_acc = part if loss_acc is None else loss_acc + part
        state._backward(loss, x, y)
    if tokens is None:
        loss_acc = loss_acc / total  # the samples' mean
    if tokens is not None and host_tokens is not None and not host_tokens > 0:
        raise ValueError(
            "loss_fn returned (loss_sum, token_count) with 0 tokens in the whole batch: the token count must be > 0 "
            "(a batch without real tokens has no token mean); return the number of tokens the sum is over"
        )
    return loss_acc, tokens, ref


def fused_update(
    state: AmpTrainState,
    loss_acc: torch.Tensor,
    tokens: torch.Tensor | None = None,
    ref: torch.Tensor | None = None,
) -> None:
    """Everything after backward on the fused path, for the gradients now in ``state``'s parameters.

    Norm of the scaled gradients → skip flag and clip coefficient on the device → the fused
    optimizer pass that unscales, clips and steps (or skips), by ``state.fused_recipe`` (see
    ``clipamp_engine.fused.FACTOR_RECIPES``) → scaler and schedule, no sync. The
    record (with the LR and loss scale in force before this update) is left pending in ``state``.

    Args:
        state: an ``AmpTrainState`` whose ``pipeline`` is ``"fused"``; its ``step_count`` is this step's.
        loss_acc, tokens, ref: what ``forward_backward`` returned (a mean loss: ``tokens = ref = None``).
    """
    lr = state.optimizer.param_groups[0]["lr"]
    lr = lr.detach().clone() if isinstance(lr, torch.Tensor) else lr  # the LR this step uses
    scale = state.scaler.scale_tensor()
    scale = scale.clone() if scale is not None else 1.0  # the scale this step's backward used
    params = [p for p in state.params if p.grad is not None]
    grads = grads_of(params)
    norm = total_norm(grads)
    factor = torch.ones_like(norm)  # what turns the stored gradient into the unscaled mean
    if isinstance(scale, torch.Tensor):  # GradScaler's inverse scale, computed the same way
        factor = scale.to(norm.device).double().reciprocal().float()
    if tokens is not None and state.accumulation_steps > 1:
        factor = factor * (ref / tokens.float()).to(norm.device)
    pre = norm * factor
    mean_loss = (loss_acc / tokens.to(loss_acc.dtype) if tokens is not None else loss_acc).to(norm.device)
    loss_finite = torch.isfinite(mean_loss)
    found_inf = (~(torch.isfinite(pre) & loss_finite)).float()
    coef = global_coefficient(state.clip, pre, state.step_count)
    apply_factor_and_step(state.optimizer, grads, factor * coef, found_inf, state.fused_recipe)
    state._updated = True
    state.scaler.record_inf_check(state.optimizer, found_inf)
    state.scaler.update()
    if state._device_lr is not None:
        state._device_lr.advance(found_inf)
    elif state.scheduler is not None and not bool(found_inf):  # sync: only LambdaLR runs on the device
        state.scheduler.step()
    state._pending.add(
        state.step_count,
        state.clip.threshold,
        [lr, pre, pre * coef, mean_loss, _tokens_or_nan(tokens, norm.device), scale, found_inf, loss_finite],
    )


def _tokens_or_nan(tokens: torch.Tensor | None, device: torch.device | str = "cpu") -> torch.Tensor:
    # exact: RecordBuffer widens it to fp64 (an fp32 count would round past 2**24 tokens)
    return tokens if tokens is not None else torch.full((), float("nan"), device=device)
