"""User mistakes: one line, exit status 2, no traceback."""

from __future__ import annotations

import os
import sys


class UserError(ValueError):
    """A bad value a user can fix; the message names the value, the allowed set and the fix."""


def fail(message: str, status: int = 2) -> "NoReturn":  # noqa: F821
    """Print ``error: <first line>`` to stderr and exit with ``status``.

    Under torchrun every rank meets the same mistake: rank 0 alone prints it.
    """
    first = str(message).strip().splitlines()[0] if str(message).strip() else "unknown error"
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {first}", file=sys.stderr)
    sys.exit(status)
