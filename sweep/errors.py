"""User mistakes: one line, exit status 2, no traceback."""

from __future__ import annotations

import os
import sys
import time

#: How long a rank other than 0 waits for rank 0 to print a shared mistake (see ``fail``).
RANK_GRACE_S = 5.0


def one_line(e: BaseException, limit: int | None = None) -> str:
    """``Type: message`` on one line (whitespace runs collapsed; ``no message`` when empty), the message
    cut at a word within ``limit`` characters: how a library's exception is quoted inside a ``UserError``."""
    text = (clip_words(str(e), limit) if limit else " ".join(str(e).split())) or "no message"
    return f"{type(e).__name__}: {text}"


def clip_words(text: str, limit: int = 300) -> str:
    """``text`` on one line, at most ``limit`` characters, cut at a word boundary and marked ``…``."""
    text = " ".join(str(text).split())
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit)
    return text[: cut if cut > limit // 2 else limit].rstrip(" ,;:") + " …"


#: The runner's config names in a shared message, as the module commands' flags spell them.
_FLAGS = (
    ("drop tracking.uri", "drop --tracking-uri"),
    ("tracking.uri=", "--tracking-uri "),
    ("tracking.experiment=", "--experiment "),
)


def for_commands(message: str) -> str:
    """A message written for ``python -m sweep`` overrides, worded for ``sweep.report`` / ``sweep.recommend``,
    whose options are ``--tracking-uri`` and ``--experiment``."""
    for config, flag in _FLAGS:
        message = message.replace(config, flag)
    return message


class UserError(ValueError):
    """A bad value a user can fix; the message names the value, the allowed set and the fix."""


def fail(message: str, status: int = 2) -> NoReturn:  # noqa: F821
    """Print ``error: <first line>`` to stderr and exit with ``status``.

    Under torchrun every rank meets the same mistake: rank 0 alone prints it. The other ranks give
    it up to ``RANK_GRACE_S`` to do so before they exit, since torchrun stops every rank as soon as
    one exits with an error, and rank 0 could be stopped before its line is out.
    """
    first = str(message).strip().splitlines()[0] if str(message).strip() else "unknown error"
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {first}", file=sys.stderr)
    else:
        time.sleep(RANK_GRACE_S)  # torchrun ends this sleep when rank 0 exits
    sys.exit(status)


def one_line_warnings() -> None:
    """Show the engine's and the app's own warnings (their categories' modules) as ``warning: MESSAGE``, the
    app's other lines' form, instead of Python's ``FILE:LINE: Category: MESSAGE`` and the source line
    (a loop line of ``sweep.run`` that says nothing to the user); other libraries' keep Python's form."""
    import warnings

    python_form = warnings.formatwarning

    def form(message, category, filename, lineno, line=None) -> str:
        if category.__module__.split(".")[0] in ("clipamp_engine", "sweep"):
            return f"warning: {' '.join(str(message).split())}\n"
        return python_form(message, category, filename, lineno, line)

    warnings.formatwarning = form
