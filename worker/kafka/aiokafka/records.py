"""Record batches whose header keys are not UTF-8, read instead of refused.

Kafka's header keys are strings to the Java client, but the protocol carries bytes,
and a producer speaking it directly (librdkafka's C API, a hand-written client) may
send any. aiokafka's parser decodes every key strictly: one such key raises
UnicodeDecodeError out of ``getmany``, outside every guard the worker has for a record,
and the same fetch fails again at every try (a partition stopped for good, a worker
crash-looping on one record).

``TolerantRecords`` stands in for aiokafka's ``MemoryRecords`` in its fetcher: each
batch is still read by aiokafka's own parser, and only a batch that parser refuses for
a header key is read again here, from its bytes, with each key decoded with
``surrogateescape``. Such a key can never come out of a valid UTF-8 decode, so the
worker tells it apart (``worker.wire.headers.check_header_keys``) and dead-letters the
record. Records the parser had already handed over are not handed over twice.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from aiokafka import codec
from aiokafka.errors import CorruptRecordException
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.record.util import decode_varint

__all__ = ["TolerantRecords"]

#: A batch's log overhead (base offset, length) and where its magic byte sits.
_LOG_OVERHEAD = struct.calcsize(">qi")
_MAGIC_OFFSET = struct.calcsize(">qii")
#: Where a v2 batch's record count sits, and where its records begin.
_COUNT_OFFSET = struct.calcsize(">qiibIhiqqqhi")
_RECORDS_OFFSET = _COUNT_OFFSET + 4
_LOG_APPEND_TIME = 1

_DECOMPRESS: dict[int, Callable[[bytes], bytes]] = {
    1: codec.gzip_decode,
    2: codec.snappy_decode,
    3: codec.lz4_decode,
    4: codec.zstd_decode,
}


@dataclass(frozen=True, slots=True)
class _Record:
    """One record as aiokafka's fetcher reads it from a batch."""

    offset: int
    timestamp: int
    timestamp_type: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    checksum: None = None


class TolerantRecords:
    """aiokafka's ``MemoryRecords`` over one fetched partition's bytes, whose v2 batches
    fall back to ``_TolerantBatch`` reading."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._records = MemoryRecords(data)
        self._pos = 0  # where the next batch begins in ``data``

    def size_in_bytes(self) -> int:
        return int(self._records.size_in_bytes())

    def has_next(self) -> bool:
        return bool(self._records.has_next())

    def next_batch(self) -> Any:
        start = self._pos
        batch = self._records.next_batch()
        if batch is None:
            return None
        (length,) = struct.unpack_from(">i", self._data, start + _LOG_OVERHEAD - 4)
        self._pos = end = start + _LOG_OVERHEAD + length
        if self._data[start + _MAGIC_OFFSET] < 2:
            return batch  # the legacy formats have no headers
        return _TolerantBatch(batch, memoryview(self._data)[start:end])


class _TolerantBatch:
    """A v2 batch read by aiokafka's parser, then by ``_read_tolerantly`` from the record
    after the last one that parser handed over, should it refuse a header key."""

    def __init__(self, batch: Any, raw: memoryview) -> None:
        self._batch = batch
        self._raw = raw
        self._records: Iterator[Any] = batch
        self._next_offset = batch.base_offset
        self._fallen_back = False

    def __getattr__(self, name: str) -> Any:
        # The batch's header fields and CRC check, as aiokafka's parser reads them.
        return getattr(self._batch, name)

    def __iter__(self) -> _TolerantBatch:
        # aiokafka's batch decompresses its records when iterated; a control batch is read
        # with next() alone, as aiokafka's fetcher does.
        self._records = iter(self._batch)
        return self

    def __next__(self) -> Any:
        try:
            record = next(self._records)
        except UnicodeDecodeError:
            if self._fallen_back:
                raise
            self._fallen_back = True
            self._records = _read_tolerantly(self._batch, self._raw, self._next_offset)
            record = next(self._records)
        self._next_offset = record.offset + 1
        return record


def _read_tolerantly(batch: Any, raw: memoryview, from_offset: int) -> Iterator[_Record]:
    """The batch's records from ``from_offset`` on, each header key decoded with
    ``surrogateescape`` (the v2 record format, read as aiokafka's own parser does)."""
    (count,) = struct.unpack_from(">i", raw, _COUNT_OFFSET)
    data: bytes = bytes(raw[_RECORDS_OFFSET:])
    if batch.compression_type:
        data = _DECOMPRESS[batch.compression_type](data)
    append_time = batch.timestamp_type == _LOG_APPEND_TIME
    pos = 0
    for _ in range(count):
        length, pos = _varint(data, pos)
        end = pos + length
        _, pos = _varint(data, pos)  # the record's attributes: none are defined
        timestamp_delta, pos = _varint(data, pos)
        offset_delta, pos = _varint(data, pos)
        key, pos = _bytes(data, pos)
        value, pos = _bytes(data, pos)
        header_count, pos = _varint(data, pos)
        headers: list[tuple[str, bytes | None]] = []
        for _ in range(header_count):
            name, pos = _bytes(data, pos)
            if name is None:
                raise CorruptRecordException("a record header without a key")
            header_value, pos = _bytes(data, pos)
            headers.append((name.decode("utf-8", "surrogateescape"), header_value))
        if pos != end:
            raise CorruptRecordException(f"a record of {length} bytes read as {length + pos - end}")
        offset = batch.base_offset + offset_delta
        if offset < from_offset:
            continue  # handed over already by aiokafka's parser
        timestamp = batch.max_timestamp if append_time else batch.first_timestamp + timestamp_delta
        yield _Record(offset, timestamp, batch.timestamp_type, key, value, headers)


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, after = decode_varint(data, pos)
    return int(value), int(after)


def _bytes(data: bytes, pos: int) -> tuple[bytes | None, int]:
    """A varint length, then that many bytes (None for a negative length)."""
    length, pos = _varint(data, pos)
    if length < 0:
        return None, pos
    return data[pos : pos + length], pos + length
