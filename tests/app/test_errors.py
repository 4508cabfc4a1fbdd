"""How a library's exception is quoted inside a user-facing one-line error."""

from __future__ import annotations

from sweep.errors import one_line


def test_one_line_names_the_type_and_collapses_whitespace():
    assert one_line(ValueError("bad value\n\n  see   above")) == "ValueError: bad value see above"


def test_one_line_cuts_the_message_at_the_limit():
    e = OSError("x" * 500)
    assert one_line(e) == "OSError: " + "x" * 500
    assert one_line(e, 300) == "OSError: " + "x" * 300 + " …"  # one word: cut at the limit, marked
    words = OSError("word " * 100)
    assert one_line(words, 32) == "OSError: word word word word word word …"  # at a word boundary


def test_one_line_says_when_there_is_no_message():
    assert one_line(RuntimeError()) == "RuntimeError: no message"
    assert one_line(RuntimeError("  \n ")) == "RuntimeError: no message"
