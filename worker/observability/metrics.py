"""The worker's Prometheus metrics, declared once: exported names, types, labels and meanings.

Metrics live on a registry owned by a ``Metrics`` object rather than the global
one, so tests can build several; the metrics table of docs/observability.md is generated from here.
"""

from __future__ import annotations

import bisect
import contextlib
import importlib.metadata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from worker.errors import ERROR_CODES, RETRY_REASONS

MetricKind = Literal["counter", "gauge", "histogram"]

# Inference: a fast model answers in well under a millisecond, a slow one in seconds.
INFERENCE_BUCKETS_S = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
)  # fmt: skip
# End to end includes time spent in Kafka, which a backlog stretches to minutes.
END_TO_END_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# Responses of one decoupled request: none, one, a few tokens, a long generation.
STREAM_RESPONSES_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


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
#: partitions assigned, models Triton served, error codes, retry reasons, Triton endpoints.
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
    MetricSpec("oldest_in_flight_seconds", "worker_oldest_in_flight_seconds", "gauge",
               (), "Age of the oldest record holding a window slot (0 when none); "
               "/debug/inflight says where it is."),
    MetricSpec("consumer_lag", "worker_consumer_lag", "gauge",
               ("topic", "partition"), "Records between the committed offset and the end."),
    MetricSpec("partitions_assigned", "worker_partitions_assigned", "gauge",
               (), "Partitions currently assigned to this worker."),
    MetricSpec("paused_partitions", "worker_paused_partitions", "gauge",
               (), "Assigned partitions paused by back-pressure or a Triton outage."),
    MetricSpec("triton_up", "worker_triton_up", "gauge",
               (), "1 when a Triton endpoint answers as live (started, not exiting), else 0."),
    MetricSpec("breaker_open", "worker_breaker_open", "gauge",
               (), "1 while the Triton circuit breaker is open (no new work dispatched)."),
    MetricSpec("triton_endpoint_up", "worker_triton_endpoint_up", "gauge",
               ("endpoint",), "1 while a Triton endpoint is in rotation (last probe live, no "
               "request found it unreachable since), else 0."),
    MetricSpec("triton_endpoint_in_flight", "worker_triton_endpoint_in_flight", "gauge",
               ("endpoint",), "Requests sent to a Triton endpoint and not yet answered."),
    MetricSpec("triton_endpoint_requests_total", "worker_triton_endpoint_requests_total",
               "counter", ("endpoint", "outcome"), "Requests sent to a Triton endpoint, by "
               "outcome: ok, error (an answer that is an error), unavailable (sent again "
               "elsewhere, or an outage)."),
    MetricSpec("transactions_total", "worker_transactions_total", "counter",
               (), "Kafka transactions committed (exactly_once delivery)."),
    MetricSpec("records_skipped_total", "worker_records_skipped_total", "counter",
               (), "Records found done in the commit metadata when a partition was assigned "
               "(done before a crash or hand-over): skipped, not processed again."),
    MetricSpec("commit_metadata_overflows_total", "worker_commit_metadata_overflows_total",
               "counter", (), "Commits made without the done offsets beyond the commit point, "
               "because their encoding was too long."),
    MetricSpec("commit_metadata_ignored_total", "worker_commit_metadata_ignored_total",
               "counter", (), "Committed offsets found at assignment with metadata this worker "
               "did not write exactly (another format, bytes after its own, or runs past "
               "WORKER_MAX_UNCOMMITTED_PER_PARTITION): ignored, the records processed again."),
    MetricSpec("model_cache_evictions_total", "worker_model_cache_evictions_total", "counter",
               (), "Model lookups dropped from the worker's bounded caches (specs of models "
               "served, answers for unknown ones) to stay within their bound: records name "
               "more distinct models or versions than the caches hold."),
    MetricSpec("fast_path_records_total", "worker_fast_path_records_total", "counter",
               (), "Records answered by the batch-native fast path (decoded, inferred and "
               "published with the other records of their fetch, no task of their own)."),
    MetricSpec("fast_path_fallbacks_total", "worker_fast_path_fallbacks_total", "counter",
               ("reason",), "Fast-path records handed to the per-record path: reason "
               "inference (their micro-batch failed), encode, publish (their send failed), "
               "order (after such a record of their key or partition, WORKER_ORDERING=key or "
               "partition) or internal."),
    MetricSpec("internal_errors_total", "worker_internal_errors_total", "counter",
               (), "Records that met a bug in the worker (dead-lettered INTERNAL_ERROR)."),
    MetricSpec("dead_letter_values_omitted_total", "worker_dead_letter_values_omitted_total",
               "counter", (), "Dead letters written without their value (or key): the "
               "dead-letter topic refused them for their size."),
    MetricSpec("models_not_ready", "worker_models_not_ready", "gauge",
               (), "Models being (re)loaded in Triton whose records are held, not failed."),
    MetricSpec("model_breaker_open", "worker_model_breaker_open", "gauge",
               ("model",), "1 while the model's INFERENCE_ERROR rate breaker is open (its "
               "records held, one probe per interval)."),
    MetricSpec("model_breaker_transitions_total", "worker_model_breaker_transitions_total",
               "counter", ("model", "state"), "Openings and closings of a model's failure-rate "
               "breaker (state: open or closed)."),
    MetricSpec("worker_info", "worker_info", "gauge",
               ("version",), "Always 1; the label carries the worker version."),
    MetricSpec("inference_latency_seconds", "worker_inference_latency_seconds", "histogram",
               ("model",), "Time from sending a request to Triton to its response.",
               INFERENCE_BUCKETS_S),
    MetricSpec("stream_responses", "worker_stream_responses", "histogram",
               ("model",), "Responses with outputs per request of a decoupled model "
               "(complete streams).", STREAM_RESPONSES_BUCKETS),
    MetricSpec("stream_first_response_seconds", "worker_stream_first_response_seconds",
               "histogram", ("model",), "Decoupled models: time from sending a request to its "
               "first response.", INFERENCE_BUCKETS_S),
    MetricSpec("stream_response_gap_seconds", "worker_stream_response_gap_seconds",
               "histogram", ("model",), "Decoupled models: time between two responses of one "
               "request.", INFERENCE_BUCKETS_S),
    MetricSpec("end_to_end_latency_seconds", "worker_end_to_end_latency_seconds", "histogram",
               (), "Time from the record's timestamp to the broker's ack of its outcome.",
               END_TO_END_BUCKETS_S),
)  # fmt: skip

#: Distinct model label values kept before further models are counted as "other".
MAX_MODEL_LABELS = 64


def observe_times(histogram: Any, amount: float, count: int) -> None:
    """``count`` observations of ``amount`` in one update of the histogram's sum and one of
    its bucket (a group's latency, once for each of its records).

    prometheus_client has no call for several observations at once; this uses its child's
    parts (``_sum``, ``_upper_bounds``, ``_buckets``) and observes one at a time where a
    version of it lacks them.
    """
    if count <= 0:
        return
    bounds = getattr(histogram, "_upper_bounds", None)
    if bounds is None:
        for _ in range(count):
            histogram.observe(amount)
        return
    histogram._sum.inc(amount * count)
    histogram._buckets[bisect.bisect_left(bounds, amount)].inc(count)


def observe_all(histogram: Any, amounts: Sequence[float]) -> None:
    """Observe each of ``amounts``, one update of the sum and one per bucket they fall in."""
    bounds = getattr(histogram, "_upper_bounds", None)
    if bounds is None:
        for amount in amounts:
            histogram.observe(amount)
        return
    per_bucket: dict[int, int] = {}
    for amount in amounts:
        index = bisect.bisect_left(bounds, amount)
        per_bucket[index] = per_bucket.get(index, 0) + 1
    histogram._sum.inc(sum(amounts))
    buckets = histogram._buckets
    for index, count in per_bucket.items():
        buckets[index].inc(count)


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
    oldest_in_flight_seconds: Gauge
    consumer_lag: Gauge
    partitions_assigned: Gauge
    paused_partitions: Gauge
    triton_up: Gauge
    breaker_open: Gauge
    triton_endpoint_up: Gauge
    triton_endpoint_in_flight: Gauge
    triton_endpoint_requests_total: Counter
    transactions_total: Counter
    records_skipped_total: Counter
    commit_metadata_overflows_total: Counter
    commit_metadata_ignored_total: Counter
    model_cache_evictions_total: Counter
    fast_path_records_total: Counter
    fast_path_fallbacks_total: Counter
    internal_errors_total: Counter
    dead_letter_values_omitted_total: Counter
    models_not_ready: Gauge
    model_breaker_open: Gauge
    model_breaker_transitions_total: Counter
    worker_info: Gauge
    inference_latency_seconds: Histogram
    stream_responses: Histogram
    stream_first_response_seconds: Histogram
    stream_response_gap_seconds: Histogram
    end_to_end_latency_seconds: Histogram

    def __init__(self, *, version: str | None = None) -> None:
        self.registry = CollectorRegistry()
        for spec in METRICS_SPEC:
            setattr(self, spec.attr, self._create(spec))
        self.worker_info.labels(version=version or _package_version()).set(1)
        self._models: set[str] = set()
        # Every label value known in advance is exported from the start, at 0: the
        # dashboard and the alerts then have a series to show, and a rate() counts the
        # first retry or dead letter of a kind instead of starting from it.
        for reason in RETRY_REASONS:
            self.retries_total.labels(reason=reason)
        for code in ERROR_CODES:
            self.dead_letters_total.labels(code=code)

    def _create(self, spec: MetricSpec) -> Counter | Gauge | Histogram:
        kw: dict[str, Any] = {"labelnames": spec.labels, "registry": self.registry}
        if spec.kind == "counter":
            return Counter(spec.name, spec.help, **kw)
        if spec.kind == "gauge":
            return Gauge(spec.name, spec.help, **kw)
        return Histogram(spec.name, spec.help, buckets=spec.buckets, **kw)

    def model_label(self, model: str) -> str:
        """The ``model`` label value for ``model``, capped so its cardinality stays bounded."""
        if model in self._models:
            return model
        if len(self._models) < MAX_MODEL_LABELS:
            self._models.add(model)
            # A model is first seen with its breaker closed: 0, not absent.
            self.model_breaker_open.labels(model=model).set(0)
            return model
        return "other"

    def model_breaker_changed(self, model: str, is_open: bool) -> None:
        """A model's failure-rate breaker opened or closed: its gauge and transitions."""
        label = self.model_label(model)
        self.model_breaker_open.labels(model=label).set(1 if is_open else 0)
        state = "open" if is_open else "closed"
        self.model_breaker_transitions_total.labels(model=label, state=state).inc()

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
