"""Writing a record until the broker has it: retries, acks in order, a replaced producer's acks."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import structlog
from aiokafka.errors import KafkaError, MessageSizeTooLargeError, ProducerClosed

from worker import errors
from worker.flow.retry import Backoff

__all__ = ["COLLATERAL_RETRIES", "Retirements", "settle_acks", "write_with_retries"]

log = structlog.get_logger(__name__)

_T = TypeVar("_T")

#: Waits between tries of a write that failed on a Kafka error (a broker restart, a leader move).
_WRITE_BACKOFF = Backoff(first_s=0.2, max_s=5.0)
#: A write sent again because another record's size refusal replaced its producer does not
#: spend a try (a burst of such records would otherwise exhaust the tries of their
#: neighbours, and the worker would stop); each such retry needs a refusal, and these are
#: bounded too.
COLLATERAL_RETRIES = 50


async def settle_acks(
    sent: Sequence[asyncio.Future[Any] | BaseException],
) -> list[BaseException | None]:
    """Each send's outcome, awaited in order: None once acknowledged, else its error (an
    error raised before sending stands for itself)."""
    outcomes: list[BaseException | None] = []
    for future in sent:
        if isinstance(future, BaseException):
            outcomes.append(future)
            continue
        try:
            await future
        except Exception as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)
    return outcomes


async def write_with_retries(
    write: Callable[[], Awaitable[_T]],
    *,
    what: str,
    attempts: int,
    failure: type[errors.WriteFailed],
    collateral: Callable[[KafkaError], bool] = lambda _exc: False,
) -> _T:
    """Call ``write``, retrying Kafka errors (a broker restart, a leader moving) with
    backoff; raise ``failure`` when every try failed. A size refusal is not retried:
    MessageSizeTooLargeError propagates at once. An error ``collateral`` says the write
    only shared (its producer replaced because of another record) is tried again at once
    without counting a try, at most COLLATERAL_RETRIES times."""
    attempt, redone = 1, 0
    while True:
        try:
            return await write()
        except MessageSizeTooLargeError:
            raise
        except KafkaError as exc:
            error = f"{type(exc).__name__}: {exc}"
            if collateral(exc) and redone < COLLATERAL_RETRIES:
                redone += 1
                continue
            log.warning("write_failed", what=what, attempt=attempt, error=error)
            if attempt == attempts:
                raise failure(f"{what} failed {attempt} times: {error}") from exc
            await asyncio.sleep(_WRITE_BACKOFF.delay_s(attempt))
            attempt += 1


class Retirements:
    """Which generations of a replaced producer have been stopped, and acks that end when
    theirs is.

    aiokafka's ``send_batch`` waits for the partition's pending batch to drain, then
    appends its batch without checking that the producer was closed meanwhile: a batch
    appended while ``stop()`` flushes is never sent and its future never resolves (seen in
    the chaos soak: results written alone after a size refusal waited for ever while their
    producer was being replaced). Once ``stop()`` has returned, whatever of that producer
    is still pending is such a batch.
    """

    def __init__(self) -> None:
        # Every generation below ``_below`` was stopped, and those in ``_early`` (stopped
        # before an older one was): a set that stays as small as the stops under way.
        self._below = 0
        self._early: set[int] = set()
        self._changed = asyncio.Event()

    def retire(self, generation: int) -> None:
        """The producer of ``generation`` has been stopped."""
        self._early.add(generation)
        while self._below in self._early:
            self._early.discard(self._below)
            self._below += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def retired(self, generation: int) -> bool:
        """True once the producer of ``generation`` has been stopped."""
        return generation < self._below or generation in self._early

    async def ack(self, generation: int, sent: Awaitable[_T]) -> _T:
        """The ack of a record sent by the producer of ``generation``; ProducerClosed (a
        Kafka error: the writer tries again) once that producer was stopped without it."""
        acked = asyncio.ensure_future(sent)
        while not acked.done() and not self.retired(generation):
            changed = asyncio.ensure_future(self._changed.wait())
            try:
                await asyncio.wait({acked, changed}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                changed.cancel()
        if not acked.done():
            acked.cancel()
            raise ProducerClosed()
        return acked.result()
