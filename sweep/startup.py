"""The app's start-up (seconds of imports and config composition): Ctrl-C is one line, exit 130, and
the cyclic garbage collector waits.

Installed first, before any heavy import, by ``python -m sweep`` (``sweep/__main__.py``) and by the
``clipamp`` console script (``sweep.console``); the app turns the handler off once it handles Ctrl-C itself,
and the collector's full collections back on once a run's model and optimizer are built.

The collector: start-up (torch, Hydra, MLflow, matplotlib, ``torch._dynamo`` that torch's optimizer
imports) builds some 600,000 objects that live as long as the process, and every full collection
while they pile up scans them all again: eight or nine of them were 15–20% of a short run's CPU time.
``defer_gc`` holds the full collections back (the young generations are still collected, so the
short-lived cycles of imports and config composition are freed) until ``resume_gc``, once the run's
model and optimizer are built: it moves the objects so far to the permanent generation
(``gc.freeze``, which no collection scans again) and restores the thresholds. Reference cycles that
outlived the young collections by then are kept, once per process: 1–3 MB in a short run, 8 MB in
one that creates its store (MLflow's migrations leave SQLAlchemy's schema objects in cycles).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable
from typing import NoReturn

_line = ["interrupted during start-up: no run was started, nothing to resume"]
_held: list[tuple[int, int, int]] = []  # the collector's thresholds while defer_gc holds full collections
_deferred = [False]  # once per process


def defer_gc() -> None:
    """No automatic full collection until ``resume_gc``; the young generations are collected as usual."""
    if gc.isenabled() and not _deferred[0]:
        _deferred[0] = True
        _held.append(gc.get_threshold())
        young, middle, _ = _held[0]
        gc.set_threshold(young, middle, 1 << 30)


def resume_gc() -> None:
    """After ``defer_gc``: the objects so far to the permanent generation, full collections back on."""
    if _held:
        gc.freeze()
        gc.set_threshold(*_held.pop())


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
