"""The writers' schemas by id: fetched once, kept in a bounded cache shared by every topic,
waited for while the registry is out.

A record names its writer's schema by id. The first record of an id asks the registry;
every record waiting for the same id shares that one request. The parsed schema is kept
(least recently used out past ``WORKER_SCHEMA_REGISTRY_CACHE_SIZE``): a producer's ids
are few and stable, so after the first the registry is not asked again. An id the
registry does not have (or a schema this worker cannot read) is remembered for a minute,
so that a run of such records costs one request, not one each.

The registry unreachable, or answering 5xx, is not the records' fault: the request is
tried again with backoff, and past ``WORKER_BREAKER_FAILURE_THRESHOLD`` failures in a row
the registry's breaker opens; the records wait for it to close (a probe of the registry
closes it), their deadlines paused. They are never dead-lettered for it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Final

import structlog

from worker.errors import RegistryUnavailable, WorkerError
from worker.flow.breaker import CircuitBreaker
from worker.flow.retry import Backoff, Budget
from worker.registry.client import RegistryClient, RegistryRefused
from worker.registry.formats import WriterSchema, writer_schema

__all__ = ["WriterSchemas"]

log = structlog.get_logger(__name__)

#: How long an id the registry does not have (or a schema that cannot be read) is remembered.
UNKNOWN_FOR_S: Final = 60.0


class _Unknown:
    """What a record naming this id gets: the error, until ``until``."""

    __slots__ = ("error", "until")

    def __init__(self, error: WorkerError, until: float) -> None:
        self.error = error
        self.until = until

    def raise_again(self) -> None:
        raise type(self.error)(self.error.message)


class WriterSchemas:
    """Schemas by id, fetched once and kept; outages waited out."""

    def __init__(
        self,
        client: RegistryClient,
        capacity: int,
        breaker: CircuitBreaker,
        backoff: Backoff,
        on_retry: Callable[[str], None] = lambda _: None,
    ) -> None:
        """``on_retry(code)``: told of each failed request (REGISTRY_UNAVAILABLE)."""
        self._client = client
        self._capacity = capacity
        self.breaker = breaker
        self._backoff = backoff
        #: Told of each failed request, by its code (REGISTRY_UNAVAILABLE).
        self.on_retry = on_retry
        self._known: OrderedDict[int, WriterSchema | _Unknown] = OrderedDict()
        # One request per id at a time; keyed by the ids records name, so bounded by the
        # records in flight (the window).
        self._fetching: dict[int, asyncio.Future[None]] = {}
        self._failures = 0

    def get(self, schema_id: int) -> WriterSchema | None:
        """The id's schema if known; raises the record's error for an unknown id; None
        when it must be fetched first (``ensure``)."""
        entry = self._known.get(schema_id)
        if entry is None:
            return None
        if isinstance(entry, _Unknown):
            if entry.until < time.monotonic():
                del self._known[schema_id]
                return None
            entry.raise_again()
        self._known.move_to_end(schema_id)
        return entry  # type: ignore[return-value]

    def known(self, schema_id: int) -> bool:
        """True when ``get`` answers without a fetch (a schema, or a remembered error)."""
        entry = self._known.get(schema_id)
        return entry is not None and (
            not isinstance(entry, _Unknown) or entry.until >= time.monotonic()
        )

    async def ensure_all(self, schema_ids: Iterable[int]) -> None:
        """``ensure`` each id, all at once."""
        await asyncio.gather(*(self.ensure(schema_id) for schema_id in set(schema_ids)))

    async def ensure(self, schema_id: int, budget: Budget | None = None) -> None:
        """Return once ``get(schema_id)`` answers without a fetch; while the registry is
        out, wait (``budget``'s deadline paused for the wait)."""
        while not self.known(schema_id):
            pending = self._fetching.get(schema_id)
            if pending is not None:
                # Shielded: one waiter's cancellation is not the others'.
                await asyncio.shield(pending)
                continue
            try:
                await self._fetch(schema_id)
            except RegistryUnavailable as exc:
                waited = time.monotonic()
                await self._wait_out(exc)
                if budget is not None:
                    budget.pause(time.monotonic() - waited)

    async def _fetch(self, schema_id: int) -> None:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._fetching[schema_id] = done
        try:
            registered = await self._client.schema(schema_id)
            self._remember(schema_id, writer_schema(schema_id, registered))
        except RegistryUnavailable as exc:
            self._failed(exc)
            raise
        except WorkerError as error:  # no such id, or a schema this worker cannot read
            self._remember(schema_id, _Unknown(error, time.monotonic() + UNKNOWN_FOR_S))
            self._succeeded()
        else:
            self._succeeded()
        finally:
            # The waiters look again: the schema is known, or one of them asks again.
            del self._fetching[schema_id]
            done.set_result(None)

    def _remember(self, schema_id: int, entry: WriterSchema | _Unknown) -> None:
        self._known[schema_id] = entry
        self._known.move_to_end(schema_id)
        while len(self._known) > self._capacity:
            self._known.popitem(last=False)

    def _failed(self, exc: RegistryUnavailable) -> None:
        self._failures += 1
        self.on_retry(exc.code)
        # Logged once per run of failures, with the first one's reason; the breaker says
        # when it opens and closes.
        if self._failures == 1:
            event = (
                "registry_refused" if isinstance(exc, RegistryRefused) else "registry_unavailable"
            )
            log.warning(event, error=exc.message)
        self.breaker.record_failure()

    def _succeeded(self) -> None:
        self._failures = 0
        self.breaker.record_success()

    async def _wait_out(self, exc: RegistryUnavailable) -> None:
        """After a failed request: wait for the breaker to close when it is open, else
        for a backoff."""
        if self.breaker.is_open:
            await self.breaker.wait_closed()
            return
        await asyncio.sleep(self._backoff.delay_s(max(1, self._failures)))

    async def probe_loop(self, interval_s: float) -> None:
        """While the breaker is open, ask the registry every ``interval_s``; an answer
        closes it."""
        while True:
            await self.breaker.wait_open()
            try:
                await self._client.schema_types()
            except RegistryUnavailable:
                await asyncio.sleep(interval_s)
                continue
            self._succeeded()
            self.breaker.close()
