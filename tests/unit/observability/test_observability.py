"""Observability: JSON log lines with context, metrics on their own registry, HTTP probes."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
from collections.abc import AsyncIterator, Iterator, Mapping

import prometheus_client
import pytest
import structlog

from worker.observability import (
    MAX_MODEL_LABELS,
    METRICS_SPEC,
    HealthServer,
    Metrics,
    configure_logging,
    metrics_reference_markdown,
    reset_logging,
)

# -- logging -------------------------------------------------------------------------


@pytest.fixture
def log_stream() -> Iterator[io.StringIO]:
    """A stream receiving the worker's logs; logging is reset afterwards."""
    stream = io.StringIO()
    yield stream
    reset_logging()
    structlog.contextvars.clear_contextvars()


def _lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_logs_are_one_object_per_line_with_context(log_stream: io.StringIO) -> None:
    """Each event is one JSON object carrying level, logger, UTC time and bound context."""
    configure_logging("json", "info", stream=log_stream)
    log = structlog.get_logger("worker.kafka.aiokafka.intake")
    structlog.contextvars.bind_contextvars(topic="requests", partition=3, offset=42)
    log.info("record_failed", code="DECODE_ERROR")
    structlog.contextvars.clear_contextvars()
    log.warning("plain_event")
    log.debug("hidden_at_info")

    first, second = _lines(log_stream)
    assert {k: first[k] for k in ("event", "level", "logger", "topic", "partition", "offset")} == {
        "event": "record_failed",
        "level": "info",
        "logger": "worker.kafka.aiokafka.intake",
        "topic": "requests",
        "partition": 3,
        "offset": 42,
    }
    assert first["code"] == "DECODE_ERROR"
    assert str(first["timestamp"]).endswith("Z")
    assert second["event"] == "plain_event"
    assert "topic" not in second


def test_json_exception_stays_on_one_line(log_stream: io.StringIO) -> None:
    """A logged exception is rendered into the same single JSON line."""
    configure_logging("json", "info", stream=log_stream)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        structlog.get_logger("worker.app").exception("crashed")
    (line,) = _lines(log_stream)
    assert line["event"] == "crashed"
    assert line["level"] == "error"
    assert "RuntimeError: boom" in str(line["exception"])


def test_library_logs_share_the_format_at_warning(log_stream: io.StringIO) -> None:
    """Third-party stdlib logs come out as JSON too, but only from WARNING up."""
    configure_logging("json", "debug", stream=log_stream)
    library = logging.getLogger("aiokafka.consumer")
    library.info("chatty %s", "detail")
    structlog.contextvars.bind_contextvars(partition=1)
    library.warning("heartbeat failed for %s", "group")
    (line,) = _lines(log_stream)
    assert line["event"] == "heartbeat failed for group"
    assert line["level"] == "warning"
    assert line["logger"] == "aiokafka.consumer"
    assert line["partition"] == 1


def test_console_format_and_reconfiguration(log_stream: io.StringIO) -> None:
    """Console output is human text, and configuring again replaces the previous setup."""
    configure_logging("json", "info", stream=io.StringIO())
    configure_logging("console", "info", stream=log_stream)
    structlog.get_logger("worker.cli").info("started", port=9400)
    text = log_stream.getvalue()
    assert "started" in text
    assert "port" in text
    assert not text.lstrip().startswith("{")
    assert len(text.strip().splitlines()) == 1


def test_configure_logging_rejects_unknown_modes() -> None:
    """An unknown format or level is refused instead of silently defaulting."""
    with pytest.raises(ValueError, match="log_format"):
        configure_logging("xml", "info")
    with pytest.raises(ValueError, match="level"):
        configure_logging("json", "trace")


# -- metrics -------------------------------------------------------------------------


def _sample(metrics: Metrics, name: str, labels: Mapping[str, str] | None = None) -> float | None:
    return metrics.registry.get_sample_value(name, dict(labels or {}))


def test_metrics_live_on_separate_registries() -> None:
    """Two Metrics objects coexist and count independently."""
    first, second = Metrics(version="1.2.3"), Metrics(version="1.2.3")
    first.records_consumed_total.labels(topic="t", partition="0").inc(3)
    labels = {"topic": "t", "partition": "0"}
    assert _sample(first, "worker_records_consumed_total", labels) == 3
    assert _sample(second, "worker_records_consumed_total", labels) is None
    assert _sample(first, "worker_info", {"version": "1.2.3"}) == 1


def test_every_declared_metric_is_exported() -> None:
    """Each entry of the metrics table is a registered metric with the worker_ prefix."""
    text = Metrics().render().decode()
    for spec in METRICS_SPEC:
        assert spec.name.startswith("worker_")
        assert f"# HELP {spec.name} " in text


def test_histograms_use_declared_buckets() -> None:
    """Inference latency buckets run from half a millisecond to ten seconds."""
    metrics = Metrics()
    metrics.inference_latency_seconds.labels(model="m").observe(0.0004)
    le_first = {"model": "m", "le": "0.0005"}
    le_last = {"model": "m", "le": "10.0"}
    assert _sample(metrics, "worker_inference_latency_seconds_bucket", le_first) == 1
    assert _sample(metrics, "worker_inference_latency_seconds_bucket", le_last) == 1


def test_model_label_cardinality_is_capped() -> None:
    """Model names beyond the cap share the label value "other"; known ones keep theirs."""
    metrics = Metrics()
    labels = [metrics.model_label(f"m{i}") for i in range(MAX_MODEL_LABELS + 5)]
    assert labels[:MAX_MODEL_LABELS] == [f"m{i}" for i in range(MAX_MODEL_LABELS)]
    assert set(labels[MAX_MODEL_LABELS:]) == {"other"}
    assert metrics.model_label("m0") == "m0"


def test_forget_partition_drops_its_lag() -> None:
    """A revoked partition's lag series disappears; forgetting twice is harmless."""
    metrics = Metrics()
    metrics.consumer_lag.labels(topic="t", partition="2").set(17)
    metrics.forget_partition("t", 2)
    metrics.forget_partition("t", 2)
    assert _sample(metrics, "worker_consumer_lag", {"topic": "t", "partition": "2"}) is None


def test_metrics_reference_lists_every_metric() -> None:
    """The metrics table (docs/observability.md) has one row per metric with its type and labels."""
    rows = metrics_reference_markdown().strip().splitlines()
    assert rows[0] == "| name | type | labels | meaning |"
    assert len(rows) == 2 + len(METRICS_SPEC)
    by_name = {row.split("|")[1].strip(" `"): row for row in rows[2:]}
    assert set(by_name) == {spec.name for spec in METRICS_SPEC}
    assert "| counter | `topic`, `partition` |" in by_name["worker_records_consumed_total"]


# -- HTTP endpoints ------------------------------------------------------------------


class Readiness:
    """A readiness answer the test can flip."""

    def __init__(self) -> None:
        self.ready = False

    def __call__(self) -> tuple[bool, Mapping[str, object]]:
        return self.ready, ({} if self.ready else {"triton": "not ready"})


@pytest.fixture
def metrics() -> Metrics:
    """A fresh set of metrics."""
    return Metrics(version="test")


@pytest.fixture
def readiness() -> Readiness:
    """Starts not ready."""
    return Readiness()


@pytest.fixture
async def server(metrics: Metrics, readiness: Readiness) -> AsyncIterator[HealthServer]:
    """A health server on an ephemeral local port, with short client limits."""
    health = HealthServer(
        metrics.registry,
        readiness,
        host="127.0.0.1",
        port=0,
        read_timeout_s=0.2,
        max_request_bytes=1024,
    )
    await health.start()
    yield health
    await health.stop()


async def _read_to_end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """Everything the server sends before it closes; a reset counts as the end."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := await reader.read(65536):
            data += chunk
    writer.close()
    with contextlib.suppress(ConnectionResetError):
        await writer.wait_closed()
    return data


async def _exchange(port: int, request: bytes) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    raw = await _read_to_end(reader, writer)  # the server closes after one response
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    return int(status_line.split(" ")[1]), headers, body


async def _get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    return await _exchange(port, f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())


async def test_healthz_is_ok(server: HealthServer) -> None:
    """/healthz answers 200 ok while the process runs."""
    status, headers, body = await _get(server.port, "/healthz")
    assert (status, body) == (200, b"ok")
    assert headers["content-length"] == "2"
    assert headers["connection"] == "close"


async def test_readyz_follows_the_readiness_check(
    server: HealthServer, readiness: Readiness
) -> None:
    """/readyz is 503 with what is not ready, then 200 once the check says ready."""
    status, headers, body = await _get(server.port, "/readyz")
    assert status == 503
    assert headers["content-type"] == "application/json"
    assert json.loads(body) == {"ready": False, "detail": {"triton": "not ready"}}

    readiness.ready = True
    status, _, body = await _get(server.port, "/readyz?verbose=1")
    assert status == 200
    assert json.loads(body) == {"ready": True, "detail": {}}


async def test_readyz_when_the_check_raises(metrics: Metrics, log_stream: io.StringIO) -> None:
    """A failing readiness check reads as not ready, and the failure is logged."""
    configure_logging("json", "info", stream=log_stream)

    def broken() -> tuple[bool, Mapping[str, object]]:
        raise RuntimeError("state unavailable")

    health = HealthServer(metrics.registry, broken, host="127.0.0.1", port=0)
    await health.start()
    try:
        status, _, body = await _get(health.port, "/readyz")
    finally:
        await health.stop()
    assert status == 503
    assert json.loads(body)["detail"] == {"error": "readiness check failed: RuntimeError"}
    assert [line["event"] for line in _lines(log_stream)] == ["readiness_check_failed"]


async def test_metrics_endpoint_shows_counts(server: HealthServer, metrics: Metrics) -> None:
    """/metrics serves the registry in the Prometheus text format, with current values."""
    metrics.records_consumed_total.labels(topic="requests", partition="0").inc(5)
    metrics.dead_letters_total.labels(code="DECODE_ERROR").inc()
    metrics.triton_up.set(1)
    status, headers, body = await _get(server.port, "/metrics")
    assert status == 200
    assert headers["content-type"] == prometheus_client.CONTENT_TYPE_LATEST
    text = body.decode()
    assert 'worker_records_consumed_total{partition="0",topic="requests"} 5.0' in text
    assert 'worker_dead_letters_total{code="DECODE_ERROR"} 1.0' in text
    assert "worker_triton_up 1.0" in text
    assert 'worker_info{version="test"} 1.0' in text


async def test_unknown_path_and_method(server: HealthServer) -> None:
    """Other paths are 404, other methods 405, and HEAD gets headers without a body."""
    assert (await _get(server.port, "/nope"))[0] == 404
    assert (await _get(server.port, "/healthz", method="POST"))[0] == 405
    status, headers, body = await _get(server.port, "/healthz", method="HEAD")
    assert (status, headers["content-length"], body) == (200, "2", b"")
    assert (await _exchange(server.port, b"garbage\r\n\r\n"))[0] == 400


async def test_slow_client_is_dropped_without_blocking_others(server: HealthServer) -> None:
    """A client that never finishes its request gets 408; others are served meanwhile."""
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /healthz HTTP/1.1\r\n")  # the head never ends
    await writer.drain()
    assert (await _get(server.port, "/healthz"))[0] == 200
    assert (await _read_to_end(reader, writer)).startswith(b"HTTP/1.1 408 ")


async def test_oversized_request_is_refused(server: HealthServer) -> None:
    """A request head beyond the size limit gets 431 and the server keeps serving."""
    request = b"GET /healthz HTTP/1.1\r\nX-Pad: " + b"a" * 4096 + b"\r\n\r\n"
    assert (await _exchange(server.port, request))[0] == 431
    assert (await _get(server.port, "/healthz"))[0] == 200


async def test_client_closing_early_is_harmless(server: HealthServer) -> None:
    """A client that disconnects before sending a full request does not disturb the server."""
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /hea")
    writer.close()
    await writer.wait_closed()
    assert (await _get(server.port, "/healthz"))[0] == 200


async def test_stop_is_idempotent_and_drops_open_connections(
    metrics: Metrics, readiness: Readiness
) -> None:
    """Stopping closes idle connections and the listener; a second stop does nothing."""
    health = HealthServer(metrics.registry, readiness, host="127.0.0.1", port=0)
    with pytest.raises(RuntimeError):
        _ = health.port
    await health.start()
    port = health.port
    assert port > 0
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /healthz")  # a request that never completes
    await writer.drain()
    await health.stop()
    await health.stop()
    assert await _read_to_end(reader, writer) == b""
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
