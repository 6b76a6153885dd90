"""In-flight limits: a global slot count and a per-key (per-partition) slot count.

A record holds one slot from dispatch until its output is acknowledged, retries
included. The intake acquires a slot before dispatching and uses ``full_for``
to decide which partitions to pause; the global limit may be changed at run
time by an adaptive limiter.

Invariants, true whenever no method of the window is running:

- ``in_flight == sum(count per key)``; a key with no slot has no count entry;
- every key's count <= per_partition_limit, and in_flight <= limit unless the
  limit was lowered while slots were held (held slots are never revoked) or ``take``
  went over it;
- no live waiter could be granted: for every key with a waiter, the key is
  full or the window is globally full. ``_grant`` restores this after every
  change that frees room, so a waiter never waits while a slot is free.

Waiters of one key are served first in, first out; keys take turns for freed
global slots, so one busy partition cannot starve the others.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable

__all__ = ["DiscardedError", "Window"]


class DiscardedError(Exception):
    """Raised in ``acquire`` callers whose key was discarded (partition revoked)."""

    def __init__(self, key: Hashable) -> None:
        """Name the discarded key in the message."""
        super().__init__(f"waiting for a slot of {key!r} abandoned: key discarded")
        self.key = key


class Window:
    """Global and per-key in-flight slots, with fair waiting and no polling."""

    def __init__(self, limit: int, per_partition_limit: int) -> None:
        """Allow ``limit`` slots in total and ``per_partition_limit`` per key."""
        _check_limit("limit", limit)
        _check_limit("per_partition_limit", per_partition_limit)
        self._limit = limit
        self._per_partition_limit = per_partition_limit
        self._in_flight = 0
        self._counts: dict[Hashable, int] = {}
        # Keys with waiters, in turn order; futures done before being granted
        # (cancelled, discarded) may linger briefly and are skipped.
        self._waiters: OrderedDict[Hashable, deque[asyncio.Future[None]]] = OrderedDict()
        # Futures of wait_for_room / wait_empty callers, woken on any release.
        self._watchers: set[asyncio.Future[None]] = set()

    @property
    def limit(self) -> int:
        """The global slot limit."""
        return self._limit

    @limit.setter
    def limit(self, value: int) -> None:
        # Lowering never revokes held slots: new acquisitions wait until below.
        _check_limit("limit", value)
        self._limit = value
        self._grant()
        self._notify_watchers()

    @property
    def per_partition_limit(self) -> int:
        """The slot limit of each key."""
        return self._per_partition_limit

    @property
    def in_flight(self) -> int:
        """Slots held in total."""
        return self._in_flight

    def in_flight_for(self, key: Hashable) -> int:
        """Slots held by ``key``."""
        return self._counts.get(key, 0)

    @property
    def waiting(self) -> int:
        """Callers blocked in ``acquire`` (for metrics and tests; O(waiters))."""
        return sum(not fut.done() for queue in self._waiters.values() for fut in queue)

    def full_for(self, key: Hashable) -> bool:
        """True when ``key`` cannot get a slot now: its own limit or the global one is reached."""
        return (
            self._counts.get(key, 0) >= self._per_partition_limit or self._in_flight >= self._limit
        )

    def try_acquire(self, key: Hashable) -> bool:
        """Take a slot for ``key`` if one is free now; never jumps ahead of waiters."""
        # By the invariant, a key with live waiters is full (itself or globally),
        # so a key that is not full has nobody waiting to be overtaken.
        if self.full_for(key):
            return False
        self._take(key)
        return True

    def take(self, key: Hashable) -> None:
        """Take a slot for ``key`` now, over the limits if need be: for a record whose slot
        went back before its outcome turned out to need more work (a result its transaction
        refused, under exactly_once), which must not wait behind the records its partition's
        commit is holding back."""
        self._take(key)

    async def acquire(self, key: Hashable) -> None:
        """Wait for a slot for ``key`` and take it.

        Cancel-safe: if the caller is cancelled, it holds no slot afterwards,
        even when the slot was granted just before the cancellation landed.
        Raises DiscardedError if ``discard(key)`` is called while waiting.
        """
        if self.try_acquire(key):
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        # No room for ``key``: queue up; _grant serves us when room frees.
        self._waiters.setdefault(key, deque()).append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Granted, but the caller will never learn it: give it back.
                self.release(key)
            else:
                fut.cancel()
                self._forget(key, fut)
            raise

    def release(self, key: Hashable) -> None:
        """Give back a slot of ``key``; ValueError if ``key`` holds none."""
        count = self._counts.get(key, 0)
        if count <= 0:
            raise ValueError(f"release of {key!r} which holds no slot")
        if count == 1:
            del self._counts[key]
        else:
            self._counts[key] = count - 1
        self._in_flight -= 1
        self._grant()
        self._notify_watchers()

    def release_many(self, key: Hashable, count: int) -> None:
        """Give back ``count`` slots of ``key`` at once (waiters served once, not per slot)."""
        held = self._counts.get(key, 0)
        if count <= 0 or held < count:
            raise ValueError(f"release of {count} slots of {key!r} which holds {held}")
        if held == count:
            del self._counts[key]
        else:
            self._counts[key] = held - count
        self._in_flight -= count
        self._grant()
        self._notify_watchers()

    def discard(self, key: Hashable) -> None:
        """Fail every waiter of ``key`` with DiscardedError (the key was revoked).

        Slots ``key`` already holds stay counted until their holders release them.
        """
        queue = self._waiters.pop(key, None)
        if queue is None:
            return
        error = DiscardedError(key)
        for fut in queue:
            if not fut.done():
                fut.set_exception(error)

    async def wait_for_room(self, key: Hashable | None = None) -> None:
        """Return once a slot is free globally (and for ``key``, if given)."""
        if key is None:
            await self._wait_until(lambda: self._in_flight < self._limit)
        else:
            await self._wait_until(lambda: not self.full_for(key))

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate`` holds; it is checked again after every release.

        For conditions that only a finished record can make true (room for some
        partition, a commit point that moved).
        """
        await self._wait_until(predicate)

    async def wait_empty(self, key: Hashable | None = None) -> None:
        """Return once nothing is in flight (for ``key``, if given): the drain."""
        if key is None:
            await self._wait_until(lambda: self._in_flight == 0)
        else:
            await self._wait_until(lambda: key not in self._counts)

    def _take(self, key: Hashable) -> None:
        self._counts[key] = self._counts.get(key, 0) + 1
        self._in_flight += 1

    def _live_head(self, key: Hashable) -> asyncio.Future[None] | None:
        """The first waiter of ``key`` still waiting; drops done ones in front of it."""
        queue = self._waiters.get(key)
        if queue is None:
            return None
        while queue and queue[0].done():
            queue.popleft()
        if not queue:
            del self._waiters[key]
            return None
        return queue[0]

    def _grant(self) -> None:
        """Hand free slots to waiters, one per key per round, until none can be served."""
        progress = True
        while progress and self._in_flight < self._limit and self._waiters:
            progress = False
            for key in list(self._waiters):
                if self._in_flight >= self._limit:
                    break
                head = self._live_head(key)
                if head is None or self._counts.get(key, 0) >= self._per_partition_limit:
                    continue
                self._waiters[key].popleft()
                self._take(key)
                head.set_result(None)
                progress = True
                # Served keys go to the back: the others get the next free slot.
                if self._waiters[key]:
                    self._waiters.move_to_end(key)
                else:
                    del self._waiters[key]

    def _forget(self, key: Hashable, fut: asyncio.Future[None]) -> None:
        queue = self._waiters.get(key)
        if queue is None:
            return
        try:
            queue.remove(fut)
        except ValueError:
            return
        if not queue:
            del self._waiters[key]

    def _notify_watchers(self) -> None:
        watchers, self._watchers = self._watchers, set()
        for fut in watchers:
            if not fut.done():
                fut.set_result(None)

    async def _wait_until(self, predicate: Callable[[], bool]) -> None:
        # Both predicates only become true when room is freed, so waking on
        # release and limit changes is enough; each wake re-checks.
        loop = asyncio.get_running_loop()
        while not predicate():
            fut: asyncio.Future[None] = loop.create_future()
            self._watchers.add(fut)
            try:
                await fut
            finally:
                self._watchers.discard(fut)


def _check_limit(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
