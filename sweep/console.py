"""The ``clipamp`` console script's entry point: the start-up Ctrl-C handler, then the app.

A console script imports its entry point's module before calling it, so that module must be light:
``sweep.__main__`` imports torch, Hydra and MLflow (seconds), during which a Ctrl-C would otherwise
end in a traceback.
"""

from __future__ import annotations

from sweep.startup import startup_sigint


def clipamp() -> None:
    """``clipamp ARGS``: the same CLI as ``python -m sweep ARGS``."""
    startup_sigint(True)
    from sweep.__main__ import cli

    cli()
