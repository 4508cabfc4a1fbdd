"""Ctrl-C during the app's start-up (seconds of imports and config composition): one line, exit 130.

Installed first, before any heavy import, by ``python -m sweep`` (``sweep/__main__.py``) and by the
``clipamp`` console script (``sweep.console``); the app turns it off once it handles Ctrl-C itself.
"""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_at_start(signum, frame) -> None:
    """Exits at once (``os._exit``): no run exists yet, and an exception raised here would unwind
    through whatever import was running (a half-imported numpy then fails later with a RecursionError)."""
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write("interrupted during start-up: no run was started, nothing to resume\n")
        sys.stderr.flush()
    os._exit(130)


def startup_sigint(on: bool) -> None:
    """Ctrl-C during start-up is one line (``on``), then the app's own handling; an ignored SIGINT
    (a background job) stays ignored."""
    current = signal.getsignal(signal.SIGINT)
    if on and current is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_at_start)
    elif not on and current is _interrupted_at_start:
        signal.signal(signal.SIGINT, signal.default_int_handler)
