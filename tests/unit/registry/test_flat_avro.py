"""The fast reader of flat Avro records answers as fastavro does, arrays of numbers as
numpy arrays; any other schema, and any payload it refuses, is left to fastavro."""

from __future__ import annotations

import io
import math
from typing import Any

import fastavro
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.errors import SchemaMismatch
from worker.registry.flat_avro import Refused, flat_reader
from worker.registry.formats import AvroWriter

SCALARS: dict[str, st.SearchStrategy[Any]] = {
    "null": st.none(),
    "boolean": st.booleans(),
    "int": st.integers(-(2**31), 2**31 - 1),
    "long": st.integers(-(2**63), 2**63 - 1),
    "float": st.floats(width=32),
    "double": st.floats(),
    "string": st.text(),
    "bytes": st.binary(),
}
KINDS = [*SCALARS, "array<float>", "array<double>"]
#: A flat schema and a record of it.
Case = tuple[dict[str, Any], dict[str, Any]]


def avro_type(kind: str) -> Any:
    return {"type": "array", "items": kind[6:-1]} if kind.startswith("array") else kind


def values(kind: str) -> st.SearchStrategy[Any]:
    if kind.startswith("array"):
        return st.lists(SCALARS[kind[6:-1]], max_size=40)
    return SCALARS[kind]


@st.composite
def schemas_and_records(draw: st.DrawFn) -> Case:
    kinds = draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=6))
    fields = [{"name": f"f{i}", "type": avro_type(k)} for i, k in enumerate(kinds)]
    record = {f"f{i}": draw(values(k)) for i, k in enumerate(kinds)}
    return {"type": "record", "name": "R", "fields": fields}, record


def write(schema: dict[str, Any], record: dict[str, Any]) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), record)
    return out.getvalue()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return len(a) == len(b) and all(same(float(x), float(y)) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


@settings(max_examples=300, deadline=None)
@given(schemas_and_records())
def test_the_fast_reader_reads_what_fastavro_reads(
    case: tuple[dict[str, Any], dict[str, Any]],
) -> None:
    """Any flat record written by fastavro: every field as fastavro reads it, all bytes taken."""
    schema, record = case
    payload = write(schema, record)
    reader = flat_reader(schema)
    assert reader is not None
    fast, taken = reader.read(payload)
    expected = fastavro.schemaless_reader(io.BytesIO(payload), fastavro.parse_schema(schema), None)
    assert isinstance(expected, dict)
    assert taken == len(payload)
    assert fast.keys() == expected.keys()
    for name, value in fast.items():
        assert same(value, expected[name]), (name, value, expected[name])


@settings(max_examples=200, deadline=None)
@given(schemas_and_records(), st.data())
def test_a_truncated_payload_is_refused_by_both(case: Case, data: st.DataObject) -> None:
    """Cut anywhere: the fast reader refuses it or takes fewer bytes than there are, and the
    writer's schema then says SCHEMA_MISMATCH as fastavro does."""
    schema, record = case
    payload = write(schema, record)
    if len(payload) < 2:
        return
    cut = payload[: data.draw(st.integers(0, len(payload) - 1))]
    reader = flat_reader(schema)
    assert reader is not None
    try:
        _, taken = reader.read(cut)
    except (Refused, UnicodeDecodeError):
        pass
    else:
        assert taken <= len(cut)
    writer = AvroWriter(1, schema)
    try:
        decoded = writer.decode(memoryview(cut))
    except SchemaMismatch:
        return
    # A prefix that is itself a whole record (a field ending early): fastavro agrees.
    assert decoded.keys() == record.keys()


def test_arrays_of_numbers_are_numpy_arrays_of_blocks_and_other_schemas_are_not_flat() -> None:
    """Arrays of floats come back as float32 arrays, also written in several blocks (the
    block-size form included); unions, records and logical types go to fastavro."""
    schema = {"type": "record", "name": "E", "fields": [
        {"name": "id", "type": "string"},
        {"name": "features", "type": {"type": "array", "items": "float"}},
    ]}  # fmt: skip
    block = b"\x06" + b"".join(np.float32(x).tobytes() for x in (1.5, 2.5, 3.5))
    sized = b"\x03\x08" + np.float32(4.5).tobytes() + np.float32(5.5).tobytes()  # -2, 8 bytes
    payload = b"\x04id" + block + sized + b"\x00"
    reader = flat_reader(schema)
    assert reader is not None
    record, taken = reader.read(payload)
    assert taken == len(payload) and record["id"] == "id"
    assert record["features"].dtype == np.float32
    assert record["features"].tolist() == [1.5, 2.5, 3.5, 4.5, 5.5]
    assert AvroWriter(1, schema).decode(memoryview(payload))["features"].tolist() == [
        1.5,
        2.5,
        3.5,
        4.5,
        5.5,
    ]
    for other in (
        ["null", "string"],
        {"type": "record", "name": "Inner", "fields": []},
        {"type": "long", "logicalType": "timestamp-millis"},
        {"type": "array", "items": "string"},
        {"type": "map", "values": "float"},
    ):
        flat = {"type": "record", "name": "E", "fields": [{"name": "x", "type": other}]}
        assert flat_reader(flat) is None, other


@pytest.mark.parametrize("payload", [b"\x02\xff", b"\x02\xc3\x28"])
def test_invalid_utf8_is_refused_with_fastavro_s_reason(payload: bytes) -> None:
    """A string that is not UTF-8: SCHEMA_MISMATCH with fastavro's message."""
    schema = {"type": "record", "name": "S", "fields": [{"name": "s", "type": "string"}]}
    with pytest.raises(SchemaMismatch, match="UnicodeDecodeError"):
        AvroWriter(1, schema).decode(memoryview(payload))
