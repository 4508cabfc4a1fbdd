"""Schema of ``spike`` (the seed's bad-batch replay), used by ``+experiment=spike``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class SpikeConfig:
    at_step: int = 150  # the corrupted batch is fed at this step
    factor: float = 20.0  # its gradient norm ≈ factor × the running peak
    fixed_max_norm: float = 1.0  # the "common threshold" arm
    horizons: List[int] = field(default_factory=lambda: [1, 5, 20, 100])
    recovery_tolerance: float = 0.05
