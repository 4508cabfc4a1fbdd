"""Data-parallel semantics of one optimizer step: what every rank must agree on, and how.

Under ``torchrun`` with DDP or FSDP2 (``fully_shard``) ``AmpTrainState`` keeps the ranks in
lockstep, so a step is taken or skipped everywhere with the same norm and record:

- **one global norm**: DDP all-reduces the gradients, so each rank's norm is the global one;
  FSDP2 gradients are DTensor shards whose norm ``total_norm`` materialises over the mesh.
- **one skip decision**: the per-micro-batch finite-loss check (a host sync the step already
  has) becomes one all-reduce of ``[loss contribution, tokens, samples]``; a non-finite sum
  means some rank saw a non-finite loss, and every rank refuses the step before backward.
  Non-finite gradients reach every rank through the gradient reduction itself.
- **one record**: the same all-reduce gives the global loss and token count.
- **one gradient reduction per step**: micro-batches before the last accumulate locally
  (DDP ``no_sync()``, FSDP2 ``set_requires_gradient_sync(False)``).
- **nothing carried over**: a step that ends without its update (a skip, an exception) leaves no
  gradient behind. DDP accumulates in ``.grad``, which ``zero_grad`` clears; FSDP2 keeps what
  micro-batches before a refused one accumulated in its own unsharded state, which ``zero_grad``
  does not reach: it is dropped too, and FSDP2's iteration state reset (``reset_iter_state``).

Single-process runs get the no-op ``Replicas``: same syncs, no collectives.

References:
    Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel Training",
    arXiv:2006.15704 (DDP, ``no_sync``). Zhao et al., "PyTorch FSDP", arXiv:2304.11277.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._torch_compat import compiled_original, fsdp_drop_unreduced_grads
from .norms import record_dtype

__all__ = ["DDPReplicas", "FSDPReplicas", "GlobalBatchLoss", "Replicas", "replicas_of", "unwrap"]


class Replicas:
    """One process: micro-batches need no context and sums are the local values."""

    size = 1
    kind = "none"

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """Context for one micro-batch's forward and backward; ``last`` reduces gradients."""
        return contextlib.nullcontext()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over ranks (here: the values themselves)."""
        return values

    def zero_grad(self, optimizer: torch.optim.Optimizer, aborted: bool) -> None:
        """End of a step: ``optimizer.zero_grad(set_to_none=True)``; ``aborted``: the step ended without its
        update (a skip, an exception), so gradients accumulated but never reduced are dropped as well."""
        optimizer.zero_grad(set_to_none=True)


class _Collective(Replicas):
    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.size = dist.get_world_size(group)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return values


class DDPReplicas(_Collective):
    """``DistributedDataParallel``: gradients are averaged over ``size`` ranks in backward."""

    kind = "ddp"

    def __init__(self, model: nn.parallel.DistributedDataParallel) -> None:
        super().__init__(model.process_group)
        self.model = model

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if last else self.model.no_sync()


class FSDPReplicas(_Collective):
    """FSDP2 (``fully_shard``): gradients are reduce-scattered (averaged) over the mesh."""

    kind = "fsdp2"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(None)
        self.model = model

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        self.model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def zero_grad(self, optimizer: torch.optim.Optimizer, aborted: bool) -> None:
        optimizer.zero_grad(set_to_none=True)
        if aborted:  # micro-batches before the refused one left unreduced gradients inside FSDP2
            self.model.reset_iter_state()  # a forward without its backward, as after an exception
            fsdp_drop_unreduced_grads(self.model)


class GlobalBatchLoss:
    """One step's loss over the global batch (all micro-batches, all ranks), in host floats.

    A loss function returns a mean loss, or ``(loss_sum, token_count)``. Each micro-batch's
    contribution (``mean · samples`` or ``loss_sum``), its token count and the local batch
    size are summed over ranks in one reduction, which is also the finite-loss check. The
    backward loss is weighted so that gradients averaged over ``W`` ranks are the mean over
    the global batch: ``mean / (B/(b·W))`` (samples; ``loss / k`` for ``k`` equal micro-batches, as the
    canonical accumulation loop divides it) or ``loss_sum · W/ref`` with ``ref`` the first
    micro-batch's global token count times ``k`` (corrected to the exact token total after
    accumulation).
    """

    def __init__(self, local_batch: int, k: int, world: Replicas) -> None:
        self.local_batch, self.k, self.world = local_batch, k, world
        self.contribution = 0.0
        self.samples = 0.0  # global batch size B
        self.tokens: float | None = None
        self.ref: float | None = None

    def add(self, result: Any, micro_batch: int) -> torch.Tensor | None:
        """Account one micro-batch; return its backward loss, or None if the loss is non-finite."""
        tokenwise = isinstance(result, tuple)
        loss = result[0] if tokenwise else result
        loss = loss.to(torch.promote_types(loss.dtype, torch.float32))  # fp16/bf16 → fp32; an fp64 loss stays fp64
        wide = record_dtype(loss.device)
        count = torch.as_tensor(result[1] if tokenwise else 0, device=loss.device).to(wide)
        part = loss.detach().to(wide) * (1 if tokenwise else micro_batch)
        local_batch = torch.tensor(self.local_batch, dtype=wide, device=loss.device)
        sums = self.world.sum(torch.stack([part, count, local_batch]))
        part_f, count_f, self.samples = sums.tolist()  # sync: the finite-loss check and the record
        if tokenwise and count_f < 0:
            raise ValueError(
                f"loss_fn returned (loss_sum, token_count) with {count_f:g} tokens: the token count must be >= 0 "
                "in a micro-batch and > 0 over the batch; return the number of tokens the sum is over"
            )
        self.contribution += part_f
        if tokenwise:
            self.tokens = (self.tokens or 0.0) + count_f
            if self.ref is None and count_f > 0:  # the first micro-batch with tokens (one without has a zero sum)
                self.ref = count_f * self.k
            if not math.isfinite(part_f):
                return None
            return loss / ((self.ref if self.ref is not None else 1.0) / self.world.size)
        if not math.isfinite(part_f):
            return None
        return loss / (self.samples / (micro_batch * self.world.size))  # k equal micro-batches: loss / k

    def check_tokens(self) -> None:
        """After the last micro-batch: a token mean needs at least one token in the (global) batch."""
        if self.tokens is not None and not self.tokens > 0:
            ranks = f" over {self.world.size} ranks" if self.world.size > 1 else ""
            raise ValueError(
                f"loss_fn returned (loss_sum, token_count) with 0 tokens in the whole batch{ranks}: the token count "
                "must be > 0 (a batch without real tokens has no token mean); return the number of tokens the sum "
                "is over"
            )

    @property
    def loss(self) -> float:
        count = self.tokens if self.tokens is not None else self.samples
        return self.contribution / count if count else math.nan

    @property
    def token_count(self) -> int | None:
        return None if self.tokens is None else int(self.tokens)


def unwrap(model: nn.Module) -> nn.Module:
    """The module under DDP and ``torch.compile`` wrappers, in any nesting (its state dict is one process's,
    without ``module.`` or ``_orig_mod.``, so that it loads into the plain model), else ``model``."""
    while True:
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else compiled_original(model)
        if inner is None:  # neither DDP nor torch.compile's wrapper
            return model
        model = inner


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed support
        return None
    return FSDPModule


def replicas_of(model: nn.Module) -> Replicas:
    """The data-parallel semantics ``model`` needs in the current process group.

    ``Replicas()`` when ``torch.distributed`` is not initialised or has one rank; DDP or FSDP2
    replicas when the model is wrapped accordingly.

    Raises:
        ValueError: several ranks but a model that is neither DDP nor ``fully_shard``-ed at
            its root (its gradients would never be reduced, and replicas would drift).
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return Replicas()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return DDPReplicas(model)
    fsdp = _fsdp_module_type()
    if fsdp is not None and isinstance(model, fsdp):
        return FSDPReplicas(model)
    raise ValueError(
        f"torch.distributed runs {dist.get_world_size()} ranks but the model is a plain "
        f"{type(model).__name__}: wrap it in DistributedDataParallel or apply fully_shard to its root module, "
        "so that gradients are reduced across ranks"
    )
