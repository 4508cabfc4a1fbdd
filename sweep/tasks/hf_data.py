"""Text for ``model=hf``: documents from local files (🤗 ``datasets``) or the built-in corpora,
a tokenizer (a local directory, or a byte-level BPE trained once with ``tokenizers`` and cached),
and the tokenized documents as a ``Corpus`` of token ids.

Everything runs offline: ``offline()`` sets the Hugging Face offline switches before the
libraries are imported, and nothing here ever names a hub repository.
"""

from __future__ import annotations

import glob
import hashlib
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config.schema import DataConfig
from ..errors import UserError, clip_words, one_line
from . import corpus as C
from .file_checks import TEXT_BUILDERS, bad_json_line, check_utf8

#: datasets builders for local files, by file extension.
FORMATS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
    ".arrow": "arrow",
}
BUILDERS = ("text", "json", "parquet", "csv", "arrow")
EOS, PAD = "<|endoftext|>", "<|pad|>"
_FILES_FIX = "pass data.files=PATH (a file, a glob or a list; .txt .json .jsonl .parquet .csv .arrow)"

Doc = tuple[str, str, str]  # (unique name, data_source, text)


def offline() -> None:
    """Never reach the Hugging Face hub (set before ``transformers``/``datasets`` are imported)."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ[key] = "1"


def resolve_files(files: Any) -> list[Path]:
    """``data.files`` (a path, a glob, or a list of them) -> existing files, in a stable order."""
    items = [files] if isinstance(files, (str, os.PathLike)) else list(files or [])
    if not items:
        raise UserError(f"data.files is not set for data=hf: {_FILES_FIX}")
    out: list[Path] = []
    for item in items:
        pattern = os.path.expanduser(str(item))
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for m in matches:
            p = Path(m)
            if p.is_dir():
                raise UserError(
                    f"data.files={str(item)!r} is a directory: pass its files, e.g. data.files='{item}/*.jsonl'"
                )
            if not p.is_file():
                raise UserError(f"data.files={str(item)!r} does not exist: {_FILES_FIX}")
            out.append(p)
        if not matches:
            raise UserError(f"data.files={str(item)!r} matches no file: {_FILES_FIX}")
    return out


def _builder(d: DataConfig, files: list[Path]) -> str:
    if d.format is not None:
        if d.format not in BUILDERS:
            raise UserError(
                f"data.format={d.format!r} is not one of {', '.join(BUILDERS)}: "
                "pass one of them, or data.format=null to infer it from the file extension"
            )
        return d.format
    kinds = {FORMATS.get(f.suffix.lower()) for f in files}
    if None in kinds or len(kinds) != 1:
        exts = sorted({f.suffix or "(none)" for f in files})
        raise UserError(
            f"data.files have extension(s) {', '.join(exts)}: cannot infer one format from "
            f"{', '.join(sorted(FORMATS))}; pass data.format=text|json|parquet|csv|arrow"
        )
    return kinds.pop()


def file_docs(d: DataConfig) -> tuple[list[Doc], str]:
    """(one document per row of every file (``data.text_field``), what was skipped).

    A document's source is ``data.source_field`` or its file. Rows whose text is empty or null
    are skipped, and so are rows whose text is not a string (a number, a list: a JSON Lines file may
    mix types); the second item counts them and names the first non-string one ("" if none).
    """
    files = resolve_files(d.files)
    builder = _builder(d, files)
    offline()
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its "Failed to load JSON" lines: the error says it
    nested = {"field": d.field} if d.field is not None else {}
    if nested and builder != "json":
        raise UserError(
            f"data.field={d.field!r} (the key a JSON file's records sit under) is read by data.format=json "
            f"only, and data.files are {builder}: drop data.field"
        )
    docs: list[Doc] = []
    empty, not_text, first_not_text = 0, 0, ""
    for f in files:
        if f.stat().st_size == 0:
            continue  # no rows (datasets cannot even infer the columns)
        if builder in TEXT_BUILDERS:
            check_utf8(f)
        try:
            ds = datasets.load_dataset(builder, data_files=[str(f)], split="train", **nested)
        except Exception as e:  # malformed file, wrong format
            if nested:
                raise UserError(f"data.field={d.field!r}: {_top_keys(f)}") from None
            bad = bad_json_line(f) if builder == "json" else None
            if bad is not None:
                raise UserError(f"data.files={str(f)!r} is not JSON Lines: {bad}; fix or remove that line") from None
            raise UserError(
                f"data.files={str(f)!r} could not be read as {builder}: {one_line(e, 300)}: "
                "fix the file or pass the right data.format"
            ) from None
        if ds.num_rows == 0:
            continue
        for key, field in (("text_field", d.text_field), ("source_field", d.source_field)):
            if field is not None and field not in ds.column_names:
                raise UserError(
                    f"data.{key}={field!r} is not a column of {f.name}: its columns are "
                    f"{', '.join(ds.column_names)}; {_nested_hint(ds, d) or f'pass data.{key}=NAME'}"
                )
        texts = ds[d.text_field]
        sources = ds[d.source_field] if d.source_field else [f.name] * len(texts)
        for i, (t, s) in enumerate(zip(texts, sources)):
            if isinstance(t, str) and t.strip():
                docs.append((f"{f.name}#{i}", f.name if s is None else str(s), t))  # no source: its file's
            elif t is None or isinstance(t, str):
                empty += 1
            else:
                not_text += 1
                first_not_text = first_not_text or f"{f.name}#{i} holds {type(t).__name__} {clip_words(repr(t), 40)}"
    if not docs:
        raise UserError(
            f"data.files={d.files!r} hold no non-empty {d.text_field!r} text"
            + (f" ({not_text} rows are not strings; {first_not_text})" if not_text else "")
            + ": pass files with text in data.text_field"
        )
    parts = [f"{empty} empty"] * bool(empty) + [f"{not_text} not strings, first {first_not_text}"] * bool(not_text)
    return docs, (f"{empty + not_text} rows skipped: {'; '.join(parts)}" if parts else "")


def _top_keys(f: Path) -> str:
    """Why ``data.field`` could not be read from ``f``: its top-level keys, or that it is not one object."""
    import json

    try:
        top = json.loads(f.read_text(encoding="utf-8"))
    except ValueError:
        return f"{f.name} is not one JSON object (JSON Lines has no key to read records from): drop data.field"
    if not isinstance(top, dict):
        return f"{f.name} holds a JSON {type(top).__name__}, not an object with keys: drop data.field"
    lists = [k for k, v in top.items() if isinstance(v, list)]
    return f"{f.name} has no list of records under that key: its keys are {', '.join(map(str, top)) or '(none)'}; " + (
        f"pass data.field={lists[0]}" if lists else "drop data.field"
    )


def _nested_hint(ds, d: DataConfig) -> str:
    """'pass data.field=KEY' when the file is one JSON object whose records (objects holding
    ``data.text_field``) sit in a list under KEY, as datasets reads with ``field=KEY``; else ""."""
    if d.field is not None or ds.num_rows != 1:
        return ""
    row = ds[0]
    for key in ds.column_names:
        value = row[key]
        if isinstance(value, list) and value and all(isinstance(r, dict) for r in value):
            if any(d.text_field in r for r in value):
                return f"its records sit in a list under the key {key!r}: pass data.field={key}"
    return ""


def builtin_docs(d: DataConfig) -> list[Doc]:
    """The byte corpora as text documents: ``data=text``'s file(s), else the stdlib sources."""
    full = C.text_corpus(d.path) if d.name == "text" else C.stdlib_corpus(int(d.max_files))
    return [(full.names[i], full.sources[i], full.doc(i).decode("utf-8", errors="replace")) for i in range(len(full))]


def has_tokenizer(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()


def load_tokenizer(path: str | os.PathLike, key: str):
    """``AutoTokenizer`` from a local directory, or a one-line ``UserError``."""
    p = Path(os.path.expanduser(str(path)))
    if not p.is_dir():
        raise UserError(
            f"{key}={str(path)!r} is not a local directory: clipamp runs offline and never "
            "downloads; pass a directory written by tokenizer.save_pretrained()"
        )
    if not has_tokenizer(p):  # else transformers may build an empty one from a model's config.json
        raise UserError(
            f"{key}={str(path)!r} has no tokenizer.json or tokenizer_config.json: pass a directory written "
            "by tokenizer.save_pretrained()"
        )
    offline()
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:
        raise UserError(
            f"{key}={str(path)!r} holds no loadable tokenizer ({one_line(e, 300)}): pass a "
            "directory written by tokenizer.save_pretrained()"
        ) from None
    # its vocabulary files missing, transformers 5 builds the class tokenizer_config.json names, empty
    if not tok("Hello, world.", add_special_tokens=False)["input_ids"]:
        raise UserError(
            f"{key}={str(path)!r} holds no tokenizer vocabulary ({type(tok).__name__} of {len(tok)} tokens "
            "encodes text to nothing): pass a directory written by tokenizer.save_pretrained()"
        )
    return tok


def _cache_root(d: DataConfig, files: list[Path]) -> Path:
    if d.cache_dir:
        return Path(os.path.expanduser(d.cache_dir))
    if files and os.access(files[0].parent, os.W_OK):
        return files[0].parent / ".clipamp"
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "clipamp"


def trained_tokenizer(d: DataConfig, docs: list[Doc], files: list[Path]):
    """A byte-level BPE of ``data.vocab_size`` trained on ``docs`` once, then loaded from its cache.

    The cache key hashes the texts, the vocabulary size and the ``tokenizers`` version, so any
    change to the corpus trains a new one. Returns (tokenizer, its directory).
    """
    offline()
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    h = hashlib.sha256(f"bpe:{d.vocab_size}:{tokenizers.__version__}".encode())
    for _, _, text in docs:
        h.update(text.encode("utf-8", errors="replace"))
        h.update(b"\0")
    where = _cache_root(d, files) / f"tokenizer-bpe{d.vocab_size}-{h.hexdigest()[:16]}"
    if not has_tokenizer(where):
        bpe = tokenizers.Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=int(d.vocab_size),
            special_tokens=[EOS, PAD],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        bpe.train_from_iterator((t for _, _, t in docs), trainer=trainer, length=len(docs))
        tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=PAD)
        tmp = where.with_name(f"{where.name}.tmp{os.getpid()}")
        try:
            tok.save_pretrained(str(tmp))
            os.replace(tmp, where)  # atomic: concurrent runs never read half a tokenizer
        except OSError as e:
            if not has_tokenizer(where):
                raise UserError(
                    f"cannot cache the trained tokenizer in {where.parent} ({e.strerror}): "
                    "pass data.cache_dir=WRITABLE_DIR"
                ) from None
    return load_tokenizer(where, "data.cache_dir"), where


def separator(tokenizer) -> str | None:
    """The token that ends each document: the tokenizer's EOS, else its SEP (BERT-style
    tokenizers mark document ends with it), else None (documents are then joined as they are)."""
    return tokenizer.eos_token if tokenizer.eos_token is not None else tokenizer.sep_token


def tokenize(docs: list[Doc], tokenizer) -> C.Corpus:
    """Documents -> a ``Corpus`` of int32 token ids, ``separator`` after each document (batched, in Rust)."""
    ids = tokenizer([t for _, _, t in docs], add_special_tokens=False)["input_ids"]
    sep = separator(tokenizer)
    end = [] if sep is None else [tokenizer.convert_tokens_to_ids(sep)]
    arrays = [np.asarray(x + end, dtype=np.int32) for x in ids]
    flat = np.concatenate(arrays) if arrays else np.zeros(0, dtype=np.int32)
    pieces = torch.from_numpy(flat).split([len(a) for a in arrays])
    return C.Corpus.from_pieces([(n, s, p) for (n, s, _), p in zip(docs, pieces)])
