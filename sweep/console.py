"""The console scripts' entry points: the start-up Ctrl-C handler, then the program.

A console script imports its entry point's module before calling it, so that module must be light:
``sweep.__main__`` imports torch, Hydra and MLflow (seconds), during which a Ctrl-C would otherwise
end in a traceback.
"""

from __future__ import annotations

from sweep.recommend import STOPPED as RECOMMEND_STOPPED
from sweep.startup import defer_gc, exit_interruptible, startup_sigint


def clipamp() -> None:
    """``clipamp ARGS``: the same CLI as ``python -m sweep ARGS``."""
    startup_sigint(True)
    defer_gc()
    from sweep.__main__ import cli

    cli()


def clipamp_recommend() -> None:
    """``clipamp-recommend ARGS``: the same CLI as ``python -m sweep.recommend ARGS``."""
    startup_sigint(True, RECOMMEND_STOPPED)
    from sweep.recommend.cli import main

    exit_interruptible(main, RECOMMEND_STOPPED)
