"""The batch path: which records take it, micro-batches sent once, results completed together.

The fakes stand in for Triton (a cached spec, inference that doubles INPUT0 or
fails as told) and for the producer (``publish_many``, whose acks a test holds
back or fails): what a real server cannot be made to do at a chosen moment. The
at_least_once delivery, the window, the offset tracker, the in-flight registry, the
steps, the breakers and the metrics are the real ones.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any
from unittest import mock

import numpy as np
import pytest
import structlog
from aiokafka.structs import ConsumerRecord, TopicPartition
from tritonclient.grpc import service_pb2

from devtools.samples import Encoding, Tensor, encode_request
from worker import errors
from worker.audit import Audit
from worker.delivery import AtLeastOnce
from worker.delivery.offsets import OffsetTracker
from worker.flow.breaker import CircuitBreaker
from worker.flow.holds import Listing, ModelGate
from worker.flow.limiter import AdaptiveLimiter
from worker.flow.model_health import ModelHealth
from worker.flow.ordering import Turns
from worker.flow.window import Window
from worker.observability import InFlightRegistry, Metrics
from worker.observability.trace_context import Tracing
from worker.records.batch import BatchPath, Candidate, Group
from worker.records.outcome import Handed, Outcome
from worker.records.rules import RecordRules
from worker.records.steps import Steps
from worker.settings import Settings, load_settings
from worker.wire.validation import ModelSpec, TensorSpec

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]

TP = TopicPartition("in", 0)
SPEC = ModelSpec(
    name="m",
    version="",
    inputs=(TensorSpec("INPUT0", "FP32", (4,)),),
    outputs=(TensorSpec("OUTPUT0", "FP32", (4,)),),
    max_batch_size=8,
)
TRACEPARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def settings(**extra: str) -> Settings:
    env = {"WORKER_INPUT_TOPICS": "in", "WORKER_OUTPUT_TOPIC": "out", "WORKER_DLQ_TOPIC": "dlq"}
    env.update({f"WORKER_{k.upper()}": v for k, v in extra.items()})
    return load_settings(env)


def record(
    offset: int,
    value: bytes | None = None,
    headers: Sequence[tuple[str, bytes]] = (),
    *,
    encoding: Encoding = "json",
    request_id: str = "r",
) -> ConsumerRecord[bytes, bytes]:
    if value is None:
        rows = np.full((1, 4), offset, dtype=np.float32)
        tensors = [Tensor("INPUT0", "FP32", (1, 4), rows)]
        value, extra = encode_request("m", tensors, encoding, request_id)
        headers = [*extra, *headers]
    return ConsumerRecord(
        topic="in",
        partition=0,
        offset=offset,
        timestamp=1_700_000_000_000,
        timestamp_type=0,
        key=b"k",
        value=value,
        checksum=None,
        serialized_key_size=1,
        serialized_value_size=len(value),
        headers=list(headers),
    )


class FakePool:
    """A cached spec (or none), and inference doubling INPUT0; fails as told."""

    def __init__(self, spec: ModelSpec | None = SPEC, *, trace_unary: bool = False) -> None:
        self.spec = spec
        self.trace_unary = trace_unary
        self.failure: errors.WorkerError | None = None
        self.rows_sent: list[int] = []

    def cached_spec(self, name: str, version: str) -> ModelSpec | None:
        return self.spec

    async def infer(self, request: Any, timeout_s: float, trace: Any = ()) -> Any:
        self.rows_sent.append(int(request.inputs[0].shape[0]))
        if self.failure is not None:
            raise self.failure
        values = np.frombuffer(request.raw_input_contents[0], dtype="<f4") * 2
        response = service_pb2.ModelInferResponse(model_name="m", model_version="1")
        response.outputs.add(name="OUTPUT0", datatype="FP32", shape=list(request.inputs[0].shape))
        response.raw_output_contents.append(values.astype("<f4").tobytes())
        return response


class FakeSink:
    """publish_many: records each call; acks wait for ``release``; offsets in ``fail`` fail.
    A record's own outcome (the per-record path's) is recorded in ``alone``."""

    def __init__(self) -> None:
        self.alone: list[int] = []
        self.calls: list[list[int]] = []
        self.values: dict[int, bytes] = {}
        self.called = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()
        self.fail: set[int] = set()

    async def publish_many(
        self, results: Sequence[tuple[Any, bytes, Any]], *, enqueued: Any = None
    ) -> list[Any]:
        self.calls.append([r.offset for r, _, _ in results])
        self.values.update({r.offset: v for r, v, _ in results})
        if enqueued is not None:
            enqueued()
        self.called.set()
        await self.release.wait()
        return [
            errors.OutputTooLarge("refused") if r.offset in self.fail else None
            for r, _, _ in results
        ]

    async def publish_result(self, rec: ConsumerRecord[bytes, bytes], *_: Any) -> None:
        self.alone.append(rec.offset)

    async def publish_dead_letter(self, rec: ConsumerRecord[bytes, bytes], *_: Any) -> None:
        self.alone.append(rec.offset)


class NoCommits:
    """The consumer as delivery sees it; these tests never commit."""

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    def highwater(self, tp: TopicPartition) -> int | None:
        return None

    async def commit(self, offsets: Any) -> None:
        raise AssertionError("no commit here")

    async def fetch_committed(self, partitions: Any) -> dict[Any, Any]:
        return {}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        raise AssertionError("at_least_once never seeks")

    def owns(self, tp: TopicPartition) -> bool:
        return True


class Harness:
    """A BatchPath over real bookkeeping and a real at_least_once delivery over a fake
    publisher; hand-overs are recorded, not run."""

    def __init__(
        self,
        pool: FakePool | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        limiter: AdaptiveLimiter | None = None,
        max_output_bytes: int | None = None,
    ) -> None:
        limit = {} if max_output_bytes is None else {"max_output_bytes": str(max_output_bytes)}
        self.settings = settings(**limit)
        self.pool = pool or FakePool()
        self.sink = FakeSink()
        self.metrics = Metrics()
        self.delivery = AtLeastOnce(
            self.sink,  # type: ignore[arg-type]
            OffsetTracker(),
            NoCommits(),
            self.metrics,
            interval_s=1.0,
            max_uncommitted=1000,
        )
        self.offsets = self.delivery.offsets
        self.generation = self.offsets.assign(TP, 0)
        self.window = Window(64, 64)
        self.inflight = InFlightRegistry(30, clock=clock)
        self.breaker = CircuitBreaker(5)
        self.models = ModelGate(seen_ready=lambda *_: True, listed=_listed, ready=_true)
        self.health = ModelHealth.from_settings(self.settings.retry, lambda *_: None)
        self.fallbacks: list[tuple[int, Outcome | None]] = []
        self.handed: list[Handed] = []
        self.steps = Steps(
            RecordRules.from_settings(self.settings),
            metrics=self.metrics,
            breaker=self.breaker,
            limiter=limiter,
            models=self.models,
            health=self.health,
            audit=Audit(self.settings, send=None),  # type: ignore[arg-type]
        )
        self.fast = BatchPath(
            self.steps,
            pool=self.pool,  # type: ignore[arg-type]
            delivery=self.delivery,
            window=self.window,
            inflight=self.inflight,
            tracing=Tracing(),
            batch_max_size=4,
        )

    def hand_over(self, handed: Handed) -> None:
        self.fallbacks.append((handed.record.offset, handed.outcome))
        self.handed.append(handed)

    async def run(self, candidates: list[Candidate]) -> None:
        await self.fast.run(Group(candidates), self.hand_over)

    def take(self, records: list[ConsumerRecord[bytes, bytes]]) -> list[Candidate]:
        """Track and select the records as dispatch does; all must qualify."""
        chosen = []
        for r in records:
            assert self.window.try_acquire(TP)
            candidate = self.fast.select(r, self.offsets.track(TP, r.offset))
            assert candidate is not None
            chosen.append(candidate)
        return chosen

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, labels)


async def _true(*_: str) -> bool:
    return True


async def _listed(*_: str) -> Listing:
    return Listing(listed=True)


def test_plain_records_qualify_and_others_are_left_to_the_per_record_path() -> None:
    """A decodable record of a cached batching model qualifies; each disqualifier sends it on."""
    h = Harness()
    assert h.fast.select(record(0), 1) is not None
    assert h.fast.select(record(1, value=b"{not json"), 1) is None
    assert Harness(FakePool(None)).fast.select(record(2), 1) is None  # spec not cached
    unbatched = ModelSpec("m", "", SPEC.inputs, SPEC.outputs, max_batch_size=0)
    assert Harness(FakePool(unbatched)).fast.select(record(3), 1) is None
    traced = [("traceparent", TRACEPARENT)]
    assert Harness(FakePool(trace_unary=True)).fast.select(record(4, headers=traced), 1) is None
    assert Harness(FakePool()).fast.select(record(5, headers=traced), 1) is not None
    held = Harness()
    asyncio.run(held.models.should_hold("m", ""))
    assert held.fast.select(record(6), 1) is None
    failing = Harness()
    for _ in range(10):
        failing.health.failed(("m", ""), errors.InferenceError("bad"), False)
    assert failing.health.is_open("m", "")
    assert failing.fast.select(record(7), 1) is None


async def test_records_are_sent_in_micro_batches_and_published_together() -> None:
    """Six one-row records, capacity 4: two Triton requests, one publish call, all done."""
    h = Harness()
    await h.run(h.take([record(i) for i in range(6)]))
    assert h.pool.rows_sent == [4, 2]
    assert h.sink.calls == [[0, 1, 2, 3, 4, 5]]
    assert b"10.0" in h.sink.values[5]  # 5 doubled, in record 5's own result
    assert h.offsets.commit_point(TP) == 6
    assert h.window.in_flight == 0 and len(h.inflight) == 0
    assert h.fallbacks == []
    assert h.sample("worker_fast_path_records_total") == 6
    assert h.sample("worker_results_published_total", model="m") == 6
    assert h.sample("worker_inference_latency_seconds_count", model="m") == 6
    assert h.sample("worker_end_to_end_latency_seconds_count") == 6


async def test_a_micro_batch_of_protobuf_requests_gets_one_result_each() -> None:
    """Protobuf results are the response split per record, each with its request's id."""
    h = Harness()
    records = [record(i, encoding="protobuf", request_id=f"p{i}") for i in range(3)]
    await h.run(h.take(records))
    assert h.pool.rows_sent == [3]
    for i in range(3):
        result = service_pb2.ModelInferResponse.FromString(h.sink.values[i])
        assert result.id == f"p{i}"
        assert np.frombuffer(result.raw_output_contents[0], dtype="<f4").tolist() == [2.0 * i] * 4
    assert h.fallbacks == []


async def test_a_result_over_the_output_limit_goes_alone_to_the_per_record_path() -> None:
    """One record of a micro-batch whose result is over WORKER_MAX_OUTPUT_BYTES (its long
    id) is handed over to say so; the others of its batch are published."""
    h = Harness(max_output_bytes=1000)
    records = [record(i, request_id="x" * 2000 if i == 1 else "r") for i in range(3)]
    await h.run(h.take(records))
    assert h.pool.rows_sent == [3]
    assert h.sink.calls == [[0, 2]]
    assert h.fallbacks == [(1, None)]
    assert h.sample("worker_fast_path_fallbacks_total", reason="encode") == 1
    assert h.offsets.done_beyond_commit(TP) == [2] and h.offsets.commit_point(TP) == 1


async def test_offsets_are_done_only_after_the_acks() -> None:
    """While the acks are outstanding nothing is done and the slots are held."""
    h = Harness()
    h.sink.release.clear()
    running = asyncio.create_task(h.run(h.take([record(i) for i in range(3)])))
    await h.sink.called.wait()
    assert h.offsets.commit_point(TP) == 0
    assert h.window.in_flight == 3
    by_state = h.inflight.snapshot()["by_state"]
    assert isinstance(by_state, dict) and by_state["publishing"] == 3
    h.sink.release.set()
    await running
    assert h.offsets.commit_point(TP) == 3
    assert h.window.in_flight == 0


async def test_a_failed_micro_batch_falls_back_record_by_record() -> None:
    """An inference error of a batch hands each of its records, with its slot, to the slow path."""
    h = Harness()
    h.pool.failure = errors.InferenceError("one row is poison")
    await h.run(h.take([record(i) for i in range(5)]))
    assert h.fallbacks == [(i, None) for i in range(5)]
    assert h.sink.calls == []
    assert h.offsets.commit_point(TP) == 0  # the per-record path marks them done
    assert h.window.in_flight == 5  # their slots went with them
    assert len(h.inflight) == 5  # and their entries: the per-record path removes them
    assert h.sample("worker_fast_path_fallbacks_total", reason="inference") == 5
    assert h.sample("worker_fast_path_records_total") == 0


async def test_partition_order_hands_over_the_rest_of_the_partition_in_turn() -> None:
    """ordering=partition: record 1's result does not encode, so 2 cannot go before it;
    0 is published, 1 and 2 go to the per-record path each after the one before, and the
    group's turn of the partition (which the next group waits for) comes back only after
    both (before, the group path did not run under this ordering at all)."""
    h = Harness(max_output_bytes=1000)
    turns = Turns()
    group = Group(
        [*h.take([record(i, request_id="x" * 2000 if i == 1 else "r") for i in range(3)])],
        turns={TP: turns.ticket(TP)},
    )
    for candidate in group.candidates:
        candidate.unit = TP
    next_group = turns.ticket(TP)
    await h.fast.run(group, h.hand_over)
    assert h.sink.calls == [[0]]
    assert [(f.record.offset, f.outcome is not None) for f in h.handed] == [(1, False), (2, True)]
    first, second = (f.publish_turn for f in h.handed)
    assert first is not None and second is not None
    waiting = asyncio.create_task(next_group.wait())
    await first.wait()
    second_waits = asyncio.create_task(second.wait())
    await asyncio.sleep(0)
    assert not second_waits.done() and not waiting.done()
    first.done()
    await second_waits
    await asyncio.sleep(0)
    assert not waiting.done()
    second.done()
    await asyncio.wait_for(waiting, 1)
    assert h.sample("worker_fast_path_fallbacks_total", reason="order") == 1


def keyed(candidates: list[Candidate], keys: Sequence[bytes], turns: Turns) -> Group:
    """ordering=key as dispatch makes it: each candidate's unit (its partition and key), and
    a group holding one turn per key (taken in offset order)."""
    group = Group(candidates)
    for candidate, key in zip(candidates, keys, strict=True):
        candidate.record = dataclasses.replace(candidate.record, key=key)
        candidate.unit = (TP, key)
        if candidate.unit not in group.turns:
            group.turns[candidate.unit] = turns.ticket(candidate.unit)
    return group


async def test_key_turns_are_waited_for_before_publishing_and_passed_once_safe() -> None:
    """ordering=key: a group holds one turn per key; its records are inferred at once,
    published only after their key's earlier records, and the key's turn goes to its next
    record once the group's results are acknowledged."""
    h = Harness()
    turns = Turns()
    earlier = turns.ticket((TP, b"k"))
    group = keyed(h.take([record(i) for i in range(3)]), [b"k"] * 3, turns)
    later = turns.ticket((TP, b"k"))
    running = asyncio.create_task(h.fast.run(group, h.hand_over))
    for _ in range(5):  # the group runs until it blocks on its key's turn (no I/O here)
        await asyncio.sleep(0)
    assert h.pool.rows_sent == [3]  # inferred already, the key's three records in one batch
    assert h.sink.calls == []  # its key's earlier record is not published yet
    earlier.done()
    await running
    assert h.sink.calls == [[0, 1, 2]] and h.fallbacks == []
    await asyncio.wait_for(later.wait(), 1)


async def test_a_keys_records_after_its_failed_one_follow_it_the_other_keys_go_on() -> None:
    """ordering=key, keys a, a, b, a in one group; record 0 (key a) does not encode: 1 and 3
    cannot be published before it and follow it on the per-record path, each after the one
    before; key b's record is published with the group and its turn passed at once; key a's
    turn comes back only after the last of its handed records."""
    h = Harness(max_output_bytes=1000)
    turns = Turns()
    candidates = h.take([record(i, request_id="x" * 2000 if i == 0 else "r") for i in range(4)])
    group = keyed(candidates, [b"a", b"a", b"b", b"a"], turns)
    next_a, next_b = turns.ticket((TP, b"a")), turns.ticket((TP, b"b"))
    await h.fast.run(group, h.hand_over)
    assert h.sink.calls == [[2]]
    assert [(f.record.offset, f.outcome is not None) for f in h.handed] == [
        (0, False),
        (1, True),
        (3, True),
    ]
    assert h.sample("worker_fast_path_fallbacks_total", reason="order") == 2
    await asyncio.wait_for(next_b.wait(), 1)  # key b's next record may go
    a_waits = asyncio.create_task(next_a.wait())
    for handed in h.handed:
        assert handed.publish_turn is not None
        await asyncio.wait_for(handed.publish_turn.wait(), 1)
        await asyncio.sleep(0)
        assert not a_waits.done()  # key a's next record waits for every handed one
        handed.publish_turn.done()
    await asyncio.wait_for(a_waits, 1)


async def test_an_ordered_units_results_are_published_in_offset_order() -> None:
    """ordering=partition, JSON and protobuf requests alternating in one partition: two
    micro-batches (pending tensors, and built requests), one hand-over in offset order
    (the micro-batches' order would put 0, 2, 4 before 1, 3)."""
    h = Harness()
    encodings: list[Encoding] = ["json", "protobuf", "json", "protobuf", "json"]
    candidates = h.take([record(i, encoding=e) for i, e in enumerate(encodings)])
    for candidate in candidates:
        candidate.unit = TP
    await h.fast.run(Group(candidates, turns={TP: Turns().ticket(TP)}), h.hand_over)
    assert sorted(h.pool.rows_sent) == [2, 3]
    assert h.sink.calls == [[0, 1, 2, 3, 4]]


async def test_a_refused_send_goes_to_the_per_record_delivery_with_its_result() -> None:
    """Record 1's send fails: it falls back with its encoded result; 0 and 2 are done."""
    h = Harness()
    h.sink.fail = {1}
    await h.run(h.take([record(i) for i in range(3)]))
    assert [offset for offset, _ in h.fallbacks] == [1]
    outcome = h.fallbacks[0][1]
    assert outcome is not None and outcome.value == h.sink.values[1] and outcome.error is None
    assert h.offsets.get(TP).done_beyond_commit() == [2]  # type: ignore[union-attr]
    assert h.offsets.commit_point(TP) == 1
    assert h.window.in_flight == 1
    assert h.sample("worker_fast_path_fallbacks_total", reason="publish") == 1


async def test_a_result_refused_after_its_group_returned_takes_a_slot_and_entry_again() -> None:
    """exactly_once returns once a group's results are staged (their slots go back) and
    tells of a refusal at the commit: the record takes a slot and an in-flight entry again
    and goes to the per-record path with its result."""
    h = Harness()
    told: list[Callable[[int, BaseException], None]] = []

    async def staged(
        results: Any, tickets: Any, *, on_safe: Any, on_refused: Any, **_: Any
    ) -> None:
        for (rec, _, _), ticket in zip(results, tickets, strict=True):
            h.offsets.done(TP, rec.offset, ticket)
        on_safe()
        told.append(on_refused)

    h.delivery.complete_many = staged  # type: ignore[method-assign,assignment]
    await h.run(h.take([record(i) for i in range(3)]))
    assert h.window.in_flight == 0 and len(h.inflight) == 0 and not h.handed
    [refused] = told
    refused(1, errors.OutputTooLarge("refused at the commit"))
    [handed] = h.handed
    assert handed.record.offset == 1 and handed.outcome is not None
    assert h.window.in_flight_for(TP) == 1
    assert len(h.inflight) == 1 and handed.entry.request_id == "r" and handed.entry.model == "m"
    refused(2, errors.PartitionRevoked("moved"))  # its next owner redoes it
    assert len(h.handed) == 1 and h.window.in_flight == 1


async def test_a_partition_revoked_during_the_group_is_not_marked_done() -> None:
    """Revoked and re-assigned while the acks wait: the old generation's offsets are dropped."""
    h = Harness()
    h.sink.release.clear()
    running = asyncio.create_task(h.run(h.take([record(i) for i in range(3)])))
    await h.sink.called.wait()
    h.offsets.revoke(TP)
    h.offsets.assign(TP, 0)
    h.sink.release.set()
    await running
    assert h.offsets.get(TP).pending() == 0  # type: ignore[union-attr]
    assert h.offsets.commit_point(TP) is None  # nothing tracked in the new assignment
    assert h.window.in_flight == 0


async def test_a_cancelled_group_leaves_its_records_not_done_and_frees_their_slots() -> None:
    """A forced stop during the acks: no offset done, every slot and entry given back."""
    h = Harness()
    h.sink.release.clear()
    running = asyncio.create_task(h.run(h.take([record(i) for i in range(3)])))
    await h.sink.called.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert h.offsets.commit_point(TP) == 0
    assert h.window.in_flight == 0 and len(h.inflight) == 0


async def test_a_bug_in_the_groups_bookkeeping_hands_the_records_over_and_is_counted() -> None:
    """complete_many raises: every record not done yet goes to the per-record path, the
    bug is logged and counted once, and the run of bugs grows."""
    h = Harness()

    async def broken(*_: Any, **__: Any) -> None:
        raise KeyError("partition")

    h.delivery.complete_many = broken  # type: ignore[method-assign]
    with structlog.testing.capture_logs() as logs:
        await h.run(h.take([record(i) for i in range(3)]))
    assert h.fallbacks == [(i, None) for i in range(3)]
    assert h.sample("worker_fast_path_fallbacks_total", reason="internal") == 3
    assert h.sample("worker_internal_errors_total") == 1
    assert [e["event"] for e in logs if e["log_level"] == "error"] == ["internal_error"]
    assert h.window.in_flight == 3  # the slots went with the records


async def test_an_overloaded_micro_batch_lowers_the_adaptive_limit_once() -> None:
    """Triton overloaded: the batch's records fall back and the limiter hears of it once."""
    limiter = mock.create_autospec(AdaptiveLimiter, instance=True, spec_set=True)
    h = Harness(limiter=limiter)
    h.pool.failure = errors.TritonOverloaded("queue full")
    await h.run(h.take([record(i) for i in range(3)]))
    assert limiter.on_overload.call_count == 1
    assert limiter.on_success.call_count == 0
    assert h.sample("worker_fast_path_fallbacks_total", reason="inference") == 3
