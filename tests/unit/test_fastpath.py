"""The fast path: which records take it, micro-batches sent once, results published together.

The fakes stand in for Triton (a cached spec, inference that doubles INPUT0 or
fails as told) and for the producer (``publish_many``, whose acks a test holds
back or fails): what a real server cannot be made to do at a chosen moment. The
window, the offset tracker, the in-flight registry, the breakers and the metrics
are the real ones.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import pytest
from aiokafka.structs import ConsumerRecord, TopicPartition
from tritonclient.grpc import service_pb2

from devtools.samples import Tensor, encode_request
from worker import errors
from worker.delivery.offsets import OffsetTracker
from worker.dispatch import Dispatcher, fast_path_allowed
from worker.fastpath import Candidate, Fallback, FastPath
from worker.flow.breaker import CircuitBreaker
from worker.flow.guard import InternalErrorGuard
from worker.flow.holds import ModelGate
from worker.flow.model_health import ModelHealth
from worker.flow.window import Window
from worker.observability import InFlightRegistry, Metrics
from worker.observability.trace_context import Tracing
from worker.record import Outcome, RecordRules
from worker.settings import Settings, load_settings
from worker.wire import Source
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
    offset: int, value: bytes | None = None, headers: Sequence[tuple[str, bytes]] = ()
) -> ConsumerRecord[bytes, bytes]:
    if value is None:
        rows = np.full((1, 4), offset, dtype=np.float32)
        value, extra = encode_request("m", [Tensor("INPUT0", "FP32", (1, 4), rows)], "json", "r")
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
    """publish_many: records each call; acks wait for ``release``; offsets in ``fail`` fail."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.values: dict[int, bytes] = {}
        self.called = asyncio.Event()
        self.release = asyncio.Event()
        self.release.set()
        self.fail: set[int] = set()

    async def publish_many(self, results: Sequence[tuple[Any, bytes, Any]]) -> list[Any]:
        self.calls.append([r.offset for r, _, _ in results])
        self.values.update({r.offset: v for r, v, _ in results})
        self.called.set()
        await self.release.wait()
        return [
            errors.OutputTooLarge("refused") if r.offset in self.fail else None
            for r, _, _ in results
        ]


class Harness:
    """A FastPath over real bookkeeping; fallbacks are recorded, not run."""

    def __init__(
        self,
        pool: FakePool | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        fallback: Fallback | None = None,
    ) -> None:
        self.settings = settings()
        self.pool = pool or FakePool()
        self.sink = FakeSink()
        self.metrics = Metrics()
        self.offsets = OffsetTracker()
        self.generation = self.offsets.assign(TP, 0)
        self.window = Window(64, 64)
        self.inflight = InFlightRegistry(30, clock=clock)
        self.breaker = CircuitBreaker(5)
        self.models = ModelGate(seen_ready=lambda *_: True, listed=_true, ready=_true)
        self.health = ModelHealth.from_settings(self.settings.retry, lambda *_: None)
        self.fallbacks: list[tuple[int, Outcome | None]] = []
        m = self.metrics
        self.fast = FastPath(
            RecordRules.from_settings(self.settings),
            pool=self.pool,  # type: ignore[arg-type]
            sink=self.sink,
            offsets=self.offsets,
            window=self.window,
            inflight=self.inflight,
            metrics=m,
            breaker=self.breaker,
            models=self.models,
            health=self.health,
            limiter=None,
            guard=InternalErrorGuard(3),
            model_metrics=lambda name: (
                m.results_published_total.labels(model=name),
                m.inference_latency_seconds.labels(model=name),
            ),
            tracing=Tracing(),
            batch_max_size=4,
            fallback=fallback or self._record_fallback,
        )

    def _record_fallback(
        self, r: ConsumerRecord[bytes, bytes], _: int, outcome: Outcome | None, entry: Any
    ) -> None:
        self.fallbacks.append((r.offset, outcome))

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


def test_the_settings_that_need_the_per_record_path_turn_the_fast_path_off() -> None:
    """exactly_once, ordering, audit, spans or WORKER_FAST_PATH=false: no fast path at all."""
    plain = Tracing()
    assert fast_path_allowed(settings(), False, plain)
    assert not fast_path_allowed(settings(delivery="exactly_once"), False, plain)
    assert not fast_path_allowed(settings(ordering="key"), False, plain)
    assert not fast_path_allowed(settings(ordering="partition"), False, plain)
    assert not fast_path_allowed(settings(fast_path="false"), False, plain)
    assert not fast_path_allowed(settings(), True, plain)
    spans = Tracing()
    spans.enabled = True
    assert not fast_path_allowed(settings(), False, spans)


async def test_records_are_sent_in_micro_batches_and_published_together() -> None:
    """Six one-row records, capacity 4: two Triton requests, one publish call, all done."""
    h = Harness()
    await h.fast.run(h.take([record(i) for i in range(6)]))
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


async def test_offsets_are_done_only_after_the_acks() -> None:
    """While the acks are outstanding nothing is done and the slots are held."""
    h = Harness()
    h.sink.release.clear()
    running = asyncio.create_task(h.fast.run(h.take([record(i) for i in range(3)])))
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
    await h.fast.run(h.take([record(i) for i in range(5)]))
    assert h.fallbacks == [(i, None) for i in range(5)]
    assert h.sink.calls == []
    assert h.offsets.commit_point(TP) == 0  # the per-record path marks them done
    assert h.window.in_flight == 5  # their slots went with them
    assert len(h.inflight) == 5  # and their entries: the per-record path removes them
    assert h.sample("worker_fast_path_fallbacks_total", reason="inference") == 5
    assert h.sample("worker_fast_path_records_total") == 0


async def test_a_refused_send_goes_to_the_per_record_delivery_with_its_result() -> None:
    """Record 1's send fails: it falls back with its encoded result; 0 and 2 are done."""
    h = Harness()
    h.sink.fail = {1}
    await h.fast.run(h.take([record(i) for i in range(3)]))
    assert [offset for offset, _ in h.fallbacks] == [1]
    outcome = h.fallbacks[0][1]
    assert outcome is not None and outcome.value == h.sink.values[1] and outcome.error is None
    assert h.offsets.get(TP).done_beyond_commit() == [2]  # type: ignore[union-attr]
    assert h.offsets.commit_point(TP) == 1
    assert h.window.in_flight == 1
    assert h.sample("worker_fast_path_fallbacks_total", reason="publish") == 1


async def test_a_partition_revoked_during_the_group_is_not_marked_done() -> None:
    """Revoked and re-assigned while the acks wait: the old generation's offsets are dropped."""
    h = Harness()
    h.sink.release.clear()
    running = asyncio.create_task(h.fast.run(h.take([record(i) for i in range(3)])))
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
    running = asyncio.create_task(h.fast.run(h.take([record(i) for i in range(3)])))
    await h.sink.called.wait()
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert h.offsets.commit_point(TP) == 0
    assert h.window.in_flight == 0 and len(h.inflight) == 0


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class HeldHandler:
    """The per-record path's handler: holds each record in ``evaluate`` until released."""

    def __init__(self) -> None:
        self.evaluating = asyncio.Event()
        self.release = asyncio.Event()

    async def evaluate(self, record: ConsumerRecord[bytes, bytes], *_: Any) -> Outcome:
        self.evaluating.set()
        await self.release.wait()
        return Outcome(record, Source.of(record), 0.0)

    async def deliver(self, outcome: Outcome) -> None:
        """Published at once."""

    def internal_failure(self, exc: BaseException) -> None:
        raise AssertionError(exc)


class AckedDelivery:
    """Delivery of the per-record path: the outcome is safe once delivered."""

    async def complete(
        self,
        record: ConsumerRecord[bytes, bytes],
        ticket: int,
        deliver: Callable[[], Awaitable[None]],
        on_safe: Callable[[], None],
    ) -> None:
        await deliver()
        on_safe()


async def test_a_record_handed_to_the_per_record_path_keeps_its_age() -> None:
    """A failed micro-batch's record, 5 s in flight, is still 5 s old on the per-record path."""
    clock, handler = Clock(), HeldHandler()
    h = Harness(clock=clock, fallback=lambda *args: dispatcher.fall_back(*args))
    dispatcher = Dispatcher(
        h.settings,
        delivery=AckedDelivery(),  # type: ignore[arg-type]
        window=h.window,
        inflight=h.inflight,
        handler=handler,  # type: ignore[arg-type]
        tracing=Tracing(),
    )
    async with asyncio.TaskGroup() as group:
        dispatcher.group = group
        candidates = h.take([record(0)])
        clock.now += 5
        h.pool.failure = errors.InferenceError("one row is poison")
        await h.fast.run(candidates)
        await handler.evaluating.wait()
        (listed,) = h.inflight.snapshot()["oldest"]  # type: ignore[misc]
        assert listed["offset"] == 0 and listed["age_s"] == 5.0
        assert listed["state"] == "decoding"  # it starts over
        handler.release.set()
    assert len(h.inflight) == 0 and h.window.in_flight == 0
