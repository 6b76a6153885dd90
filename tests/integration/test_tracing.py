"""Trace context against real Kafka and Triton: headers kept, spans emitted, Triton continuing.

The worker runs in-process; its spans go to the SDK's in-memory exporter. For
Triton's side a Triton of this module's own runs in OpenTelemetry trace mode
(``rate=0``: only requests that bring a context are traced), exporting OTLP/HTTP
to a small receiver here; tritonserver 2.51 sends OTLP's JSON encoding, ids in hex.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from devtools.devstack.paths import models_dir
from devtools.devstack.process import tail
from devtools.devstack.triton import TritonServer, ensure_triton
from devtools.samples import SampleRequest, double_inputs, encode_request
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    headers_dict,
    running_worker,
    send,
    settings_for,
)
from worker.app import Worker
from worker.observability._otel import OtelTracing

pytestmark = pytest.mark.timeout(240)

TRACESTATE = b"vendor=opaque"


def traceparent(trace_id: str, parent_id: str = "00f067aa0ba902b7") -> bytes:
    return f"00-{trace_id}-{parent_id}-01".encode()


def double(request_id: str, trace_id: str) -> SampleRequest:
    tensors = double_inputs(np.random.default_rng(1), width=4)
    value, headers = encode_request("double", tensors, "json", request_id)
    headers = [*headers, ("traceparent", traceparent(trace_id)), ("tracestate", TRACESTATE)]
    return SampleRequest(value, headers, "double", "json", request_id)


def broken(request_id: str, trace_id: str) -> SampleRequest:
    headers = [
        ("content-type", b"application/json"),
        ("x-request-id", request_id.encode()),
        ("traceparent", traceparent(trace_id)),
        ("tracestate", TRACESTATE),
    ]
    return SampleRequest(b"{not json", headers, "double", "json", request_id)


async def test_result_and_dead_letter_keep_the_context_and_each_record_has_its_spans(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """A good and a bad traced record: both outcomes keep traceparent/tracestate; two trees.
    Then three traced records of the now known model, answered together by the group path:
    a tree each, as the per-record path makes it."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    good_id, bad_id = "4bf92f3577b34da6a3ce929d0e0e4736", "5bf92f3577b34da6a3ce929d0e0e4737"
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    settings = settings_for(kafka, triton, topics)
    tracing = OtelTracing(provider, output_topic=topics.output, dlq_topic=topics.dlq, group_id="g")
    grouped_ids = [f"{i}cf92f3577b34da6a3ce929d0e0e473{i}" for i in range(3)]
    async with running_worker(settings, Worker(settings, tracing=tracing)) as worker:
        await send(
            kafka.bootstrap_servers, topics.input, [double("good", good_id), broken("bad", bad_id)]
        )
        got = await collect(kafka.bootstrap_servers, topics, expected=2)
        grouped = [double(f"grouped-{i}", trace_id) for i, trace_id in enumerate(grouped_ids)]
        await send(kafka.bootstrap_servers, topics.input, grouped)
        await collect(kafka.bootstrap_servers, topics, expected=5, into=got)
    sample = worker.metrics.registry.get_sample_value
    assert sample("worker_fast_path_records_total", {}) == len(grouped)
    result = headers_dict(got.results["good"].headers)
    letter = headers_dict(got.dead_letters["bad"].headers)
    assert result["traceparent"] == traceparent(good_id)
    assert result["tracestate"] == TRACESTATE
    assert letter["traceparent"] == traceparent(bad_id)
    assert letter["tracestate"] == TRACESTATE
    assert letter["x-error-code"] == b"DECODE_ERROR"

    spans = exporter.get_finished_spans()
    by_trace: dict[str, list[Any]] = {}
    for span in spans:
        by_trace.setdefault(format(span.context.trace_id, "032x"), []).append(span)
    assert set(by_trace) == {good_id, bad_id, *grouped_ids}
    good = {s.name: s for s in by_trace[good_id]}
    assert set(good) == {f"consume {topics.input}", "infer double", f"publish {topics.output}"}
    bad = {s.name: s for s in by_trace[bad_id]}
    assert set(bad) == {f"consume {topics.input}", f"publish {topics.dlq}"}
    trees = [good, bad]
    for trace_id in grouped_ids:
        tree = {s.name: s for s in by_trace[trace_id]}
        assert set(tree) == {f"consume {topics.input}", "infer double", f"publish {topics.output}"}
        trees.append(tree)
    for tree in trees:
        root = tree[f"consume {topics.input}"]
        assert root.parent is not None and format(root.parent.span_id, "016x") == "00f067aa0ba902b7"
        for name, span in tree.items():
            if span is not root:
                assert span.parent is not None and span.parent.span_id == root.context.span_id, name


class _Receiver(BaseHTTPRequestHandler):
    """OTLP/HTTP traces endpoint that keeps every body it is sent."""

    bodies: list[bytes]
    arrived: threading.Condition

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with self.arrived:
            self.bodies.append(body)
            self.arrived.notify_all()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


#: (name, trace id, parent span id) of an exported span.
Exported = tuple[str, str, str]


def _spans(body: bytes) -> list[Exported]:
    document = json.loads(body)
    return [
        (span["name"], span["traceId"].lower(), span.get("parentSpanId", "").lower())
        for resource in document.get("resourceSpans", [])
        for scope in resource.get("scopeSpans", [])
        for span in scope.get("spans", [])
    ]


class Collector:
    """The spans Triton exported."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.arrived = threading.Condition()
        handler = type("Handler", (_Receiver,), {"bodies": self.bodies, "arrived": self.arrived})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def spans(self) -> list[Exported]:
        with self.arrived:
            return [span for body in self.bodies for span in _spans(body)]

    def wait_for(self, trace_id: str, timeout_s: float) -> bool:
        """True once a span of ``trace_id`` has arrived (False after ``timeout_s``)."""
        with self.arrived:
            return self.arrived.wait_for(
                lambda: any(s[1] == trace_id for b in self.bodies for s in _spans(b)), timeout_s
            )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def collector() -> Iterator[Collector]:
    found = Collector()
    yield found
    found.close()


@pytest.fixture(scope="module")
def traced_triton(
    collector: Collector, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """Triton serving ``double``, tracing (OpenTelemetry) exactly the requests with a context."""
    server = TritonServer(
        ensure_triton(lambda _: None),
        models_dir(),
        tmp_path_factory.mktemp("traced-triton"),
        models=["double"],
        extra_args=[
            "--trace-config=mode=opentelemetry",
            "--trace-config=rate=0",
            "--trace-config=count=-1",
            "--trace-config=level=TIMESTAMPS",
            f"--trace-config=opentelemetry,url={collector.url}",
            # Exported every 100 ms, and at the stop (which ends and exports every span
            # Triton holds): the test waits for either (one export has been seen missing
            # in each way, neither twice in one run).
            "--trace-config=opentelemetry,bsp_schedule_delay=100",
        ],
    )
    server.start()
    _traced_once(server, collector)
    yield server
    server.stop()


#: The trace of the request that shows Triton's tracing ready (``_traced_once``).
WARM_UP_TRACE = "0af7651916cd43dd8448eb211c80319c"


def _traced_once(server: TritonServer, collector: Collector) -> None:
    """A traced request sent straight to Triton (no worker), again every 2 s until its span
    is exported: the module's tests start once Triton's tracing is seen to work. Now and
    then a fresh Triton exported no span at all of the unary record (0 exports, even at
    its stop) though the worker sent it unary with its context; a tracer or exporter not
    ready yet is ruled out this way, and what the test then finds missing is the worker's."""
    client = grpcclient.InferenceServerClient(server.grpc_address)
    data = grpcclient.InferInput("INPUT0", [1, 4], "FP32")
    data.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    deadline = time.monotonic() + 60
    try:
        while True:
            client.infer(
                "double", [data], headers={"traceparent": traceparent(WARM_UP_TRACE).decode()}
            )
            if collector.wait_for(WARM_UP_TRACE, timeout_s=2):
                return
            assert time.monotonic() < deadline, (
                "Triton exported no span of a traced request sent straight to it in 60 s; "
                f"its log ends:\n{tail(server.log_path, 40)}"
            )
    finally:
        client.close()


def _executions(server: TritonServer) -> int:
    """How many requests Triton's ``double`` has executed (for a failure's message)."""
    client = grpcclient.InferenceServerClient(server.grpc_address)
    try:
        stats = client.get_inference_statistics("double", as_json=True)
        return sum(int(m.get("inference_count", 0)) for m in stats.get("model_stats", []))
    finally:
        client.close()


async def test_triton_continues_the_trace_of_a_record_sent_unary(
    kafka: KafkaUnderTest, traced_triton: TritonServer, collector: Collector, unique: str
) -> None:
    """WORKER_TRITON_TRACE=unary: Triton's spans carry the record's trace; on a stream, not.

    Triton now and then exports no span of a request it traced and executed: seen for a
    record sent unary with its context (no export at all; once, only the warm-up's, in
    30 s and at Triton's stop), and for the warm-up's own request, sent straight to it.
    The worker's part is deterministic (a record with a sampled context under ``unary``
    never takes the group path, tests/unit/records/test_batch.py, and is sent unary with
    its context as gRPC metadata), so three such records are sent, each of its own trace,
    and Triton's spans of any one of them prove it."""
    on_stream = "6bf92f3577b34da6a3ce929d0e0e4738"
    unary = [f"7bf92f3577b34da6a3ce929d0e0e473{i}" for i in range(3)]
    runs = (("stream", [("s", on_stream)]), ("unary", [(f"u{i}", t) for i, t in enumerate(unary)]))
    for mode, records in runs:
        topics = Topics.fresh(f"{unique}{mode}")
        await create(kafka, topics)
        settings = settings_for(kafka, traced_triton, topics, triton_trace=mode)
        async with running_worker(settings):
            await send(kafka.bootstrap_servers, topics.input, [double(r, t) for r, t in records])
            got = await collect(kafka.bootstrap_servers, topics, expected=len(records))
        assert {r for r, _ in records} <= set(got.results)
    exported = any(collector.wait_for(t, timeout_s=10) for t in unary)
    executed = _executions(traced_triton)
    traced_triton.stop()
    assert exported or any(collector.wait_for(t, timeout_s=10) for t in unary), (
        f"Triton exported no span of the 3 unary records; {len(collector.bodies)} exports "
        f"came, {executed} requests executed (the warm-up's, the stream's and the unary "
        f"ones), with spans {collector.spans()}; its log ends:\n"
        f"{tail(traced_triton.log_path, 40)}"
    )
    spans = collector.spans()
    # The stop exported every span Triton held: none is of the stream record's trace.
    assert not [s for s in spans if s[1] == on_stream]
    for trace_id in {s[1] for s in spans if s[1] in unary}:
        ours = [s for s in spans if s[1] == trace_id]
        # Triton's top-level span is a child of the record's own parent span (no worker spans).
        assert ("InferRequest", trace_id, "00f067aa0ba902b7") in ours
        assert any(name == "double" for name, _, _ in ours)
