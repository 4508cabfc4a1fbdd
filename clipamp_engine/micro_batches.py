"""Micro-batches for gradient accumulation: split a batch along its first dimension."""

from __future__ import annotations

from typing import Any

import torch


def split(batch: Any, k: int) -> list[Any]:
    """``batch`` (a tensor, or a tuple/list/dict of them) as ``k`` micro-batches along dim 0."""
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, k))
    if isinstance(batch, (tuple, list)):
        parts = [split(b, k) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(k)]
    if isinstance(batch, dict):
        parts = {key: split(v, k) for key, v in batch.items()}
        return [{key: v[i] for key, v in parts.items()} for i in range(k)]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into micro-batches")


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the first tensor's leading dimension."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (tuple, list)):
        return batch_size(batch[0])
    return batch_size(next(iter(batch.values())))
