"""Warnings that point at the user's line, not at the engine's.

``warnings.warn(..., stacklevel=N)`` names the frame ``N`` calls up; the engine warns from different
depths (``step`` → ``flush`` → a monitor; ``step_deferred`` → …; a user's own ``flush()``), so a fixed
``N`` named a line inside ``clipamp_engine`` for most callers. ``warn`` walks up to the first frame
outside the package (Python 3.12's ``skip_file_prefixes`` does this; 3.11 is supported).
"""

from __future__ import annotations

import sys


def warn(message: str, category: type[Warning]) -> None:
    """``warnings.warn(message, category)`` attributed to the nearest caller outside ``clipamp_engine``."""
    import warnings

    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] == __package__:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level + 1)
