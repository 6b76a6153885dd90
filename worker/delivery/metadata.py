"""The done offsets beyond a commit point, carried in the commit's metadata string.

A partition is committed up to its lowest record not done; records after it may be
done already (out-of-order completion, one record stuck in retries). Their offsets
travel with the commit, compactly, as runs relative to the committed offset:
``d1:<start>+<length>,...`` in hexadecimal, where a run covers offsets
``point + start`` to ``point + start + length`` inclusive. A member that starts
from such a commit skips them instead of processing them again.

Anything else in the metadata (another tool's, a truncated string) reads as
"nothing done beyond the point": the records are processed again, never skipped
wrongly.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DoneRuns", "decode", "encode"]

_PREFIX = "d1:"


@dataclass(frozen=True, slots=True)
class DoneRuns:
    """Runs of done offsets (absolute, inclusive, sorted, disjoint) beyond a commit point."""

    point: int
    runs: tuple[tuple[int, int], ...]

    def __contains__(self, offset: object) -> bool:
        if not isinstance(offset, int) or offset < self.point:
            return False
        index = bisect.bisect_right(self.runs, (offset, float("inf"))) - 1
        return index >= 0 and self.runs[index][0] <= offset <= self.runs[index][1]

    @property
    def last(self) -> int:
        """The highest done offset (the point - 1 when there is none)."""
        return self.runs[-1][1] if self.runs else self.point - 1

    def __len__(self) -> int:
        return sum(end - start + 1 for start, end in self.runs)


def runs_of(offsets: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted offsets grouped into inclusive runs of consecutive offsets."""
    runs: list[tuple[int, int]] = []
    for offset in offsets:
        if runs and offset == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], offset)
        else:
            runs.append((offset, offset))
    return runs


def encode(point: int, done_beyond: Sequence[int], max_bytes: int) -> str | None:
    """The metadata for a commit at ``point``; "" when nothing is done beyond it.

    None when the encoding would exceed ``max_bytes``: the commit then goes
    without it (and the caller counts that).
    """
    if not done_beyond:
        return ""
    parts = [f"{start - point:x}+{end - start:x}" for start, end in runs_of(done_beyond)]
    text = _PREFIX + ",".join(parts)
    return text if len(text.encode()) <= max_bytes else None


def decode(point: int, text: str | None) -> DoneRuns:
    """The done runs a commit at ``point`` carries; none for metadata that is not ours."""
    if not text or not text.startswith(_PREFIX):
        return DoneRuns(point, ())
    runs: list[tuple[int, int]] = []
    try:
        for part in text[len(_PREFIX) :].split(","):
            start_hex, _, length_hex = part.partition("+")
            start, length = int(start_hex, 16), int(length_hex, 16)
            if start <= 0 or length < 0:
                return DoneRuns(point, ())
            runs.append((point + start, point + start + length))
    except ValueError:
        return DoneRuns(point, ())
    runs.sort()
    for (_, end), (next_start, _) in itertools.pairwise(runs):
        if next_start <= end:
            return DoneRuns(point, ())
    return DoneRuns(point, tuple(runs))
