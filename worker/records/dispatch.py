"""Records into tasks: a path chosen per record, the batch path's records as one group.

The intake hands over the records of one pass (each holding a window slot, in
offset order per partition) with the function ``Dispatcher.run`` returns. Each
record is tracked, skipped if the commit metadata says it was done, then either
taken by the batch path (``worker.records.batch``: one task for all of them) or
given a task of its own on the per-record path (``worker.records.single``), with
ordering turns, retries, holds, decoupled streams and sequences. Every task
belongs to the worker's TaskGroup and to ``running``, so that a shutdown drains
them and a forced stop cancels them.

Records of a registry-format topic whose writer's schema is not known yet wait for it
together (one request per schema id) and then take the batch path as a group, rather than
each going the per-record way for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Hashable, Sequence
from typing import Any

from worker.delivery.base import Delivery
from worker.flow.ordering import Turns
from worker.flow.window import Window
from worker.kafka.feed import Dispatch
from worker.kafka.types import ConsumerRecord, TopicPartition
from worker.observability import InFlightRegistry
from worker.observability.tracing import Tracing
from worker.records.batch import BatchPath, Candidate, Group
from worker.records.outcome import Handed
from worker.records.single import SinglePath
from worker.records.steps import Steps
from worker.records.stream import StreamCalls, StreamRules
from worker.registry import Registry
from worker.settings import Settings
from worker.settings.fields import Ordering
from worker.triton.batching import MicroBatcher
from worker.triton.pool import TritonPool

__all__ = ["Dispatcher", "build_dispatcher"]


class Dispatcher:
    """Runs each dispatched record on the batch path (grouped) or the per-record path."""

    def __init__(
        self,
        *,
        delivery: Delivery,
        window: Window,
        single: SinglePath,
        batch: BatchPath | None,
        ordering: Ordering,
        sequence_from_key: bool,
        registry: Registry | None = None,
    ) -> None:
        """``batch``: None when the settings keep every record on the per-record path;
        ``registry``: the Schema Registry of the registry-format topics, if any."""
        self._delivery = delivery
        self._window = window
        self._single = single
        #: The batch path; None when the settings keep every record on the per-record path.
        self.batch = batch
        self._ordering = ordering
        self._sequence_from_key = sequence_from_key
        # Records wait for their schemas out of offset order: only where no turn is taken.
        self._registry = registry if ordering == "unordered" and not sequence_from_key else None
        self._turns = Turns()
        self._group: asyncio.TaskGroup | None = None
        self.running: set[asyncio.Task[None]] = set()

    def run(self, group: asyncio.TaskGroup) -> Dispatch:
        """The worker runs: the records' tasks go to ``group`` (its TaskGroup) from now on.

        Returns what the intake dispatches with (``dispatch_many``).
        """
        self._group = group
        return self.dispatch_many

    def dispatch_many(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        """Start the records of one dispatch pass (each holds its window slot): those the
        group path takes in groups, each other in a task of its own."""
        batch = self.batch if self.batch is not None and self.batch.open else None
        registry = self._registry if batch is not None else None
        delivery, groups = self._delivery, _Groups(self._ordering, self._turns)
        waiting: list[tuple[ConsumerRecord[bytes, bytes], int]] = []
        for record in records:
            generation = delivery.track(record)
            if delivery.settle_if_done(record, generation):
                # Done before a crash or hand-over (the commit metadata says so): skipped.
                self._window.release(TopicPartition(record.topic, record.partition))
                continue
            if registry is not None and registry.pending(record.topic, record.value):
                waiting.append((record, generation))
                continue
            candidate = batch.select(record, generation) if batch is not None else None
            if candidate is None:
                groups.passing(record)
                self._dispatch_one(record, generation)
            else:
                groups.add(candidate)
        for group in groups.made:
            if group.candidates:
                assert batch is not None
                self._spawn(batch.run(group, self._fall_back))
        if waiting:
            self._spawn(self._after_schemas(waiting))

    async def _after_schemas(self, waiting: list[tuple[ConsumerRecord[bytes, bytes], int]]) -> None:
        """The records whose schemas are fetched first (each id once; while the registry
        is out, they wait), then dispatched as a group; their slots are held meanwhile."""
        assert self._registry is not None
        try:
            await self._registry.ready_many((r.topic, r.value) for r, _ in waiting)
        except Exception:  # a bug here: the per-record path fetches for each record
            pass
        except BaseException:
            # Cancelled (a forced stop): the records are not done; their slots go back.
            for record, _ in waiting:
                self._window.release(TopicPartition(record.topic, record.partition))
            raise
        batch = self.batch if self.batch is not None and self.batch.open else None
        chosen = []
        for record, generation in waiting:
            candidate = batch.select(record, generation) if batch is not None else None
            if candidate is not None:
                chosen.append(candidate)
            else:
                self._dispatch_one(record, generation)
        if chosen:
            assert batch is not None
            await batch.run(Group(chosen), self._fall_back)

    def _dispatch_one(self, record: ConsumerRecord[bytes, bytes], generation: int) -> None:
        tp = TopicPartition(record.topic, record.partition)
        # Tickets are taken here, synchronously, because dispatch runs in offset order.
        # With sequences keyed by Kafka key every keyed record takes one: its model, known
        # only once decoded, says whether it waits its turn (see SinglePath.evaluate).
        # A group path record takes one only for ordering ``key``: its model keeps no
        # sequences.
        mode = self._ordering
        key_turn = (
            self._turns.ticket((tp, record.key))
            if (mode == "key" or self._sequence_from_key) and record.key is not None
            else None
        )
        publish_turn = self._turns.ticket(tp) if mode == "partition" else None
        self._spawn(self._single.run(record, generation, key_turn, publish_turn))

    def _fall_back(self, handed: Handed) -> None:
        """A group path record (with its slot, in-flight entry and turns) goes the
        per-record way: from the start, or, given its outcome, only to be published."""
        self._spawn(
            self._single.run(
                handed.record,
                handed.generation,
                None,
                handed.publish_turn,
                handed.outcome,
                handed.entry,
            )
        )

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        group = self._group
        if group is None:
            work.close()
            raise RuntimeError("records dispatched before the worker runs (Dispatcher.run)")
        task = group.create_task(work)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    def cancel_all(self) -> None:
        """Cancel every record's task (forced stop): those records are not done."""
        for task in list(self.running):
            task.cancel()


def build_dispatcher(
    settings: Settings,
    *,
    steps: Steps,
    pool: TritonPool,
    batcher: MicroBatcher,
    delivery: Delivery,
    window: Window,
    inflight: InFlightRegistry,
    tracing: Tracing,
) -> Dispatcher:
    """The per-record path, the batch path when the settings and the delivery mode allow
    it, and the dispatcher choosing between them."""
    streams = StreamCalls(StreamRules.from_settings(settings), pool, steps)
    single = SinglePath(
        steps,
        pool=pool,
        batcher=batcher,
        streams=streams,
        delivery=delivery,
        window=window,
        inflight=inflight,
        tracing=tracing,
        key_mode=settings.delivery.ordering == "key",
    )
    batch = None
    if settings.flow.fast_path:
        batch = BatchPath(
            steps,
            pool=pool,
            delivery=delivery,
            window=window,
            inflight=inflight,
            tracing=tracing,
            batch_max_size=settings.flow.batch_max_size,
        )
    return Dispatcher(
        delivery=delivery,
        window=window,
        single=single,
        batch=batch,
        ordering=settings.delivery.ordering,
        sequence_from_key=settings.delivery.sequence_from_key,
        registry=steps.rules.registry,
    )


class _Groups:
    """The groups of one dispatch pass, made in offset order with their ordering turns
    (taken here, synchronously, so in offset order).

    A candidate's ordering unit is its partition (``partition``), its partition and key
    (``key``, a record with a key), or none. A group holds one turn per unit, taken when
    the unit's first record joins it; its records of a unit publish together, in offset
    order, once that turn comes. ``unordered`` (or no unit at all): one group. A record
    going the per-record way whose unit the last group holds cuts it: the unit's later
    candidates go in a group after it.
    """

    def __init__(self, ordering: Ordering, turns: Turns) -> None:
        self._ordering = ordering
        self._turns = turns
        self.made: list[Group] = [Group()]

    def _unit(self, record: ConsumerRecord[bytes, bytes], tp: TopicPartition) -> Hashable | None:
        unit: Hashable | None = None
        if self._ordering == "partition":
            unit = tp
        elif self._ordering == "key" and record.key is not None:
            unit = (tp, record.key)
        return unit

    def add(self, candidate: Candidate) -> None:
        group = self.made[-1]
        unit = self._unit(candidate.record, candidate.tp)
        if unit is not None:
            candidate.unit = unit
            if unit not in group.turns:
                group.turns[unit] = self._turns.ticket(unit)
        group.candidates.append(candidate)

    def passing(self, record: ConsumerRecord[bytes, bytes]) -> None:
        """A record of the pass goes the per-record way (its turn taken after this)."""
        unit = self._unit(record, TopicPartition(record.topic, record.partition))
        if unit is not None and unit in self.made[-1].turns:
            self.made.append(Group())
