"""Trace context through one record, and the optional spans (an in-memory exporter).

The Triton and Kafka sides are the small fakes of the records tests (inference that
doubles, a sink that keeps what it is given); the spans go to the SDK's
InMemorySpanExporter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.unit.records.fakes import (
    AckedDelivery,
    FakeSink,
    FakeTriton,
    good_record,
    record,
    settings,
    single_path,
    steps_for,
)
from worker.observability._otel import OtelTracing
from worker.observability.trace_context import Tracing, record_context, sampled
from worker.observability.tracing import build_tracing
from worker.records.single import SinglePath
from worker.settings import ConfigError

pytestmark = pytest.mark.timeout(20)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TRACESTATE = "vendor=opaque"


class TracedTriton(FakeTriton):
    """The fake inference, keeping the trace context each try was handed."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.traces: list[Any] = []

    async def infer(
        self, request: Any, spec: Any, timeout_s: float, trace: Any = (), inflight: Any = None
    ) -> Any:
        self.traces.append(trace)
        return await super().infer(request, spec, timeout_s, trace)


def traced_record(traceparent: str = TRACEPARENT) -> Any:
    good = good_record()
    return record(
        good.value,
        headers=[
            *good.headers,
            ("traceparent", traceparent.encode()),
            ("tracestate", b"vendor=opaque"),
        ],
    )


def handler(triton: FakeTriton, sink: FakeSink, tracing: Tracing) -> SinglePath:
    return single_path(triton, steps_for(), delivery=AckedDelivery(sink), tracing=tracing)


def in_memory() -> tuple[OtelTracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing = OtelTracing(provider, output_topic="out", dlq_topic="dlq", group_id="g")
    return tracing, exporter


async def run_record(h: SinglePath, tracing: Tracing, rec: Any) -> Any:
    """The record's path as the worker runs it: under its consume span, evaluate, deliver."""
    with tracing.consume(rec):
        outcome = await h.evaluate(rec)
        await h.deliver(outcome)
    return outcome


def test_a_records_context_is_read_from_its_headers() -> None:
    """traceparent and tracestate become gRPC metadata; a malformed traceparent is none."""
    headers = [("TraceParent", TRACEPARENT.encode()), ("tracestate", TRACESTATE.encode())]
    assert record_context(headers) == (("traceparent", TRACEPARENT), ("tracestate", TRACESTATE))
    assert record_context([("traceparent", b"00-nonsense")]) == ()
    assert record_context([("traceparent", b"\xff" * 55)]) == ()
    assert record_context([("x-request-id", b"r1")]) == ()
    assert sampled(record_context([("traceparent", TRACEPARENT.encode())]))
    assert not sampled(record_context([("traceparent", TRACEPARENT[:-2].encode() + b"00")]))


async def test_without_spans_triton_is_handed_the_records_own_sampled_context() -> None:
    """No-op tracing: the record's traceparent/tracestate reach the inference unchanged."""
    triton, sink = TracedTriton(), FakeSink()
    h = handler(triton, sink, Tracing())
    await run_record(h, Tracing(), traced_record())
    assert triton.traces == [(("traceparent", TRACEPARENT), ("tracestate", TRACESTATE))]
    await run_record(h, Tracing(), traced_record(TRACEPARENT[:-2] + "00"))
    assert triton.traces[-1] == ()  # not sampled: not handed on
    await run_record(h, Tracing(), good_record())
    assert triton.traces[-1] == ()
    assert len(sink.results) == 3


async def test_one_span_tree_per_record_under_the_incoming_trace() -> None:
    """consume → infer and publish, children of the record's traceparent; Triton gets infer's."""
    tracing, exporter = in_memory()
    triton, sink = TracedTriton(), FakeSink()
    h = handler(triton, sink, tracing)
    await run_record(h, tracing, traced_record())
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"consume in", "infer double", "publish out"}
    consume, infer, publish = spans["consume in"], spans["infer double"], spans["publish out"]
    for span in spans.values():
        assert format(span.context.trace_id, "032x") == TRACE_ID
    assert consume.parent is not None and format(consume.parent.span_id, "016x") == PARENT_ID
    assert consume.parent.is_remote
    assert str(consume.context.trace_state.to_header()) == TRACESTATE
    assert infer.parent is not None and infer.parent.span_id == consume.context.span_id
    assert publish.parent is not None and publish.parent.span_id == consume.context.span_id
    assert consume.kind is SpanKind.CONSUMER and publish.kind is SpanKind.PRODUCER
    assert consume.attributes is not None and infer.attributes is not None
    assert consume.attributes["messaging.source.name"] == "in"
    assert consume.attributes["messaging.destination.partition.id"] == "0"
    assert consume.attributes["messaging.kafka.offset"] == 7
    assert consume.attributes["messaging.consumer.group.name"] == "g"
    assert infer.attributes["worker.model.name"] == "double"
    assert publish.attributes is not None and publish.attributes["worker.outcome"] == "result"
    # Triton is handed the infer span's context: its spans continue the same trace.
    (trace,) = triton.traces
    assert dict(trace)["traceparent"] == f"00-{TRACE_ID}-{format(infer.context.span_id, '016x')}-01"
    assert dict(trace)["tracestate"] == TRACESTATE


async def test_records_have_separate_trees_and_a_dead_letter_is_marked() -> None:
    """Two records, two trees; a record without context starts a trace; a failure says its code."""
    tracing, exporter = in_memory()
    triton, sink = TracedTriton(), FakeSink()
    h = handler(triton, sink, tracing)
    await run_record(h, tracing, traced_record())
    await run_record(
        h, tracing, record(b"{not json", headers=[("traceparent", TRACEPARENT.encode())])
    )
    await run_record(h, tracing, good_record())
    spans = exporter.get_finished_spans()
    roots = [s for s in spans if s.name == "consume in"]
    assert len(roots) == 3
    by_root = {
        r.context.span_id: [s for s in spans if s.parent and s.parent.span_id == r.context.span_id]
        for r in roots
    }
    assert sorted(len(children) for children in by_root.values()) == [1, 2, 2]
    dead = [s for s in spans if s.name == "publish dlq"]
    assert len(dead) == 1 and dead[0].attributes is not None
    assert dead[0].attributes["worker.error_code"] == "DECODE_ERROR"
    assert format(dead[0].context.trace_id, "032x") == TRACE_ID
    fresh = roots[2]
    assert fresh.parent is None and format(fresh.context.trace_id, "032x") != TRACE_ID
    assert len(sink.dead_letters) == 1
    assert sink.dead_letters[0]["traceparent"] == TRACEPARENT.encode()


def test_tracing_is_chosen_by_the_standard_variables() -> None:
    """No OTEL_* variable, none or disabled: no spans; an exporter named: spans; unknown: error."""
    s = settings()
    assert not build_tracing({}, s).enabled
    assert not build_tracing({"OTEL_TRACES_EXPORTER": "none"}, s).enabled
    disabled = {"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}
    assert not build_tracing(disabled, s).enabled
    console = build_tracing({"OTEL_TRACES_EXPORTER": "console"}, s)
    assert console.enabled
    console.shutdown()
    otlp = build_tracing({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:4318"}, s)
    assert otlp.enabled
    otlp.shutdown()
    with pytest.raises(ConfigError) as raised:
        build_tracing({"OTEL_TRACES_EXPORTER": "zipkin"}, s)
    assert raised.value.setting == "OTEL_TRACES_EXPORTER"
    with pytest.raises(ConfigError) as raised:
        build_tracing({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, s)
    assert raised.value.setting == "OTEL_EXPORTER_OTLP_PROTOCOL"


def test_without_tracing_nothing_of_opentelemetry_is_imported() -> None:
    """A worker built with no OTEL_* variable set loads no OpenTelemetry module."""
    code = (
        "import asyncio, os, sys\n"
        "for k in [k for k in os.environ if k.startswith('OTEL_')]: del os.environ[k]\n"
        "from worker.app import Worker\n"
        "from worker.settings import load_settings\n"
        "async def main():\n"
        "    return Worker(load_settings({'WORKER_INPUT_TOPICS': 'in',"
        " 'WORKER_OUTPUT_TOPIC': 'out', 'WORKER_DLQ_TOPIC': 'dlq'}))\n"
        "w = asyncio.run(main())\n"
        "assert not w.tracing.enabled\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_replay_keeps_the_trace_context_of_the_dead_letter() -> None:
    """replay_headers drops the worker's dead-letter headers but keeps traceparent/tracestate."""
    from datetime import UTC, datetime

    from worker import errors
    from worker.wire import Source
    from worker.wire.headers import dead_letter_headers, replay_headers

    original = [("traceparent", TRACEPARENT.encode()), ("tracestate", TRACESTATE.encode())]
    letter = dead_letter_headers(
        original,
        errors.DecodeError("bad"),
        Source("in", 0, 7, 0),
        attempts=1,
        group_id="g",
        failed_at=datetime.now(UTC),
    )
    replayed = dict(replay_headers(letter, "dlq/0/3", 1))
    assert replayed["traceparent"] == TRACEPARENT.encode()
    assert replayed["tracestate"] == TRACESTATE.encode()
    assert "x-error-code" not in replayed
