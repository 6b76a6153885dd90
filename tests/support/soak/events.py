"""The soak's mapped topic: payment events scored by ``mlp`` through a mapping file.

Its producer sends what a pipeline's own producers would: plain JSON events (now and then
with a UTF-8 BOM), CloudEvents in binary mode (``ce_*`` headers) and in structured mode
(``application/cloudevents+json``), and about 10 % hostile events (a missing field, a
string where a number belongs, a short array, not JSON, an array, a tombstone, a
structured event without an object for data). Each good event is answered by a new event
of the mapping's fields in the request's mode; each hostile one by a dead letter with its
code. A record's id is the event's ``id`` field (the mapping's ``request_id``); the hostile
ones also carry it as ``x-request-id``, since their body may hold none.
"""

from __future__ import annotations

import codecs
import json
import time
from typing import Any

import numpy as np
import orjson
from aiokafka.structs import ConsumerRecord

from devtools.samples import MLP_EVENTS_MAPPING, Tensor
from tests.support.soak.checks import MlpCheck, first_header
from tests.support.soak.traffic import Produced, Sent

#: The encodings of a mapped event, as a Sent's ``encoding``.
EVENT_ENCODINGS = ("event", "ce-binary", "ce-structured")
LABELS = [f"class-{i}" for i in range(10)]
CE_TYPE, CE_SOURCE = "soak.payment.scored", "/soak/scoring"
_STRUCTURED = b"application/cloudevents+json"

#: The mapped topic's mapping: the id, the amount, the probabilities and a label.
MAPPING = (
    MLP_EVENTS_MAPPING
    + """amount = "/amount"
label = {{ argmax = "PROBS", labels = {labels} }}
[topics.{topic}.cloudevents]
type = "{ce_type}"
source = "{ce_source}"
"""
)

#: Hostile events: (kind, expected code). The tombstone goes through librdkafka only.
HOSTILE_EVENTS = (
    ("event-missing-field", "INVALID_REQUEST"),
    ("event-not-a-number", "INVALID_REQUEST"),
    ("event-short-array", "INVALID_REQUEST"),
    ("event-not-json", "DECODE_ERROR"),
    ("event-an-array", "DECODE_ERROR"),
    ("event-tombstone", "DECODE_ERROR"),
    ("event-structured-no-data", "DECODE_ERROR"),
)


def mapping_text(topic: str) -> str:
    """The mapping file of the soak's mapped topic."""
    labels = json.dumps(LABELS)
    return MAPPING.format(topic=topic, labels=labels, ce_type=CE_TYPE, ce_source=CE_SOURCE)


class EventTraffic:
    """The records of the mapped topic's partition, drawn from the seed like ``Traffic``."""

    def __init__(self, seed: int, number: int, *, librdkafka: bool) -> None:
        self._rng = np.random.default_rng([seed, number, 1])
        self._number = number
        self._librdkafka = librdkafka

    def make(self, seq: int) -> Produced:
        """Record ``seq`` of the partition."""
        rid = f"p{self._number}-s{seq}"
        draw = self._rng.random()
        if draw < 0.1:
            made = self._hostile(rid)
        else:
            made = self._good(
                rid, "ce-binary" if draw < 0.3 else "ce-structured" if draw < 0.5 else "event"
            )
        made.sent.produced_ms = int(time.time() * 1000)
        return made

    def _good(self, rid: str, encoding: str) -> Produced:
        features = self._rng.standard_normal(64).astype(np.float32)
        amount = round(float(self._rng.uniform(1, 500)), 2)
        event = {"id": rid, "amount": amount, "features": features.tolist(), "note": "ok"}
        kind = "event"
        value = orjson.dumps(event)
        headers: list[tuple[str, bytes | None]] = []
        if encoding == "ce-binary":
            kind = encoding
            headers = [
                ("ce_specversion", b"1.0"),
                ("ce_id", f"ce-{rid}".encode()),
                ("ce_source", b"/soak/payments"),
                ("ce_type", b"soak.payment"),
                ("ce_subject", b"card"),
                ("content-type", b"application/json"),
            ]
        elif encoding == "ce-structured":
            kind = encoding
            envelope = {
                "specversion": "1.0",
                "id": f"ce-{rid}",
                "source": "/soak/payments",
                "type": "soak.payment",
                "data": event,
            }
            value, headers = orjson.dumps(envelope), [("content-type", _STRUCTURED)]
        elif self._rng.random() < 0.1:
            kind, value = "event-bom", codecs.BOM_UTF8 + value
        sent = Sent(rid, self._number, kind, None, "mlp", encoding)
        sent.tensors = [Tensor("INPUT0", "FP32", (1, 64), features.reshape(1, 64))]
        sent.fields = {"id": rid, "amount": amount}
        return Produced(sent, rid.encode(), value, headers)

    def _hostile(self, rid: str) -> Produced:
        kinds = [k for k in HOSTILE_EVENTS if self._librdkafka or k[0] != "event-tombstone"]
        kind, code = kinds[int(self._rng.integers(len(kinds)))]
        features: list[Any] = [0.5] * 64
        value: bytes | None = {
            "event-missing-field": orjson.dumps({"id": rid, "amount": 1.0}),
            "event-not-a-number": orjson.dumps({"id": rid, "features": [*features[:3], "n/a"]}),
            "event-short-array": orjson.dumps({"id": rid, "features": features[:63]}),
            "event-not-json": b"amount=12&id=" + rid.encode(),
            "event-an-array": orjson.dumps([rid, 1, 2]),
            "event-tombstone": None,
            "event-structured-no-data": orjson.dumps(
                {"specversion": "1.0", "id": rid, "source": "/s", "type": "t", "data": 5}
            ),
        }[kind]
        headers: list[tuple[str, bytes | None]] = [("x-request-id", rid.encode())]
        if kind == "event-structured-no-data":
            headers.append(("content-type", _STRUCTURED))
        sent = Sent(rid, self._number, kind, code, "mlp", "event")
        return Produced(sent, rid.encode(), value, headers)


def check_event(
    sent: Sent, record: ConsumerRecord[bytes, bytes], deferred: list[MlpCheck]
) -> str | None:
    """Why a mapped event's result is wrong, or None: its mode, its CloudEvent attributes
    (the id made of the request's coordinates, so a duplicate carries the same), its fields;
    the probabilities are compared with the reference later (``check_mlp``)."""
    headers = record.headers
    content_type = first_header(headers, "content-type")
    structured = sent.encoding == "ce-structured"
    if content_type != (_STRUCTURED if structured else b"application/json"):
        return f"content-type {content_type!r} for a {sent.encoding} event"
    if first_header(headers, "x-request-id") != sent.rid.encode():
        return f"x-request-id {first_header(headers, 'x-request-id')!r}"
    source = b"/".join(
        first_header(headers, f"x-source-{part}") or b"?"
        for part in ("topic", "partition", "offset")
    ).decode()
    attributes = {
        "id": source,
        "source": CE_SOURCE,
        "type": CE_TYPE,
        "correlationid": f"ce-{sent.rid}",
    }
    body = orjson.loads(record.value)
    got = {k.removeprefix("ce_"): (v or b"").decode() for k, v in headers if k.startswith("ce_")}
    if sent.encoding == "ce-binary" and got != {"specversion": "1.0", **attributes}:
        return f"ce_* headers {got}, want {attributes}"
    if sent.encoding != "ce-binary" and got:
        return f"ce_* headers {got} on the result of a {sent.encoding} event"
    if structured:
        envelope = {k: v for k, v in body.items() if k != "data"}
        want = {"specversion": "1.0", **attributes, "datacontenttype": "application/json"}
        if envelope != want:
            return f"envelope {envelope}, want {want}"
        body = body.get("data")
    return check_fields(sent, body, deferred)


def check_fields(sent: Sent, body: Any, deferred: list[MlpCheck]) -> str | None:
    """Why a result event's fields are wrong (the id and amount copied, the label the argmax
    of the probabilities), or None; the probabilities are compared with the reference later."""
    if not isinstance(body, dict) or set(body) != {"id", "amount", "probs", "label"}:
        return f"result fields {body}"
    if {k: body[k] for k in ("id", "amount")} != sent.fields:
        return f"id and amount {body['id']!r}, {body['amount']!r}, sent {sent.fields}"
    probs = np.asarray(body["probs"], dtype=np.float64)
    if probs.shape != (10,):
        return f"probs of shape {probs.shape}"
    if body["label"] != LABELS[int(np.argmax(probs))]:
        return f"label {body['label']!r} is not the argmax of probs"
    assert sent.tensors is not None
    deferred.append(MlpCheck(sent.rid, np.asarray(sent.tensors[0].values), probs.reshape(1, 10)))
    return None
