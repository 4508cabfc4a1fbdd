"""Passwords in URLs: one redaction for every form a URL takes, and the argv rewrite that keeps them
out of what Hydra writes (``multirun.yaml``, the ``overrides`` tag, its "Error executing job" line).

Each URL is parsed, not pattern-matched as a whole: its authority's userinfo runs, as in
``urllib.parse.urlsplit``, up to the *last* ``@`` of the URL, so a password holding ``@``
(``http://alice:p@ss@host``) is hidden whole. Forms seen: userinfo ``scheme://user:SECRET@host``,
Hydra-escaped ``scheme\\://user\\:SECRET@host``, and query parameters ``?password=SECRET`` /
``&token=SECRET``. A URL ends at whitespace or a quote; anything between its ``user:`` and its last
``@`` is taken for the password, so an unusual URL is over-hidden rather than leaked.
"""

from __future__ import annotations

import os
import re

#: ``scheme://`` (``\\:`` and ``\\/`` as Hydra escapes them), then the rest of the URL.
_URL = re.compile(r"[A-Za-z][\w+.-]*\\?:(?:\\?/){2}(?P<rest>[^\s'\"]+)")
#: ``?password=SECRET`` or ``&password=SECRET`` (also token, secret, api_key …), any case.
_QUERY = re.compile(
    r"(?P<head>[?&;](?:password|passwd|pwd|secret|token|access_token|api_key|apikey)=)"
    r"(?P<secret>[^&\s#'\",\]]+)",
    re.IGNORECASE,
)
ENV_PREFIX = "CLIPAMP_SECRET_"
HIDDEN = "***"


def secret_spans(text: str) -> list[tuple[int, int]]:
    """``(start, end)`` of every URL password in ``text``, in order and non-overlapping."""
    spans = []
    for url in _URL.finditer(text):
        rest, base = url["rest"], url.start("rest")
        at = rest.rfind("@")
        colon = rest.find(":", 0, at) if at > 0 else -1
        if colon >= 0 and colon + 1 < at:
            spans.append((base + colon + 1, base + at))
    for m in _QUERY.finditer(text):
        start, end = m.span("secret")
        if not any(s <= start < e for s, e in spans):
            spans.append((start, end))
    return sorted((s, e) for s, e in spans if text[s:e] != HIDDEN)


def _replace(text: str, spans: list[tuple[int, int]], new) -> str:
    for start, end in reversed(spans):
        text = text[:start] + new(text[start:end]) + text[end:]
    return text


def redact_text(text: str) -> str:
    """Replace every URL password in free text (any form above) with ``***``."""
    return _replace(text, secret_spans(text), lambda secret: HIDDEN)


def redact(uri: str) -> str:
    """``scheme://user:secret@host/db?password=x`` → ``scheme://user:***@host/db?password=***``."""
    return redact_text(uri)


def secrets_in(text: str) -> list[str]:
    """The passwords ``redact_text`` would hide in ``text``."""
    return [text[s:e] for s, e in secret_spans(text)]


#: Hydra flags that print (the config, help, info) instead of running a job.
PRINT_ONLY = ("--cfg", "-c", "--info", "-i", "--help", "-h", "--hydra-help", "--shell-completion", "-sc")


def hide_argv(argv: list[str], environ=os.environ) -> list[str]:
    """Move each URL password of ``argv`` into ``$CLIPAMP_SECRET_<n>`` and put ``${oc.env:…}`` in its place.

    Hydra then only ever sees (and writes, and echoes) the interpolation; OmegaConf resolves it to
    the password when the app reads its config. Only the password's own characters are replaced
    (a password that also occurs in the key, ``tracking.uri=…alice:r@…``, leaves the key alone).
    When Hydra only prints (``--cfg job --resolve``, ``--help``, ``--info``) no job runs: the
    password becomes ``***`` and reaches no environment.
    """
    print_only = any(a.split("=", 1)[0] in PRINT_ONLY for a in argv)

    def hidden(secret: str) -> str:
        if print_only:
            return HIDDEN
        name = f"{ENV_PREFIX}{len([k for k in environ if k.startswith(ENV_PREFIX)])}"
        environ[name] = secret
        return "${oc.env:" + name + "}"

    return [_replace(arg, secret_spans(arg), hidden) for arg in argv]


#: ``seal`` puts this in a file where a password was; ``unseal`` takes it back from the environment.
_SEALED = re.compile(r"<clipamp-sealed-(\d+)>")
SEALED_PREFIX = "CLIPAMP_SEALED_"


def seal(text: str, environ: dict[str, str]) -> str:
    """``text`` for a file another process reads: each URL password becomes ``<clipamp-sealed-N>`` and
    goes to ``environ[CLIPAMP_SEALED_N]`` (the environment that process gets), so the file never holds it."""

    def sealed(secret: str) -> str:
        n = len([k for k in environ if k.startswith(SEALED_PREFIX)])
        environ[f"{SEALED_PREFIX}{n}"] = secret
        return f"<clipamp-sealed-{n}>"

    return _replace(text, secret_spans(text), sealed)


def unseal(text: str, environ=os.environ) -> str:
    """The text ``seal`` was given, its passwords read back from ``environ``."""
    return _SEALED.sub(lambda m: environ[f"{SEALED_PREFIX}{m[1]}"], text)
