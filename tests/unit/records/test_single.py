"""The per-record path: bugs become INTERNAL_ERROR, model reloads are held, the task's books.

The fakes (``fakes``) stand in for the Triton side (model spec and inference) and the
Kafka side (the sink, a delivery mode), to inject what real servers cannot be made to
do on demand: a library raising an unexpected exception, a model that is not ready for
exactly two tries, a delivery that fails after publishing.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.records.fakes import (
    TP,
    AckedDelivery,
    FakeSink,
    FakeTriton,
    good_record,
    record,
    sample,
    settings,
    single_path,
    steps_for,
)
from worker import errors
from worker.flow.breaker import CircuitBreaker
from worker.flow.holds import NOT_LISTED, Listing, ModelGate
from worker.flow.ordering import Turns
from worker.flow.window import Window
from worker.observability import InFlight, InFlightRegistry, Metrics
from worker.records.single import SinglePath
from worker.settings import Settings
from worker.wire.validation import ModelSpec

pytestmark = pytest.mark.timeout(10)


def handler(
    triton: FakeTriton,
    sink: FakeSink,
    s: Settings | None = None,
    gate: ModelGate | None = None,
    breaker: CircuitBreaker | None = None,
) -> tuple[SinglePath, Metrics]:
    s = s or settings()
    metrics = Metrics(version="test")
    steps = steps_for(s, metrics=metrics, breaker=breaker, gate=gate)
    return single_path(triton, steps, s=s, delivery=AckedDelivery(sink)), metrics


def counter(metrics: Metrics, name: str) -> float:
    return sample(metrics, name)


async def test_record_with_neither_key_nor_value_is_a_decode_error() -> None:
    """Null key and null value: one DECODE_ERROR dead letter, never an exception."""
    sink = FakeSink()
    h, _ = handler(FakeTriton(), sink)
    outcome = await h.evaluate(record(None, key=None, headers=[("trace", None)]))
    await h.deliver(outcome)
    assert sink.dead_letters[0]["x-error-code"] == b"DECODE_ERROR"
    assert b"neither key nor value" in sink.dead_letters[0]["x-error-message"]
    assert sink.dead_letters[0]["trace"] is None


async def test_an_unexpected_exception_in_inference_is_an_internal_error_dead_letter() -> None:
    """A library assertion while inferring: INTERNAL_ERROR naming it, metric counted."""
    sink = FakeSink()
    h, metrics = handler(FakeTriton(raise_on_infer=AssertionError("invariant broken")), sink)
    outcome = await h.evaluate(good_record())
    await h.deliver(outcome)
    letter = sink.dead_letters[0]
    assert letter["x-error-code"] == b"INTERNAL_ERROR"
    assert letter["x-error-message"] == b"AssertionError: invariant broken"
    assert letter["x-error-retryable"] == b"false"
    assert counter(metrics, "worker_internal_errors_total") == 1


async def test_a_result_the_sink_chokes_on_becomes_an_internal_error_dead_letter() -> None:
    """An unexpected exception while publishing the result: the record is dead-lettered."""
    sink = FakeSink(result_error=KeyError("partition"))
    h, _ = handler(FakeTriton(), sink)
    await h.deliver(await h.evaluate(good_record()))
    assert sink.results == []
    assert sink.dead_letters[0]["x-error-code"] == b"INTERNAL_ERROR"


async def test_a_result_refused_for_its_size_sets_the_ceiling_of_later_results() -> None:
    """The sink refuses a result for its size: OUTPUT_TOO_LARGE, and the next result as
    large is dead-lettered without reaching the sink."""
    sink = FakeSink(result_error=errors.OutputTooLarge("larger than 'out' accepts"))
    h, _ = handler(FakeTriton(), sink)
    await h.deliver(await h.evaluate(good_record(offset=1, width=100)))
    sink.result_error = None
    await h.deliver(await h.evaluate(good_record(offset=2, width=100)))
    assert sink.results == []
    assert [d["x-error-code"] for d in sink.dead_letters] == [b"OUTPUT_TOO_LARGE"] * 2
    assert b"refused one of" in sink.dead_letters[1]["x-error-message"]


async def test_a_result_refused_for_its_huge_key_sets_no_ceiling() -> None:
    """The sink refuses a result whose key is most of it: OUTPUT_TOO_LARGE for it alone;
    the next record's result, its value as large, is published."""
    sink = FakeSink(result_error=errors.OutputTooLarge("larger than 'out' accepts"))
    h, _ = handler(FakeTriton(), sink)
    await h.deliver(await h.evaluate(good_record(offset=1, key=b"k" * 100_000)))
    sink.result_error = None
    await h.deliver(await h.evaluate(good_record(offset=2)))
    assert len(sink.results) == 1
    assert [d["x-error-code"] for d in sink.dead_letters] == [b"OUTPUT_TOO_LARGE"]


async def test_a_dead_letter_that_fails_is_written_without_the_records_headers() -> None:
    """The dead letter itself meets a bug: a plain one with only the worker's headers."""
    sink = FakeSink(dlq_errors=1)
    h, _ = handler(FakeTriton(), sink)
    await h.deliver(await h.evaluate(record(b"not json", headers=[("odd", b"x")])))
    assert len(sink.dead_letters) == 1
    assert sink.dead_letters[0]["x-error-code"] == b"INTERNAL_ERROR"
    assert "odd" not in sink.dead_letters[0]


async def test_a_dead_letter_that_never_writes_is_fatal() -> None:
    """If even the plain dead letter fails, WriteFailed: the offset is never committed."""
    sink = FakeSink(dlq_errors=2)
    h, _ = handler(FakeTriton(), sink)
    with pytest.raises(errors.WriteFailed, match="in-0@7"):
        await h.deliver(await h.evaluate(record(b"not json")))


async def test_consecutive_internal_errors_stop_the_worker_before_the_limit_is_dead_lettered() -> (
    None
):
    """N records in a row meeting a bug: N-1 dead letters, then TooManyInternalErrors."""
    sink = FakeSink()
    s = settings(max_consecutive_internal_errors="3")
    h, _ = handler(FakeTriton(raise_on_infer=RuntimeError("bug")), sink, s)
    for _ in range(2):
        await h.deliver(await h.evaluate(good_record()))
    with pytest.raises(errors.TooManyInternalErrors, match="3 records in a row"):
        await h.deliver(await h.evaluate(good_record()))
    assert len(sink.dead_letters) == 2


async def test_one_good_outcome_resets_the_internal_error_run() -> None:
    """The limit counts a run: a result in between starts it again."""
    sink = FakeSink()
    s = settings(max_consecutive_internal_errors="2")
    failing = FakeTriton(raise_on_infer=RuntimeError("bug"))
    h, _ = handler(failing, sink, s)
    await h.deliver(await h.evaluate(good_record()))
    failing.raise_on_infer = None
    await h.deliver(await h.evaluate(good_record()))
    failing.raise_on_infer = RuntimeError("bug")
    await h.deliver(await h.evaluate(good_record()))
    assert len(sink.dead_letters) == 2 and len(sink.results) == 1


async def test_a_model_being_reloaded_is_held_without_spending_attempts() -> None:
    """Not ready twice, then ready: one result, no attempt counted, waited for the probe."""
    probed = asyncio.Event()
    ready = asyncio.Event()

    async def is_ready(name: str, version: str) -> bool:
        probed.set()
        return ready.is_set()

    async def listed(name: str, version: str) -> Listing:
        return NOT_LISTED

    gate = ModelGate(
        seen_ready=lambda name, version: True, listed=listed, ready=is_ready, interval_s=0.001
    )
    triton = FakeTriton(not_ready_tries=1)
    sink = FakeSink()
    h, metrics = handler(triton, sink, settings(max_attempts="1"), gate)
    probing = asyncio.create_task(gate.probe_loop())
    evaluating = asyncio.create_task(h.evaluate(good_record()))
    await probed.wait()
    assert gate.held() == ["double"] and not evaluating.done()
    ready.set()
    outcome = await evaluating
    probing.cancel()
    assert outcome.error is None and triton.tries == 2
    assert gate.held() == []
    retries = [
        sample.value
        for family in metrics.registry.collect()
        if family.name == "worker_retries"
        for sample in family.samples
        if sample.name == "worker_retries_total"
    ]
    assert sum(retries) == 0  # held, never retried


async def test_a_model_the_repository_does_not_list_is_not_found_at_once() -> None:
    """Never ready here and not in the repository index: MODEL_NOT_FOUND, no hold."""

    async def no(name: str, version: str) -> bool:
        return False

    async def unlisted(name: str, version: str) -> Listing:
        return NOT_LISTED

    gate = ModelGate(seen_ready=lambda name, version: False, listed=unlisted, ready=no)

    class Unknown(FakeTriton):
        async def model_spec(self, name: str, version: str) -> ModelSpec:
            raise errors.ModelNotFound("Request for unknown model: 'double' is not found")

    h, _ = handler(Unknown(), FakeSink(), gate=gate)
    outcome = await h.evaluate(good_record())
    assert outcome.error is not None and outcome.error.code == "MODEL_NOT_FOUND"
    assert gate.held() == []


async def test_retryable_failures_are_retried_then_exhausted_with_the_attempt_count() -> None:
    """Timeouts every try: WORKER_MAX_ATTEMPTS tries, then RETRIES_EXHAUSTED naming the last."""
    timeouts = [errors.TritonTimeout("no response within 30 ms") for _ in range(5)]
    triton, sink = FakeTriton(failures=timeouts), FakeSink()
    h, metrics = handler(triton, sink, settings(max_attempts="3"))
    await h.deliver(await h.evaluate(good_record()))
    letter = sink.dead_letters[0]
    assert triton.tries == 3
    assert letter["x-error-code"] == b"RETRIES_EXHAUSTED"
    assert letter["x-attempts"] == b"3" and letter["x-error-retryable"] == b"true"
    assert b"TRITON_TIMEOUT" in letter["x-error-message"]
    assert (
        metrics.registry.get_sample_value("worker_retries_total", {"reason": "TRITON_TIMEOUT"}) == 2
    )


async def test_a_retry_that_succeeds_publishes_one_result() -> None:
    """One overload, then an answer: a result, no dead letter."""
    triton, sink = FakeTriton(failures=[errors.TritonOverloaded("queue full")]), FakeSink()
    h, _ = handler(triton, sink)
    await h.deliver(await h.evaluate(good_record()))
    assert len(sink.results) == 1 and sink.dead_letters == [] and triton.tries == 2


async def test_an_outage_waits_for_the_breaker_without_spending_tries() -> None:
    """Triton unavailable opens the breaker: the record waits, then succeeds on its 1 attempt."""
    breaker = CircuitBreaker(1)
    triton = FakeTriton(failures=[errors.TritonUnavailable("connection refused")])
    sink = FakeSink()
    h, _ = handler(triton, sink, settings(max_attempts="1"), breaker=breaker)
    evaluating = asyncio.create_task(h.evaluate(good_record()))
    await breaker.wait_open()
    assert not evaluating.done()
    breaker.close()
    outcome = await evaluating
    assert outcome.error is None and triton.tries == 2


async def test_the_record_deadline_bounds_all_tries() -> None:
    """A deadline shorter than the backoff: exhausted before WORKER_MAX_ATTEMPTS."""
    timeouts = [errors.TritonTimeout("late") for _ in range(10)]
    triton, sink = FakeTriton(failures=timeouts), FakeSink()
    s = settings(
        max_attempts="10",
        record_deadline_ms="1",
        retry_backoff_ms="1000",
        retry_backoff_max_ms="1000",
    )
    h, _ = handler(triton, sink, s)
    outcome = await h.evaluate(good_record())
    assert outcome.error is not None and outcome.error.code == "RETRIES_EXHAUSTED"
    assert triton.tries < 10


async def test_a_permanent_failure_is_not_retried() -> None:
    """An inference error is the record's own: one try, INFERENCE_ERROR."""
    triton = FakeTriton(failures=[errors.InferenceError("model raised")])
    sink = FakeSink()
    h, _ = handler(triton, sink)
    await h.deliver(await h.evaluate(good_record()))
    assert triton.tries == 1
    assert sink.dead_letters[0]["x-error-code"] == b"INFERENCE_ERROR"
    assert sink.dead_letters[0]["x-attempts"] == b"1"


async def test_the_in_flight_entry_learns_the_request_id_and_model() -> None:
    """Once decoded, the record's in-flight entry names its request id and model; sent to Triton."""
    triton, sink = FakeTriton(), FakeSink()
    h, _ = handler(triton, sink)
    entry = InFlight("in", 0, 7, 0.0)
    outcome = await h.evaluate(good_record(), None, entry)
    assert outcome.error is None
    assert (entry.request_id, entry.model, entry.state) == ("r1", "double", "sent")


# -- the record's task ------------------------------------------------------------------


class HeldTriton(FakeTriton):
    """Inference that waits for ``release`` (the record stays in flight meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.inferring = asyncio.Event()
        self.release = asyncio.Event()

    async def infer(self, request: object, *args: object, **kwargs: object) -> object:
        self.inferring.set()
        await self.release.wait()
        return await super().infer(request, *args, **kwargs)  # type: ignore[arg-type]


def task_path(
    triton: FakeTriton, s: Settings | None = None
) -> tuple[SinglePath, AckedDelivery, Window, InFlightRegistry, Metrics]:
    s = s or settings()
    metrics, delivery = Metrics(version="test"), AckedDelivery()
    window, inflight = Window(8, 8), InFlightRegistry(30)
    path = single_path(
        triton,
        steps_for(s, metrics=metrics),
        s=s,
        delivery=delivery,
        window=window,
        inflight=inflight,
    )
    return path, delivery, window, inflight, metrics


async def test_a_records_task_completes_it_then_gives_back_its_slot_and_entry() -> None:
    """run: evaluated, published, marked done by the delivery mode; slot and entry freed."""
    path, delivery, window, inflight, metrics = task_path(FakeTriton())
    rec = good_record()
    assert window.try_acquire(TP)
    await path.run(rec, delivery.track(rec), None, None)
    assert delivery.completed == [7] and len(delivery.sink.results) == 1
    assert delivery.offsets.commit_point(TP) == 8
    assert window.in_flight == 0 and len(inflight) == 0
    assert counter(metrics, "worker_internal_errors_total") == 0


async def test_a_bug_around_the_record_is_counted_and_leaves_it_not_done() -> None:
    """The delivery mode raises after publishing: INTERNAL_ERROR logged and counted, the
    record not done (its offset is not committed), its slot freed all the same."""
    path, delivery, window, _, metrics = task_path(FakeTriton())
    delivery.fail = RuntimeError("bookkeeping broke")
    rec = good_record()
    assert window.try_acquire(TP)
    await path.run(rec, delivery.track(rec), None, None)
    assert counter(metrics, "worker_internal_errors_total") == 1
    assert delivery.offsets.commit_point(TP) == 7
    assert window.in_flight == 0


async def test_a_revoked_partition_ends_the_task_without_an_error() -> None:
    """PartitionRevoked from the delivery mode: the next owner redoes it; nothing counted."""
    path, delivery, window, _, metrics = task_path(FakeTriton())
    delivery.fail = errors.PartitionRevoked("in-0")
    rec = good_record()
    assert window.try_acquire(TP)
    await path.run(rec, delivery.track(rec), None, None)
    assert counter(metrics, "worker_internal_errors_total") == 0
    assert window.in_flight == 0


async def test_records_of_a_key_are_answered_in_their_turn() -> None:
    """ordering=key: the later record's task, started first, waits for the earlier one."""
    s = settings(ordering="key")
    path, delivery, window, _, _ = task_path(FakeTriton(), s)
    turns = Turns()
    first, second = good_record(7), good_record(8)
    tickets = [delivery.track(first), delivery.track(second)]
    key_turns = [turns.ticket((TP, b"k")), turns.ticket((TP, b"k"))]
    for _ in range(2):
        assert window.try_acquire(TP)
    later = asyncio.create_task(path.run(second, tickets[1], key_turns[1], None))
    earlier = asyncio.create_task(path.run(first, tickets[0], key_turns[0], None))
    await asyncio.gather(later, earlier)
    assert delivery.completed == [7, 8]


async def test_a_cancelled_record_is_left_not_done_and_frees_its_slot() -> None:
    """A forced stop while the record is at Triton: not done, slot and entry given back."""
    triton = HeldTriton()
    path, delivery, window, inflight, _ = task_path(triton)
    rec = good_record()
    assert window.try_acquire(TP)
    task = asyncio.create_task(path.run(rec, delivery.track(rec), None, None))
    await triton.inferring.wait()
    assert len(inflight) == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert delivery.completed == [] and delivery.offsets.commit_point(TP) == 7
    assert window.in_flight == 0 and len(inflight) == 0


async def test_an_outcome_given_is_only_published() -> None:
    """A record handed over with its outcome (the batch path's refused send): no inference."""
    triton = FakeTriton()
    path, delivery, window, inflight, _ = task_path(triton)
    rec = good_record()
    outcome = await path.evaluate(rec)
    triton.tries = 0
    assert window.try_acquire(TP)
    entry = inflight.add(rec)
    await path.run(rec, delivery.track(rec), None, None, outcome, entry)
    assert triton.tries == 0 and delivery.completed == [7]
    assert len(inflight) == 0
