"""Bounded memory of model lookups: what Triton said of each model name and version.

Model names and versions come from records, so a producer decides how many distinct
ones the worker meets: a million unknown names must not cost a million entries. A
``BoundedCache`` keeps at most ``capacity`` entries, the least recently used dropped
first (each drop counted), each expiring after ``ttl_s`` when given. ``KeyedLocks``
lets concurrent lookups of one key take turns, keeping a lock only while it is used.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar, cast

__all__ = ["MAX_CACHED_MODELS", "BoundedCache", "KeyedLocks"]

#: Model lookups remembered per cache: specs of models served, answers for unknown ones.
#: Far more than a Triton serves; a producer naming more only makes lookups repeat.
MAX_CACHED_MODELS = 1024

_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")


class BoundedCache(Generic[_K, _V]):
    """At most ``capacity`` entries, least recently used dropped first; optionally expiring."""

    def __init__(
        self,
        capacity: int,
        *,
        ttl_s: float | None = None,
        on_evict: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_evict`` is called for each entry dropped to stay within ``capacity``."""
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._ttl_s = ttl_s
        self._on_evict = on_evict
        self._clock = clock
        self._entries: OrderedDict[_K, tuple[float, _V]] = OrderedDict()

    def get(self, key: _K) -> _V | None:
        """The value of ``key`` (now the most recently used), or None if absent or expired."""
        found = self._entries.get(key)
        if found is None:
            return None
        if found[0] <= self._clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return found[1]

    def put(self, key: _K, value: _V) -> None:
        """Keep ``value`` under ``key``; the least recently used entry goes when full."""
        expires_at = float("inf") if self._ttl_s is None else self._clock() + self._ttl_s
        entries = self._entries
        entries[key] = (expires_at, value)
        entries.move_to_end(key)
        while len(entries) > self.capacity:
            _, (oldest_expires_at, _) = entries.popitem(last=False)
            if self._on_evict is not None and oldest_expires_at > self._clock():
                self._on_evict()  # a live entry lost, not an expired one

    def pop(self, key: _K) -> None:
        """Forget ``key`` (nothing happens when it is absent)."""
        self._entries.pop(key, None)

    def discard_where(self, condition: Callable[[_K], bool]) -> None:
        """Forget every key for which ``condition`` holds."""
        for key in [key for key in self._entries if condition(key)]:
            del self._entries[key]

    def __contains__(self, key: object) -> bool:
        found = self._entries.get(cast(_K, key))
        return found is not None and found[0] > self._clock()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[_K]:
        return iter(list(self._entries))


class KeyedLocks(Generic[_K]):
    """A lock per key, kept only while some task holds or waits for it.

    Concurrent lookups of one model take turns (the first asks Triton, the others
    find its answer cached); a map of a lock per key ever asked would grow without end.
    """

    def __init__(self) -> None:
        self._locks: dict[_K, _Shared] = {}

    def hold(self, key: _K) -> _Held[_K]:
        """``async with locks.hold(key):`` runs alone among the holders of ``key``."""
        return _Held(self, key)

    def __len__(self) -> int:
        return len(self._locks)


class _Shared:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class _Held(Generic[_K]):
    __slots__ = ("_key", "_owner", "_shared")

    def __init__(self, owner: KeyedLocks[_K], key: _K) -> None:
        self._owner, self._key = owner, key
        locks = owner._locks
        shared = locks.get(key)
        if shared is None:
            shared = locks[key] = _Shared()
        shared.users += 1  # counted from now: a waiter cancelled before entering still leaves
        self._shared = shared

    async def __aenter__(self) -> None:
        try:
            await self._shared.lock.acquire()
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *_: object) -> None:
        self._shared.lock.release()
        self._leave()

    def _leave(self) -> None:
        shared = self._shared
        shared.users -= 1
        if shared.users == 0 and self._owner._locks.get(self._key) is shared:
            del self._owner._locks[self._key]
