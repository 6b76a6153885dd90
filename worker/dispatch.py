"""Records into tasks: a dispatch pass's fast-path records as one group, the others one each.

The intake hands over the records of one pass (each holding a window slot, in
offset order per partition) with ``dispatch_many``. Each record is tracked,
skipped if the commit metadata says it was done, then either taken by the fast
path (``worker.fastpath``: one task for all of them) or given a task of its own:
the per-record path, with ordering turns, retries, holds, decoupled streams and
sequences. Every task belongs to the worker's TaskGroup and to ``running``, so
that a shutdown drains them and a forced stop cancels them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any

import structlog
from aiokafka.structs import ConsumerRecord, TopicPartition

from worker import errors
from worker.delivery.base import Delivery
from worker.fastpath import FastPath
from worker.flow.ordering import Ticket, Turns
from worker.flow.window import Window
from worker.observability import InFlight, InFlightRegistry
from worker.observability.tracing import Tracing
from worker.record import Outcome, RecordHandler
from worker.settings import Settings

__all__ = ["Dispatcher", "fast_path_allowed"]


def fast_path_allowed(settings: Settings, audit_enabled: bool, tracing: Tracing) -> bool:
    """True when the settings let records take the fast path at all (see ``worker.fastpath``)."""
    return (
        settings.flow.fast_path
        and settings.delivery.delivery == "at_least_once"
        and settings.delivery.ordering == "unordered"
        and not audit_enabled
        and not tracing.enabled
    )


class Dispatcher:
    """Runs each dispatched record on the fast path (grouped) or the per-record path."""

    def __init__(
        self,
        settings: Settings,
        *,
        delivery: Delivery,
        window: Window,
        inflight: InFlightRegistry,
        handler: RecordHandler,
        tracing: Tracing,
    ) -> None:
        self._settings = settings
        self._delivery = delivery
        self.window = window
        self._inflight = inflight
        self._handler = handler
        self._tracing = tracing
        self._turns = Turns()
        self.fast: FastPath | None = None  # set by the worker when the settings allow it
        self.group: asyncio.TaskGroup | None = None  # the worker's, while it runs
        self.running: set[asyncio.Task[None]] = set()

    def dispatch_many(self, records: Sequence[ConsumerRecord[bytes, bytes]]) -> None:
        """Start the records of one dispatch pass (each holds its window slot)."""
        fast = self.fast if self.fast is not None and self.fast.open else None
        delivery, chosen = self._delivery, []
        for record in records:
            generation = delivery.track(record)
            if delivery.settle_if_done(record, generation):
                # Done before a crash or hand-over (the commit metadata says so): skipped.
                self.window.release(TopicPartition(record.topic, record.partition))
                continue
            candidate = fast.select(record, generation) if fast is not None else None
            if candidate is not None:
                chosen.append(candidate)
            else:
                self._dispatch_one(record, generation)
        if chosen:
            assert fast is not None
            self._spawn(fast.run(chosen))

    def _dispatch_one(self, record: ConsumerRecord[bytes, bytes], generation: int) -> None:
        tp = TopicPartition(record.topic, record.partition)
        # Tickets are taken here, synchronously, because dispatch runs in offset order.
        # With sequences keyed by Kafka key every keyed record takes one: its model, known
        # only once decoded, says whether it waits its turn (see RecordHandler.evaluate).
        # A fast-path record never takes one: its model keeps no sequences.
        mode = self._settings.delivery.ordering
        key_turn = (
            self._turns.ticket((tp, record.key))
            if (mode == "key" or self._settings.delivery.sequence_from_key)
            and record.key is not None
            else None
        )
        publish_turn = self._turns.ticket(tp) if mode == "partition" else None
        self._spawn(self._process(record, generation, key_turn, publish_turn))

    def fall_back(
        self,
        record: ConsumerRecord[bytes, bytes],
        generation: int,
        outcome: Outcome | None,
        entry: InFlight,
    ) -> None:
        """A fast-path record (with its slot and in-flight ``entry``) goes the per-record way:
        from the start, or, given its ``outcome``, only to be published."""
        self._spawn(self._process(record, generation, None, None, outcome, entry))

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        assert self.group is not None
        task = self.group.create_task(work)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    def cancel_all(self) -> None:
        """Cancel every record's task (forced stop): those records are not done."""
        for task in list(self.running):
            task.cancel()

    async def _process(
        self,
        record: ConsumerRecord[bytes, bytes],
        generation: int,
        key_turn: Ticket | None,
        publish_turn: Ticket | None,
        evaluated: Outcome | None = None,
        entry: InFlight | None = None,
    ) -> None:
        tp = TopicPartition(record.topic, record.partition)
        structlog.contextvars.bind_contextvars(
            topic=record.topic, partition=record.partition, offset=record.offset
        )
        if entry is None:
            entry = self._inflight.add(record)
        handler = self._handler
        try:
            key_mode = self._settings.delivery.ordering == "key"
            if key_turn is not None and key_mode:
                entry.state = "waiting_turn"
                await key_turn.wait()
            with self._tracing.consume(record):
                outcome = evaluated or await handler.evaluate(
                    record, None if key_mode else key_turn, entry
                )
                if publish_turn is not None:
                    entry.state = "waiting_turn"
                    await publish_turn.wait()

                def safe() -> None:
                    # The outcome is acknowledged, or staged in offset order: the next record
                    # of the key or partition may go (exactly_once need not wait for commit).
                    entry.state = "waiting_commit"
                    for turn in (key_turn, publish_turn):
                        if turn is not None:
                            turn.done()

                entry.state = "publishing"
                await self._delivery.complete(
                    record, generation, lambda: handler.deliver(outcome), safe
                )
        except errors.PartitionRevoked:
            pass  # the partition moved away; its next owner redoes the record
        except errors.Fatal:
            raise
        except Exception as exc:
            # A bug in the bookkeeping around the record: never a crash for every member
            # that takes the partition. The record stays uncommitted.
            handler.internal_failure(exc)
        finally:
            # Forced stop (cancelled) lands here too: the record is not done and
            # its offset is not committed.
            for turn in (key_turn, publish_turn):
                if turn is not None:
                    turn.done()
            self.window.release(tp)
            self._inflight.remove(entry)
