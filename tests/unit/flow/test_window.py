"""In-flight window: global and per-key limits, fairness, cancellation, drains."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Hashable

import pytest

from worker.flow.window import DiscardedError, Window

pytestmark = pytest.mark.timeout(10)


async def start_waiter(window: Window, key: Hashable) -> asyncio.Task[None]:
    """Start a task blocked in ``acquire(key)``; returns once it is suspended there."""
    entered = asyncio.Event()

    async def waiter() -> None:
        entered.set()
        # acquire runs up to its first suspension in this same step, so by the
        # time the caller sees ``entered``, the task is queued as a waiter.
        await window.acquire(key)

    task = asyncio.create_task(waiter())
    await entered.wait()
    assert not task.done()
    return task


async def run_holders(window: Window, keys: list[str]) -> tuple[int, dict[str, int]]:
    """Run one task per key that holds a slot until told to release; returns the maxima.

    Each holder reports its release event through a queue after acquiring; the
    test then lets holders go one at a time, so the window is as full as it can be.
    """
    held: Counter[str] = Counter()
    max_total = 0
    max_per_key: Counter[str] = Counter()
    handoff: asyncio.Queue[asyncio.Event] = asyncio.Queue()

    async def holder(key: str) -> None:
        nonlocal max_total
        await window.acquire(key)
        held[key] += 1
        max_total = max(max_total, held.total())
        max_per_key[key] = max(max_per_key[key], held[key])
        go = asyncio.Event()
        await handoff.put(go)
        await go.wait()
        held[key] -= 1
        window.release(key)

    async with asyncio.TaskGroup() as group:
        for key in keys:
            group.create_task(holder(key))
        for _ in keys:
            go = await handoff.get()
            assert window.in_flight <= window.limit
            go.set()
    return max_total, dict(max_per_key)


async def test_never_more_than_limit_in_flight() -> None:
    """Fifty tasks over a limit of five: at most five hold a slot, and five do at once."""
    window = Window(limit=5, per_partition_limit=100)
    max_total, _ = await run_holders(window, [f"p{i % 7}" for i in range(50)])
    assert max_total == 5
    assert window.in_flight == 0
    assert window.waiting == 0


async def test_per_partition_limit_holds_under_concurrency() -> None:
    """Per-key limit two, global four: no key exceeds two, the total never exceeds four."""
    window = Window(limit=4, per_partition_limit=2)
    keys = ["a"] * 20 + ["b"] * 20 + ["c"] * 5
    max_total, max_per_key = await run_holders(window, keys)
    assert max_total == 4
    assert max_per_key == {"a": 2, "b": 2, "c": 2}
    assert window.in_flight == 0


async def test_full_for_reflects_key_and_global_limits() -> None:
    """A key is full at its own limit, and every key is full at the global limit."""
    window = Window(limit=3, per_partition_limit=2)
    assert window.try_acquire("a") and window.try_acquire("a")
    assert window.full_for("a") is True
    assert window.full_for("b") is False
    assert window.try_acquire("a") is False
    assert window.try_acquire("b") is True
    assert (window.full_for("b"), window.full_for("c")) == (True, True)
    assert window.try_acquire("c") is False
    window.release("a")
    assert (window.full_for("a"), window.full_for("c")) == (False, False)
    assert (window.in_flight, window.in_flight_for("a"), window.in_flight_for("b")) == (2, 1, 1)


async def test_waiters_of_one_key_are_served_in_order() -> None:
    """Waiters of the same key get slots first in, first out."""
    window = Window(limit=10, per_partition_limit=1)
    await window.acquire("a")
    waiters = [await start_waiter(window, "a") for _ in range(3)]
    assert window.waiting == 3
    for n, task in enumerate(waiters):
        window.release("a")
        await task
        assert [w.done() for w in waiters] == [i <= n for i in range(3)]
        assert window.in_flight_for("a") == 1
    assert window.waiting == 0


async def test_keys_take_turns_for_freed_global_slots() -> None:
    """With the window globally full, freed slots alternate between waiting keys."""
    window = Window(limit=1, per_partition_limit=5)
    await window.acquire("x")
    a1, a2 = await start_waiter(window, "a"), await start_waiter(window, "a")
    b1 = await start_waiter(window, "b")
    window.release("x")
    await a1
    window.release("a")
    await b1
    assert not a2.done()
    window.release("b")
    await a2
    assert window.in_flight_for("a") == 1


async def test_cancelled_waiter_leaks_no_slot() -> None:
    """Cancelling a blocked acquire leaves no slot taken and no waiter queued."""
    window = Window(limit=1, per_partition_limit=1)
    await window.acquire("a")
    task = await start_waiter(window, "a")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert window.waiting == 0
    window.release("a")
    assert window.in_flight == 0
    assert window.try_acquire("a") is True


async def test_cancel_after_grant_gives_the_slot_back() -> None:
    """A waiter cancelled after its slot was granted but before it resumed releases it."""
    window = Window(limit=1, per_partition_limit=1)
    await window.acquire("a")
    task = await start_waiter(window, "a")
    window.release("a")
    assert window.in_flight_for("a") == 1  # handed to the waiter already
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert window.in_flight == 0
    assert window.try_acquire("b") is True


async def test_cancelled_waiter_passes_its_turn_on() -> None:
    """When the first waiter is cancelled, the next one gets the freed slot."""
    window = Window(limit=1, per_partition_limit=1)
    await window.acquire("a")
    first = await start_waiter(window, "a")
    second = await start_waiter(window, "a")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    window.release("a")
    await second
    assert window.in_flight_for("a") == 1


async def test_lowering_the_limit_keeps_held_slots() -> None:
    """Lowering the limit revokes nothing; new slots wait until below the new limit."""
    window = Window(limit=4, per_partition_limit=4)
    for key in "abcd":
        assert window.try_acquire(key)
    window.limit = 2
    assert window.in_flight == 4
    assert window.full_for("e") is True
    window.release("a")
    window.release("b")
    assert window.try_acquire("e") is False
    window.release("c")
    assert window.try_acquire("e") is True
    assert window.in_flight == 2


async def test_raising_the_limit_wakes_waiters() -> None:
    """Raising the limit grants slots to tasks already waiting."""
    window = Window(limit=1, per_partition_limit=5)
    await window.acquire("a")
    waiters = [await start_waiter(window, key) for key in ("a", "b")]
    window.limit = 3
    await asyncio.gather(*waiters)
    assert (window.in_flight_for("a"), window.in_flight_for("b")) == (2, 1)


async def test_invalid_limits_are_rejected() -> None:
    """Limits below one are refused at construction and at run time."""
    with pytest.raises(ValueError, match="per_partition_limit"):
        Window(limit=1, per_partition_limit=0)
    window = Window(limit=1, per_partition_limit=1)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        window.limit = 0
    assert window.limit == 1


async def test_release_without_slot_is_loud() -> None:
    """Releasing a key that holds no slot raises ValueError and changes nothing."""
    window = Window(limit=2, per_partition_limit=2)
    window.try_acquire("a")
    with pytest.raises(ValueError, match="holds no slot"):
        window.release("b")
    assert window.in_flight == 1


async def test_wait_empty_per_key_and_global() -> None:
    """wait_empty(key) returns when that key is drained, wait_empty() when all are."""
    window = Window(limit=4, per_partition_limit=4)
    window.try_acquire("a")
    window.try_acquire("b")
    empty_a = asyncio.create_task(window.wait_empty("a"))
    empty_all = asyncio.create_task(window.wait_empty())
    window.release("a")
    await empty_a
    assert not empty_all.done()
    window.release("b")
    await empty_all
    assert window.in_flight == 0
    await window.wait_empty()  # already empty: returns at once


async def test_wait_for_room_returns_when_a_slot_frees() -> None:
    """wait_for_room waits while the window is full and returns once a slot is free."""
    window = Window(limit=2, per_partition_limit=1)
    window.try_acquire("a")
    window.try_acquire("b")
    room = asyncio.create_task(window.wait_for_room())
    room_for_a = asyncio.create_task(window.wait_for_room("a"))
    window.release("b")
    await room
    assert window.in_flight < window.limit
    assert not room_for_a.done()
    window.release("a")
    await room_for_a
    assert window.full_for("a") is False


async def test_wait_for_room_yields_to_waiters() -> None:
    """A slot freed for a waiting acquire is not room: wait_for_room keeps waiting."""
    window = Window(limit=1, per_partition_limit=1)
    window.try_acquire("a")
    acquirer = await start_waiter(window, "b")
    room = asyncio.create_task(window.wait_for_room())
    window.release("a")
    await acquirer
    assert not room.done()
    window.release("b")
    await room


async def test_discard_fails_waiters_and_keeps_held_slots() -> None:
    """discard(key) fails that key's waiters; held slots stay until released."""
    window = Window(limit=2, per_partition_limit=1)
    await window.acquire("a")
    a_waiter = await start_waiter(window, "a")
    window.discard("a")
    with pytest.raises(DiscardedError) as caught:
        await a_waiter
    assert caught.value.key == "a"
    assert window.in_flight_for("a") == 1
    assert window.waiting == 0
    window.release("a")
    assert window.in_flight == 0
    await window.acquire("a")  # the key is usable again after discard
    assert window.in_flight_for("a") == 1


async def test_discard_cancel_race_leaks_nothing() -> None:
    """A waiter both discarded and cancelled ends cancelled, holding no slot."""
    window = Window(limit=1, per_partition_limit=1)
    await window.acquire("a")
    task = await start_waiter(window, "a")
    window.discard("a")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    window.release("a")
    assert (window.in_flight, window.waiting) == (0, 0)


async def test_release_many_frees_slots_at_once_and_wakes_waiters() -> None:
    """Three slots of a key given back together: two waiters served, more than held is loud."""
    window = Window(3, 3)
    for _ in range(3):
        assert window.try_acquire("a")
    waiters = [asyncio.create_task(window.acquire("b")) for _ in range(2)]
    await asyncio.sleep(0)  # let them queue
    window.release_many("a", 3)
    await asyncio.wait_for(asyncio.gather(*waiters), 1)
    assert window.in_flight == 2 and window.in_flight_for("a") == 0
    with pytest.raises(ValueError):
        window.release_many("b", 3)
