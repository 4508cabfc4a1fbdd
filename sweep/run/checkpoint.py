"""Checkpoints of a run: written atomically, never from non-finite parameters or optimizer state."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any

import torch

from clipamp_engine import AmpTrainState, total_norm

CHECKPOINT_NAME = "checkpoint.pt"


def non_finite_state(state: AmpTrainState) -> str | None:
    """Name what is non-finite in the model parameters or optimizer state, else ``None``."""
    params = [p.detach() for p in state.model.parameters()]
    if params and not bool(torch.isfinite(total_norm(params, float("inf")))):  # sync: once per checkpoint
        return "model parameters"
    moments = [v for s in state.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel() > 0]
    if moments and not bool(torch.isfinite(total_norm(moments, float("inf")))):  # sync
        return "optimizer state"
    return None


def save_checkpoint(path: Path, state: AmpTrainState, **extra: Any) -> bool:
    """Write ``state`` (+ ``extra``) to ``path`` atomically; refuse (warn, keep the old file) if non-finite."""
    bad = non_finite_state(state)
    if bad is not None:
        warnings.warn(f"checkpoint at step {state.step_count} refused: {bad} hold inf/NaN; "
                      f"keeping the previous checkpoint {path}", RuntimeWarning, stacklevel=2)
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"engine": state.state_dict(), "rng": torch.get_rng_state(), **extra}, tmp)
    os.replace(tmp, path)
    return True


def load_checkpoint(path: Path) -> dict[str, Any]:
    return torch.load(path, map_location="cpu", weights_only=False)
