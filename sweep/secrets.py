"""Passwords in URLs: one redaction for every form a URL takes, and the argv rewrite that keeps them
out of what Hydra writes (``multirun.yaml``, the ``overrides`` tag, its "Error executing job" line).

Forms seen: userinfo ``scheme://user:SECRET@host``, Hydra-escaped ``scheme\\://user\\:SECRET@host``,
and query parameters ``?password=SECRET`` / ``&token=SECRET``.
"""

from __future__ import annotations

import os
import re

#: ``scheme://user:`` (``\\:`` and ``\\//`` as Hydra escapes them), then the secret up to ``@``.
_USERINFO = re.compile(r"(?P<head>[A-Za-z][\w+.-]*\\?:(?:\\?/){2}[^\s:/@\\]*\\?:)(?P<secret>[^@\s/]+)(?=@)")
#: ``?password=SECRET`` or ``&password=SECRET`` (also token, secret, api_key …), any case.
_QUERY = re.compile(
    r"(?P<head>[?&;](?:password|passwd|pwd|secret|token|access_token|api_key|apikey)=)"
    r"(?P<secret>[^&\s#'\",\]]+)",
    re.IGNORECASE,
)
ENV_PREFIX = "CLIPAMP_SECRET_"


def redact_text(text: str) -> str:
    """Replace every URL password in free text (any form above) with ``***``."""
    text = _USERINFO.sub(lambda m: m["head"] + "***", text)
    return _QUERY.sub(lambda m: m["head"] + "***", text)


def redact(uri: str) -> str:
    """``scheme://user:secret@host/db?password=x`` → ``scheme://user:***@host/db?password=***``."""
    return redact_text(uri)


def secrets_in(text: str) -> list[str]:
    """The passwords ``redact_text`` would hide in ``text``."""
    return [m["secret"] for pattern in (_USERINFO, _QUERY) for m in pattern.finditer(text) if m["secret"] != "***"]


def hide_argv(argv: list[str], environ=os.environ) -> list[str]:
    """Move each URL password of ``argv`` into ``$CLIPAMP_SECRET_<n>`` and put ``${oc.env:…}`` in its place.

    Hydra then only ever sees (and writes, and echoes) the interpolation; OmegaConf resolves it to
    the password when the app reads its config.
    """
    out = []
    for arg in argv:
        for secret in secrets_in(arg):
            name = f"{ENV_PREFIX}{len([k for k in environ if k.startswith(ENV_PREFIX)])}"
            environ[name] = secret
            arg = arg.replace(secret, "${oc.env:" + name + "}")
        out.append(arg)
    return out
