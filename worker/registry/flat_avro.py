"""A fast reader of flat Avro records: numbers arrays straight into numpy.

fastavro turns each element of an Avro array into a Python object (about 80 ns a float):
for a record of 64 features that is most of the cost of reading it, more than orjson
takes to parse the same event as JSON. Events that feed a model are mostly flat records
of a few scalars and an array of numbers, so for those (and only those) this reader
decodes each field directly, an array of ``float`` or ``double`` as one numpy array over
the payload's bytes. A schema of any other shape (unions, maps, nested records, enums,
fixed, logical types, arrays of anything but numbers) is read by fastavro, as is every
payload this reader refuses; the unit tests hold both readers to the same answers.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

import numpy as np

__all__ = ["FlatRecord", "flat_reader"]

_FLOAT: Final = struct.Struct("<f")
_DOUBLE: Final = struct.Struct("<d")
_ARRAY_ITEMS: Final[dict[str, np.dtype[Any]]] = {
    "float": np.dtype("<f4"),
    "double": np.dtype("<f8"),
}
#: Elements an array of the payload may claim before the reader gives up (fastavro then
#: reads it, and refuses it as it does).
_MOST_ELEMENTS: Final = 1 << 26


class Refused(Exception):
    """The payload is not a record of this schema (truncated, a bad length)."""


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """A zigzag varint (Avro's int and long) at ``pos``; the value and the next position."""
    result = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise Refused("varint past the end")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), pos
        shift += 7


def _string(buf: bytes, pos: int) -> tuple[Any, int]:
    size, pos = _varint(buf, pos)
    end = pos + size
    if size < 0 or end > len(buf):
        raise Refused("string past the end")
    return buf[pos:end].decode("utf-8"), end


def _bytes(buf: bytes, pos: int) -> tuple[Any, int]:
    size, pos = _varint(buf, pos)
    end = pos + size
    if size < 0 or end > len(buf):
        raise Refused("bytes past the end")
    return buf[pos:end], end


def _float(buf: bytes, pos: int) -> tuple[Any, int]:
    if pos + 4 > len(buf):
        raise Refused("float past the end")
    return _FLOAT.unpack_from(buf, pos)[0], pos + 4


def _double(buf: bytes, pos: int) -> tuple[Any, int]:
    if pos + 8 > len(buf):
        raise Refused("double past the end")
    return _DOUBLE.unpack_from(buf, pos)[0], pos + 8


def _boolean(buf: bytes, pos: int) -> tuple[Any, int]:
    if pos >= len(buf) or buf[pos] > 1:
        raise Refused("not a boolean")
    return buf[pos] == 1, pos + 1


def _null(buf: bytes, pos: int) -> tuple[Any, int]:
    return None, pos


def _numbers(dtype: np.dtype[Any]) -> Callable[[bytes, int], tuple[Any, int]]:
    """An array of ``float`` or ``double``: its blocks' elements as one numpy array."""
    width = dtype.itemsize

    def read(buf: bytes, pos: int) -> tuple[Any, int]:
        blocks = []
        while True:
            count, pos = _varint(buf, pos)
            if count == 0:
                break
            if count < 0:  # a block that gives its size in bytes as well
                count = -count
                _, pos = _varint(buf, pos)
            end = pos + count * width
            if count > _MOST_ELEMENTS or end > len(buf):
                raise Refused("array past the end")
            blocks.append(np.frombuffer(buf, dtype, count, pos))
            pos = end
        if len(blocks) == 1:
            return blocks[0], pos
        return (np.concatenate(blocks) if blocks else np.empty(0, dtype)), pos

    return read


_SCALARS: Final[dict[str, Callable[[bytes, int], tuple[Any, int]]]] = {
    "null": _null,
    "boolean": _boolean,
    "int": _varint,
    "long": _varint,
    "float": _float,
    "double": _double,
    "string": _string,
    "bytes": _bytes,
}


class FlatRecord:
    """Reads records of one flat schema: each field in order, nothing else."""

    __slots__ = ("_fields",)

    def __init__(self, fields: list[tuple[str, Callable[[bytes, int], tuple[Any, int]]]]) -> None:
        self._fields = fields

    def read(self, payload: bytes) -> tuple[dict[str, Any], int]:
        """The record and the bytes it took; Refused when the payload is not one."""
        record: dict[str, Any] = {}
        pos = 0
        for name, read in self._fields:
            record[name], pos = read(payload, pos)
        return record, pos


def _field_reader(avro: Any) -> Callable[[bytes, int], tuple[Any, int]] | None:
    if isinstance(avro, dict):
        if avro.get("logicalType") is not None:
            return None  # fastavro converts it (a timestamp, a decimal)
        if avro.get("type") == "array" and isinstance(avro.get("items"), str):
            dtype = _ARRAY_ITEMS.get(avro["items"])
            return _numbers(dtype) if dtype is not None else None
        avro = avro.get("type")
    return _SCALARS.get(avro) if isinstance(avro, str) else None


def flat_reader(schema: Any) -> FlatRecord | None:
    """The fast reader of ``schema`` (a record of scalars and arrays of numbers); None for
    any other schema, which fastavro reads."""
    if not isinstance(schema, dict) or schema.get("type") != "record":
        return None
    fields = []
    for field in schema.get("fields", ()):
        read = _field_reader(field.get("type"))
        if read is None:
            return None
        fields.append((str(field["name"]), read))
    return FlatRecord(fields)
