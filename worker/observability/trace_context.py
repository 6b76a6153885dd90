"""A record's W3C trace context, and the no-op ``Tracing`` (no spans) the worker uses by default.

``Tracing`` here records nothing and imports nothing of OpenTelemetry: a record
costs a header lookup. ``worker.observability.tracing`` chooses it or the spans of
the ``otel`` extra (``worker.observability._otel``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, NamedTuple

from worker.wire.headers import TRACEPARENT, TRACESTATE, Headers, header_value

__all__ = ["GroupSpan", "TraceMetadata", "Tracing", "record_context", "sampled"]

#: gRPC metadata of a record's trace context: ``(("traceparent", ...), ("tracestate", ...))``.
TraceMetadata = tuple[tuple[str, str], ...]

#: ``00-<32 hex trace id>-<16 hex parent id>-<2 hex flags>``
_TRACEPARENT_CHARS: Final = 55


class GroupSpan(NamedTuple):
    """A record answered by the group path, for its spans: the record (its trace context),
    its model and version, and when (``time.monotonic()``) it was taken, sent to Triton,
    answered and published."""

    record: Any
    model_name: str
    model_version: str
    taken: float
    sent: float
    answered: float
    published: float


def record_context(headers: Headers) -> TraceMetadata:
    """The record's W3C trace context as gRPC metadata; () if it has none or it is malformed."""
    raw = header_value(headers, TRACEPARENT)
    if raw is None:
        return ()
    parent = _ascii(raw)
    if parent is None or len(parent) != _TRACEPARENT_CHARS or parent[2] != "-":
        return ()
    state = header_value(headers, TRACESTATE)
    text = _ascii(state) if state is not None else None
    return ((TRACEPARENT, parent), (TRACESTATE, text)) if text else ((TRACEPARENT, parent),)


def sampled(context: TraceMetadata) -> bool:
    """True when the traceparent's flags say its caller records the trace."""
    return bool(context) and int(context[0][1][-2:], 16) & 1 == 1


def _ascii(raw: bytes) -> str | None:
    # gRPC metadata values must be printable ASCII; a context that is not is dropped.
    try:
        text = bytes(raw).decode("ascii").strip()
    except UnicodeDecodeError:
        return None
    return text if text.isprintable() else None


class _NoSpan:
    """The span of the no-op path: one instance, nothing recorded."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_NO_SPAN: Final = _NoSpan()


class Tracing:
    """No spans: the record's own context goes to Triton as it came (sampled only)."""

    enabled = False

    def consume(self, record: Any) -> Any:
        """The record's root span (``consume <topic>``), a child of its incoming context."""
        return _NO_SPAN

    def infer(self, model_name: str, model_version: str) -> Any:
        """The span of the record's inference, every try included."""
        return _NO_SPAN

    def publish(self, outcome: Any) -> Any:
        """The span of publishing the record's outcome (result or dead letter)."""
        return _NO_SPAN

    def group_spans(self, answered: Sequence[GroupSpan]) -> None:
        """The span trees of records answered together (the group path), after the fact:
        each record's ``consume`` → ``infer`` → ``publish``, at the times of its group."""

    def to_triton(self, headers: Headers) -> TraceMetadata:
        """The trace context to hand to Triton for this record: () when not sampled."""
        context = record_context(headers)
        return context if sampled(context) else ()

    def shutdown(self) -> None:
        """Flush and stop what this object started (nothing here)."""
