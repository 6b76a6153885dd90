"""The soak's Avro topic: payment events in the Confluent wire format, scored by ``mlp``.

Its producer writes what a pipeline's Avro producers write: records framed by
confluent-kafka's own ``AvroSerializer`` against the soak's Schema Registry, moving partway
through the run (at record ``evolve_at``) to a second, compatible version of their schema
(a ``currency`` field with a default), and about 10 % hostile values: truncated Avro,
bytes left over, a schema id the registry does not have, an empty value, Avro without
its frame (no magic byte), a tombstone, and a record whose array is one short. Each good
event is answered by an Avro result of the mapping's fields, each hostile one by a dead
letter with its code. A result is read back with confluent-kafka's ``AvroDeserializer``
once the run is over (``check_avro_results``): the registry may be down while the
collector reads.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from aiokafka.structs import ConsumerRecord
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from devtools.samples import Tensor
from tests.support.soak.checks import MlpCheck, first_header
from tests.support.soak.events import LABELS, check_fields
from tests.support.soak.traffic import NotYet, Produced, Sent
from worker.registry.framing import HEADER_BYTES, frame

#: A Sent's ``encoding`` on the Avro topic.
AVRO_ENCODING = "avro"
#: The kinds of its good events, by their schema's version.
AVRO_VERSIONS = {1: "avro-v1", 2: "avro-v2"}
#: Hostile values: (kind, the code of the dead letter the worker gives it).
HOSTILE_AVRO = (
    ("avro-truncated", "SCHEMA_MISMATCH"),
    ("avro-left-over", "SCHEMA_MISMATCH"),
    ("avro-unknown-id", "SCHEMA_NOT_FOUND"),
    ("avro-empty", "BAD_MAGIC_BYTE"),
    ("avro-no-magic", "BAD_MAGIC_BYTE"),
    ("avro-tombstone", "DECODE_ERROR"),
    ("avro-short-array", "INVALID_REQUEST"),
)
HOSTILE_SHARE = 0.1
#: Schema ids from here up are never the soak's registry's (it holds a few per run).
UNKNOWN_IDS_FROM = 1_000_000
_CURRENCIES = ("EUR", "USD", "GBP", "CHF")
_CONTENT_TYPE = b"application/avro"

#: The Avro topic's mapping: the fields of the mapped JSON topic's results, as Avro.
MAPPING = """
[topics.{topic}]
model = "mlp"
format = "avro"
request_id = "/id"
[topics.{topic}.inputs.INPUT0]
datatype = "FP32"
from = "$.features"
shape = [64]
[topics.{topic}.result]
name = "soak.PaymentScore"
[topics.{topic}.result.fields]
id = "/id"
amount = "/amount"
probs = "PROBS"
label = {{ argmax = "PROBS", labels = {labels} }}
"""


def avro_mapping_text(topic: str) -> str:
    """The mapping of the soak's Avro topic."""
    return MAPPING.format(topic=topic, labels=json.dumps(LABELS))


def payment_schema(version: int) -> str:
    """The events' Avro schema: version 2 adds a currency with a default (compatible both
    ways, as the registry's default BACKWARD compatibility wants)."""
    fields: list[dict[str, Any]] = [
        {"name": "id", "type": "string"},
        {"name": "amount", "type": "double"},
        {"name": "features", "type": {"type": "array", "items": "float"}},
    ]
    if version >= 2:
        fields.append({"name": "currency", "type": "string", "default": "EUR"})
    record = {"type": "record", "name": "Payment", "namespace": "soak", "fields": fields}
    return json.dumps(record)


@dataclass(frozen=True, slots=True)
class _Draft:
    """A record drawn from the seed, before the serializer frames it."""

    sent: Sent
    version: int
    record: dict[str, Any]
    #: What is sent made of the serializer's value (None: a tombstone).
    spoil: Callable[[bytes], bytes | None]
    headers: list[tuple[str, bytes | None]]


class AvroTraffic:
    """The records of the Avro topic's partition, drawn from the seed like ``Traffic``.

    ``make(seq)`` raises NotYet while the registry is out as the producer first writes a
    version (the serializer registers it then); the same ``seq`` made again later is the
    same record.
    """

    def __init__(
        self,
        seed: int,
        number: int,
        client: SchemaRegistryClient,
        topic: str,
        evolve_at: int,
        *,
        librdkafka: bool,
    ) -> None:
        self._rng = np.random.default_rng([seed, number, 2])
        self._number = number
        self._librdkafka = librdkafka
        self._client = client
        self._evolve_at = evolve_at
        self._context = SerializationContext(topic, MessageField.VALUE)
        # The subject from the topic alone (TopicNameStrategy), not asked of the registry.
        conf = {"subject.name.strategy.type": "TOPIC"}
        self._serializers = {
            v: AvroSerializer(client, payment_schema(v), conf=conf) for v in AVRO_VERSIONS
        }
        self._registered: set[int] = set()
        self._draft: tuple[int, _Draft] | None = None

    def make(self, seq: int) -> Produced:
        """Record ``seq`` of the partition."""
        if self._draft is None or self._draft[0] != seq:
            self._draft = (seq, self._draw(f"p{self._number}-s{seq}", seq))
        draft = self._draft[1]
        self._register(draft.version)
        value = draft.spoil(self._serializers[draft.version](draft.record, self._context) or b"")
        self._draft = None
        draft.sent.produced_ms = int(time.time() * 1000)
        return Produced(draft.sent, draft.sent.rid.encode(), value, draft.headers)

    def _register(self, version: int) -> None:
        """The version's schema registered under the topic's subject (once), as the
        serializer does on its first record; NotYet while the registry is out."""
        if version in self._registered:
            return
        subject = f"{self._context.topic}-value"
        try:
            self._client.register_schema(subject, Schema(payment_schema(version), "AVRO"))
        except SchemaRegistryError as exc:
            if exc.http_status_code is not None and 0 < exc.http_status_code < 500:
                raise  # refused: the soak's schemas are wrong, not the registry out
            raise NotYet(f"the registry answered {exc}") from exc
        except Exception as exc:  # the client's HTTP library: connection refused, timeout
            raise NotYet(f"the registry is out of reach: {exc!r}") from exc
        self._registered.add(version)

    def _draw(self, rid: str, seq: int) -> _Draft:
        rng = self._rng
        version = 2 if seq >= self._evolve_at else 1
        hostile = rng.random() < HOSTILE_SHARE
        features = rng.standard_normal(64).astype(np.float32)
        amount = round(float(rng.uniform(1, 500)), 2)
        record: dict[str, Any] = {"id": rid, "amount": amount, "features": features.tolist()}
        if version == 2:
            record["currency"] = _CURRENCIES[int(rng.integers(len(_CURRENCIES)))]
        if not hostile:
            sent = Sent(rid, self._number, AVRO_VERSIONS[version], None, "mlp", AVRO_ENCODING)
            sent.tensors = [Tensor("INPUT0", "FP32", (1, 64), features.reshape(1, 64))]
            sent.fields = {"id": rid, "amount": amount}
            return _Draft(sent, version, record, _as_is, [])
        kinds = [k for k in HOSTILE_AVRO if self._librdkafka or k[0] != "avro-tombstone"]
        kind, code = kinds[int(rng.integers(len(kinds)))]
        cut, unknown = float(rng.random()), int(rng.integers(UNKNOWN_IDS_FROM, 2**31))
        if kind == "avro-short-array":
            record["features"] = record["features"][:63]
        spoil = _spoiler(kind, cut, unknown)
        sent = Sent(rid, self._number, kind, code, "mlp", AVRO_ENCODING)
        return _Draft(sent, version, record, spoil, [("x-request-id", rid.encode())])


def _as_is(value: bytes) -> bytes | None:
    return value


def _spoiler(kind: str, cut: float, unknown: int) -> Callable[[bytes], bytes | None]:
    """What a hostile kind makes of a good framed value."""
    spoilers: dict[str, Callable[[bytes], bytes | None]] = {
        # Anywhere from the bare frame to one byte short: a record never ends early.
        "avro-truncated": lambda v: v[: HEADER_BYTES + int(cut * (len(v) - HEADER_BYTES))],
        "avro-left-over": lambda v: v + b"\x02\x04",
        "avro-unknown-id": lambda v: frame(unknown, v[HEADER_BYTES:]),
        "avro-empty": lambda v: b"",
        "avro-no-magic": lambda v: v[HEADER_BYTES:],  # a non-empty id's length leads: not 0
        "avro-tombstone": lambda v: None,
        "avro-short-array": _as_is,
    }
    return spoilers[kind]


@dataclass(frozen=True, slots=True)
class AvroResult:
    """An Avro result as read, decoded once the run is over."""

    sent: Sent
    value: bytes


def check_avro(
    sent: Sent, record: ConsumerRecord[bytes, bytes], deferred: list[AvroResult]
) -> str | None:
    """Why an Avro event's result is wrong as read (its headers, its frame), or None; its
    fields are checked later (``check_avro_results``)."""
    headers = record.headers
    if (content_type := first_header(headers, "content-type")) != _CONTENT_TYPE:
        return f"content-type {content_type!r} for an Avro event"
    if first_header(headers, "x-request-id") != sent.rid.encode():
        return f"x-request-id {first_header(headers, 'x-request-id')!r}"
    copied = [k for k, _ in headers if k.startswith("ce_")]
    if copied:
        return f"ce_* headers {copied} on the result of an Avro event"
    value = record.value or b""
    if len(value) <= HEADER_BYTES or value[0] != 0:
        return f"result value {value[:8]!r} is not in the Confluent wire format"
    deferred.append(AvroResult(sent, bytes(value)))
    return None


def check_avro_results(
    results: Sequence[AvroResult], read: Callable[[bytes], Any], deferred: list[MlpCheck]
) -> list[str]:
    """The Avro results that are wrong, each decoded by ``read`` (confluent-kafka's
    deserializer against the registry): the copied id and amount, the label the argmax of
    the probabilities, which are compared with the reference later (``check_mlp``)."""
    wrong = []
    for result in results:
        sent = result.sent
        try:
            body = read(result.value)
        except Exception as exc:  # whatever the deserializer says of it
            wrong.append(f"{sent.rid} ({sent.kind}, avro): does not decode: {exc!r}")
            continue
        if (problem := check_fields(sent, body, deferred)) is not None:
            wrong.append(f"{sent.rid} ({sent.kind}, avro): {problem}")
    return wrong
