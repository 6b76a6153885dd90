"""The dispatcher: a path per record, the batch path's records as one task, turns in order.

The two paths are recording fakes (what the dispatcher asks of them: ``select``,
``run``), so each test sees which path each record took and with which turns; the
last test runs the real paths to follow a record the batch path hands over. The
delivery mode is the fake of ``fakes`` over a real offset tracker, the window real.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord

from tests.unit.records.fakes import TP, AckedDelivery, Clock, good_record, settings, single_path
from tests.unit.records.fakes import FakeTriton as FakeTritonBase
from tests.unit.records.test_batch import SPEC as BATCH_SPEC
from tests.unit.records.test_batch import Harness
from tests.unit.records.test_batch import record as batch_record
from worker import errors
from worker.delivery import build_delivery
from worker.flow.window import Window
from worker.kafka.aiokafka.transactions import PerPartitionTransactions
from worker.kafka.types import TopicPartition
from worker.observability.trace_context import Tracing
from worker.records.batch import Group
from worker.records.dispatch import Dispatcher, build_dispatcher
from worker.settings import Settings
from worker.wire.validation import ModelSpec

pytestmark = pytest.mark.timeout(10)


class FakeSingle:
    """The per-record path: records each run (offset, key turn?, partition turn?, handed
    over?); a run waits for ``release`` when it is cleared (``waiting`` counts them)."""

    def __init__(self) -> None:
        self.runs: list[tuple[int, bool, bool, bool]] = []
        self.order: list[int] = []  # offsets, as their turns come
        self.release = asyncio.Event()
        self.release.set()
        self.waiting = 0
        self.changed = asyncio.Event()

    async def run(
        self,
        record: ConsumerRecord[bytes, bytes],
        ticket: int,
        key_turn: Any,
        publish_turn: Any,
        evaluated: Any = None,
        entry: Any = None,
    ) -> None:
        self.runs.append(
            (record.offset, key_turn is not None, publish_turn is not None, entry is not None)
        )
        self.waiting += 1
        self.changed.set()
        await self.release.wait()
        for turn in (key_turn, publish_turn):
            if turn is not None:
                await turn.wait()
        self.order.append(record.offset)
        for turn in (key_turn, publish_turn):
            if turn is not None:
                turn.done()


@dataclass
class FakeCandidate:
    """What the dispatcher reads and writes of a candidate."""

    record: ConsumerRecord[bytes, bytes]
    unit: Hashable | None = None

    @property
    def tp(self) -> TopicPartition:
        return TopicPartition(self.record.topic, self.record.partition)


class FakeBatch:
    """The group path: takes the records whose offset is in ``takes``; records each group
    (its offsets, and the ordering units it holds a turn of), and gives its turns back as
    it runs."""

    def __init__(self, takes: set[int]) -> None:
        self.takes = takes
        self.open = True
        self.groups: list[list[int]] = []
        self.units: list[list[Any]] = []
        self.order: list[int] = []  # offsets, as the groups' turns come

    def select(self, record: ConsumerRecord[bytes, bytes], generation: int) -> Any:
        return FakeCandidate(record) if record.offset in self.takes else None

    async def run(self, group: Group, hand_over: Any) -> None:
        candidates: Sequence[Any] = group.candidates
        self.groups.append([c.record.offset for c in candidates])
        self.units.append(list(group.turns))
        assert all(c.unit in group.turns for c in candidates if c.unit is not None)
        for turn in group.turns.values():
            await turn.wait()
        self.order += [c.record.offset for c in candidates]
        for turn in group.turns.values():
            turn.done()


class SkippingDelivery(AckedDelivery):
    """A delivery mode whose commit metadata says the offsets in ``done`` were done."""

    def __init__(self, done: set[int]) -> None:
        super().__init__()
        self.done = done

    def settle_if_done(self, rec: ConsumerRecord[bytes, bytes], ticket: int) -> bool:
        return rec.offset in self.done


def dispatcher(
    s: Settings | None = None,
    *,
    batch: FakeBatch | None = None,
    delivery: AckedDelivery | None = None,
) -> tuple[Dispatcher, FakeSingle, Window]:
    s = s or settings()
    single, window = FakeSingle(), Window(64, 64)
    built = Dispatcher(
        delivery=delivery or AckedDelivery(),  # type: ignore[arg-type]  # a fake of its seam
        window=window,
        single=single,  # type: ignore[arg-type]
        batch=batch,  # type: ignore[arg-type]
        ordering=s.delivery.ordering,
        sequence_from_key=s.delivery.sequence_from_key,
    )
    return built, single, window


def records(*offsets: int, key: bytes | None = b"k") -> list[ConsumerRecord[bytes, bytes]]:
    return [good_record(o, key) for o in offsets]


def acquired(window: Window, count: int) -> None:
    for _ in range(count):
        assert window.try_acquire(TP)


async def test_plain_records_go_as_one_group_the_others_one_task_each() -> None:
    """Records 1 and 3 qualify: one batch task for both; 0 and 2 get a task each."""
    batch = FakeBatch(takes={1, 3})
    d, single, window = dispatcher(batch=batch)
    acquired(window, 4)
    async with asyncio.TaskGroup() as group:
        d.run(group)(records(0, 1, 2, 3))
        assert len(d.running) == 3
    assert batch.groups == [[1, 3]]
    assert [run[0] for run in single.runs] == [0, 2]
    assert d.running == set()


async def test_records_done_before_are_skipped_and_their_slots_given_back() -> None:
    """The commit metadata lists offset 1: no task for it, its slot freed at once."""
    d, single, window = dispatcher(delivery=SkippingDelivery({1}))
    acquired(window, 3)
    async with asyncio.TaskGroup() as group:
        d.run(group)(records(0, 1, 2))
        assert window.in_flight == 2
    assert [run[0] for run in single.runs] == [0, 2]


async def test_while_the_breaker_is_open_every_record_takes_the_per_record_path() -> None:
    """The batch path closed (an outage): its records wait on the per-record path."""
    batch = FakeBatch(takes={0, 1})
    batch.open = False
    d, single, window = dispatcher(batch=batch)
    acquired(window, 2)
    async with asyncio.TaskGroup() as group:
        d.run(group)(records(0, 1))
    assert batch.groups == [] and [run[0] for run in single.runs] == [0, 1]


@pytest.mark.parametrize(
    ("env", "key", "turns"),
    [
        pytest.param({}, b"k", (False, False), id="unordered"),
        pytest.param({"ordering": "key"}, b"k", (True, False), id="key"),
        pytest.param({"ordering": "key"}, None, (False, False), id="key-without-a-key"),
        pytest.param({"ordering": "partition"}, b"k", (False, True), id="partition"),
        pytest.param({"sequence_from_key": "true"}, b"k", (True, False), id="sequences"),
    ],
)
async def test_each_record_takes_the_turns_its_ordering_asks_for(
    env: dict[str, str], key: bytes | None, turns: tuple[bool, bool]
) -> None:
    """A key turn under ordering=key (or sequences by key), a partition turn under
    ordering=partition, none otherwise; a record without a key never has a key turn."""
    d, single, window = dispatcher(settings(**env))
    acquired(window, 1)
    async with asyncio.TaskGroup() as group:
        d.run(group)(records(0, key=key))
    assert [run[1:3] for run in single.runs] == [turns]


async def test_a_forced_stop_cancels_every_records_task() -> None:
    """cancel_all: the records' tasks, waiting on their path, end cancelled (not done)."""
    d, single, window = dispatcher()
    single.release.clear()
    acquired(window, 2)
    async with asyncio.TaskGroup() as group:
        d.run(group)(records(0, 1))
        tasks = set(d.running)
        while single.waiting < 2:
            single.changed.clear()
            await single.changed.wait()
        d.cancel_all()
    assert len(tasks) == 2 and all(task.cancelled() for task in tasks)
    assert d.running == set()


def test_dispatching_before_the_worker_runs_is_a_bug() -> None:
    """No task group yet: dispatch_many refuses instead of losing the records."""
    d, _, window = dispatcher()
    acquired(window, 1)
    with pytest.raises(RuntimeError, match="before the worker runs"):
        d.dispatch_many(records(0))


async def test_ordering_key_makes_one_group_with_a_turn_per_key() -> None:
    """Keys a, a, b, a, a, a (offset 4 per-record): 0-3 in one group holding one turn of
    key a and one of key b; 4 takes key a's next turn on its own, so 5 goes in a group
    after it. Key a's records are answered in offset order, the per-record one among them."""
    batch = FakeBatch(takes={0, 1, 2, 3, 5})
    d, single, window = dispatcher(settings(ordering="key"), batch=batch)
    keyed = [good_record(o, k) for o, k in enumerate([b"a", b"a", b"b", b"a", b"a", b"a"])]
    acquired(window, 6)
    async with asyncio.TaskGroup() as group:
        d.run(group)(keyed)
    assert batch.groups == [[0, 1, 2, 3], [5]]
    assert batch.units == [[(TP, b"a"), (TP, b"b")], [(TP, b"a")]]
    assert [run[:3] for run in single.runs] == [(4, True, False)]
    assert batch.order == [0, 1, 2, 3, 5] and single.order == [4]


async def test_ordering_key_leaves_records_without_a_key_unordered() -> None:
    """A record without a key has no unit: it joins the group and holds no turn."""
    batch = FakeBatch(takes={0, 1})
    d, _, window = dispatcher(settings(ordering="key"), batch=batch)
    acquired(window, 2)
    async with asyncio.TaskGroup() as group:
        d.run(group)([good_record(0, None), good_record(1, b"a")])
    assert batch.groups == [[0, 1]] and batch.units == [[(TP, b"a")]]


async def test_ordering_partition_cuts_the_group_where_a_record_goes_alone() -> None:
    """Offsets 0, 1 (per-record), 2, 3 of one partition: 0 in one group, 2 and 3 in the
    next, each group with one turn of the partition; the turns come in offset order."""
    batch = FakeBatch(takes={0, 2, 3})
    d, single, window = dispatcher(settings(ordering="partition"), batch=batch)
    acquired(window, 4)
    async with asyncio.TaskGroup() as group:
        d.run(group)(records(0, 1, 2, 3))
    assert batch.groups == [[0], [2, 3]]
    assert batch.units == [[TP], [TP]]
    assert single.runs == [(1, False, True, False)]


@pytest.mark.parametrize(
    "env",
    [
        pytest.param({}, id="defaults"),
        pytest.param({"delivery": "exactly_once"}, id="exactly_once"),
        pytest.param({"ordering": "key"}, id="key"),
        pytest.param({"ordering": "partition"}, id="partition"),
        pytest.param({"audit": "log"}, id="audit"),
    ],
)
def test_every_mode_has_the_group_path(env: dict[str, str]) -> None:
    """The delivery mode, the ordering and the audit do not choose the path: the group path
    is built in every mode (only WORKER_FAST_PATH=false leaves it out)."""
    h = Harness()
    transactions = PerPartitionTransactions("g", "p", lambda _id: None)
    for fast_path, built in (("true", True), ("false", False)):
        s = settings(fast_path=fast_path, **env)
        delivery = build_delivery(s, h.sink, h.delivery._edge, h.metrics, transactions=transactions)  # type: ignore[arg-type]
        dispatcher = build_dispatcher(
            s,
            steps=h.steps,
            pool=h.pool,  # type: ignore[arg-type]
            batcher=None,  # type: ignore[arg-type]
            delivery=delivery,
            window=h.window,
            inflight=h.inflight,
            tracing=Tracing(),
        )
        assert (dispatcher.batch is not None) is built


class HeldTriton(FakeTritonBase):
    """The per-record path's Triton for the batch tests' model: holds each record in
    inference until released."""

    def __init__(self) -> None:
        super().__init__()
        self.inferring = asyncio.Event()
        self.release = asyncio.Event()

    async def model_spec(self, name: str, version: str) -> ModelSpec:
        return BATCH_SPEC

    async def infer(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self.inferring.set()
        await self.release.wait()
        return await super().infer(request, *args, **kwargs)


async def test_a_record_handed_to_the_per_record_path_keeps_its_age() -> None:
    """A failed micro-batch's record, 5 s in flight, is still 5 s old on the per-record path."""
    clock, triton = Clock(), HeldTriton()
    h = Harness(clock=clock)
    single = single_path(triton, h.steps, delivery=h.delivery, window=h.window, inflight=h.inflight)
    d = Dispatcher(
        delivery=h.delivery,
        window=h.window,
        single=single,
        batch=h.fast,
        ordering="unordered",
        sequence_from_key=False,
    )
    async with asyncio.TaskGroup() as group:
        acquired(h.window, 1)
        h.pool.failure = errors.InferenceError("one row is poison")
        d.run(group)([batch_record(0)])
        clock.now += 5
        await triton.inferring.wait()
        oldest = h.inflight.snapshot()["oldest"]
        assert isinstance(oldest, list)
        (listed,) = oldest
        assert listed["offset"] == 0 and listed["age_s"] == 5.0
        assert listed["state"] == "sent"  # it started over: decoded again, now at Triton
        triton.release.set()
    assert len(h.inflight) == 0 and h.window.in_flight == 0
    assert h.sink.alone == [0] and h.offsets.commit_point(TP) == 1
