"""What the pages show, extracted for checking: shell commands, runnable Python snippets, links.

Pages are README.md and every ``docs/*.md``. A shell command is a line of a ```bash/```sh/```console
block (``\\``-continued lines joined, ``$ `` prompts and trailing comments dropped) or an inline code
span that starts with an invocation; a command is split at ``&&``, ``||``, ``;`` and ``|`` into the
invocations it chains. A synopsis (``clip=MODE``, ``[--wide]``, ``…``), or a tool named in prose
(a bare ``python -m sweep.report``), is not a command and is not checked. A runnable snippet is a
```python block right after a ``<!-- runnable -->`` line.
"""

from __future__ import annotations

import argparse
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
RUNNABLE = re.compile(r"<!-- runnable -->\s*\n```python\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|<img [^>]*src=\"([^\"]+)\"")
#: Hydra flags the app accepts beside overrides (they take no value, or take the next token).
OVERRIDE = re.compile(r"^(\+\+|\+|~)?[A-Za-z_][\w./@-]*(=|$)")
#: A synopsis in prose, not a command: placeholders (``clip=MODE``), optional parts, ellipses.
SYNOPSIS = re.compile(r"=[A-Z][A-Z_]*$|^\[|…|\.\.\.")
HYDRA_FLAGS = {"--help", "-h", "--hydra-help", "-m", "--multirun", "--resolve", "--info"}
HYDRA_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--shell-completion", "-sc", "--config-name", "-cn"}


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Invocation:
    """One call of the app, the report or the demo that a page shows."""

    page: Path
    line: int
    program: str  # "sweep", "sweep.report", "sweep.recommend", "clipamp_engine.demo", "bench/….py", "scripts/….py"
    args: tuple[str, ...]

    def where(self) -> str:
        return f"{self.page.name}:{self.line}: {self.program} {' '.join(self.args)}"


def _code_outside_fences(text: str) -> str:
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def shell_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, command) for every shell line of a page, fenced or inline."""
    for m in FENCE.finditer(text):
        if m.group(1) not in ("bash", "sh", "console", "shell"):
            continue
        start = text.count("\n", 0, m.start(2)) + 1
        joined, first = "", None
        for i, raw in enumerate(m.group(2).splitlines()):
            line = raw.strip().removeprefix("$ ")
            first = start + i if first is None else first
            if line.endswith("\\"):
                joined += line[:-1] + " "
                continue
            joined += line
            if joined and not joined.startswith("#"):
                yield first, joined
            joined, first = "", None
    outside = _code_outside_fences(text)
    for m in INLINE.finditer(outside):
        if " " in m.group(1).split(" -m ", 1)[-1].strip():  # a bare `python -m sweep.report` names a tool
            yield outside.count("\n", 0, m.start()) + 1, m.group(1)


def invocations(page: Path) -> Iterator[Invocation]:
    """Every call of ``clipamp``, ``python -m sweep|sweep.report|clipamp_engine.demo``, ``bench/*.py``,
    ``scripts/*.py`` and ``bash scripts/gpu_check`` on a page."""
    for line, command in shell_lines(page.read_text()):
        try:
            tokens = shlex.split(command, comments=True)
        except ValueError:
            continue  # prose in backticks, not a command
        for part in _split_chain(tokens):
            found = _program(part)
            if found and not any(SYNOPSIS.search(a) for a in found[1]):
                yield Invocation(page, line, found[0], tuple(found[1]))


def _split_chain(tokens: list[str]) -> Iterator[list[str]]:
    part: list[str] = []
    for tok in tokens:
        if tok in ("&&", "||", ";", "|"):
            yield part
            part = []
        else:
            part.append(tok)
    yield part


def _program(tokens: list[str]) -> tuple[str, list[str]] | None:
    while tokens and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", tokens[0]):
        tokens = tokens[1:]  # environment assignments before the command
    if not tokens:
        return None
    if Path(tokens[0]).name == "clipamp":
        return "sweep", tokens[1:]
    if Path(tokens[0]).name == "clipamp-recommend":
        return "sweep.recommend", tokens[1:]
    script = len(tokens) > 1 and re.fullmatch(r"(bench|scripts)/\w+\.py", tokens[1])
    if Path(tokens[0]).name.startswith("python") and script:
        return tokens[1], tokens[2:]  # a benchmark or a script
    if tokens[:2] == ["bash", "scripts/gpu_check"]:
        return "scripts/gpu_check.py", tokens[2:]  # the wrapper hands its arguments to the driver
    if "-m" in tokens[:-1] and (Path(tokens[0]).name.startswith("python") or tokens[0] == "torchrun"):
        i = tokens.index("-m")
        if tokens[i + 1] in ("sweep", "sweep.report", "sweep.recommend", "clipamp_engine.demo"):
            return tokens[i + 1], tokens[i + 2 :]
    return None


def overrides(args: tuple[str, ...]) -> list[str]:
    """The Hydra overrides of an app call (flags dropped; a multirun's comma lists keep their first value)."""
    out, skip = [], False
    multirun = "-m" in args or "--multirun" in args
    for a in args:
        if skip:
            skip = False
        elif a in HYDRA_FLAGS_WITH_VALUE:
            skip = True
        elif a.startswith("-"):
            if a not in HYDRA_FLAGS and not a.startswith(("--cfg=", "--shell-completion=")):
                raise ValueError(f"unknown flag {a}")
        elif multirun and "=" in a and "," in a.split("=", 1)[1] and not a.split("=", 1)[1].startswith("["):
            key, value = a.split("=", 1)
            out.append(f"{key}={value.split(',')[0]}")
        elif OVERRIDE.match(a):
            out.append(a)
        else:
            raise ValueError(f"{a!r} is not an override (KEY=VALUE)")
    return out


class _Parsed(BaseException):
    """Raised right after a CLI's argparse accepted its arguments: nothing runs."""


def parses(main, argv: list[str]) -> None:
    """``main(argv)`` gets as far as a successful ``parse_args`` (argparse errors exit with 2)."""
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        try:
            main(argv)
        except _Parsed:
            return
    raise AssertionError(f"{argv} did not reach argument parsing")


def script_parses(program: str, args: list[str]) -> None:
    """A ``bench/`` or ``scripts/`` file's ``main()`` (which reads ``sys.argv``) parses ``args``."""
    main = runpy.run_path(str(ROOT / program), run_name="bench")["main"]
    with mock.patch.object(sys, "argv", [program, *args]):
        parses(lambda _argv: main(), list(args))


def broken_links(page: Path) -> list[str]:
    out = []
    for m in LINK.finditer(_code_outside_fences(page.read_text())):
        target = (m.group(1) or m.group(2)).split("#")[0]
        if not target or re.match(r"[a-z]+:", target):
            continue  # an anchor on the same page, or a URL
        if not (page.parent / target).exists():
            out.append(f"{page.name}: {target}")
    return out


def runnable_snippets(page: Path) -> list[tuple[int, str]]:
    text = page.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in RUNNABLE.finditer(text)]


#: A snippet that imports a training framework (its import and its fit take seconds), or trains for
#: hundreds of steps (``steps = 320``): the test that runs it is marked slow; the fast subset keeps the rest.
FRAMEWORK_IMPORT = re.compile(r"^(?:from|import) (?:transformers|lightning|accelerate)\b", re.M)
STEPS = re.compile(r"^steps = (\d+)$", re.M)


def snippet_is_slow(code: str) -> bool:
    steps = STEPS.search(code)
    return bool(FRAMEWORK_IMPORT.search(code)) or (steps is not None and int(steps.group(1)) > 200)
