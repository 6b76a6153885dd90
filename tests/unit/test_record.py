"""One record's path through the handler: bugs become INTERNAL_ERROR, model reloads are held.

The fakes stand in for the Triton side (model spec and inference) and the Kafka
side (the sink), to inject what real servers cannot be made to do on demand: a
library raising an unexpected exception, a model that is not ready for exactly
two tries.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from aiokafka.structs import ConsumerRecord
from tritonclient.grpc import service_pb2

from devtools.samples import Tensor, encode_request
from worker import errors
from worker.audit import Audit
from worker.flow.breaker import CircuitBreaker
from worker.flow.holds import ModelGate
from worker.observability import InFlight, Metrics
from worker.record import RecordHandler, RecordRules
from worker.settings import Settings, load_settings
from worker.wire.validation import ModelSpec, TensorSpec

pytestmark = pytest.mark.timeout(10)

SPEC = ModelSpec(
    name="double",
    version="",
    inputs=(TensorSpec("INPUT0", "FP32", (-1,)),),
    outputs=(TensorSpec("OUTPUT0", "FP32", (-1,)),),
    max_batch_size=0,
)


def settings(**extra: str) -> Settings:
    env = {
        "WORKER_INPUT_TOPICS": "in",
        "WORKER_OUTPUT_TOPIC": "out",
        "WORKER_DLQ_TOPIC": "dlq",
        "WORKER_RETRY_BACKOFF_MS": "1",
        "WORKER_RETRY_BACKOFF_MAX_MS": "2",
    }
    env.update({f"WORKER_{k.upper()}": v for k, v in extra.items()})
    return load_settings(env)


def record(
    value: bytes | None, key: bytes | None = b"k", headers: Sequence[tuple[str, Any]] = ()
) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic="in",
        partition=0,
        offset=7,
        timestamp=1_700_000_000_000,
        timestamp_type=0,
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=len(key or b""),
        serialized_value_size=len(value or b""),
        headers=list(headers),
    )


def good_record() -> ConsumerRecord[bytes, bytes]:
    values = np.arange(4, dtype=np.float32)
    value, headers = encode_request(
        "double", [Tensor("INPUT0", "FP32", (4,), values)], "json", "r1"
    )
    return record(value, headers=headers)


class FakeTriton:
    """Model spec and inference: doubles INPUT0; fails as told."""

    def __init__(
        self,
        *,
        not_ready_tries: int = 0,
        raise_on_infer: BaseException | None = None,
        failures: list[errors.WorkerError] | None = None,
    ):
        self.not_ready_tries = not_ready_tries
        self.raise_on_infer = raise_on_infer
        self.failures = list(failures or [])  # raised by the first tries, in order
        self.tries = 0

    async def model_spec(self, name: str, version: str) -> ModelSpec:
        return SPEC

    async def infer(
        self, request: Any, spec: ModelSpec, timeout_s: float, trace: Any = (), inflight: Any = None
    ) -> Any:
        self.tries += 1
        if self.raise_on_infer is not None:
            raise self.raise_on_infer
        if self.failures:
            raise self.failures.pop(0)
        if self.tries <= self.not_ready_tries:
            raise errors.ModelNotReady(
                "Request for unknown model: 'double' has no available versions"
            )
        infer = request.infer_request
        values = np.frombuffer(infer.raw_input_contents[0], dtype="<f4") * 2
        response = service_pb2.ModelInferResponse(model_name="double", model_version="1")
        response.outputs.add(name="OUTPUT0", datatype="FP32", shape=list(infer.inputs[0].shape))
        response.raw_output_contents.append(values.astype("<f4").tobytes())
        return response


class FakeSink:
    """Records what was published; raises as told on results or dead letters."""

    def __init__(self, *, result_error: Exception | None = None, dlq_errors: int = 0) -> None:
        self.result_error = result_error
        self.dlq_errors = dlq_errors
        self.results: list[bytes] = []
        self.dead_letters: list[dict[str, Any]] = []

    async def publish_result(self, rec: Any, value: bytes, headers: Any) -> None:
        if self.result_error is not None:
            raise self.result_error
        self.results.append(value)

    async def publish_dead_letter(self, rec: Any, headers: Any) -> None:
        if self.dlq_errors > 0:
            self.dlq_errors -= 1
            raise TypeError("boom while writing the dead letter")
        self.dead_letters.append(dict(headers))


def handler(
    triton: FakeTriton,
    sink: FakeSink,
    s: Settings | None = None,
    gate: ModelGate | None = None,
    breaker: CircuitBreaker | None = None,
) -> tuple[RecordHandler, Metrics]:
    s = s or settings()
    metrics = Metrics(version="test")
    built = RecordHandler(
        RecordRules.from_settings(s),
        pool=triton,  # type: ignore[arg-type]
        batcher=triton,  # type: ignore[arg-type]
        sink=sink,
        metrics=metrics,
        audit=Audit(s, send=None),  # type: ignore[arg-type]
        breaker=breaker or CircuitBreaker(5),
        models=gate,
    )
    return built, metrics


def counter(metrics: Metrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


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

    async def listed(name: str, version: str) -> bool:
        return False

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

    gate = ModelGate(seen_ready=lambda name, version: False, listed=no, ready=no)

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
