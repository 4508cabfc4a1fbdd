"""Global gradient norms: measure (never mutate) apart from scale (take a norm already computed).

Dense gradients go through torch's fused ``_foreach_norm`` (one kernel per device/dtype group,
accumulating in at least fp32: fp16/bf16/fp32 in fp32, fp64 in fp64); sparse COO gradients are
coalesced and normed from their values, never densified. FSDP2 gradients (DTensor shards)
give the norm over the whole mesh. Nothing here syncs with the host except ``has_non_finite_grad``
(one sync, for its bool).

References:
    Pascanu, Mikolov, Bengio, "On the difficulty of training recurrent neural networks",
    arXiv:1211.5063 (global-norm clipping).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch

from ._torch_compat import dtensor_class, sparse_values

Params = torch.Tensor | Iterable[torch.Tensor]

#: The epsilon ``torch.nn.utils.clip_grad_norm_`` adds to the norm before dividing.
CLIP_EPS = 1e-6


def grads_of(parameters: Params) -> list[torch.Tensor]:
    """The ``.grad`` tensors of ``parameters``, ``None`` skipped, sparse ones coalesced in place."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = []
    for p in parameters:
        g = p.grad
        if g is None:
            continue
        if g.is_sparse and not g.is_coalesced():
            g = p.grad = g.coalesce()
        grads.append(g)
    return grads


def dense_views(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Dense tensors to run foreach kernels on: sparse COO tensors contribute their values.

    The values alias the sparse tensor's storage, so in-place ops on them act on the gradient,
    and a coalesced tensor stays coalesced (``sparse.mul_`` would clear the flag).
    """
    return [sparse_values(t) if t.is_sparse else t for t in tensors]


def group_indices(tensors: list[torch.Tensor], with_dtype: bool) -> dict[tuple, list[int]]:
    """Indices of ``tensors`` grouped by device (and dtype): one fused kernel per group."""
    groups: dict[tuple, list[int]] = defaultdict(list)
    for i, t in enumerate(tensors):
        groups[(t.device, t.dtype) if with_dtype else (t.device,)].append(i)
    return groups


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a norm of ``dtype`` values accumulates in: at least fp32, never narrower."""
    return torch.promote_types(dtype, torch.float32)


def record_dtype(device: torch.device) -> torch.dtype:
    """The dtype a step's scalars (its loss, token count, record row) are summed and kept in on ``device``:
    fp64, in which an fp32 loss times a batch size is exact; fp32 on MPS, which has no fp64."""
    return torch.float32 if device.type == "mps" else torch.float64


def per_tensor_norms(tensors: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """Norm of each tensor (sparse: of its values) as one 1-D tensor, in input order.

    One fused ``_foreach_norm`` per (device, dtype) group, accumulating in
    ``accumulation_dtype`` (fp16/bf16/fp32 → fp32, fp64 → fp64); the result is fp64 if any
    tensor is fp64, else fp32, and lives on the first tensor's device. An uncoalesced sparse
    tensor (an embedding row looked up twice holds two entries) is normed from its coalesced copy:
    its raw values are not the gradient's entries.
    """
    views = [sparse_values(t if t.is_coalesced() else t.coalesce()) if t.is_sparse else t for t in tensors]
    if not views:
        return torch.zeros(0, dtype=torch.float32)
    out: list[torch.Tensor] = [None] * len(views)  # type: ignore[list-item]
    for (_, dtype), idx in group_indices(views, with_dtype=True).items():
        norms = torch._foreach_norm([views[i] for i in idx], norm_type, dtype=accumulation_dtype(dtype))
        for i, n in zip(idx, norms):
            out[i] = n
    device = views[0].device
    return torch.stack([n.to(device) for n in out])  # stack promotes fp32 + fp64 → fp64


def total_norm(grads: list[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """Norm of all ``grads`` as one concatenated vector, as a 0-dim tensor (fp64 if any
    gradient is fp64, else fp32). For fp32/fp64 gradients it equals
    ``torch.nn.utils.get_total_norm``; fp16/bf16 gradients are normed in fp32 here, where torch
    norms them in their own dtype.

    Non-finite entries propagate (inf → inf, nan → nan), so ``isfinite(total_norm(g))`` is a
    one-kernel non-finite check for the L2 and inf norms.
    """
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return full_tensor(torch.linalg.vector_norm(per_tensor_norms(grads, norm_type), norm_type))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor as the plain tensor it stands for (a collective over its mesh); others as is.

    The norm of FSDP2's sharded gradients is a DTensor whose reduction is pending or already
    replicated; the full value is the norm of the whole unsharded gradient, equal on every rank.
    """
    dtensor = dtensor_class()  # None while nothing imported DTensor: then none exists
    return t.full_tensor() if dtensor is not None and isinstance(t, dtensor) else t


def replicated(t: torch.Tensor) -> torch.Tensor:
    """A DTensor whose reduction is pending (a ``Partial`` placement: the norm of an FSDP2-sharded vector,
    or over a sharded dim) as the replicated DTensor of its value (a collective over its mesh); any other
    tensor as is. Unlike ``full_tensor`` it stays a DTensor, so it mixes with FSDP2's shards in one
    foreach op, and in-place ops on it are allowed (DTensor refuses them on a ``Partial``)."""
    dtensor = dtensor_class()
    if dtensor is None or not isinstance(t, dtensor) or not any(p.is_partial() for p in t.placements):
        return t
    from torch.distributed.tensor import Replicate  # imported already: t is a DTensor

    return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])


def scale_grads_(grads: list[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply every gradient (sparse: its values) in place by one factor (fused, no sync)."""
    views = dense_views(grads)
    for (device,), idx in group_indices(views, with_dtype=False).items():
        f = factor.to(device) if isinstance(factor, torch.Tensor) else factor
        torch._foreach_mul_([views[i] for i in idx], f)


def clip_coefficient(norm: torch.Tensor, max_norm: float | torch.Tensor) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` without branching (torch's clamp, no host sync)."""
    return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)


def clip_global_l2_norm(parameters: Params, max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip all gradients by their global L2 norm, in place; return ``(pre, post)`` norms.

    Scales by ``min(1, max_norm / (pre + 1e-6))`` like ``torch.nn.utils.clip_grad_norm_``
    (exactly so for dense fp32/fp64 grads; fp16/bf16 grads are normed in fp32 here, in their own
    dtype by torch), sparse grads included without densifying. Non-finite gradients are never
    "clipped": they are left untouched and reported through a non-finite ``pre`` (and ``post``).

    Args:
        parameters: tensors (or one tensor) whose ``.grad`` to clip; ``None`` grads skipped.
        max_norm: the threshold τ (> 0).

    Returns:
        ``(pre, post)``: 0-dim tensors (fp64 if any gradient is fp64, else fp32);
        ``post = pre · coefficient``.
    """
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r} must be > 0 (use clip mode 'none' to disable)")
    grads = grads_of(parameters)
    pre = total_norm(grads)
    finite = torch.isfinite(pre)
    coef = torch.where(finite, clip_coefficient(pre, max_norm), torch.ones_like(pre))
    scale_grads_(grads, coef)
    return pre, pre * coef


def has_non_finite_grad(parameters: Params) -> bool:
    """True if any gradient holds an inf or NaN (fused max-abs per group; one host sync)."""
    grads = grads_of(parameters)
    return not bool(torch.isfinite(total_norm(grads, float("inf"))))  # sync: the answer is a bool
