"""A run in which every step was skipped trained nothing: it ends FAILED with the reason as a tag, and
the command exits with status 3 (not 0, not a user mistake's 2), one line naming the skip reasons.

Only ``train`` and ``calibrate`` runs: a sweep trial (or a spike arm) whose every step was skipped is a
result of the search (or of the experiment), which it records and goes on from.
"""

from __future__ import annotations

from collections import Counter

from sweep.errors import UserError

EXIT_NOTHING_TRAINED = 3


class NothingTrained(UserError):
    """Every step of the run was skipped; ``status`` is the exit status."""

    status = EXIT_NOTHING_TRAINED


def nothing_trained(rows: list[dict], run: str | None) -> NothingTrained | None:
    """``NothingTrained`` (not raised) if ``rows`` hold steps and all were skipped in a train/calibrate run."""
    if run not in ("train", "calibrate") or not rows or not all(r["skipped"] for r in rows):
        return None
    reasons = ", ".join(f"{reason or 'unknown'} ×{n}" for reason, n in Counter(r["skip_reason"] for r in rows).items())
    return NothingTrained(
        f"all {len(rows)} steps were skipped ({reasons}): nothing was trained and the run ended FAILED (its "
        "steps.csv and summary are kept); check amp.dtype, clip.max_norm, the data and the loss"
    )
