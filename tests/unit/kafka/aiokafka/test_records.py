"""Record batches read by aiokafka's parser, and again tolerantly when it refuses a header key."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from aiokafka.record.default_records import DefaultRecordBatch, _DefaultRecordBatchBuilderPy
from aiokafka.record.memory_records import MemoryRecords

from worker.kafka.aiokafka.records import TolerantRecords

#: (key, value, headers with raw keys) of one record.
Raw = tuple[bytes | None, bytes | None, Sequence[tuple[bytes, bytes | None]]]


class _RawKey(str):
    """A header key written as ``raw`` (the builder encodes each key with ``encode``)."""

    raw: bytes = b""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.raw


def _key(raw: bytes) -> str:
    key = _RawKey(raw.decode("latin-1"))
    key.raw = raw
    return key


def _batch(records: Sequence[Raw], *, base_offset: int = 0, codec: int = 0) -> bytes:
    builder = _DefaultRecordBatchBuilderPy(
        magic=2,
        compression_type=codec,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=1 << 20,
    )
    for delta, (key, value, headers) in enumerate(records):
        written = [(_key(name), header) for name, header in headers]
        assert builder.append(delta, timestamp=1_700 + delta, key=key, value=value, headers=written)
    data = bytearray(builder.build())
    data[0:8] = base_offset.to_bytes(8, "big")  # the broker assigns it; the CRC skips it
    return bytes(data)


#: (offset, key, value, headers) of one record read.
Read = tuple[int, bytes | None, bytes | None, list[tuple[str, bytes | None]]]


def _read(data: bytes) -> list[Read]:
    found: list[Read] = []
    records = TolerantRecords(data)
    while records.has_next():
        for record in records.next_batch():
            found.append((record.offset, record.key, record.value, list(record.headers)))
    return found


#: Each codec a batch may be compressed with (its id in a batch's attributes), and its name.
CODECS, CODEC_NAMES = [0, 1, 2, 3, 4], ["none", "gzip", "snappy", "lz4", "zstd"]

ODD: list[Raw] = [
    (b"k0", b"v0", [(b"a", b"1")]),
    (None, b"v1", [(b"x-\xff\xfe", b"odd"), (b"b", None)]),
]
AFTER: list[Raw] = [(b"k2", None, []), (b"k3", b"v3", [(b"c", b"3")])]


def test_aiokafka_alone_refuses_the_batch() -> None:
    """The premise: aiokafka's parser raises UnicodeDecodeError at the odd key."""
    with pytest.raises(UnicodeDecodeError):
        list(DefaultRecordBatch(_batch([*ODD, *AFTER])))


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_NAMES)
def test_every_record_once_the_odd_key_escaped(codec: int) -> None:
    """Every record of the batch comes out once, in order; the odd key decoded with
    surrogateescape, the others as aiokafka reads them."""
    data = _batch([*ODD, *AFTER], base_offset=40, codec=codec)
    assert _read(data) == [
        (40, b"k0", b"v0", [("a", b"1")]),
        (41, None, b"v1", [("x-\udcff\udcfe", b"odd"), ("b", None)]),
        (42, b"k2", None, []),
        (43, b"k3", b"v3", [("c", b"3")]),
    ]


def test_batches_after_the_odd_one_are_read_by_aiokafka_again() -> None:
    """A fetch of three batches, the odd one in the middle: all records, each once, with
    their timestamps."""
    data = _batch(AFTER, base_offset=0) + _batch(ODD, base_offset=2) + _batch(AFTER, base_offset=4)
    records = TolerantRecords(data)
    seen = []
    while records.has_next():
        seen += [(r.offset, r.timestamp) for r in records.next_batch()]
    assert seen == [(0, 1700), (1, 1701), (2, 1700), (3, 1701), (4, 1700), (5, 1701)]


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_NAMES)
def test_the_same_bytes_as_aiokafka_reads_them_when_every_key_is_text(codec: int) -> None:
    """Without an odd key the batch is aiokafka's own: same records, same fields."""
    data = _batch([*AFTER, *AFTER], base_offset=7, codec=codec)
    ours = _read(data)
    theirs = []
    plain = MemoryRecords(data)
    while plain.has_next():
        batch = plain.next_batch()
        assert batch is not None
        theirs += [(r.offset, r.key, r.value, list(r.headers)) for r in batch]
    assert ours == theirs
