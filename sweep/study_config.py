"""Schema of ``study`` (the Optuna sweep of max_norm × dtype), used by ``+experiment=sweep``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class StudyConfig:
    mode: str = "pareto"  # pareto (loss vs clipping ratio) | constrained (loss, clip ratio in a band)
    n_trials: int = 8
    name: Optional[str] = None  # default: derived from task and mode; same name + storage = resume
    storage: Optional[str] = None  # default: sqlite:///mlruns/optuna.db beside the tracking store
    sampler: str = "tpe"
    dtypes: List[str] = field(default_factory=lambda: ["fp16", "bf16"])
    max_norm_low: float = 0.05
    max_norm_high: float = 20.0
    target_clip_low: float = 0.0
    target_clip_high: float = 0.2
