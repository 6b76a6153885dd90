"""What the output topic refused for its size lately: results as large are not sent again.

The broker refuses a result over the output topic's ``max.message.bytes``, and each
refusal is dear: at_least_once replaces its producer and sends the result again alone;
exactly_once aborts the transaction carrying it, and every outcome in that transaction
is sent again (on librdkafka one at a time, when the refused batch held several). A model
whose results are all over the limit would pay that for every record: a worker on
exactly_once fell to a few hundred records a second. So the smallest result refused
lately is a ceiling: a result at least that large is dead-lettered ``OUTPUT_TOO_LARGE``
without being sent. The ceiling is forgotten ``REMEMBER_S`` after the last refusal, so
once the topic's limit is raised such results are sent again within that time.

Sizes are what the broker judges: the whole record (its key, value and headers, as
``record_bytes`` counts them), for a result copies its request's key and headers. A
refused record whose key and headers are most of it teaches nothing: its size is its
request's, not its model's, and the results of other requests must not pay for it.

One ceiling for the output topic, whatever the record: nothing here is keyed by data.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

__all__ = ["REMEMBER_S", "OutputRefusals", "record_bytes"]

#: How long a refusal keeps results at least as large from being sent.
REMEMBER_S = 60.0

#: The fixed part of a record batch (format v2): base offset, length, leader epoch, magic,
#: CRC, attributes, last offset delta, timestamps, producer id and epoch, base sequence,
#: record count. A record sent alone pays it once.
_BATCH_OVERHEAD_BYTES = 61


def _varint_bytes(n: int) -> int:
    """The length of ``n`` as a zigzag varint (how a v2 record writes its lengths)."""
    zigzag = (n << 1) ^ (n >> 63)
    return max(1, (zigzag.bit_length() + 6) // 7)


def _field_bytes(data: bytes | None) -> int:
    """A length-prefixed field of a v2 record (null: length -1 and no bytes)."""
    if data is None:
        return 1
    return _varint_bytes(len(data)) + len(data)


def record_bytes(
    key: bytes | None, value: bytes | None, headers: Sequence[tuple[str, bytes | None]]
) -> int:
    """The bytes of a record alone in a batch, as Kafka's producers write it (record
    format v2) and the broker measures it against the topic's ``max.message.bytes``."""
    # Attributes, timestamp delta and offset delta: one byte each for the batch's first record.
    body = 3 + _field_bytes(key) + _field_bytes(value) + _varint_bytes(len(headers))
    for name, data in headers:
        raw = name.encode()
        body += _varint_bytes(len(raw)) + len(raw) + _field_bytes(data)
    return _BATCH_OVERHEAD_BYTES + _varint_bytes(body) + body


class OutputRefusals:
    """The smallest result the output topic refused within ``remember_s`` of the last
    refusal (None when there was none), in ``record_bytes``."""

    def __init__(
        self, remember_s: float = REMEMBER_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.remember_s = remember_s
        self._clock = clock
        self._smallest: int | None = None
        self._last = 0.0

    def refused(
        self, key: bytes | None, value: bytes, headers: Sequence[tuple[str, bytes | None]]
    ) -> None:
        """The broker refused the result record (``key``, ``value``, ``headers``) for its
        size; it sets the ceiling unless its key and headers are most of it."""
        size = record_bytes(key, value, headers)
        if 2 * len(value) <= size:
            return
        ceiling = self.ceiling()
        self._smallest = size if ceiling is None else min(ceiling, size)
        self._last = self._clock()

    def ceiling(self) -> int | None:
        """Results of this many bytes (``record_bytes``) or more are refused; None: any size
        is tried."""
        if self._smallest is not None and self._clock() - self._last > self.remember_s:
            self._smallest = None
        return self._smallest
