"""What is wrong with a user's data file, in one line naming the file, the line and the encoding.

🤗 ``datasets`` reports a bad file as "DatasetGenerationError: An error occurred while generating the
dataset" (or lets a ``UnicodeDecodeError`` out later, when the column is read): these checks find
the first offending line themselves, with the standard library's decoders.
"""

from __future__ import annotations

import json
from pathlib import Path

from sweep.errors import UserError

#: ``datasets`` builders that read their files as text (UTF-8).
TEXT_BUILDERS = ("text", "json", "csv")


def check_utf8(path: Path, key: str = "data.files") -> None:
    """``UserError`` naming the line, column and byte of ``path``'s first byte that is not UTF-8."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(
            f"{key}={str(path)!r} is not UTF-8 text: line {line}, column {column} holds byte 0x{data[e.start]:02x} "
            f"({e.reason}); re-encode the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8 {path.name} > "
            f"{path.stem}.utf8{path.suffix}`) and pass that file"
        ) from None


def bad_json_line(path: Path) -> str | None:
    """``line N: reason`` for the first line of a JSON Lines file that is not JSON (None if every line
    is, or the whole file is one JSON document)."""
    text = path.read_text(encoding="utf-8")
    try:
        json.loads(text)
        return None
    except json.JSONDecodeError:
        pass
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                json.loads(line)
            except json.JSONDecodeError as e:
                return f"line {n}: {e.msg} at column {e.colno}"
    return None
