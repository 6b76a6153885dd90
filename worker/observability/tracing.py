"""Trace context: W3C ``traceparent`` / ``tracestate`` carried through, and optional spans.

A record's trace context travels as it came: its headers are kept on the result,
the dead letter and a replay (see ``worker.wire.headers``), and a sampled context
is handed to Triton as gRPC metadata where the call can carry it (see
``TritonPool.infer``).

Spans are emitted only with the ``otel`` extra installed and tracing asked for the
standard way (``OTEL_TRACES_EXPORTER``, or an ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT``;
``OTEL_SDK_DISABLED=true`` wins). Each record then has one span tree, a child of
its incoming context: ``consume <topic>`` → ``infer <model>`` → ``publish <topic>``.
Otherwise ``Tracing`` is a no-op: nothing of OpenTelemetry is imported and a record
costs a header lookup.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping

import structlog

from worker.observability.trace_context import Tracing
from worker.settings import ConfigError, Settings

__all__ = ["Tracing", "build_tracing"]

log = structlog.get_logger(__name__)


def build_tracing(environ: Mapping[str, str], settings: Settings) -> Tracing:
    """Spans when ``environ`` asks for them the standard way and the ``otel`` extra is there.

    ConfigError (naming OTEL_TRACES_EXPORTER) when an exporter is named but the extra
    is missing; a warning, and no spans, when only an endpoint is set.
    """
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return Tracing()
    exporters = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if exporters == "none" or not (exporters or endpoint):
        return Tracing()
    if importlib.util.find_spec("opentelemetry.sdk") is None:
        if exporters:
            raise ConfigError(
                "OTEL_TRACES_EXPORTER",
                f"OTEL_TRACES_EXPORTER: {exporters!r} needs the otel extra "
                "(pip install 'kafka-triton-worker[otel]')",
            )
        log.warning("tracing_unavailable", reason="the otel extra is not installed")
        return Tracing()
    from worker.observability import _otel

    provider = _otel.provider_from_env(environ, exporters or "otlp")
    return _otel.OtelTracing(
        provider,
        output_topic=settings.topics.output_topic,
        dlq_topic=settings.topics.dlq_topic,
        group_id=settings.kafka.group_id,
        owned=True,
    )
