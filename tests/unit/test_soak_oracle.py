"""The chaos soak's own judgement: stalls, sequences, its schedule, its traffic and the
result events of its mapped JSON and Avro topics."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import orjson
import pytest
from aiokafka.structs import ConsumerRecord
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.serialization import MessageField, SerializationContext

from devtools import samples
from tests.support.soak.avro import (
    AVRO_VERSIONS,
    HOSTILE_AVRO,
    AvroResult,
    AvroTraffic,
    check_avro,
    check_avro_results,
    payment_schema,
)
from tests.support.soak.checks import MlpCheck, check_mlp
from tests.support.soak.events import (
    CE_SOURCE,
    CE_TYPE,
    HOSTILE_EVENTS,
    LABELS,
    EventTraffic,
    check_event,
)
from tests.support.soak.lanes import Ledger
from tests.support.soak.oracle import held_windows, sequence_problems
from tests.support.soak.outcomes import Outcome
from tests.support.soak.progress import Progress
from tests.support.soak.schedule import FAULT_KINDS, FIRST_KINDS, schedule
from tests.support.soak.traffic import OUTPUT_MAX_BYTES, NotYet, Produced, Sent, Traffic
from worker.errors import BadMagicByte, SchemaMismatch
from worker.registry.formats import AvroWriter
from worker.registry.framing import unframe

pytestmark = pytest.mark.unit


def test_a_partition_with_records_waiting_stalls_past_the_bound() -> None:
    """Committed offset still while records wait: a stall once past the bound, not before."""
    progress = Progress(2, bound_s=10.0, now=0.0)
    ends = {0: 5, 1: 5}
    assert progress.observe(1.0, {0: 2, 1: 5}, ends) is None
    assert progress.observe(10.5, {0: 2, 1: 5}, ends) is None
    stall = progress.observe(11.5, {0: 2, 1: 5}, ends)
    assert stall is not None and (stall.partition, stall.committed, stall.end) == (0, 2, 5)
    assert stall.seconds == pytest.approx(10.5)


def test_a_partition_with_nothing_waiting_never_stalls() -> None:
    """Committed up to the end: standing still is no stall, however long."""
    progress = Progress(1, bound_s=1.0, now=0.0)
    assert progress.observe(100.0, {0: 5}, {0: 5}) is None
    assert progress.worst_stall_s == 0.0


def test_an_excused_fault_and_its_settling_time_do_not_count() -> None:
    """No stall while a fault is excused, nor during its settling time; counted after."""
    progress = Progress(1, bound_s=5.0, now=0.0)
    ends = {0: 9}
    progress.excuse("broker down")
    progress.excuse("no worker")
    assert progress.observe(30.0, {}, ends) is None  # the broker did not answer: excused
    progress.resume("broker down", now=30.0)
    assert progress.observe(45.0, {}, ends) is None  # the other excuse still holds
    progress.resume("no worker", now=45.0, settle_s=6.0)
    assert progress.observe(55.0, {}, ends) is None  # 4 s counted of 5
    assert progress.observe(56.5, {}, ends) is not None
    assert progress.worst_stall_s == pytest.approx(5.5)


def test_a_moving_offset_resets_the_stall() -> None:
    """Each move of the committed offset starts the count again."""
    progress = Progress(1, bound_s=2.0, now=0.0)
    for t in range(1, 20):  # a move at every other reading, a second apart
        assert progress.observe(float(t), {0: t // 2}, {0: 100}) is None
    assert progress.worst_stall_s == pytest.approx(1.0)


def _sequence(
    ledger: Ledger, key: str, sums: list[int], produced_ms: int
) -> dict[tuple[int, int], str]:
    accepted = {}
    for step, total in enumerate(sums):
        rid = f"{key}-{step}"
        ledger.sent[rid] = Sent(
            rid, 0, "sequence", model="running_sum", sequence=key, step=step,
            expected_sum=total, produced_ms=produced_ms,
        )  # fmt: skip
        accepted[(0, len(ledger.sent))] = rid
    return accepted


def test_only_sequences_no_fault_touched_must_be_exact() -> None:
    """A wrong sum or a dead letter fails an untouched sequence; a touched one may have both."""
    ledger = Ledger()
    calm = _sequence(ledger, "calm", [1, 3], produced_ms=1_000)
    hit = _sequence(ledger, "hit", [2, 5], produced_ms=5_000)
    accepted = {**calm, **hit}
    sums = iter([1, 4, 2, 9])  # calm's second sum is wrong; hit's is too
    by_source = {
        source: [Outcome(source, rid, None, ms, next(sums))]
        for (source, rid), ms in zip(accepted.items(), [1_100, 1_200, 5_100, 5_200], strict=True)
    }
    problems, untouched, touched = sequence_problems(ledger, accepted, by_source, [(5_150, 6_000)])
    assert (untouched, touched) == (1, 1)
    assert problems == ["sequence calm step 1 (calm-1): SUM 4, want 3 with no fault about"]
    lost = next(iter(calm.items()))
    by_source[lost[0]] = [Outcome(lost[0], lost[1], "INFERENCE_ERROR", 1_100)]
    problems, _, _ = sequence_problems(ledger, accepted, by_source, [(5_150, 6_000)])
    assert "sequence calm step 0 (calm-0): dead letter INFERENCE_ERROR" in problems[0]


def test_a_hold_for_a_retired_version_is_read_from_the_workers_logs(tmp_path: Path) -> None:
    """The window of each hold a worker logged: from its start (its end less the time held)
    to a second after its end; other lines and a worker without a log are passed over."""
    log = tmp_path / "w0.log"
    lines = [
        {"event": "worker_started", "timestamp": "2026-12-07T00:26:16.417279Z"},
        {"model": "double", "version": "1", "held_s": 5.04, "event": "model_version_retired",
         "timestamp": "2026-12-07T00:26:21.580000Z"},
    ]  # fmt: skip
    log.write_text("\n".join(json.dumps(line) for line in lines) + "\nnot JSON\n")
    workers = [mock.Mock(log_path=log), mock.Mock(log_path=tmp_path / "w1.log")]
    ended_ms = 1_796_603_181_580  # 2026-12-07T00:26:21.580Z
    assert held_windows(mock.Mock(workers=workers)) == [(ended_ms - 5_040, ended_ms + 1_000)]


@pytest.mark.parametrize("delivery", sorted(FIRST_KINDS))
def test_the_first_round_starts_with_the_modes_kinds_and_has_every_kind(delivery: str) -> None:
    """The mode's first kinds lead, every kind follows once, and a seed replays the same."""
    first = FIRST_KINDS[delivery]
    round_ = [f.kind for f in itertools.islice(schedule(7, first), len(FAULT_KINDS))]
    assert set(round_[: len(first)]) == set(first)
    assert sorted(round_) == sorted(FAULT_KINDS)
    again = list(itertools.islice(schedule(7, first), 20))
    assert again == list(itertools.islice(schedule(7, first), 20))


def test_the_traffic_mixes_every_kind_and_sums_its_sequences() -> None:
    """Every kind appears, a seed replays the same records, sequences sum their steps."""
    traffic, replay = (Traffic(3, 1, librdkafka=True, tag="t") for _ in range(2))
    made = [traffic.make(seq) for seq in range(8000)]
    again = [replay.make(seq) for seq in range(50)]
    assert [m.value for m in made[:50]] == [m.value for m in again]
    kinds = {m.sent.kind for m in made}
    expected = {"unserved-model", "tokens", "sequence", "result-too-large", "plain"}
    assert expected | {"big-key", "big-header", "compressed-too-large", "retired-version"} <= kinds
    unknown = [m.sent.model for m in made if m.sent.kind == "unserved-model"]
    assert len(set(unknown)) == len(unknown)  # a new name each time
    for big in (m for m in made if m.sent.kind == "result-too-large"):
        assert big.value is not None
        assert OUTPUT_MAX_BYTES < len(big.value) <= samples.BAD_SAMPLES_MAX_REQUEST_BYTES
    for big in (m for m in made if m.sent.kind in ("big-key", "big-header")):
        parts = [big.key or b"", *(v or b"" for _, v in big.headers)]
        assert max(len(p) for p in parts) > OUTPUT_MAX_BYTES > len(big.value or b"")
    for huge in (m for m in made if m.sent.kind == "compressed-too-large"):
        assert len(huge.value or b"") > 2**20  # over the dead-letter topic's default limit
    uncompressed = Traffic(3, 1, librdkafka=True, tag="t", compressed=False)
    kinds = {uncompressed.make(seq).sent.kind for seq in range(3000)}
    assert "compressed-too-large" not in kinds
    steps = [m for m in made if m.sent.sequence is not None]
    assert all(m.key == m.sent.sequence.encode() for m in steps if m.sent.sequence)
    by_key: dict[str, list[Sent]] = {}
    for m in steps:
        by_key.setdefault(str(m.sent.sequence), []).append(m.sent)
    for sents in by_key.values():
        assert [s.step for s in sents] == list(range(len(sents)))
        assert all(b.expected_sum > a.expected_sum for a, b in itertools.pairwise(sents))


EVENTS_TOPIC = "events"


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
    source = f"{EVENTS_TOPIC}/0/7"
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
        ("x-source-topic", EVENTS_TOPIC.encode()),
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
    return ConsumerRecord(EVENTS_TOPIC, 0, 3, 0, 0, None, encoded, None, 0, len(encoded), headers)


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
        assert f"'id': '{EVENTS_TOPIC}/0/7'" in (check_event(made.sent, moved, []) or "")


AVRO_TOPIC = "avro-payments"


def _registry() -> SchemaRegistryClient:
    """confluent-kafka's own in-memory registry."""
    return SchemaRegistryClient.new_client({"url": "mock://soak"})


def _code_of(value: bytes | None, writers: dict[int, AvroWriter]) -> str | None:
    """The dead letter's code the worker's own decoding gives a value (None: a result)."""
    if value is None:
        return "DECODE_ERROR"
    try:
        schema_id, payload = unframe(value, AVRO_TOPIC, "avro")
    except BadMagicByte:
        return "BAD_MAGIC_BYTE"
    writer = writers.get(schema_id)
    if writer is None:
        return "SCHEMA_NOT_FOUND"
    try:
        record = writer.decode(payload)
    except SchemaMismatch:
        return "SCHEMA_MISMATCH"
    return None if len(record["features"]) == 64 else "INVALID_REQUEST"


def test_the_avro_traffic_evolves_its_schema_mixes_hostile_values_and_replays() -> None:
    """Both schema versions (the second from ``evolve_at``) and every hostile kind appear; a
    seed replays the same values; each value is what the worker's decoding makes of it."""
    client = _registry()
    traffic, replay = (AvroTraffic(5, 5, client, AVRO_TOPIC, 1000, librdkafka=True) for _ in "ab")
    made = [traffic.make(seq) for seq in range(2000)]
    assert [m.value for m in made] == [replay.make(seq).value for seq in range(2000)]
    kinds = {m.sent.kind for m in made}
    assert {*AVRO_VERSIONS.values(), *(kind for kind, _ in HOSTILE_AVRO)} <= kinds
    subject = f"{AVRO_TOPIC}-value"
    ids = {v: client.get_version(subject, v).schema_id for v in AVRO_VERSIONS}
    writers = {
        i: AvroWriter(i, json.loads(payment_schema(v))) for v, i in ids.items() if i is not None
    }
    for seq, m in enumerate(made):
        assert m.sent.rid == f"p5-s{seq}" and m.key == m.sent.rid.encode()
        assert _code_of(m.value, writers) == m.sent.expected_code, (m.sent.kind, m.value)
        if m.sent.expected_code is None:
            assert m.value is not None
            assert int.from_bytes(m.value[1:5], "big") == ids[1 if seq < 1000 else 2]
            assert m.sent.kind == AVRO_VERSIONS[1 if seq < 1000 else 2]
        else:
            assert ("x-request-id", m.sent.rid.encode()) in m.headers
    aiokafka = AvroTraffic(5, 5, client, AVRO_TOPIC, 1000, librdkafka=False)
    assert all(aiokafka.make(seq).value is not None for seq in range(500))


def test_an_avro_record_waits_while_the_registry_is_out_for_its_new_version() -> None:
    """NotYet while the registry is out as the producer first writes version 2; the same
    record once it is back, as a run without the outage makes it; a refusal is no outage."""
    client = _registry()
    traffic = AvroTraffic(9, 5, client, AVRO_TOPIC, 10, librdkafka=True)
    replay = AvroTraffic(9, 5, _registry(), AVRO_TOPIC, 10, librdkafka=True)
    made = [traffic.make(seq) for seq in range(10)]
    refused = ConnectionRefusedError("[Errno 111] Connection refused")
    with mock.patch.object(client, "register_schema", side_effect=refused):
        for _ in range(3):
            with pytest.raises(NotYet):
                traffic.make(10)
    incompatible = SchemaRegistryError(409, 409, "incompatible with an earlier schema")
    with mock.patch.object(client, "register_schema", side_effect=incompatible):
        with pytest.raises(SchemaRegistryError):
            traffic.make(10)
    made += [traffic.make(seq) for seq in range(10, 20)]
    again = [replay.make(seq) for seq in range(20)]
    assert [m.sent.kind for m in made] == [m.sent.kind for m in again]
    assert [m.value for m in made] == [m.value for m in again]
    assert made[10].sent.kind in (AVRO_VERSIONS[2], *(k for k, _ in HOSTILE_AVRO))


#: The result schema the worker derives from the Avro topic's mapping.
AVRO_RESULT = json.dumps(
    {
        "type": "record",
        "name": "PaymentScore",
        "namespace": "soak",
        "fields": [
            {"name": "id", "type": ["null", "string"], "default": None},
            {"name": "amount", "type": ["null", "double"], "default": None},
            {"name": "probs", "type": {"type": "array", "items": "float"}},
            {"name": "label", "type": ["null", "string"], "default": None},
        ],
    }
)


def _avro_result(
    client: SchemaRegistryClient,
    made: Produced,
    body: dict[str, Any],
    headers: list[tuple[str, bytes]] | None = None,
) -> ConsumerRecord[bytes, bytes]:
    """The result record a worker should write for ``made``, framed by the registry's id."""
    write = AvroSerializer(client, AVRO_RESULT, conf={"subject.name.strategy.type": "TOPIC"})
    value = write(body, SerializationContext("out", MessageField.VALUE)) or b""
    if headers is None:
        headers = [
            ("content-type", b"application/avro"),
            ("x-request-id", made.sent.rid.encode()),
            ("x-source-topic", AVRO_TOPIC.encode()),
        ]
    return ConsumerRecord(AVRO_TOPIC, 0, 3, 0, 0, None, value, None, 0, len(value), headers)


def test_a_right_avro_result_passes_and_each_wrong_part_is_named() -> None:
    """An Avro result read back through the registry: right, or its wrong header, frame,
    copied field or label named; its probabilities left to the reference."""
    client = _registry()
    traffic = AvroTraffic(11, 5, client, AVRO_TOPIC, 10**9, librdkafka=True)
    made = next(m for m in (traffic.make(seq) for seq in range(50)) if m.sent.kind == "avro-v1")
    body = _body(made)
    deserializer = AvroDeserializer(client)

    def read(value: bytes) -> Any:
        return deserializer(value, SerializationContext("out", MessageField.VALUE))

    results: list[AvroResult] = []
    assert check_avro(made.sent, _avro_result(client, made, body), results) is None
    deferred: list[MlpCheck] = []
    assert check_avro_results(results, read, deferred) == []
    assert [c.rid for c in deferred] == [made.sent.rid]
    assert check_mlp(deferred) == [f"{made.sent.rid} (mlp): PROBS differ from the reference"]

    wrong_parts = (({**body, "label": "class-x"}, "label"), ({**body, "amount": 1.5}, "amount"))
    for wrong, named in wrong_parts:
        results = []
        assert check_avro(made.sent, _avro_result(client, made, wrong), results) is None
        assert named in " ".join(check_avro_results(results, read, []))
    as_json = [("content-type", b"application/json"), ("x-request-id", made.sent.rid.encode())]
    wrong_type = check_avro(made.sent, _avro_result(client, made, body, as_json), [])
    assert "content-type b'application/json'" in (wrong_type or "")
    unframed = dataclasses.replace(_avro_result(client, made, body), value=orjson.dumps(body))
    assert "Confluent wire format" in (check_avro(made.sent, unframed, []) or "")
    unknown = AvroResult(made.sent, b"\x00\x00\x0f\x42\x40" + orjson.dumps(body))
    assert "does not decode" in " ".join(check_avro_results([unknown], read, []))
