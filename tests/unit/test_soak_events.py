"""The chaos soak's mapped topic: its traffic, and the check of each result event."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from aiokafka.structs import ConsumerRecord

from tests.support.soak.checks import MlpCheck, check_mlp
from tests.support.soak.events import (
    CE_SOURCE,
    CE_TYPE,
    HOSTILE_EVENTS,
    LABELS,
    EventTraffic,
    check_event,
)
from tests.support.soak.traffic import Produced

pytestmark = pytest.mark.unit

TOPIC = "events"


def test_the_event_traffic_mixes_modes_and_hostile_events_and_replays() -> None:
    """Plain, BOM, both CloudEvents modes and every hostile kind; a seed replays the same;
    a hostile event carries its id as a header and the code it must get."""
    traffic, replay = (EventTraffic(5, 4, librdkafka=True) for _ in range(2))
    made = [traffic.make(seq) for seq in range(2000)]
    assert [m.value for m in made[:50]] == [replay.make(seq).value for seq in range(50)]
    kinds = {m.sent.kind for m in made}
    assert {"event", "event-bom", "ce-binary", "ce-structured"} <= kinds
    assert {kind for kind, _ in HOSTILE_EVENTS} <= kinds
    for m in made:
        assert m.sent.rid.startswith("p4-s")
        if m.sent.expected_code is not None:
            assert ("x-request-id", m.sent.rid.encode()) in m.headers
    aiokafka = EventTraffic(5, 4, librdkafka=False)
    assert all(aiokafka.make(seq).value is not None for seq in range(500))


def _first(kind: str) -> Produced:
    traffic = EventTraffic(11, 4, librdkafka=True)
    return next(m for m in (traffic.make(seq) for seq in range(500)) if m.sent.kind == kind)


def _result(
    made: Produced,
    body: dict[str, Any],
    extra: list[tuple[str, bytes]] | None = None,
    offset: int = 7,
) -> ConsumerRecord[bytes, bytes]:
    """The result record a worker should write for ``made`` at offset 7 of the topic (its
    x-source-offset header says ``offset``)."""
    source = f"{TOPIC}/0/7"
    attributes = {
        "specversion": "1.0",
        "id": source,
        "source": CE_SOURCE,
        "type": CE_TYPE,
        "correlationid": f"ce-{made.sent.rid}",
    }
    content_type = b"application/json"
    headers = [
        ("x-request-id", made.sent.rid.encode()),
        ("x-source-topic", TOPIC.encode()),
        ("x-source-partition", b"0"),
        ("x-source-offset", str(offset).encode()),
    ]
    value = body
    if made.sent.kind == "ce-binary":
        headers += [(f"ce_{k}", v.encode()) for k, v in attributes.items()]
    elif made.sent.kind == "ce-structured":
        content_type = b"application/cloudevents+json"
        value = {**attributes, "datacontenttype": "application/json", "data": body}
    headers = [("content-type", content_type), *headers, *(extra or [])]
    encoded = orjson.dumps(value)
    return ConsumerRecord(TOPIC, 0, 3, 0, 0, None, encoded, None, 0, len(encoded), headers)


def _body(made: Produced) -> dict[str, Any]:
    assert made.sent.tensors is not None and made.sent.fields is not None
    rows = np.asarray(made.sent.tensors[0].values, dtype=np.float32)
    probs = np.exp(rows[0, :10]) / np.exp(rows[0, :10]).sum()
    label = LABELS[int(np.argmax(probs))]
    return {**made.sent.fields, "probs": probs.tolist(), "label": label}


@pytest.mark.parametrize("kind", ["event", "event-bom", "ce-binary", "ce-structured"])
def test_a_right_result_event_passes_and_each_wrong_part_is_named(kind: str) -> None:
    made = _first(kind)
    body = _body(made)
    deferred: list[MlpCheck] = []
    assert check_event(made.sent, _result(made, body), deferred) is None
    assert [c.rid for c in deferred] == [made.sent.rid]
    # The reference is not the softmax above: the deferred check catches the values.
    assert check_mlp(deferred) == [f"{made.sent.rid} (mlp): PROBS differ from the reference"]

    wrong_label = {**body, "label": "class-x"}
    assert "label" in (check_event(made.sent, _result(made, wrong_label), []) or "")
    wrong_amount = {**body, "amount": -1}
    assert "id and amount" in (check_event(made.sent, _result(made, wrong_amount), []) or "")
    copied = _result(made, body, [("ce_subject", b"card")])
    assert check_event(made.sent, copied, []) is not None
    if kind.startswith("ce-"):  # the CloudEvent's id is the request record's coordinates
        moved = _result(made, body, offset=8)
        assert f"'id': '{TOPIC}/0/7'" in (check_event(made.sent, moved, []) or "")
