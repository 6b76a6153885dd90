"""The Confluent wire format: a zero byte, a 4-byte schema id, the payload."""

from __future__ import annotations

import pytest

from worker.errors import BadMagicByte
from worker.registry.framing import frame, schema_id_of, unframe


def test_a_framed_value_gives_its_schema_id_and_payload_back() -> None:
    """frame then unframe is the identity; the id is read big-endian."""
    value = frame(258, b"payload")
    assert value[:5] == b"\x00\x00\x00\x01\x02"
    schema_id, payload = unframe(value, "t", "avro")
    assert (schema_id, bytes(payload)) == (258, b"payload")
    assert schema_id_of(value) == 258


@pytest.mark.parametrize(
    ("value", "said"),
    [
        (b"", "got an empty value"),
        (b'{"id": 1}', "got first byte 0x7b (plain JSON?)"),
        (b"\x01\x00\x00\x00\x01x", "got first byte 0x01"),
        (b"\x00\x00\x01", "got 3 bytes, fewer than the 5 of the header"),
    ],
)
def test_a_value_that_is_not_framed_is_a_bad_magic_byte_saying_what_came(
    value: bytes, said: str
) -> None:
    """Empty, plain JSON, another magic byte, a short header: BAD_MAGIC_BYTE naming it."""
    assert schema_id_of(value) is None
    with pytest.raises(BadMagicByte) as info:
        unframe(value, "payments", "avro")
    assert info.value.message.startswith("record value: topic 'payments' expects avro")
    assert info.value.message.endswith(said)
