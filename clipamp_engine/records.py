"""Per-step records: what one optimizer step did, or why it was skipped."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

#: The canonical first eight columns of every per-step CSV, in this order.
CANONICAL_COLUMNS = (
    "step",
    "lr",
    "grad_l2_pre_clip",
    "grad_l2_post_clip",
    "loss",
    "skipped",
    "skip_reason",
    "scaler_scale",
)

#: Why a step can be skipped (a closed set). ``no_loss``: the host ran the step without a loss, so without a
#: backward and a gradient (Lightning's ``training_step`` returning ``None``).
SKIP_REASONS = ("nonfinite_loss", "nonfinite_grad", "no_loss")


@dataclass(frozen=True)
class StepLog:
    """An optimizer step that was taken.

    ``grad_l2_pre_clip`` is the global L2 norm of the unscaled, accumulated gradient;
    ``grad_l2_post_clip`` the norm the optimizer saw; ``clipped`` whether they differ.
    ``max_norm`` is the clipping threshold in force (None for modes without one);
    ``extra`` holds optional forensic columns (update_norm, data_source, …); ``pipeline``
    says which update path ran (``"fused"``: unscale and clip folded into a fused optimizer,
    ``"default"``: the canonical passes), constant for a run and not a CSV column.
    """

    step: int
    lr: float
    grad_l2_pre_clip: float
    grad_l2_post_clip: float
    loss: float
    scaler_scale: float
    clipped: bool
    token_count: int | None = None
    max_norm: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    skipped: bool = False
    skip_reason: str = ""
    pipeline: str = "default"

    def row(self) -> dict[str, Any]:
        """Flat dict: canonical columns first, then clipped, token_count, max_norm and extras."""
        out = {name: getattr(self, name) for name in CANONICAL_COLUMNS}
        out["clipped"] = self.clipped
        out["token_count"] = self.token_count
        out["max_norm"] = self.max_norm
        out.update(self.extra)
        return out

    def with_extra(self, **extra: Any) -> StepLog:
        return dataclasses.replace(self, extra={**self.extra, **extra})


@dataclass(frozen=True)
class SkipLog(StepLog):
    """A step whose optimizer update was refused; parameters and optimizer state untouched."""

    skipped: bool = True
    skip_reason: str = "nonfinite_grad"

    def __post_init__(self) -> None:
        if self.skip_reason not in SKIP_REASONS:
            raise ValueError(f"skip_reason={self.skip_reason!r} is not one of {', '.join(SKIP_REASONS)}")
