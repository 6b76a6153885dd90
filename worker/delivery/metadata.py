"""The done offsets beyond a commit point, carried in the commit's metadata string.

A partition is committed up to its lowest record not done; records after it may be
done already (out-of-order completion, one record stuck in retries). Their offsets
travel with the commit, compactly, as runs relative to the committed offset:
``d1:<start>+<length>,...`` in lowercase hexadecimal, increasing, where a run covers
offsets ``point + start`` to ``point + start + length`` inclusive. A member that
starts from such a commit skips them instead of processing them again.

The metadata is read from the group, which anyone with access to it can write: it is
trusted only as far as this worker could have written it. A worker never runs more
than ``max_ahead`` (WORKER_MAX_UNCOMMITTED_PER_PARTITION) records past its commit
point, nor writes more than ``max_bytes``; anything else (another tool's metadata, a
truncated string, a run reaching further) is ``ForeignMetadata``: nothing is skipped,
the records are processed again, never skipped wrongly.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DoneRuns", "ForeignMetadata", "decode", "encode"]

_PREFIX = "d1:"
_RUN = re.compile(r"([0-9a-f]+)\+([0-9a-f]+)")


class ForeignMetadata(ValueError):
    """Commit metadata this worker could not have written (the message says why)."""


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

    @property
    def records(self) -> int:
        """How many offsets the runs cover."""
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


def decode(point: int, text: str | None, *, max_ahead: int, max_bytes: int) -> DoneRuns:
    """The done runs a commit at ``point`` carries (none for empty metadata).

    Raises ForeignMetadata for metadata this worker could not have written: not
    its format, longer than ``max_bytes``, runs out of order or overlapping, or a
    run ending ``max_ahead`` or more offsets past the point.
    """
    if not text:
        return DoneRuns(point, ())
    if len(text) > max_bytes or not text.startswith(_PREFIX):
        raise ForeignMetadata("not the worker's done runs (another format, or too long)")
    runs: list[tuple[int, int]] = []
    for part in text[len(_PREFIX) :].split(","):
        found = _RUN.fullmatch(part)
        if found is None:
            raise ForeignMetadata(f"malformed run {part[:32]!r}")
        start, length = int(found[1], 16), int(found[2], 16)
        if start <= 0 or (runs and point + start <= runs[-1][1]):
            raise ForeignMetadata("runs out of order or overlapping")
        if start + length >= max_ahead:
            raise ForeignMetadata(
                f"a run reaches {start + length} offsets past the commit point; the worker "
                f"never runs {max_ahead} past it (WORKER_MAX_UNCOMMITTED_PER_PARTITION)"
            )
        runs.append((point + start, point + start + length))
    return DoneRuns(point, tuple(runs))
