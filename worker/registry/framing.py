"""The Confluent wire format: a zero byte, the schema id (4 bytes, big-endian), the payload.

What Confluent's serializers (and Flink's ``avro-confluent``, Kafka Connect's converters,
Karapace's and Apicurio's clients in their Confluent mode) write for Avro and JSON Schema
values. Protobuf adds message indexes after the id; this worker does not read it.
"""

from __future__ import annotations

from typing import Final

from worker.errors import BadMagicByte

__all__ = ["HEADER_BYTES", "MAGIC_BYTE", "frame", "schema_id_of", "unframe"]

MAGIC_BYTE: Final = 0
#: The magic byte and the schema id.
HEADER_BYTES: Final = 5


def schema_id_of(value: bytes | None) -> int | None:
    """The schema id a framed value names; None for one that is not framed."""
    if value is None or len(value) < HEADER_BYTES or value[0] != MAGIC_BYTE:
        return None
    return int.from_bytes(value[1:HEADER_BYTES], "big")


def unframe(value: bytes, topic: str, fmt: str) -> tuple[int, memoryview]:
    """(schema id, payload) of a framed value; BadMagicByte naming what came instead."""
    if len(value) < HEADER_BYTES or value[0] != MAGIC_BYTE:
        if not value:
            got = "an empty value"
        elif value[0] != MAGIC_BYTE:
            got = f"first byte 0x{value[0]:02x}" + (
                " (plain JSON?)" if value[:1] in (b"{", b"[", b" ", b"\xef") else ""
            )
        else:
            got = f"{len(value)} bytes, fewer than the 5 of the header"
        raise BadMagicByte(
            f"record value: topic {topic!r} expects {fmt} in the Confluent wire format (a zero "
            f"magic byte, a 4-byte schema id, the payload), got {got}"
        )
    return int.from_bytes(value[1:HEADER_BYTES], "big"), memoryview(value)[HEADER_BYTES:]


def frame(schema_id: int, payload: bytes) -> bytes:
    """A payload framed with its schema id."""
    return b"\x00" + schema_id.to_bytes(4, "big") + payload
