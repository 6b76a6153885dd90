"""What the records tests share: settings, records, the steps over real bookkeeping, fakes.

The fakes stand in for the Triton side (model spec and inference that doubles
INPUT0, failing as told) and the Kafka side (a sink keeping what it is given, a
delivery mode that completes at once), to inject what real servers cannot be made
to do on demand. The steps, the breakers, the window and the metrics are the real ones.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
from aiokafka.structs import ConsumerRecord, TopicPartition
from tritonclient.grpc import service_pb2

from devtools.samples import Tensor, encode_request
from worker import errors
from worker.audit import Audit
from worker.delivery.offsets import OffsetTracker
from worker.flow.breaker import CircuitBreaker
from worker.flow.holds import ModelGate
from worker.flow.limiter import AdaptiveLimiter
from worker.flow.model_health import ModelHealth
from worker.flow.window import Window
from worker.observability import InFlightRegistry, Metrics
from worker.observability.trace_context import Tracing
from worker.records.rules import RecordRules
from worker.records.single import SinglePath
from worker.records.steps import Steps
from worker.records.stream import StreamCalls, StreamRules
from worker.settings import Settings, load_settings
from worker.wire.validation import ModelSpec, TensorSpec

TP = TopicPartition("in", 0)

SPEC = ModelSpec(
    name="double",
    version="",
    inputs=(TensorSpec("INPUT0", "FP32", (-1,)),),
    outputs=(TensorSpec("OUTPUT0", "FP32", (-1,)),),
    max_batch_size=0,
)


def settings(**extra: str) -> Settings:
    """Settings of a worker on topics in, out and dlq; ``extra``: SETTING_NAME=value."""
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
    value: bytes | None,
    key: bytes | None = b"k",
    headers: Sequence[tuple[str, Any]] = (),
    offset: int = 7,
) -> ConsumerRecord[bytes, bytes]:
    """A record of partition in-0 at ``offset``."""
    return ConsumerRecord(
        topic="in",
        partition=0,
        offset=offset,
        timestamp=1_700_000_000_000,
        timestamp_type=0,
        key=key,
        value=value,
        checksum=None,
        serialized_key_size=len(key or b""),
        serialized_value_size=len(value or b""),
        headers=list(headers),
    )


def good_record(
    offset: int = 7, key: bytes | None = b"k", width: int = 4
) -> ConsumerRecord[bytes, bytes]:
    """A JSON request of model ``double``: INPUT0 = [0, 1, ..., width - 1], request id r1."""
    values = np.arange(width, dtype=np.float32)
    value, headers = encode_request(
        "double", [Tensor("INPUT0", "FP32", (width,), values)], "json", "r1"
    )
    return record(value, key, headers, offset)


class FakeTriton:
    """Model spec and inference: doubles INPUT0; fails as told."""

    def __init__(
        self,
        *,
        not_ready_tries: int = 0,
        raise_on_infer: BaseException | None = None,
        failures: Sequence[errors.WorkerError] | None = None,
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

    async def publish_results(self, rec: Any, results: Sequence[tuple[bytes, Any]]) -> None:
        self.results.extend(value for value, _ in results)

    async def publish_dead_letter(self, rec: Any, headers: Any) -> None:
        if self.dlq_errors > 0:
            self.dlq_errors -= 1
            raise TypeError("boom while writing the dead letter")
        self.dead_letters.append(dict(headers))


class AckedDelivery:
    """A delivery mode over real offsets whose outcomes are safe once delivered (as
    at_least_once's); ``fail`` makes ``complete`` raise after delivering."""

    def __init__(self, sink: Any = None) -> None:
        self.sink = sink if sink is not None else FakeSink()
        self.offsets = OffsetTracker()
        self.fail: BaseException | None = None
        self.completed: list[int] = []

    def track(self, rec: ConsumerRecord[bytes, bytes]) -> int:
        if self.offsets.get(TP) is None:
            self.offsets.assign(TP, rec.offset)
        return self.offsets.track(TP, rec.offset)

    def settle_if_done(self, rec: ConsumerRecord[bytes, bytes], ticket: int) -> bool:
        return False

    async def complete(
        self,
        rec: ConsumerRecord[bytes, bytes],
        ticket: int,
        deliver: Callable[[], Awaitable[None]],
        on_safe: Callable[[], None],
    ) -> None:
        await deliver()
        on_safe()
        if self.fail is not None:
            raise self.fail
        self.offsets.done(TP, rec.offset, ticket)
        self.completed.append(rec.offset)


def steps_for(
    s: Settings | None = None,
    *,
    metrics: Metrics | None = None,
    breaker: CircuitBreaker | None = None,
    gate: ModelGate | None = None,
    health: ModelHealth | None = None,
    limiter: AdaptiveLimiter | None = None,
) -> Steps:
    """The steps of ``s`` over real bookkeeping (no audit topic: nothing is sent)."""
    s = s or settings()
    return Steps(
        RecordRules.from_settings(s),
        metrics=metrics if metrics is not None else Metrics(version="test"),
        breaker=breaker if breaker is not None else CircuitBreaker(5),
        limiter=limiter,
        models=gate,
        health=health,
        audit=Audit(s, send=None),  # type: ignore[arg-type]
    )


def single_path(
    triton: FakeTriton,
    steps: Steps,
    *,
    s: Settings | None = None,
    delivery: Any = None,
    window: Window | None = None,
    inflight: InFlightRegistry | None = None,
    tracing: Tracing | None = None,
) -> SinglePath:
    """The per-record path over ``triton`` (its pool and its micro-batcher) and ``steps``."""
    s = s or settings()
    return SinglePath(
        steps,
        pool=triton,  # type: ignore[arg-type]
        batcher=triton,  # type: ignore[arg-type]
        streams=StreamCalls(StreamRules.from_settings(s), triton, steps),  # type: ignore[arg-type]
        # AckedDelivery: a fake of what the single path asks of a delivery mode.
        delivery=delivery if delivery is not None else AckedDelivery(),  # type: ignore[arg-type]
        window=window if window is not None else Window(64, 64),
        inflight=inflight if inflight is not None else InFlightRegistry(30),
        tracing=tracing if tracing is not None else Tracing(),
        key_mode=s.delivery.ordering == "key",
    )


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    """A metric's sample value (0 when the series does not exist)."""
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now
