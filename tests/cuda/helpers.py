"""Shared pieces of the CUDA tests: the marker pair, a two-layer model with fault injection, sync counting.

Every module here sets ``pytestmark = CUDA``: the tests carry the ``cuda`` marker (``pytest -m cuda``
selects them) and skip with the reason "needs a CUDA device" wherever none is visible.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.engine.test_step import Tiny

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def Net() -> Tiny:
    """The engine tests' fault-injecting two-layer model, 32 wide."""
    return Tiny(hidden=32)


def batch(i: int, n: int = 8, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic batch ``i`` on the GPU (drawn on the CPU, so every run sees the same numbers)."""
    g = torch.Generator().manual_seed(i)
    x, y = torch.randn(n, 6, generator=g), torch.randn(n, 1, generator=g)
    return (x * scale).cuda(), (y * scale).cuda()


def params_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def count_syncs(fn) -> tuple[object, int]:
    """Run ``fn()``; return its result and the number of host syncs CUDA's sync debug mode saw.

    ``torch.cuda.set_sync_debug_mode("warn")`` warns once per synchronising call (a device→host copy,
    ``.item()``, a stream synchronize, a blocking host→device copy).
    """
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum("synchronizing CUDA operation" in str(w.message) for w in seen)
