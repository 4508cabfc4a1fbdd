"""The order test files are handed to pytest-xdist's workers in: the files with the most slow tests first.

``scripts/test`` runs ``--dist loadfile``: a worker takes a whole file at a time, in the order of the
collection when ``--no-loadscope-reorder`` is given (by default xdist would order the files by their count of
tests, which puts a file of a few minute-long tests near the end, where one worker finishes it while the other
has nothing left to take). Slow tests (end-to-end runs, seconds to a minute each) are most of a file's time, so
handing out the files with more of them first, and the many files of fast tests last, lets the two workers end
together: longest first, with the shortest jobs left to fill the gaps.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest


def slow_first(items: Sequence[pytest.Item]) -> list[pytest.Item]:
    """``items`` with their files ordered by count of slow-marked tests, then of tests, both descending (ties
    keep the collection's order); each file's tests stay together and in their order. The same collection
    gives the same order in every process."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def cost(tests: list[pytest.Item]) -> tuple[int, int]:
        return sum(t.get_closest_marker("slow") is not None for t in tests), len(tests)

    ordered = sorted(files.values(), key=cost, reverse=True)  # stable: ties keep the collection's order
    return [item for tests in ordered for item in tests]
