"""Avro and JSON Schema events through a real Schema Registry (Apicurio, Confluent's API),
against the real broker and Triton.

The events are written by confluent-kafka's own ``AvroSerializer`` and ``JSONSerializer``
against the registry, as a pipeline's producers write them; the results are read back
with its ``AvroDeserializer`` and ``JSONDeserializer``. In one scenario per delivery mode:
events of a first schema version, hostile values (truncated Avro, bytes left over, a
schema id the registry does not have, an empty value, plain JSON, a tombstone, an event
the mapping refuses, JSON off its schema), the producer moving to a second, compatible
version mid-stream, and the registry stopped while events of a third version (whose
schema the worker has not fetched yet) arrive: those wait, none is dead-lettered, and all
are answered once it is back.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONDeserializer, JSONSerializer
from confluent_kafka.serialization import MessageField, SerializationContext

from devtools.devstack.registry import SchemaRegistry
from tests.integration.test_foreign_traffic import Out, produce
from tests.support import KafkaUnderTest, Topics, TritonUnderTest, collect, mlp_reference
from tests.support.worker import run_to_exit, running_worker, settings_for, worker_env
from worker.checks.report import run_checks
from worker.registry.framing import frame
from worker.settings import load_settings
from worker.wire import header_value

pytestmark = pytest.mark.timeout(180)

LABELS = [f"class-{i}" for i in range(10)]


def payment(version: int) -> str:
    """The events' Avro schema: version 2 adds a currency, version 3 a channel (both with
    defaults: compatible both ways)."""
    fields: list[dict[str, Any]] = [
        {"name": "id", "type": "string"},
        {"name": "amount", "type": "double"},
        {"name": "features", "type": {"type": "array", "items": "float"}},
    ]
    if version >= 2:
        fields.append({"name": "currency", "type": "string", "default": "EUR"})
    if version >= 3:
        fields.append({"name": "channel", "type": ["null", "string"], "default": None})
    return json.dumps(
        {"type": "record", "name": "Payment", "namespace": "com.example", "fields": fields}
    )


#: The readings topic's JSON Schema (draft 7, as confluent-kafka's JSONSerializer writes).
READING = json.dumps(
    {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Reading",
        "type": "object",
        "properties": {
            "id": {"type": "string"},
            "a": {"type": "number"},
            "b": {"type": "number"},
        },
        "required": ["id", "a", "b"],
    }
)

#: A json-schema topic of readings for ``double``, its results under the record's name.
READINGS_MAPPING = """
[topics.{readings}]
model = "double"
format = "json-schema"
request_id = "/id"
[topics.{readings}.inputs.INPUT0]
datatype = "FP32"
fields = ["/a", "/b"]
[topics.{readings}.result]
name = "com.example.Doubled{unique}"
subject = "record"
fields = {{ id = "/id", doubled = "OUTPUT0" }}
"""

MAPPING = """
[topics.{topic}]
model = "mlp"
format = "avro"
request_id = "/id"
[topics.{topic}.inputs.INPUT0]
datatype = "FP32"
from = "$.features"
shape = [64]
[topics.{topic}.result.fields]
id = "/id"
amount = "/amount"
score = "PROBS[1]"
label = {{ argmax = "PROBS", labels = {labels} }}
"""


class Payments:
    """Avro payments framed by confluent-kafka's serializer, schema ``version`` of three."""

    def __init__(self, client: SchemaRegistryClient, topic: str) -> None:
        self._context = SerializationContext(topic, MessageField.VALUE)
        self._serializers = {v: AvroSerializer(client, payment(v)) for v in (1, 2, 3)}
        self.sent: dict[str, list[float]] = {}

    def event(self, name: str, version: int, rng: np.random.Generator, **extra: Any) -> Out:
        features = [float(x) for x in rng.standard_normal(64).astype(np.float32)]
        self.sent[name] = features
        record = {"id": name, "amount": 12.5, "features": features, **extra}
        value = self._serializers[version](record, self._context)
        return Out(value, name.encode())


@pytest.fixture
def registry_client(schema_registry: SchemaRegistry) -> Iterator[SchemaRegistryClient]:
    """confluent-kafka's client of the session's registry, closed after the test."""
    with SchemaRegistryClient({"url": schema_registry.url}) as client:
        yield client


def context_of(topic: str) -> SerializationContext:
    return SerializationContext(topic, MessageField.VALUE)


async def wait_open(worker: Any, timeout_s: float) -> None:
    """Until the worker's registry breaker opens (the registry is out and was asked)."""
    await asyncio.wait_for(worker.registry.writers.breaker.wait_open(), timeout_s)


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
async def test_avro_events_hostile_values_evolution_and_a_registry_restart(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    schema_registry: SchemaRegistry,
    registry_client: SchemaRegistryClient,
    unique: str,
    tmp_path: Path,
    delivery: str,
) -> None:
    """Avro events of two versions answered, each hostile value a dead letter of its own
    code with its bytes, and the events of a third version held through a registry
    restart and answered, none dead-lettered; JSON Schema readings beside them answered,
    one that does not match its schema dead-lettered; every result read back by
    confluent-kafka's own deserializers."""
    topics = Topics.fresh(unique)
    readings = f"readings-{unique}"
    await kafka.create_topics([topics.input, readings, topics.output, topics.dlq])
    rng = np.random.default_rng(11)
    payments = Payments(registry_client, topics.input)
    first = [payments.event(f"v1-{i}", 1, rng) for i in range(4)]
    good = first[0].value
    assert good is not None
    hostile = {
        "truncated": ("SCHEMA_MISMATCH", good[: len(good) // 2]),
        "left-over": ("SCHEMA_MISMATCH", good + b"\x02\x04"),
        "unknown-id": ("SCHEMA_NOT_FOUND", b"\x00" + (987654).to_bytes(4, "big") + good[5:]),
        "empty": ("BAD_MAGIC_BYTE", b""),
        "plain-json": ("BAD_MAGIC_BYTE", orjson.dumps({"id": "plain-json"})),
        "tombstone": ("DECODE_ERROR", None),
    }
    short = payments.event("short", 1, rng, features=[0.5] * 63)
    second = [payments.event(f"v2-{i}", 2, rng, currency="USD") for i in range(3)]
    third = [payments.event(f"v3-{i}", 3, rng, channel="web") for i in range(3)]
    read_context = SerializationContext(readings, MessageField.VALUE)
    to_json = JSONSerializer(READING, registry_client)
    json_readings = [
        Out(to_json({"id": f"r-{i}", "a": i + 0.5, "b": -i}, read_context), f"r-{i}".encode())
        for i in range(3)
    ]
    reading_id = int.from_bytes((json_readings[0].value or b"")[1:5], "big")
    off_schema = frame(reading_id, b'{"id": "r-bad", "a": "lots", "b": 1}')
    mapping = tmp_path / "mapping.toml"
    mapping.write_text(
        MAPPING.format(topic=topics.input, labels=json.dumps(LABELS))
        + READINGS_MAPPING.format(readings=readings, unique=unique)
    )
    settings = settings_for(
        kafka,
        triton,
        topics,
        input_topics=f"{topics.input},{readings}",
        mapping_file=str(mapping),
        delivery=delivery,
        schema_registry_url=schema_registry.url,
        schema_registry_auto_register="true",
    )
    sent = [
        *first,
        *(Out(value, name.encode()) for name, (_, value) in hostile.items()),
        short,
        *second,
    ]
    json_sent = [*json_readings, Out(off_schema, b"r-bad")]
    async with running_worker(settings) as worker:
        await produce(kafka.bootstrap_servers, topics.input, sent)
        await produce(kafka.bootstrap_servers, readings, json_sent)
        got = await collect(kafka.bootstrap_servers, topics, len(sent) + len(json_sent))
        # Events of a version the worker has not read yet, while the registry is out.
        await asyncio.to_thread(schema_registry.stop)
        try:
            await produce(kafka.bootstrap_servers, topics.input, third)
            await wait_open(worker, 60)
            assert got.dead_letters.keys() == {*hostile, "short", "r-bad"}
        finally:
            await asyncio.to_thread(schema_registry.start)
        await collect(
            kafka.bootstrap_servers, topics, len(sent) + len(json_sent) + len(third), into=got
        )

    assert got.duplicates == 0
    for name, code in {
        **{k: c for k, (c, _) in hostile.items()},
        "short": "INVALID_REQUEST",
    }.items():
        letter = got.dead_letters[name]
        assert header_value(letter.headers, "x-error-code") == code.encode(), name
    for name, (_, value) in hostile.items():
        assert got.dead_letters[name].value == value, name
    bad = got.dead_letters["r-bad"]
    assert header_value(bad.headers, "x-error-code") == b"SCHEMA_MISMATCH"
    assert header_value(bad.headers, "x-error-message") == (
        f"$.a: does not match schema id {reading_id}: 'lots' is not of type 'number'".encode()
    )
    assert bad.value == off_schema
    answered = {*(f"v1-{i}" for i in range(4)), *(f"v2-{i}" for i in range(3))}
    answered |= {f"v3-{i}" for i in range(3)}
    assert got.results.keys() == answered | {f"r-{i}" for i in range(3)}
    from_json = JSONDeserializer(None, schema_registry_client=registry_client)
    for i in range(3):
        result = got.results[f"r-{i}"]
        assert from_json(result.value, context_of(topics.output)) == {
            "id": f"r-{i}",
            "doubled": [2 * (i + 0.5), -2.0 * i],
        }
        assert header_value(result.headers, "content-type") == b"application/json"
    subject = registry_client.get_latest_version(f"com.example.Doubled{unique}")
    assert subject.schema is not None and subject.schema.schema_type == "JSON"
    # The results, read back by confluent-kafka's own deserializer with the schema the
    # worker registered under the output topic's subject.
    read = AvroDeserializer(registry_client)
    for name in answered:
        record = got.results[name]
        body = read(record.value, context_of(topics.output))
        expected = mlp_reference(np.asarray([payments.sent[name]], dtype=np.float32))[0]
        assert body is not None and set(body) == {"id", "amount", "score", "label"}
        assert body["id"] == name and body["amount"] == 12.5
        assert body["score"] == pytest.approx(float(expected[1]), rel=1e-5)
        assert body["label"] == LABELS[int(np.argmax(expected))]
        assert header_value(record.headers, "content-type") == b"application/avro"
    registered = registry_client.get_latest_version(f"{topics.output}-value")
    assert registered.schema is not None and registered.schema.schema_str is not None
    fields = json.loads(registered.schema.schema_str)["fields"]
    assert [(f["name"], f["type"]) for f in fields] == [
        ("id", ["null", "string"]),
        ("amount", ["null", "double"]),
        ("score", "float"),
        ("label", ["null", "string"]),
    ]


async def test_a_subject_schema_that_does_not_take_the_result_stops_the_start_in_one_line(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    schema_registry: SchemaRegistry,
    registry_client: SchemaRegistryClient,
    unique: str,
    tmp_path: Path,
) -> None:
    """Without auto-registration, the output subject's latest schema must take what the
    mapping writes: one that lacks a field (or has none at all) refuses the start, exit 2,
    one line naming the subject and the first difference; `check` fails its row."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.output, topics.dlq])
    mapping = tmp_path / "mapping.toml"
    mapping.write_text(MAPPING.format(topic=topics.input, labels=json.dumps(LABELS)))
    env = worker_env(
        kafka,
        triton,
        topics,
        mapping_file=str(mapping),
        schema_registry_url=schema_registry.url,
    )
    registry_client.register_schema(f"{topics.input}-value", Schema(payment(1), "AVRO"))

    missing = await asyncio.to_thread(run_to_exit, env, tmp_path / "none.log", 60.0)

    subject = f"{topics.output}-value"
    narrow = {
        "type": "record",
        "name": "Score",
        "fields": [
            {"name": "id", "type": ["null", "string"], "default": None},
            {"name": "score", "type": "float"},
            {"name": "label", "type": ["null", "string"], "default": None},
        ],
    }
    schema_id = registry_client.register_schema(subject, Schema(json.dumps(narrow), "AVRO"))

    refused = await asyncio.to_thread(run_to_exit, env, tmp_path / "narrow.log", 60.0)

    where = f"topics.{topics.input}.result"
    for exited, line in (
        (
            missing,
            f"error: {where}: subject '{subject}' has no schema: register the mapping's result "
            "schema (`kafka-triton-worker check` shows it), or set "
            "WORKER_SCHEMA_REGISTRY_AUTO_REGISTER=true",
        ),
        (
            refused,
            f"error: {where}: the latest schema of subject '{subject}' (version 1, id "
            f"{schema_id}) does not accept what the mapping writes: it has no field 'amount', "
            "which the mapping writes",
        ),
    ):
        assert exited.code == 2, exited.lines[-10:]
        assert [x for x in exited.lines if not x.startswith("{")] == [line], exited.lines[-10:]
    # `check` says the same of the subject, and shows the registry.
    rows = {r.check: r for r in await run_checks(load_settings(env), 10.0)}
    assert rows["Schema Registry"].outcome == "ok", rows["Schema Registry"]
    assert schema_registry.url in rows["Schema Registry"].detail
    row = rows[f"registry {topics.input}"]
    assert row.outcome == "fail" and row.detail == (
        f"avro; events {topics.input}-value version 1; results under '{subject}' (version 1, "
        f"id {schema_id}) does not accept what the mapping writes: it has no field 'amount', "
        "which the mapping writes"
    )
