"""Bounded memory of model lookups: LRU with expiry, a lock per key in use, flat under many names.

The Triton client is a fake at the ``ServerPool`` seam (``_client``): a real Triton
answers "unknown model" just the same, but a unit test must not need one, and the
fake counts the calls that reach it.
"""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
from typing import Any

import pytest
from tritonclient.grpc import InferenceServerException

from worker import errors
from worker.observability.metrics import Metrics
from worker.triton.cache import MAX_CACHED_MODELS, BoundedCache, KeyedLocks
from worker.triton.pool import TritonPool

pytestmark = pytest.mark.timeout(60)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_least_recently_used_entry_goes_first_and_is_counted() -> None:
    """Three entries, room for two: the one not read lately is dropped, one eviction told."""
    evicted: list[int] = []
    cache: BoundedCache[str, int] = BoundedCache(2, on_evict=lambda: evicted.append(1))
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # "b" is now the least recently used
    cache.put("c", 3)
    assert list(cache) == ["a", "c"] and "b" not in cache and cache.get("b") is None
    assert len(evicted) == 1 and len(cache) == 2


def test_entries_expire_and_an_expired_one_dropped_is_not_an_eviction() -> None:
    """With a TTL an entry is gone once it expires; making room past an expired one costs none."""
    clock, evicted = Clock(), []
    cache: BoundedCache[str, int] = BoundedCache(
        1, ttl_s=5.0, on_evict=lambda: evicted.append(1), clock=clock
    )
    cache.put("a", 1)
    clock.now += 4.9
    assert cache.get("a") == 1 and "a" in cache
    clock.now += 0.2
    assert "a" not in cache
    cache.put("b", 2)  # pushes the expired "a" out: nothing was lost
    assert evicted == []
    assert cache.get("b") == 2
    clock.now += 10
    assert cache.get("b") is None and len(cache) == 0


def test_keys_can_be_dropped_by_condition() -> None:
    """discard_where forgets every matching key, pop one; absent keys are no error."""
    cache: BoundedCache[tuple[str, str], int] = BoundedCache(10)
    for key in [("m", ""), ("m", "1"), ("n", "")]:
        cache.put(key, 0)
    cache.discard_where(lambda key: key[0] == "m")
    cache.pop(("x", ""))
    assert list(cache) == [("n", "")]
    with pytest.raises(ValueError, match="capacity"):
        BoundedCache(0)


async def test_holders_of_a_key_take_turns_and_no_lock_outlives_them() -> None:
    """Three holders of one key run one at a time; one cancelled while waiting leaves none."""
    locks: KeyedLocks[str] = KeyedLocks()
    inside: list[str] = []
    holding: set[str] = set()
    gate = asyncio.Event()
    asking = {name: asyncio.Event() for name in "abc"}

    async def hold(name: str) -> None:
        asking[name].set()  # nothing awaits between this and waiting for the key
        async with locks.hold("k"):
            assert not holding, f"{name} entered while {holding} held the key"
            holding.add(name)
            inside.append(name)
            await gate.wait()
            holding.discard(name)

    first = asyncio.create_task(hold("a"))
    waiting = [asyncio.create_task(hold(n)) for n in "bc"]
    for event in asking.values():
        await event.wait()
    assert inside == ["a"] and len(locks) == 1
    waiting[0].cancel()
    gate.set()
    await asyncio.gather(first, waiting[1])
    with pytest.raises(asyncio.CancelledError):
        await waiting[0]
    assert inside == ["a", "c"] and len(locks) == 0
    async with locks.hold("other"):
        assert len(locks) == 1
    assert len(locks) == 0


class UnknownModels:
    """A Triton client that knows no model at all, and counts the lookups reaching it."""

    def __init__(self) -> None:
        self.lookups = 0

    async def get_model_metadata(self, name: str, version: str, **_: Any) -> Any:
        self.lookups += 1
        raise InferenceServerException(
            f"Request for unknown model: '{name}' is not found", status="StatusCode.NOT_FOUND"
        )

    async def close(self) -> None:
        """Nothing to close."""


async def _unknown(pool: TritonPool, names: range) -> None:
    for i in names:
        with pytest.raises(errors.ModelNotFound):
            await pool.model_spec(f"no-such-model-{i}", "")


async def test_many_distinct_unknown_models_keep_memory_flat() -> None:
    """6,000 more unknown names after 2,000: every one MODEL_NOT_FOUND, allocations flat."""
    metrics = Metrics()
    pool = TritonPool("10.0.0.1:1,10.0.0.2:1", 1, metrics=metrics)
    await pool.endpoints.refresh()  # the endpoints, without streams: lookups only
    clients = [UnknownModels(), UnknownModels()]
    for endpoint, client in zip(pool.endpoints, clients, strict=True):
        endpoint.pool._client = client
    tracemalloc.start()
    try:
        await _unknown(pool, range(2_000))  # the caches fill up
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        await _unknown(pool, range(2_000, 8_000))
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        await pool.close()
    assert growth < 256 * 1024, f"{growth} bytes kept for 6,000 unknown models"
    assert [c.lookups for c in clients] == [8_000, 8_000]
    evictions = metrics.registry.get_sample_value("worker_model_cache_evictions_total")
    assert evictions is not None and evictions >= 2 * (8_000 - MAX_CACHED_MODELS)


async def test_an_unknown_model_asked_again_soon_is_answered_from_memory() -> None:
    """The same unknown name twice within the negative TTL: one lookup, a fresh error each time."""
    pool = TritonPool("10.0.0.1:1", 1)
    await pool.endpoints.refresh()
    (endpoint,) = pool.endpoints
    client = UnknownModels()
    endpoint.pool._client = client
    try:
        caught = []
        for _ in range(2):
            with pytest.raises(errors.ModelNotFound) as error:
                await pool.model_spec("nope", "")
            caught.append(error.value)
    finally:
        await pool.close()
    assert client.lookups == 1
    assert caught[0] is not caught[1] and caught[0].message == caught[1].message
