"""The done offsets beyond a commit point, carried in the commit's metadata string.

A partition is committed up to its lowest record not done; records after it may be
done already (out-of-order completion, one record stuck in retries). Their offsets
travel with the commit, compactly, as runs relative to the committed offset:
``d2:<start>+<length>,...;<check>`` in lowercase hexadecimal, increasing, where a run
covers offsets ``point + start`` to ``point + start + length`` inclusive, and
``<check>`` is the CRC-32 (8 hex digits) of the commit point and the runs. A member
that starts from such a commit skips them instead of processing them again.

The metadata is read from the group, which anyone with access to it can write: it is
trusted only as far as this worker could have written it, exactly. A worker never runs
more than ``max_ahead`` (WORKER_MAX_UNCOMMITTED_PER_PARTITION) records past its commit
point, nor writes more than ``max_bytes``; and what it wrote ends with its check, which
also binds it to the offset it was committed with. Anything else (another tool's
metadata, a truncated string, bytes after the check, a run reaching further, the check
of another offset) is ``ForeignMetadata``: nothing is skipped, the records are processed
again, never skipped wrongly.

The first format, ``d1:<runs>`` without a check, is foreign too: it has no end of its
own, and librdkafka's Python binding reads commit metadata that another client wrote
(without a C string's terminator) past its end, so a stray byte that happens to be a
hex digit or a comma lengthens or adds a run (records never done would be skipped). A
worker upgraded from it processes again, once, the records its predecessor had done
beyond each commit point.
"""

from __future__ import annotations

import bisect
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["DoneRuns", "ForeignMetadata", "decode", "encode"]

_PREFIX = "d2:"
_PREVIOUS_PREFIX = "d1:"
#: The whole metadata: the runs, then the check; nothing before, nothing after.
_FRAME = re.compile(r"d2:([0-9a-f+,]+);([0-9a-f]{8})")
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


def _check(point: int, runs: str) -> str:
    """The CRC-32 of the commit point and the runs, as 8 lowercase hex digits."""
    return f"{zlib.crc32(f'{point}:{runs}'.encode()):08x}"


def encode(point: int, done_beyond: Sequence[int], max_bytes: int) -> str | None:
    """The metadata for a commit at ``point``; "" when nothing is done beyond it.

    None when the encoding would exceed ``max_bytes``: the commit then goes
    without it (and the caller counts that).
    """
    if not done_beyond:
        return ""
    runs = ",".join(f"{start - point:x}+{end - start:x}" for start, end in runs_of(done_beyond))
    text = f"{_PREFIX}{runs};{_check(point, runs)}"
    return text if len(text.encode()) <= max_bytes else None


def decode(point: int, text: str | None, *, max_ahead: int, max_bytes: int) -> DoneRuns:
    """The done runs a commit at ``point`` carries (none for empty metadata).

    Raises ForeignMetadata for metadata this worker could not have written: not
    exactly its format, longer than ``max_bytes``, a check that is not the one of these
    runs at this point, runs out of order or overlapping, or a run ending
    ``max_ahead`` or more offsets past the point.
    """
    if not text:
        return DoneRuns(point, ())
    if len(text) > max_bytes:
        raise ForeignMetadata(f"longer than the {max_bytes} bytes the worker writes")
    if text.startswith(_PREVIOUS_PREFIX):
        raise ForeignMetadata(
            "the worker's first format (d1), which has no check: it cannot be told apart "
            "from the same text with bytes after it"
        )
    frame = _FRAME.fullmatch(text)
    if frame is None:
        raise ForeignMetadata("not the worker's done runs (another format, or bytes after it)")
    if frame[2] != _check(point, frame[1]):
        raise ForeignMetadata(f"its check is not that of its runs at offset {point}")
    runs: list[tuple[int, int]] = []
    for part in frame[1].split(","):
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
