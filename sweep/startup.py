"""Ctrl-C during the app's start-up (seconds of imports and config composition): one line, exit 130.

Installed first, before any heavy import, by ``python -m sweep`` (``sweep/__main__.py``) and by the
``clipamp`` console script (``sweep.console``); the app turns it off once it handles Ctrl-C itself.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

_line = ["interrupted during start-up: no run was started, nothing to resume"]


def _interrupted_at_start(signum, frame) -> None:
    """Exits at once (``os._exit``): nothing was done yet, and an exception raised here would unwind
    through whatever import was running (a half-imported numpy then fails later with a RecursionError)."""
    if os.environ.get("RANK", "0") == "0":
        sys.stderr.write(_line[0] + "\n")
        sys.stderr.flush()
    os._exit(130)


def startup_sigint(on: bool, line: str | None = None) -> None:
    """Ctrl-C during start-up is one line (``on``; the app's unless ``line`` is given), then the
    program's own handling; an ignored SIGINT (a background job) stays ignored."""
    if line is not None:
        _line[0] = line
    current = signal.getsignal(signal.SIGINT)
    if on and current is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_at_start)
    elif not on and current is _interrupted_at_start:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def exit_interruptible(main: Callable[[], int], line: str) -> NoReturn:
    """``sys.exit(main())`` for a tool that only reads (reports, recommendations): Ctrl-C once its
    imports are done is ``line`` and exit 130, not a traceback; a reader of its output that went away
    (``| head``) ends it quietly, as SIGPIPE ends other tools (exit 141)."""
    startup_sigint(False)
    try:
        code = main()
    except KeyboardInterrupt:
        sys.stderr.write(line + "\n")
        code = 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's own flush writes nowhere
        code = 128 + signal.SIGPIPE
    sys.exit(code)
