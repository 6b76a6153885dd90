"""Ordering turns: tickets taken in dispatch order are honoured in that order, per key."""

from __future__ import annotations

import asyncio

import pytest

from worker.flow.ordering import Turns, wait_all

pytestmark = pytest.mark.timeout(10)


async def test_turns_of_one_key_run_in_ticket_order_whatever_finishes_first() -> None:
    """Three tickets of one key: each waits for the one before, even if it is ready sooner."""
    turns = Turns()
    tickets = [turns.ticket("k") for _ in range(3)]
    order: list[int] = []

    async def holder(index: int, ready: asyncio.Event) -> None:
        await ready.wait()
        await tickets[index].wait()
        order.append(index)
        tickets[index].done()

    events = [asyncio.Event() for _ in range(3)]
    tasks = [asyncio.create_task(holder(i, events[i])) for i in range(3)]
    for event in reversed(events):  # the last ticket is ready first
        event.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert len(turns) == 0  # the key is forgotten once its last ticket is done


async def test_other_keys_do_not_wait() -> None:
    """A ticket of another key goes at once while the first key's turn is held."""
    turns = Turns()
    held = turns.ticket("a")
    blocked = turns.ticket("a")
    free = turns.ticket("b")
    await asyncio.wait_for(free.wait(), 1)
    waiting = asyncio.create_task(blocked.wait())
    await asyncio.sleep(0)  # one turn of the loop: the waiter has run up to its await
    assert not waiting.done()
    held.done()
    await asyncio.wait_for(waiting, 1)


async def test_a_failed_holder_still_hands_the_turn_on() -> None:
    """done() is idempotent and called on failure too: the next ticket is never stuck."""
    turns = Turns()
    first, second = turns.ticket("k"), turns.ticket("k")
    first.done()
    first.done()
    await asyncio.wait_for(second.wait(), 1)
    second.done()
    assert len(turns) == 0


async def test_a_ticket_given_up_unwaited_still_holds_the_next_back() -> None:
    """B passes (its record needs no turn) while A holds: C still waits for A, not for B."""
    turns = Turns()
    a, b, c = turns.ticket("k"), turns.ticket("k"), turns.ticket("k")
    await asyncio.wait_for(a.wait(), 1)
    b.done()  # given up without waiting: the turn passes on only once A's is done
    waiting = asyncio.create_task(c.wait())
    await asyncio.sleep(0)  # one turn of the loop: the waiter has run up to its await
    assert not waiting.done()
    a.done()
    await asyncio.wait_for(waiting, 1)
    c.done()
    assert len(turns) == 0


async def test_a_groups_turns_are_waited_for_together_and_a_cancelled_wait_holds_nothing() -> None:
    """wait_all: returns at once when every key's turn has come, else once the last earlier
    ticket is done; cancelled, it leaves the earlier tickets as they were."""
    turns = Turns()
    earlier_a, earlier_b = turns.ticket("a"), turns.ticket("b")
    group = [turns.ticket("a"), turns.ticket("b"), turns.ticket("c")]
    waiting = asyncio.create_task(wait_all(group))
    await asyncio.sleep(0)
    earlier_a.done()
    await asyncio.sleep(0)
    assert not waiting.done()  # key b's earlier ticket is still held
    earlier_b.done()
    await asyncio.wait_for(waiting, 1)
    await asyncio.wait_for(wait_all(group), 1)  # all come: at once
    later = turns.ticket("a")
    cancelled = asyncio.create_task(wait_all([later]))
    await asyncio.sleep(0)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    group[0].done()  # the cancelled wait left key a's chain intact
    await asyncio.wait_for(later.wait(), 1)
