"""The registry-format topics: built only for them, refused without a URL, read by id."""

from __future__ import annotations

import io
import json

import fastavro
import pytest

from worker.errors import SchemaMismatch
from worker.registry import SchemaPending, build_registry
from worker.registry.client import RegisteredSchema
from worker.registry.formats import writer_schema
from worker.registry.framing import frame
from worker.registry.results import ResultWriter
from worker.settings import ConfigError, load_settings

REQUIRED = {
    "WORKER_INPUT_TOPICS": "clicks,plain",
    "WORKER_OUTPUT_TOPIC": "out",
    "WORKER_DLQ_TOPIC": "dlq",
}
CLICK = {"type": "record", "name": "Click", "fields": [{"name": "x", "type": "float"}]}


def test_no_registry_without_a_registry_format_and_a_refusal_without_its_url() -> None:
    """Plain JSON topics need no registry; an avro topic without the URL is one line."""
    settings = load_settings(REQUIRED)
    assert build_registry(settings, {"plain": "json"}) is None
    with pytest.raises(ConfigError) as caught:
        build_registry(settings, {"clicks": "avro", "plain": "json"})
    assert caught.value.message == (
        "WORKER_SCHEMA_REGISTRY_URL: the mapping's topics clicks (avro) read their schemas "
        "from a Schema Registry: set its URL"
    )


def test_a_record_is_pending_until_its_schema_is_known_and_read_with_it() -> None:
    """Every record of a topic is pending until its results' schema is resolved; then a
    framed record of an unknown id is (SchemaPending when read); once its schema is kept,
    it reads; a schema of another format is a mismatch."""
    settings = load_settings({**REQUIRED, "WORKER_SCHEMA_REGISTRY_URL": "http://127.0.0.1:1"})
    registry = build_registry(settings, {"clicks": "avro", "plain": "json"})
    assert registry is not None
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(CLICK), {"x": 0.5})
    value = frame(4, out.getvalue())
    assert registry.pending("clicks", b"not framed")  # its results' schema: not resolved yet
    registry.set_result("clicks", ResultWriter.of("avro", "out-value", 1, CLICK))
    assert registry.pending("clicks", value) and not registry.pending("plain", value)
    assert not registry.pending("clicks", b"not framed")  # read at once: BAD_MAGIC_BYTE
    with pytest.raises(SchemaPending):
        registry.read("clicks", value)
    writers = registry.writers
    writers._remember(4, writer_schema(4, RegisteredSchema("AVRO", json.dumps(CLICK))))
    assert not registry.pending("clicks", value)
    assert registry.read("clicks", value) == {"x": 0.5}
    writers._remember(5, writer_schema(5, RegisteredSchema("JSON", '{"type": "object"}')))
    with pytest.raises(SchemaMismatch, match="schema id 5 is a json-schema schema; topic 'clicks'"):
        registry.read("clicks", frame(5, b"{}"))
