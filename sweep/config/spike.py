"""Schema of ``spike`` (the seed's bad-batch replay), used by ``+experiment=spike``.

See ``sweep.spike`` for what each arm does; ``sweep.spike.check_spike_config`` checks meaning.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

#: The fp16 variant's sizes: fp16 matmuls have no fast CPU kernel (the default GPT takes ~1.7 s a
#: step in fp16), so it runs a smaller GPT (20–40 ms a step). ``amp.growth_interval=20`` lets the
#: loss scale climb to its ceiling within the run, where a long fp16 run sits (2^17–2^18 here).
FP16_OVERRIDES = ["model.d_model=32", "model.n_layer=2", "model.n_head=2", "model.block_size=64",
                  "data.batch_size=8", "data.seq_len=64", "amp.growth_interval=20"]


@dataclass
class SpikeConfig:
    at_step: int = 150  # the corrupted batch is fed at this step (after a calibration window ends)
    factor: float = 20.0  # its pre-clip gradient norm = factor × the running peak
    peak_window: int = 50  # the running peak is over this many steps before the spike (0: since step 1)
    fixed_max_norm: float = 1.0  # the "common threshold" arm
    horizons: List[int] = field(default_factory=lambda: [1, 5, 20, 100])  # loss_excess_H, steps after
    recovery_tolerance: float = 0.05  # "recovered": loss within 5% of the unspiked reference to the end
    fp16: bool = True  # also run the fp16 variant (reference + calibrated, overflow expected)
    fp16_overrides: List[str] = field(default_factory=lambda: list(FP16_OVERRIDES))  # KEY=VALUE on top
    figure_out: Optional[str] = None  # also copy the parent run's figure here, e.g. docs/spike.png
