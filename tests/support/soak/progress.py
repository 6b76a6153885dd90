"""Is every partition making progress? The group's committed offsets against the partitions' ends.

A partition with acknowledged records beyond its committed offset has requests waiting
on it; its committed offset must then move at least every ``bound_s``, except while a
planned fault makes that impossible (the broker or both Tritons down, a model unloaded,
no worker in the group) and for a settling time after it, which the soak declares
fault by fault (``excuse`` and ``resume``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass

from aiokafka.admin import AIOKafkaAdminClient

from tests.support.soak.lanes import Inputs


@dataclass(frozen=True, slots=True)
class Stall:
    """A partition whose committed offset stood still while records waited on it."""

    partition: int
    seconds: float
    committed: int
    end: int
    at: float  # when it was seen (monotonic)

    def describe(self, bound_s: float) -> str:
        return (
            f"partition {self.partition}: committed offset {self.committed} has not moved for "
            f"{self.seconds:.1f} s (bound {bound_s:.1f} s) with records up to {self.end} waiting"
        )


class Progress:
    """Each partition's committed offset and when it last moved; the worst stall seen."""

    def __init__(self, partitions: int, bound_s: float, now: float) -> None:
        self.bound_s = bound_s
        self.committed = [0] * partitions
        self.worst: Stall | None = None
        self._moved_at = [now] * partitions
        self._excuses: set[str] = set()
        self._counting_from = now

    @property
    def worst_stall_s(self) -> float:
        return self.worst.seconds if self.worst is not None else 0.0

    def excuse(self, reason: str) -> None:
        """``reason`` (a fault) makes progress impossible from now until ``resume(reason)``."""
        self._excuses.add(reason)

    def resume(self, reason: str, now: float, settle_s: float = 0.0) -> None:
        """``reason`` is over: once no other excuse holds, stalls count again, from
        ``settle_s`` after ``now`` at the earliest."""
        self._excuses.discard(reason)
        self._counting_from = max(self._counting_from, now + settle_s)

    def observe(
        self, now: float, committed: Mapping[int, int], ends: Mapping[int, int]
    ) -> Stall | None:
        """One reading of the committed offsets (empty when the broker did not answer);
        returns a stall over the bound, if there is one."""
        over = None
        for p, before in enumerate(self.committed):
            after = max(before, committed.get(p, before))
            self.committed[p] = after
            end = ends.get(p, 0)
            if after > before or after >= end:  # moved, or nothing waits on it
                self._moved_at[p] = now
            if self._excuses:
                continue
            since = max(self._moved_at[p], self._counting_from)
            stall = Stall(p, now - since, after, end, now)
            if stall.seconds > self.worst_stall_s:
                self.worst = stall
            if stall.seconds > self.bound_s and over is None:
                over = stall
        return over


class OffsetReader:
    """The group's committed offsets of the soak's inputs, each read bounded in time
    (aiokafka's admin client: librdkafka's aborted this process on an assertion when a
    request with a timeout met a broker restart)."""

    def __init__(self, bootstrap: str, group: str, inputs: Inputs, timeout_s: float = 2.0) -> None:
        self._bootstrap, self._group, self._inputs = bootstrap, group, inputs
        self._timeout_s = timeout_s
        self._admin: AIOKafkaAdminClient | None = None

    async def read(self) -> dict[int, int]:
        """Input number → committed offset; empty when the broker does not answer in time."""
        # Bounded by the client's own request timeout, not by cancelling it: a start or a
        # request cancelled midway leaves a connection open.
        try:
            if self._admin is None:
                self._admin = AIOKafkaAdminClient(
                    bootstrap_servers=self._bootstrap,
                    request_timeout_ms=int(self._timeout_s * 1000),
                )
                await self._admin.start()
            found = await self._admin.list_consumer_group_offsets(self._group)
        except Exception:  # the broker is out of reach: nothing moved, as far as we know
            await self.close()
            return {}
        inputs = self._inputs
        return {
            inputs.number(tp.topic, tp.partition): meta.offset
            for tp, meta in found.items()
            if (tp.topic, tp.partition) in inputs.partitions
        }

    async def read_answered(self, tries: int = 10) -> dict[int, int]:
        """The committed offsets, from a read the broker answered (``tries`` at most)."""
        for _ in range(tries):
            if found := await self.read():
                return found
        raise AssertionError(f"the committed offsets of {self._group} could not be read")

    async def close(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            with contextlib.suppress(Exception):
                await admin.close()
