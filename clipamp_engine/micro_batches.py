"""Micro-batches for gradient accumulation: split a batch along its first dimension."""

from __future__ import annotations

from typing import Any

import torch


def split(batch: Any, k: int) -> list[Any]:
    """``batch`` as ``k`` micro-batches along dim 0: a tensor, ``None`` (no targets), a tuple/list/dict of
    those, or a list of samples (strings, say) chunked as ``torch.tensor_split`` chunks a tensor."""
    if batch is None:
        return [None] * k
    if isinstance(batch, torch.Tensor):
        return list(torch.tensor_split(batch, k))
    if isinstance(batch, dict):
        parts = {key: split(v, k) for key, v in batch.items()}
        return [{key: v[i] for key, v in parts.items()} for i in range(k)]
    if isinstance(batch, (tuple, list)) and not any(_is_structure(b) for b in batch):
        n = len(batch)
        bounds = [i * (n // k) + min(i, n % k) for i in range(k + 1)]
        return [batch[bounds[i] : bounds[i + 1]] for i in range(k)]
    if isinstance(batch, (tuple, list)):
        parts = [split(b, k) for b in batch]
        return [type(batch)(p[i] for p in parts) for i in range(k)]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__} into micro-batches")


def batch_size(batch: Any) -> int:
    """Samples in ``batch``: the leading dimension of its first tensor or list of samples (depth first);
    ``ValueError`` if it holds neither."""
    size = _first_tensor_rows(batch)
    if size is None:
        raise ValueError(
            f"cannot tell the batch size of a {type(batch).__name__} that holds no tensor and no list of samples: "
            "pass the inputs as a tensor, or a tuple, list or dict holding one"
        )
    return size


def _is_structure(b: Any) -> bool:
    return b is None or isinstance(b, (torch.Tensor, tuple, list, dict))


def _first_tensor_rows(batch: Any) -> int | None:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (tuple, list)) and batch and not any(_is_structure(b) for b in batch):
        return len(batch)  # a list of samples
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (tuple, list)) else ()
    for v in values:
        size = _first_tensor_rows(v)
        if size is not None:
            return size
    return None
