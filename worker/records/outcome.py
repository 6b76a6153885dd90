"""How a record ends, and how the batch path hands a record to the per-record path.

Both paths meet here: the batch path builds an ``Outcome`` for a result it could not
publish and hands it over with the record (``HandOver``); the per-record path
evaluates, delivers and books every other ``Outcome``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from worker import errors, wire
from worker.flow.ordering import Ticket
from worker.kafka.types import ConsumerRecord
from worker.observability.inflight import InFlight
from worker.records.stream import Streamed
from worker.wire import Source

__all__ = ["HandOver", "Handed", "Outcome"]


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


class Handed(NamedTuple):
    """A record the group path hands to the per-record path, with its slot, its in-flight
    entry and its place among its key's or partition's records (``publish_turn``, given
    back by the per-record path once it is safe)."""

    record: ConsumerRecord[bytes, bytes]
    generation: int
    #: Its encoded outcome when only its publishing is left to do; None: from the start.
    outcome: Outcome | None
    entry: InFlight
    publish_turn: Ticket | None = None


#: Hands a record to the per-record path.
HandOver = Callable[[Handed], None]
