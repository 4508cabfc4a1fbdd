"""A bad data file is one line naming the file, the line and what is wrong (not ``datasets``'
"DatasetGenerationError" or a ``UnicodeDecodeError`` traceback); a corpus of one document under
``data=hf`` names ``data.files``, the key ``data=hf`` takes."""

from __future__ import annotations

import pytest

from tests.app.helpers import run_cli, run_cli_here
from tests.reliability.helpers import assert_one_line_error

pytestmark = pytest.mark.slow

HF = [
    "+experiment=train",
    "model=hf_llama",
    "data=hf",
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=1",
    "model.config.num_attention_heads=4",
    "model.config.num_key_value_heads=2",
    "model.config.max_position_embeddings=128",
    "data.vocab_size=300",
    "data.seq_len=32",
    "data.batch_size=8",
    "data.eval_batches=1",
    "progress=false",
    "tracking.plots=false",
    "steps=2",
]

CASES = {
    "latin1.jsonl": (
        b'{"text": "one document"}\n{"text": "caf\xe9 au lait"}\n',
        ["is not UTF-8 text: line 2, column 14 holds byte 0xe9", "re-encode the file as UTF-8"],
    ),
    "broken.jsonl": (
        b'{"text": "one document"}\n{"text": broken}\n{"text": "three"}\n',
        ["is not JSON Lines: line 2: Expecting value at column 10", "fix or remove that line"],
    ),
    "latin1.txt": (b"first line\nsecond \xff\xfe line\n", ["is not UTF-8 text: line 2, column 8 holds byte 0xff"]),
    "one.jsonl": (
        b'{"text": "only one document here, with a few words in it"}\n',
        ["the corpus has 1 usable document(s): pass data.files=FILE(S) with more documents"],
    ),
}


#: The case run as ``python -m sweep`` in a new process (the exit status Python gives, and nothing printed at start-up
#: before the line); the others through the CLI's entry point in this process (``run_cli_here``: no interpreter
#: start-up, which is most of a refused command's seconds).
IN_A_PROCESS = "latin1.jsonl"


@pytest.mark.parametrize("name", CASES)
def test_bad_data_file_is_one_line_naming_file_and_line(tmp_path, name, store, capsys, monkeypatch):
    """The default store is made already (the refusal comes after it opens)."""
    data, fragments = CASES[name]
    path = tmp_path / name
    path.write_bytes(data)
    if name == IN_A_PROCESS:
        res = run_cli(*HF, f"data.files={path}", cwd=tmp_path)
    else:
        res = run_cli_here(*HF, f"data.files={path}", cwd=tmp_path, capsys=capsys, monkeypatch=monkeypatch)
    named = [] if name == "one.jsonl" else [f"data.files='{path}'"]
    line = assert_one_line_error(res, *named, *fragments)
    assert "data.path" not in line and "DatasetGenerationError" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # nothing printed before the line
