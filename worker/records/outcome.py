"""How a record ends, and how the batch path hands a record to the per-record path.

Both paths meet here: the batch path builds an ``Outcome`` for a result it could not
publish and hands it over with the record (``HandOver``); the per-record path
evaluates, delivers and books every other ``Outcome``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from worker import errors, wire
from worker.kafka.types import ConsumerRecord
from worker.observability.inflight import InFlight
from worker.records.stream import Streamed
from worker.wire import Source

__all__ = ["HandOver", "Outcome"]


@dataclass(slots=True)
class Outcome:
    """How a record ends: a result value with its headers, or an error for a dead letter."""

    record: ConsumerRecord[bytes, bytes]
    source: Source
    started: float
    request: wire.DecodedRequest | None = None
    value: bytes | None = None
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)
    error: errors.WorkerError | None = None
    served_version: str | None = None
    streamed: Streamed | None = None  # a decoupled model's results (or live stream)


#: Hands a record (its slot and in-flight entry with it) to the per-record path; with its
#: encoded outcome when only its publishing is left to do.
HandOver = Callable[[ConsumerRecord[bytes, bytes], int, Outcome | None, InFlight], None]
