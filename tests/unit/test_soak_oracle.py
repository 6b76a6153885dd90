"""The chaos soak's own judgement: stalls, sequences, its schedule, its traffic and the
result events of its mapped topic."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import orjson
import pytest
from aiokafka.structs import ConsumerRecord

from devtools import samples
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
from tests.support.soak.oracle import sequence_problems
from tests.support.soak.outcomes import Outcome
from tests.support.soak.progress import Progress
from tests.support.soak.schedule import FAULT_KINDS, FIRST_KINDS, schedule
from tests.support.soak.traffic import OUTPUT_MAX_BYTES, Produced, Sent, Traffic

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
