"""OpenTelemetry spans of a record (the ``otel`` extra); imported only when tracing is on.

One tree per record, a child of the context its ``traceparent`` / ``tracestate``
headers carry (a new trace when it has none):

- ``consume <topic>`` (CONSUMER): the record's whole life in the worker, with its
  Kafka coordinates, consumer group and outcome;
- ``infer <model>`` (CLIENT): its inference, every try and any wait for a
  micro-batch included; its context is what Triton is handed;
- ``publish <topic>`` (PRODUCER): writing the result or the dead letter, until the
  broker's acknowledgement.

Records answered together (the group path) get the same trees, made once the group is
done from the times it recorded (``group_spans``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from worker.observability.trace_context import (
    GroupSpan,
    TraceMetadata,
    Tracing,
    record_context,
)
from worker.settings import ConfigError
from worker.wire.headers import Headers

__all__ = ["OtelTracing", "provider_from_env"]

_W3C = TraceContextTextMapPropagator()


def provider_from_env(environ: Mapping[str, str], exporters: str) -> TracerProvider:
    """A TracerProvider exporting to each exporter that OTEL_TRACES_EXPORTER names.

    The SDK reads the rest of the standard variables itself (OTEL_SERVICE_NAME,
    OTEL_RESOURCE_ATTRIBUTES, OTEL_TRACES_SAMPLER, OTEL_BSP_*, OTEL_EXPORTER_OTLP_*).
    """
    attributes = {} if environ.get("OTEL_SERVICE_NAME") else {"service.name": "kafka-triton-worker"}
    provider = TracerProvider(resource=Resource.create(attributes))
    for name in (part.strip() for part in exporters.split(",")):
        if name and name != "none":
            provider.add_span_processor(BatchSpanProcessor(_exporter(name, environ)))
    return provider


def _exporter(name: str, environ: Mapping[str, str]) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ConfigError(
            "OTEL_TRACES_EXPORTER",
            f"OTEL_TRACES_EXPORTER: unknown exporter {name!r}, expected otlp, console or none",
        )
    protocol = environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol.strip() != "http/protobuf":
        raise ConfigError(
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            f"OTEL_EXPORTER_OTLP_PROTOCOL: only http/protobuf is supported, got {protocol!r}",
        )
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(
            "OTEL_TRACES_EXPORTER",
            "OTEL_TRACES_EXPORTER: otlp needs opentelemetry-exporter-otlp-proto-http "
            "(pip install 'kafka-triton-worker[otel]')",
        ) from None
    return OTLPSpanExporter()


class _Span:
    """A span made current for a ``with`` block; ``outcome`` decides its closing attributes."""

    __slots__ = ("_dlq_topic", "_outcome", "_output_topic", "_span", "_token")

    def __init__(self, span: trace.Span, outcome: Any = None, topics: tuple[str, str] = ("", "")):
        self._span = span
        self._outcome = outcome
        self._output_topic, self._dlq_topic = topics
        self._token: object = None

    def __enter__(self) -> trace.Span:
        self._token = otel_context.attach(trace.set_span_in_context(self._span))
        return self._span

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        span = self._span
        try:
            if self._outcome is not None:
                _describe_outcome(span, self._outcome, self._output_topic, self._dlq_topic)
            if exc is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, type(exc).__name__))
        finally:
            span.end()
            otel_context.detach(self._token)  # type: ignore[arg-type]


def _describe_outcome(span: trace.Span, outcome: Any, output_topic: str, dlq_topic: str) -> None:
    error = outcome.error
    topic = dlq_topic if error else output_topic
    span.update_name(f"publish {topic}")
    span.set_attribute("messaging.destination.name", topic)
    span.set_attribute("worker.outcome", "dead_letter" if error else "result")
    if error is not None:
        span.set_attribute("worker.error_code", error.code)
        span.set_status(Status(StatusCode.ERROR, error.code))


def _infer_attributes(model_name: str, model_version: str) -> dict[str, str]:
    return {
        "rpc.system": "grpc",
        "rpc.service": "inference.GRPCInferenceService",
        "worker.model.name": model_name,
        "worker.model.version": model_version,
    }


class OtelTracing(Tracing):
    """Spans through ``provider``; ``owned``: shut it down (flush) with the worker."""

    enabled = True

    def __init__(
        self,
        provider: trace.TracerProvider,
        *,
        output_topic: str,
        dlq_topic: str,
        group_id: str,
        owned: bool = False,
    ) -> None:
        self._provider = provider
        self._tracer = provider.get_tracer("worker")
        self._topics = (output_topic, dlq_topic)
        self._group_id = group_id
        self._owned = owned

    def consume(self, record: Any) -> AbstractContextManager[trace.Span]:
        return _Span(self._consume_span(record))

    def _consume_span(self, record: Any, start_time: int | None = None) -> trace.Span:
        carrier = dict(record_context(record.headers))
        parent = _W3C.extract(carrier) if carrier else otel_context.Context()
        return self._tracer.start_span(
            f"consume {record.topic}",
            context=parent,
            kind=SpanKind.CONSUMER,
            attributes={
                "messaging.system": "kafka",
                "messaging.operation.type": "process",
                "messaging.source.name": record.topic,
                "messaging.destination.partition.id": str(record.partition),
                "messaging.kafka.offset": record.offset,
                "messaging.consumer.group.name": self._group_id,
            },
            start_time=start_time,
        )

    def infer(self, model_name: str, model_version: str) -> AbstractContextManager[trace.Span]:
        span = self._tracer.start_span(
            f"infer {model_name}",
            kind=SpanKind.CLIENT,
            attributes=_infer_attributes(model_name, model_version),
        )
        return _Span(span)

    def publish(self, outcome: Any) -> AbstractContextManager[trace.Span]:
        span = self._tracer.start_span(
            "publish",
            kind=SpanKind.PRODUCER,
            attributes={"messaging.system": "kafka", "messaging.operation.type": "send"},
        )
        return _Span(span, outcome, self._topics)

    def group_spans(self, answered: Sequence[GroupSpan]) -> None:
        """Each record's span tree, as ``consume``, ``infer`` and ``publish`` would have made
        it, from the times its group recorded (monotonic, turned into the wall clock)."""
        offset_ns = time.time_ns() - time.monotonic_ns()
        output_topic = self._topics[0]
        for item in answered:

            def at(moment: float) -> int:
                return offset_ns + int(moment * 1e9)

            consumed = self._consume_span(item.record, at(item.taken))
            parent = trace.set_span_in_context(consumed)
            infer = self._tracer.start_span(
                f"infer {item.model_name}",
                context=parent,
                kind=SpanKind.CLIENT,
                attributes=_infer_attributes(item.model_name, item.model_version),
                start_time=at(item.sent),
            )
            infer.end(end_time=at(item.answered))
            publish = self._tracer.start_span(
                f"publish {output_topic}",
                context=parent,
                kind=SpanKind.PRODUCER,
                attributes={
                    "messaging.system": "kafka",
                    "messaging.operation.type": "send",
                    "messaging.destination.name": output_topic,
                    "worker.outcome": "result",
                },
                start_time=at(item.answered),
            )
            publish.end(end_time=at(item.published))
            consumed.end(end_time=at(item.published))

    def to_triton(self, headers: Headers) -> TraceMetadata:
        """The current span's context (the record's infer span), if it is sampled."""
        carrier: dict[str, str] = {}
        _W3C.inject(carrier)
        parent = carrier.get("traceparent")
        if parent is None or not parent.endswith("1"):
            return ()
        state = carrier.get("tracestate")
        return (
            (("traceparent", parent), ("tracestate", state))
            if state
            else (("traceparent", parent),)
        )

    def shutdown(self) -> None:
        if self._owned and isinstance(self._provider, TracerProvider):
            self._provider.shutdown()
