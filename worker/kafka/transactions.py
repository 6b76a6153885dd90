"""What a Kafka transaction writes and how it ended, on either client: the messages, the
outcome, and the failure to start a transactional producer.

Each client's transactional producer (``aiokafka/transactions.py``: one per input
partition; ``rdkafka/transactions.py``: one per worker) speaks these; delivery's
``exactly_once`` modes stage messages and read outcomes in them.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import Fatal
from worker.flow.retry import Backoff
from worker.wire import Headers

__all__ = [
    "START_ATTEMPTS",
    "START_BACKOFF",
    "Message",
    "ProducerStartFailed",
    "TransactionOutcome",
]

#: Tries of starting a transactional producer before the worker gives up on it, on either
#: client: with the backoff, a broker out of reach for about a minute. Five tries (7.5 s)
#: were outlasted by a broker restart that began as a failed transaction's producer was
#: replaced (exit 3, chaos soak, exactly_once on aiokafka, seed 1222039730).
START_ATTEMPTS = 20
START_BACKOFF = Backoff(first_s=0.5, max_s=4.0)

#: (topic, value, key, headers) of one record a transaction writes.
Message = tuple[str, bytes | None, bytes | None, Headers]


class ProducerStartFailed(Fatal):
    """A partition's transactional producer cannot start: its outcomes could never be written."""


@dataclass(frozen=True, slots=True)
class TransactionOutcome:
    """How one transaction ended: committed, or which messages the broker refused for size."""

    committed: bool
    fenced: bool = False
    too_large: tuple[int, ...] = ()  # indexes into the messages sent
