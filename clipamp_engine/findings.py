"""What a diagnosis finds: the kinds of norm pattern, their usual causes, a ``Finding``, and its
markdown rendering (``clipamp_engine.diagnosis`` finds them)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

FINDING_KINDS = (
    "nonfinite",
    "zero_norm",
    "spikes",
    "slow_growth",
    "always_clipped",
    "sustained_clipping",
    "scale_oscillating",
    "scale_at_floor",
)
SEVERITIES = ("info", "warning", "error")
CAUSES = {
    "nonfinite": "overflow, an invalid loss or bad input; clipping does not fix NaNs",
    "zero_norm": "a detached graph, frozen parameters or an empty loss mask",
    "spikes": "bad samples, long sequences or label bugs",
    "slow_growth": "LR too high, instability accumulating",
    "always_clipped": "τ too low, or the LR / loss scale / loss normalisation is wrong: clipping should catch "
    "spikes, not set the step length",
    "sustained_clipping": "clipping has become the normal step length after warm-up (a warning sign "
    "for pretraining): the LR, the loss scale or τ from a window that missed a change",
    "scale_oscillating": "overflows recur soon after every growth; the scale never settles",
    "scale_at_floor": "gradients overflow even at the smallest loss scale: check the loss, the LR, fp16 ranges "
    "(or use bf16)",
}


@dataclass(frozen=True)
class Finding:
    """One named pattern in a norm trace, with the steps and figures that show it."""

    kind: str
    severity: str
    message: str
    steps: list[int] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)


# -- reading rows ----------------------------------------------------------------------------


def format_findings(findings: Sequence[Finding], max_steps: int = 10, *, markdown: bool = True) -> str:
    """A bullet list of findings: markdown for a report, or plain text for a terminal (``markdown=False``)."""
    if not findings:
        return "- no findings: the norm trace shows none of the known failure patterns\n"
    lines = []
    for f in findings:
        steps = ""
        if f.steps:
            shown = ", ".join(map(str, f.steps[:max_steps]))
            more = f" … (+{len(f.steps) - max_steps})" if len(f.steps) > max_steps else ""
            steps = f" — steps {shown}{more}"
        kind = f"**{f.kind}**" if markdown else f.kind
        lines.append(f"- {kind} ({f.severity}): {f.message}{steps}")
    return "\n".join(lines) + "\n"
