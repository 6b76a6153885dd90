"""Payloads read with their writers' schemas: Avro with fastavro, JSON Schema with jsonschema."""

from __future__ import annotations

import io
import json

import fastavro
import pytest

from worker.errors import SchemaMismatch
from worker.registry.client import RegisteredSchema
from worker.registry.formats import writer_schema

PAYMENT = {
    "type": "record",
    "name": "Payment",
    "fields": [{"name": "id", "type": "string"}, {"name": "amount", "type": "double"}],
}
JSON_PAYMENT = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "amount": {"type": "number"}},
    "required": ["id"],
}


def avro(record: dict[str, object]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(PAYMENT), record)
    return out.getvalue()


def test_avro_payloads_decode_and_a_broken_one_says_why() -> None:
    """A record decodes to a dict; truncated or with bytes left over it is SCHEMA_MISMATCH."""
    writer = writer_schema(7, RegisteredSchema("AVRO", json.dumps(PAYMENT)))
    payload = avro({"id": "p-1", "amount": 2.5})
    assert writer.fmt == "avro"
    assert writer.decode(memoryview(payload)) == {"id": "p-1", "amount": 2.5}
    with pytest.raises(SchemaMismatch, match="does not decode with schema id 7: EOFError"):
        writer.decode(memoryview(payload[:-3]))
    with pytest.raises(SchemaMismatch) as info:
        writer.decode(memoryview(payload + b"\x00"))
    assert info.value.message == (
        "Avro payload has 1 bytes left over after the record of schema id 7: it was not "
        "written with that schema"
    )
    with pytest.raises(SchemaMismatch) as empty:
        writer.decode(memoryview(b""))
    assert "BytesIO" not in empty.value.message  # fastavro's buffer is no one's concern


def test_json_schema_payloads_are_validated_against_their_schema() -> None:
    """Valid JSON matching the schema decodes; a mismatch names the path; not JSON says so."""
    writer = writer_schema(9, RegisteredSchema("JSON", json.dumps(JSON_PAYMENT)))
    assert writer.fmt == "json-schema"
    assert writer.decode(memoryview(b'{"id": "p", "amount": 1}')) == {"id": "p", "amount": 1}
    with pytest.raises(SchemaMismatch) as info:
        writer.decode(memoryview(b'{"id": "p", "amount": "lots"}'))
    assert info.value.message == (
        "$.amount: does not match schema id 9: 'lots' is not of type 'number'"
    )
    with pytest.raises(SchemaMismatch, match="is not valid JSON"):
        writer.decode(memoryview(b"{"))


@pytest.mark.parametrize(
    ("registered", "said"),
    [
        (RegisteredSchema("PROTOBUF", "syntax = 'proto3';"), "is a PROTOBUF schema"),
        (RegisteredSchema("AVRO", '{"type": "nope"}'), "(AVRO) does not parse"),
        (
            RegisteredSchema("AVRO", "{}", ({"name": "com.example.Other"},)),
            "references other schemas (com.example.Other)",
        ),
    ],
)
def test_a_schema_this_worker_cannot_read_is_a_mismatch(
    registered: RegisteredSchema, said: str
) -> None:
    """Protobuf, a schema that does not parse, one with references: SCHEMA_MISMATCH."""
    with pytest.raises(SchemaMismatch, match=said.replace("(", r"\(").replace(")", r"\)")):
        writer_schema(3, registered)
