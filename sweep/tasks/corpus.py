"""Byte corpora (stdlib sources or user files) and seeded window sampling.

A ``Corpus`` is a set of documents stored as one flat uint8 tensor plus
offsets; ``sample_windows`` draws B random windows of up to T+1 bytes from
random documents, fully vectorised (no per-token Python loops).
"""
from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from ..errors import UserError

PAD_INPUT, IGNORE = 0, -100
CHUNK_BYTES = 4096
# stdlib directories that are tests, tools, data, generated codec tables or third-party code.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__",
                "turtledemo", "ensurepip", "pydoc_data", "encodings"}
_PATH_FIX = "pass data.path=FILE with a readable text file or directory"


@dataclass(frozen=True)
class Corpus:
    names: tuple[str, ...]  # unique document ids (relative paths, "file#k" for chunks)
    sources: tuple[str, ...]  # data_source label per document
    data: torch.Tensor  # uint8 [total bytes], documents back to back
    offsets: torch.Tensor  # int64 [n_docs + 1]

    @staticmethod
    def from_docs(docs: Sequence[tuple[str, str, bytes]]) -> "Corpus":
        docs = [d for d in docs if len(d[2]) >= 2]  # need at least one (input, target) pair
        lengths = torch.tensor([0] + [len(d[2]) for d in docs], dtype=torch.int64)
        blob = bytearray(b"".join(d[2] for d in docs)) or bytearray(1)
        return Corpus(tuple(d[0] for d in docs), tuple(d[1] for d in docs),
                      torch.frombuffer(blob, dtype=torch.uint8), lengths.cumsum(0))

    def __len__(self) -> int:
        return len(self.names)

    @property
    def nbytes(self) -> int:
        return int(self.offsets[-1])

    def doc(self, i: int) -> bytes:
        return bytes(self.data[self.offsets[i] : self.offsets[i + 1]].numpy())

    def subset(self, idx: Sequence[int]) -> "Corpus":
        return Corpus.from_docs([(self.names[i], self.sources[i], self.doc(i)) for i in idx])


def _unit_hash(name: str, salt: str) -> float:
    """Stable (process- and platform-independent) hash of ``name`` in [0, 1)."""
    h = hashlib.sha1(f"{salt}:{name}".encode()).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


@functools.lru_cache(maxsize=8)
def stdlib_corpus(max_files: int) -> Corpus:
    """The running interpreter's own stdlib ``.py`` files, a hash-chosen ``max_files`` of them."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP and d.isidentifier()]
        rel = Path(dirpath).relative_to(root)
        paths += [(rel / f).as_posix() for f in filenames
                  if f.endswith(".py") and not f.startswith("_sysconfigdata")]
    docs = []
    for rel in sorted(paths, key=lambda p: _unit_hash(p, "stdlib")):
        if len(docs) == max_files:
            break
        try:
            data = (root / rel).read_bytes()
        except OSError:
            continue
        if len(data) >= 2:
            docs.append((rel, rel.split("/")[0] if "/" in rel else rel[:-3], data))  # package or module
    return Corpus.from_docs(sorted(docs))


def text_corpus(path: str | None) -> Corpus:
    """A user's file (split into ~4 KiB chunks) or directory (one document per file)."""
    if not path:
        raise UserError(f"data.path is not set for data.name=text: {_PATH_FIX}")
    p = Path(os.path.expanduser(str(path)))
    if not p.exists():
        raise UserError(f"data.path={str(path)!r} does not exist: {_PATH_FIX}")
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file()
                       and not any(part.startswith(".") for part in f.relative_to(p).parts))
        docs = [(f.relative_to(p).as_posix(), _read(f, path)) for f in files]
        docs = [(n, b) for n, b in docs if b]
        if not docs:
            raise UserError(f"data.path={str(path)!r} contains no non-empty files: {_PATH_FIX}")
        if len(docs) == 1:
            return Corpus.from_docs(_chunks(*docs[0], path))
        return Corpus.from_docs([(n, n, b) for n, b in docs])
    data = _read(p, path)
    if not data:
        raise UserError(f"data.path={str(path)!r} is empty (0 bytes): "
                        "pass data.path=FILE with a non-empty text file")
    return Corpus.from_docs(_chunks(p.name, data, path))


def _read(f: Path, path) -> bytes:
    try:
        return f.read_bytes()
    except OSError as e:
        raise UserError(f"data.path={str(path)!r} could not be read ({type(e).__name__}: {e.strerror}): {_PATH_FIX}") from None


def _chunks(name: str, data: bytes, path) -> list[tuple[str, str, bytes]]:
    """Split one file into >= 2 roughly equal chunks of <= ~4 KiB, so both splits get one."""
    if len(data) < 4:
        raise UserError(f"data.path={str(path)!r} has only {len(data)} bytes: "
                        "pass data.path=FILE with at least 4 bytes of text")
    n = max(2, -(-len(data) // CHUNK_BYTES))
    cuts = [round(i * len(data) / n) for i in range(n + 1)]
    return [(f"{name}#{i}", name, data[cuts[i] : cuts[i + 1]]) for i in range(n)]


def split_corpus(corpus: Corpus, eval_fraction: float) -> tuple[Corpus, Corpus]:
    """Train/eval split by a stable hash of each document name; both sides non-empty."""
    if len(corpus) < 2:
        raise UserError(f"the corpus has {len(corpus)} usable document(s): pass data.path=FILE with more text")
    h = [_unit_hash(n, "eval") for n in corpus.names]
    ev = [i for i, x in enumerate(h) if x < eval_fraction]
    if not ev:
        ev = [min(range(len(h)), key=h.__getitem__)]
    if len(ev) == len(h):
        ev.remove(max(range(len(h)), key=h.__getitem__))
    evs = set(ev)
    return corpus.subset([i for i in range(len(h)) if i not in evs]), corpus.subset(ev)


def sample_windows(corpus: Corpus, batch_size: int, seq_len: int, g: torch.Generator):
    """B windows of up to seq_len+1 bytes -> (inputs int64 [B,T], targets int64 [B,T], source).

    Inputs are padded with 0 and targets with -100 at exactly the same positions.
    """
    n = len(corpus)
    doc = torch.randint(n, (batch_size,), generator=g)
    start_doc, length = corpus.offsets[doc], corpus.offsets[doc + 1] - corpus.offsets[doc]
    win = length.clamp(max=seq_len + 1)
    room = length - win  # how far the window may slide inside its document
    start = (torch.rand(batch_size, generator=g, dtype=torch.float64) * (room + 1)).long().clamp(max=room)
    ar = torch.arange(seq_len + 1)
    valid = ar < win[:, None]
    idx = torch.where(valid, (start_doc + start)[:, None] + ar, 0)
    tok = corpus.data[idx].long()
    keep = valid[:, 1:]  # position t is real iff its target byte t+1 exists
    inputs = tok[:, :-1].masked_fill(~keep, PAD_INPUT)
    targets = tok[:, 1:].masked_fill(~keep, IGNORE)
    source = Counter(corpus.sources[i] for i in doc.tolist()).most_common(1)[0][0]
    return inputs, targets, source
