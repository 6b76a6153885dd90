"""Turn-taking for ordered modes: tickets taken in offset order, honoured in that order.

``WORKER_ORDERING=key`` processes records of the same key one at a time, in offset
order; ``partition`` publishes each partition's outcomes in offset order while
inference runs concurrently. Both are a chain of futures per ordering key: a
ticket is taken synchronously at dispatch (so in offset order), and its holder
waits for the previous ticket of the same key before its turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Iterable


class Ticket:
    """One place in the queue of its key."""

    __slots__ = ("_key", "_mine", "_owner", "_previous")

    def __init__(
        self,
        owner: Turns,
        key: Hashable,
        previous: asyncio.Future[None] | None,
        mine: asyncio.Future[None],
    ) -> None:
        self._owner = owner
        self._key = key
        self._previous = previous
        self._mine = mine

    async def wait(self) -> None:
        """Return when every earlier ticket of the same key is done."""
        previous = self._pending()
        if previous is not None:
            await asyncio.shield(previous)

    def _pending(self) -> asyncio.Future[None] | None:
        """The previous ticket's future while it is not done; None once it is (or none)."""
        previous = self._previous
        return previous if previous is not None and not previous.done() else None

    def done(self) -> None:
        """Hand the turn to the next ticket. Idempotent; call it even on failure.

        A holder may give up its turn without having waited for it (a record that
        turned out not to need ordering): the next ticket still waits for every
        earlier one, so the turn passes on only once the previous ticket is done.
        """
        previous = self._previous
        if previous is None or previous.done():
            self._finish()
        else:
            previous.add_done_callback(lambda _: self._finish())

    def then(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once every earlier ticket of the same key is done (at once when
        they are): a turn handed on through several holders is given back after the last."""
        previous = self._previous
        if previous is None or previous.done():
            callback()
        else:
            previous.add_done_callback(lambda _: callback())

    def _finish(self) -> None:
        if not self._mine.done():
            self._mine.set_result(None)
        self._owner._release(self._key, self._mine)


class Turns:
    """The tail of each key's chain of tickets."""

    def __init__(self) -> None:
        self._tails: dict[Hashable, asyncio.Future[None]] = {}

    def ticket(self, key: Hashable) -> Ticket:
        """Take the next place for ``key`` (synchronously, so in dispatch order)."""
        mine: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        previous = self._tails.get(key)
        self._tails[key] = mine
        return Ticket(self, key, previous, mine)

    def _release(self, key: Hashable, mine: asyncio.Future[None]) -> None:
        # Forget the key once its last ticket is done, so the map stays small.
        if self._tails.get(key) is mine:
            del self._tails[key]

    def __len__(self) -> int:
        return len(self._tails)


async def wait_all(tickets: Iterable[Ticket]) -> None:
    """Return when every earlier ticket of each of ``tickets``' keys is done: a group's
    turns waited for together (one wait for those not come yet, none when all have)."""
    pending = {previous for ticket in tickets if (previous := ticket._pending()) is not None}
    if pending:
        # Cancelled, the wait leaves the earlier tickets' futures alone (as shield does).
        await asyncio.wait(pending)
