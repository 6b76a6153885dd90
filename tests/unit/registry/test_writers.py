"""Writers' schemas by id: one request per id, kept in a bounded cache, an unknown id
remembered, an outage waited out (the registry's breaker) and never a record's failure."""

from __future__ import annotations

import asyncio
import json

import pytest

from worker.errors import RegistryUnavailable, SchemaNotFound
from worker.flow.breaker import CircuitBreaker
from worker.flow.retry import Backoff, Budget
from worker.registry.client import RegisteredSchema, RegistryClient
from worker.registry.writers import WriterSchemas

pytestmark = pytest.mark.timeout(10)

SCHEMA = RegisteredSchema("AVRO", json.dumps({"type": "record", "name": "R", "fields": []}))


class FakeRegistry:
    """The client's seam: ids 1..99 exist; ``down`` makes every call unavailable;
    ``gate`` holds the answers until set."""

    def __init__(self) -> None:
        self.asked: list[int] = []
        self.down = False
        self.gate = asyncio.Event()
        self.gate.set()

    async def schema(self, schema_id: int) -> RegisteredSchema:
        self.asked.append(schema_id)
        await self.gate.wait()
        if self.down:
            raise RegistryUnavailable("registry unreachable: Connection refused")
        if schema_id >= 100:
            raise SchemaNotFound(f"schema id {schema_id}: no such schema")
        return SCHEMA

    async def schema_types(self) -> list[str]:
        if self.down:
            raise RegistryUnavailable("registry unreachable: Connection refused")
        return ["AVRO"]


def writers(fake: FakeRegistry, capacity: int = 10, threshold: int = 2) -> WriterSchemas:
    client: RegistryClient = fake  # type: ignore[assignment]
    return WriterSchemas(client, capacity, CircuitBreaker(threshold, name="registry"),
                         Backoff(0.001, 0.002))  # fmt: skip


async def test_records_of_one_id_share_one_request_and_the_schema_is_kept() -> None:
    """Ten waiters of id 1 cost one request; afterwards get() answers without one."""
    fake = FakeRegistry()
    fake.gate.clear()
    cache = writers(fake)
    waiting = asyncio.gather(*(cache.ensure(1) for _ in range(10)))
    await asyncio.sleep(0)
    fake.gate.set()
    await waiting
    assert fake.asked == [1]
    found = cache.get(1)
    assert found is not None and found.schema_id == 1


async def test_an_unknown_id_is_remembered_and_raised_for_each_record() -> None:
    """Id 404 is asked once; every get() raises SCHEMA_NOT_FOUND, a fresh error each time."""
    fake = FakeRegistry()
    cache = writers(fake)
    await cache.ensure_all([404, 404])
    await cache.ensure(404)
    assert fake.asked == [404]
    errors = []
    for _ in range(2):
        with pytest.raises(SchemaNotFound) as info:
            cache.get(404)
        errors.append(info.value)
    assert errors[0] is not errors[1] and errors[0].code == "SCHEMA_NOT_FOUND"


async def test_the_cache_keeps_the_most_recently_used_ids_up_to_its_size() -> None:
    """Capacity 2: a third id evicts the least recently used one, which is asked again."""
    fake = FakeRegistry()
    cache = writers(fake, capacity=2)
    await cache.ensure_all([1])
    await cache.ensure_all([2])
    assert cache.get(1) is not None  # 1 used: 2 is now the oldest
    await cache.ensure(3)
    assert cache.get(2) is None and cache.get(1) is not None
    await cache.ensure(2)
    assert fake.asked == [1, 2, 3, 2]


async def test_an_outage_opens_the_breaker_the_record_waits_and_its_deadline_pauses() -> None:
    """The registry down: failures open the breaker, the record waits (no error), a probe
    closes the breaker once it answers, the record goes on; its deadline moved on by the
    wait; each failure told as a retry."""
    fake = FakeRegistry()
    fake.down = True
    retried: list[str] = []
    cache = writers(fake, threshold=2)
    cache.on_retry = retried.append
    budget = Budget.lasting(60.0)
    deadline = budget.deadline
    record = asyncio.create_task(cache.ensure(5, budget))
    await asyncio.wait_for(cache.breaker.wait_open(), 5)
    assert not record.done()
    probing = asyncio.create_task(cache.probe_loop(0.001))
    fake.down = False
    await asyncio.wait_for(record, 5)
    probing.cancel()
    assert not cache.breaker.is_open and cache.get(5) is not None
    assert budget.deadline > deadline
    assert retried and set(retried) == {"REGISTRY_UNAVAILABLE"}


async def test_a_cancelled_fetch_lets_the_other_waiters_ask_again() -> None:
    """The waiter asking is cancelled mid-request: another waiter asks, and both ends are
    clean (no waiter hangs)."""
    fake = FakeRegistry()
    fake.gate.clear()
    cache = writers(fake)
    first = asyncio.create_task(cache.ensure(7))
    await asyncio.sleep(0)
    second = asyncio.create_task(cache.ensure(7))
    await asyncio.sleep(0)
    first.cancel()
    fake.gate.set()
    await asyncio.wait_for(second, 5)
    assert cache.get(7) is not None and fake.asked == [7, 7]
