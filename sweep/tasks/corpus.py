"""Corpora (stdlib sources, user files, or tokenized documents) and seeded window sampling.

A ``Corpus`` is a set of documents stored as one flat id tensor (uint8 bytes; int32 token ids
for ``model=hf``) plus offsets; ``sample_windows`` draws B random windows of up to T+1 ids from
random documents (padded), ``sample_packed`` B windows of exactly T+1 ids from the documents
back to back; both fully vectorised (no per-token Python loops).
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError

PAD_INPUT, IGNORE = 0, -100
CHUNK_BYTES = 4096
# stdlib directories that are tests, tools, data, generated codec tables or third-party code.
_STDLIB_SKIP = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "__pycache__",
    "turtledemo",
    "ensurepip",
    "pydoc_data",
    "encodings",
}
_PATH_FIX = "pass data.path=FILE with a readable text file or directory"


@dataclass(frozen=True)
class Corpus:
    names: tuple[str, ...]  # unique document ids (relative paths, "file#k" for chunks)
    sources: tuple[str, ...]  # data_source label per document
    data: torch.Tensor  # [total ids], documents back to back: uint8 bytes, or int32 token ids
    offsets: torch.Tensor  # int64 [n_docs + 1]

    @staticmethod
    def from_docs(docs: Sequence[tuple[str, str, bytes]]) -> Corpus:
        return Corpus.from_pieces(
            [
                (n, s, torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.zeros(0, dtype=torch.uint8))
                for n, s, b in docs
            ]
        )

    @staticmethod
    def from_pieces(docs: Sequence[tuple[str, str, torch.Tensor]]) -> Corpus:
        """Documents as 1-D tensors of ids (bytes or tokens; the first one's dtype is kept)."""
        dtype = docs[0][2].dtype if docs else torch.uint8
        docs = [d for d in docs if len(d[2]) >= 2]  # need at least one (input, target) pair
        lengths = torch.tensor([0] + [len(d[2]) for d in docs], dtype=torch.int64)
        data = torch.cat([d[2] for d in docs]) if docs else torch.zeros(1, dtype=dtype)
        return Corpus(tuple(d[0] for d in docs), tuple(d[1] for d in docs), data, lengths.cumsum(0))

    def __len__(self) -> int:
        return len(self.names)

    @property
    def nbytes(self) -> int:  # ids: bytes, or tokens
        return int(self.offsets[-1])

    def doc(self, i: int) -> bytes:
        return bytes(self.data[self.offsets[i] : self.offsets[i + 1]].numpy())

    def subset(self, idx: Sequence[int]) -> Corpus:
        o = self.offsets
        return Corpus.from_pieces([(self.names[i], self.sources[i], self.data[o[i] : o[i + 1]]) for i in idx])


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
        paths += [(rel / f).as_posix() for f in filenames if f.endswith(".py") and not f.startswith("_sysconfigdata")]
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
        files = sorted(
            f for f in p.rglob("*") if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts)
        )
        docs = [(f.relative_to(p).as_posix(), _read(f, path)) for f in files]
        docs = [(n, b) for n, b in docs if b]
        if not docs:
            raise UserError(f"data.path={str(path)!r} contains no non-empty files: {_PATH_FIX}")
        if len(docs) == 1:
            return Corpus.from_docs(_chunks(*docs[0], path))
        return Corpus.from_docs([(n, n, b) for n, b in docs])
    data = _read(p, path)
    if not data:
        raise UserError(f"data.path={str(path)!r} is empty (0 bytes): pass data.path=FILE with a non-empty text file")
    return Corpus.from_docs(_chunks(p.name, data, path))


def _read(f: Path, path) -> bytes:
    try:
        return f.read_bytes()
    except OSError as e:
        raise UserError(
            f"data.path={str(path)!r} could not be read ({type(e).__name__}: {e.strerror}): {_PATH_FIX}"
        ) from None


def _chunks(name: str, data: bytes, path) -> list[tuple[str, str, bytes]]:
    """Split one file into >= 2 roughly equal chunks of <= ~4 KiB, so both splits get one."""
    if len(data) < 4:
        raise UserError(
            f"data.path={str(path)!r} has only {len(data)} bytes: pass data.path=FILE with at least 4 bytes of text"
        )
    n = max(2, -(-len(data) // CHUNK_BYTES))
    cuts = [round(i * len(data) / n) for i in range(n + 1)]
    return [(f"{name}#{i}", name, data[cuts[i] : cuts[i + 1]]) for i in range(n)]


def split_corpus(
    corpus: Corpus, eval_fraction: float, more: str = "pass data.path=FILE with more text"
) -> tuple[Corpus, Corpus]:
    """Train/eval split by a stable hash of each document name; both sides non-empty (else ``more``
    says how to give the corpus more documents)."""
    if len(corpus) < 2:
        raise UserError(f"the corpus has {len(corpus)} usable document(s): {more}")
    h = [_unit_hash(n, "eval") for n in corpus.names]
    ev = [i for i, x in enumerate(h) if x < eval_fraction]
    if not ev:
        ev = [min(range(len(h)), key=h.__getitem__)]
    if len(ev) == len(h):
        ev.remove(max(range(len(h)), key=h.__getitem__))
    evs = set(ev)
    return corpus.subset([i for i in range(len(h)) if i not in evs]), corpus.subset(ev)


def sample_windows(corpus: Corpus, batch_size: int, seq_len: int, g: torch.Generator, pad: int = PAD_INPUT):
    """B windows of up to seq_len+1 ids -> (inputs int64 [B,T], targets int64 [B,T], source).

    Inputs are padded with ``pad`` and targets with -100 at exactly the same positions.
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
    inputs = tok[:, :-1].masked_fill(~keep, pad)
    targets = tok[:, 1:].masked_fill(~keep, IGNORE)
    source = Counter(corpus.sources[i] for i in doc.tolist()).most_common(1)[0][0]
    return inputs, targets, source


def sample_packed(corpus: Corpus, batch_size: int, seq_len: int, g: torch.Generator):
    """B windows of exactly seq_len+1 ids from the documents back to back (packing, no padding).

    A window may span a document boundary (each tokenized document ends with EOS), as in GPT-2
    style packed pre-training; its source is the document it starts in. Needs more than seq_len ids.
    """
    start = torch.randint(corpus.nbytes - seq_len, (batch_size,), generator=g)
    tok = corpus.data[start[:, None] + torch.arange(seq_len + 1)].long()
    doc = torch.searchsorted(corpus.offsets, start, right=True) - 1
    source = Counter(corpus.sources[i] for i in doc.tolist()).most_common(1)[0][0]
    return tok[:, :-1], tok[:, 1:], source
