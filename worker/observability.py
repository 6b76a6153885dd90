"""What the worker tells the outside: structured logs, Prometheus metrics, HTTP probes.

Logs: structlog configured once; every record, ours or a library's, leaves through
one handler as a JSON line (or console text), with the contextvars bound by the
caller (topic, partition, offset, request id). Metrics live on a registry owned by
a `Metrics` object rather than the global one, so tests can build several.
`HealthServer` serves ``/metrics``, ``/healthz`` and ``/readyz`` with asyncio alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TextIO

import orjson
import prometheus_client
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# -- logging -------------------------------------------------------------------------

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

#: Libraries whose own stdlib logging is kept at WARNING whatever the worker's level.
THIRD_PARTY_LOGGERS = ("aiokafka", "kafka", "tritonclient", "grpc", "asyncio", "urllib3")


class _WorkerLogHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The one handler `configure_logging` installs; its type lets a reset find it."""


def _orjson_dumps(obj: Any, **kwargs: Any) -> str:
    return orjson.dumps(obj, default=kwargs.get("default"), option=orjson.OPT_NON_STR_KEYS).decode()


def configure_logging(log_format: str, level: str, *, stream: TextIO | None = None) -> None:
    """Route structlog and stdlib logging to ``stream`` (stderr) as JSON lines or console text.

    Calling it again replaces the previous configuration.
    """
    if log_format not in ("json", "console"):
        raise ValueError(f"log_format must be json or console, got {log_format!r}")
    if level not in _LEVELS:
        raise ValueError(f"level must be one of {', '.join(_LEVELS)}, got {level!r}")
    reset_logging()
    shared: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    target = stream if stream is not None else sys.stderr
    renderer: list[structlog.typing.Processor]
    if log_format == "json":
        # Tracebacks become one escaped string, so an error stays one line.
        renderer = [
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(serializer=_orjson_dumps),
        ]
    else:
        renderer = [structlog.dev.ConsoleRenderer(colors=target.isatty())]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        # Not cached: module-level loggers must follow a reconfiguration (tests do it);
        # the hot path does not log, so the lookup cost does not matter.
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *renderer],
    )
    handler = _WorkerLogHandler(target)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.addHandler(handler)
    root.setLevel(_LEVELS[level])
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(max(_LEVELS[level], logging.WARNING))


def reset_logging() -> None:
    """Undo `configure_logging`: structlog defaults, our handler removed, levels unset."""
    structlog.reset_defaults()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _WorkerLogHandler)]:
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.WARNING)
    for name in THIRD_PARTY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)


# -- metrics -------------------------------------------------------------------------

MetricKind = Literal["counter", "gauge", "histogram"]

# Inference: a fast model answers in well under a millisecond, a slow one in seconds.
INFERENCE_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
)  # fmt: skip
# End to end includes time spent in Kafka, which a backlog stretches to minutes.
END_TO_END_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: its exported name, type, labels and meaning."""

    attr: str  # attribute of `Metrics` holding it
    name: str
    kind: MetricKind
    labels: tuple[str, ...]
    help: str
    buckets: tuple[float, ...] = ()


#: Every metric the worker exports. Labels take values from bounded sets only:
#: partitions assigned, models Triton served, error codes, retry reasons.
METRICS_SPEC: tuple[MetricSpec, ...] = (
    MetricSpec("records_consumed_total", "worker_records_consumed_total", "counter",
               ("topic", "partition"), "Records fetched from the input topics."),
    MetricSpec("results_published_total", "worker_results_published_total", "counter",
               ("model",), "Results acknowledged by the broker on the output topic."),
    MetricSpec("dead_letters_total", "worker_dead_letters_total", "counter",
               ("code",), "Records acknowledged on the dead-letter topic, by error code."),
    MetricSpec("retries_total", "worker_retries_total", "counter",
               ("reason",), "Retries of an inference or a publish, by reason."),
    MetricSpec("commits_total", "worker_commits_total", "counter",
               (), "Offset commits that succeeded."),
    MetricSpec("commit_failures_total", "worker_commit_failures_total", "counter",
               (), "Offset commits that failed."),
    MetricSpec("in_flight", "worker_in_flight", "gauge",
               (), "Records holding a window slot: sent, waiting or retrying."),
    MetricSpec("window_limit", "worker_window_limit", "gauge",
               (), "Current limit of records in flight."),
    MetricSpec("consumer_lag", "worker_consumer_lag", "gauge",
               ("topic", "partition"), "Records between the committed offset and the end."),
    MetricSpec("partitions_assigned", "worker_partitions_assigned", "gauge",
               (), "Partitions currently assigned to this worker."),
    MetricSpec("paused_partitions", "worker_paused_partitions", "gauge",
               (), "Assigned partitions paused by back-pressure or a Triton outage."),
    MetricSpec("triton_up", "worker_triton_up", "gauge",
               (), "1 when Triton answers as live (started, not exiting), else 0."),
    MetricSpec("breaker_open", "worker_breaker_open", "gauge",
               (), "1 while the Triton circuit breaker is open (no new work dispatched)."),
    MetricSpec("transactions_total", "worker_transactions_total", "counter",
               (), "Kafka transactions committed (exactly_once delivery)."),
    MetricSpec("internal_errors_total", "worker_internal_errors_total", "counter",
               (), "Records that met a bug in the worker (dead-lettered INTERNAL_ERROR)."),
    MetricSpec("dead_letter_values_omitted_total", "worker_dead_letter_values_omitted_total",
               "counter", (), "Dead letters written without their value (or key): the "
               "dead-letter topic refused them for their size."),
    MetricSpec("models_not_ready", "worker_models_not_ready", "gauge",
               (), "Models being (re)loaded in Triton whose records are held, not failed."),
    MetricSpec("worker_info", "worker_info", "gauge",
               ("version",), "Always 1; the label carries the worker version."),
    MetricSpec("inference_latency_seconds", "worker_inference_latency_seconds", "histogram",
               ("model",), "Time from sending a request to Triton to its response.",
               INFERENCE_BUCKETS_S),
    MetricSpec("end_to_end_latency_seconds", "worker_end_to_end_latency_seconds", "histogram",
               (), "Time from the record's timestamp to the broker's ack of its outcome.",
               END_TO_END_BUCKETS_S),
)  # fmt: skip

#: Distinct model label values kept before further models are counted as "other".
MAX_MODEL_LABELS = 64


def _package_version() -> str:
    try:
        return importlib.metadata.version("kafka-triton-worker")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class Metrics:
    """The worker's Prometheus metrics on a registry of their own."""

    records_consumed_total: Counter
    results_published_total: Counter
    dead_letters_total: Counter
    retries_total: Counter
    commits_total: Counter
    commit_failures_total: Counter
    in_flight: Gauge
    window_limit: Gauge
    consumer_lag: Gauge
    partitions_assigned: Gauge
    paused_partitions: Gauge
    triton_up: Gauge
    breaker_open: Gauge
    transactions_total: Counter
    internal_errors_total: Counter
    dead_letter_values_omitted_total: Counter
    models_not_ready: Gauge
    worker_info: Gauge
    inference_latency_seconds: Histogram
    end_to_end_latency_seconds: Histogram

    def __init__(self, *, version: str | None = None) -> None:
        self.registry = CollectorRegistry()
        for spec in METRICS_SPEC:
            setattr(self, spec.attr, self._create(spec))
        self.worker_info.labels(version=version or _package_version()).set(1)
        self._models: set[str] = set()

    def _create(self, spec: MetricSpec) -> Counter | Gauge | Histogram:
        kw: dict[str, Any] = {"labelnames": spec.labels, "registry": self.registry}
        if spec.kind == "counter":
            return Counter(spec.name, spec.help, **kw)
        if spec.kind == "gauge":
            return Gauge(spec.name, spec.help, **kw)
        return Histogram(spec.name, spec.help, buckets=spec.buckets, **kw)

    def model_label(self, model: str) -> str:
        """The ``model`` label value for ``model``, capped so its cardinality stays bounded."""
        if model in self._models or len(self._models) < MAX_MODEL_LABELS:
            self._models.add(model)
            return model
        return "other"

    def forget_partition(self, topic: str, partition: int) -> None:
        """Drop per-partition gauges of a revoked partition so no stale lag is exported."""
        with contextlib.suppress(KeyError):
            self.consumer_lag.remove(topic, str(partition))

    def render(self) -> bytes:
        """The exposition text of every metric, as served on ``/metrics``."""
        return prometheus_client.generate_latest(self.registry)


def metrics_reference_markdown() -> str:
    """The metrics as a Markdown table (name | type | labels | meaning)."""
    lines = ["| name | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for spec in METRICS_SPEC:
        labels = ", ".join(f"`{label}`" for label in spec.labels) or "-"
        lines.append(f"| `{spec.name}` | {spec.kind} | {labels} | {spec.help} |")
    return "\n".join(lines) + "\n"


# -- HTTP endpoints ------------------------------------------------------------------

#: Answers whether the worker is ready, and what is (not) ready, e.g. {"triton": "down"}.
ReadinessCheck = Callable[[], tuple[bool, Mapping[str, object]]]

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class HealthServer:
    """``GET /metrics``, ``/healthz`` and ``/readyz`` over HTTP/1.1, one request per connection.

    Each connection gets ``read_timeout_s`` and ``max_request_bytes`` for its request
    head, so a slow or hostile client costs one small task and is then dropped.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        readiness: ReadinessCheck,
        *,
        host: str = "0.0.0.0",
        port: int,
        read_timeout_s: float = 5.0,
        max_request_bytes: int = 8192,
    ) -> None:
        self._registry = registry
        self._readiness = readiness
        self._host = host
        self._requested_port = port
        self._read_timeout_s = read_timeout_s
        self._max_request_bytes = max_request_bytes
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._log = structlog.get_logger(__name__)

    @property
    def port(self) -> int:
        """The port listened on (the ephemeral one chosen when started with port 0)."""
        if self._server is None:
            raise RuntimeError("HealthServer is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Listen; returns once the socket is bound."""
        if self._server is not None:
            return
        self._server = await asyncio.start_server(
            self._serve, self._host, self._requested_port, limit=self._max_request_bytes
        )

    async def stop(self) -> None:
        """Stop listening and drop open connections; safe to call more than once."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        # Aborting a transport ends its handler's read with EOF. Cancelling the handler
        # task instead would make asyncio report it as an unhandled error.
        for writer in self._connections.values():
            writer.transport.abort()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._server is None or task is None:  # accepted just before stop()
            writer.transport.abort()
            return
        self._connections[task] = writer
        try:
            status, content_type, body, head_only = await self._respond(reader)
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode("latin-1")
            writer.write(head if head_only else head + body)
            async with asyncio.timeout(self._read_timeout_s):
                await writer.drain()
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away or stalled; nothing to tell it
        except Exception:
            self._log.exception("health_request_failed")
        finally:
            await self._close(writer)
            del self._connections[task]

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        # A client that stops reading must not keep the connection (and its task) alive.
        writer.close()
        try:
            async with asyncio.timeout(self._read_timeout_s):
                await writer.wait_closed()
        except (ConnectionError, TimeoutError):
            writer.transport.abort()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes, bool]:
        text = "text/plain; charset=utf-8"
        try:
            async with asyncio.timeout(self._read_timeout_s):
                request_head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            return 408, text, b"request timeout\n", False
        except asyncio.LimitOverrunError:
            return 431, text, b"request too large\n", False
        parts = request_head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return 400, text, b"bad request\n", False
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            return 405, text, b"method not allowed\n", False
        head_only = method == b"HEAD"
        if target == b"/healthz":
            return 200, text, b"ok", head_only
        if target == b"/readyz":
            return (*self._ready(), head_only)
        if target == b"/metrics":
            try:
                metrics = prometheus_client.generate_latest(self._registry)
            except Exception:
                self._log.exception("metrics_render_failed")
                return 500, text, b"metrics unavailable\n", head_only
            return 200, prometheus_client.CONTENT_TYPE_LATEST, metrics, head_only
        return 404, text, b"not found\n", head_only

    def _ready(self) -> tuple[int, str, bytes]:
        try:
            ready, detail = self._readiness()
        except Exception as exc:
            self._log.exception("readiness_check_failed")
            ready, detail = False, {"error": f"readiness check failed: {type(exc).__name__}"}
        body = orjson.dumps({"ready": ready, "detail": dict(detail)}, default=str) + b"\n"
        return (200 if ready else 503), "application/json", body
