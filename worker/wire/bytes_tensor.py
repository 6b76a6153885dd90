"""BYTES tensors: each element a 4-byte little-endian length, then its bytes (Triton's framing).

The one place that knows the length prefix; the codec and the micro-batcher use it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Final

from worker.errors import DecodeError

__all__ = [
    "LENGTH_PREFIX",
    "bytes_offsets",
    "count_bytes_elements",
    "deserialize_bytes_tensor",
    "serialize_bytes_tensor",
]

#: The 4-byte little-endian length in front of every BYTES element.
LENGTH_PREFIX: Final = struct.Struct("<I")


def serialize_bytes_tensor(items: Iterable[bytes]) -> bytes:
    """Encode BYTES elements as Triton does: 4-byte LE length, then the bytes."""
    pack = LENGTH_PREFIX.pack
    parts: list[bytes] = []
    for item in items:
        parts.append(pack(len(item)))
        parts.append(item)
    return b"".join(parts)


def bytes_offsets(raw: bytes | memoryview, where: str) -> list[tuple[int, int]]:
    """(start, end) of each element; DecodeError naming ``where`` if the framing is broken."""
    offsets: list[tuple[int, int]] = []
    unpack_from = LENGTH_PREFIX.unpack_from
    position = 0
    total = len(raw)
    while position < total:
        if position + 4 > total:
            raise DecodeError(
                f"{where}: BYTES element {len(offsets)} has a truncated length prefix "
                f"at byte {position} of {total}"
            )
        (length,) = unpack_from(raw, position)
        start = position + 4
        end = start + length
        if end > total:
            raise DecodeError(
                f"{where}: BYTES element {len(offsets)} claims {length} bytes at byte {start}, "
                f"past the end of the tensor ({total} bytes)"
            )
        offsets.append((start, end))
        position = end
    return offsets


def deserialize_bytes_tensor(raw: bytes | memoryview, where: str = "tensor") -> list[bytes]:
    """Split a length-prefixed BYTES tensor into its elements."""
    data = bytes(raw)
    return [data[start:end] for start, end in bytes_offsets(data, where)]


def count_bytes_elements(raw: bytes | memoryview, where: str) -> int:
    """Count the elements of a length-prefixed BYTES tensor, checking its framing."""
    return len(bytes_offsets(raw, where))
