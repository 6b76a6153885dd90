"""Results and dead letters through librdkafka (``WORKER_KAFKA_CLIENT=confluent``).

The producers under the same ``Publisher`` (idempotent, ``acks=all``; a record counts as
done once the broker acks it; dead letters slimmed when refused for their size), with
librdkafka underneath: ``produce`` only queues the record, librdkafka's own threads frame,
compress and batch it, and a poll thread hands each delivery report back to the
event loop as the result of the record's future. librdkafka keeps the idempotent
sequence numbers itself (a batch refused for its size does not wedge the partition,
see the publisher's integration tests), so there is no producer renewal here. A
record that must be judged on its own size goes through a second producer whose
batches hold one record each.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import confluent_kafka
import structlog
from aiokafka.errors import KafkaError

from worker.kafka.publisher import Headers
from worker.kafka.rdkafka.threads import in_thread, teardown
from worker.kafka.rdkafka.types import from_rd_error

__all__ = ["RdProducer", "RdProducers"]

log = structlog.get_logger(__name__)

#: Wait before trying again a record refused because librdkafka's queue is full.
_QUEUE_FULL_WAIT_S = 0.005

#: Bound on connecting at start-up, on flushing at stop, and on destroying the client.
_START_TIMEOUT_S = 10.0
_FLUSH_TIMEOUT_S = 30.0
_DESTROY_TIMEOUT_S = 5.0


class _Group:
    """The delivery reports of a group of records: one callable for all of them (the
    ``on_delivery`` of each), which counts them; its future is set once the last came.
    Called on librdkafka's poll thread: it only queues the report for the event loop."""

    __slots__ = ("_reports", "errors", "future", "left", "sealed")

    def __init__(self, future: asyncio.Future[None], reports: deque[_Report]) -> None:
        self.future = future
        self.left = 0
        #: Every record of the group is queued: the last report ends it. (Reports of the
        #: first records may come while the rest still wait for room in librdkafka's queue.)
        self.sealed = False
        #: (error, message) of each record refused.
        self.errors: list[tuple[Any, Any]] = []
        self._reports = reports

    def __call__(self, error: Any, message: Any) -> None:
        self._reports.append((self, error, message))

    def report(self, error: Any, message: Any) -> None:
        """One record's report, on the loop."""
        self.left -= 1
        if error is not None:
            self.errors.append((error, message))
        self._end_if_done()

    def seal(self) -> None:
        """Every record is queued (or refused before it was)."""
        self.sealed = True
        self._end_if_done()

    def _end_if_done(self) -> None:
        if self.sealed and self.left <= 0 and not self.future.done():
            self.future.set_result(None)


#: One delivery report: the record's future (or its group), librdkafka's error (or None),
#: the message.
_Report = tuple["asyncio.Future[Any] | _Group", Any, Any]


class RdProducer:
    """A librdkafka producer whose ``send`` returns an asyncio future of the delivery report."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = dict(config)
        self._producer: confluent_kafka.Producer | None = None
        self._poller: threading.Thread | None = None
        self._closing = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # Delivery reports arrive on librdkafka's poll (or flush) thread and are settled
        # on the event loop in batches: one wake-up of the loop per poll, not per record.
        self._reports: deque[_Report] = deque()
        self._handing_over = False

    @property
    def handle(self) -> confluent_kafka.Producer:
        """The librdkafka producer (started)."""
        assert self._producer is not None
        return self._producer

    async def start(self) -> None:
        """Create the producer and reach a broker (KafkaError when none answers)."""
        self._loop = asyncio.get_running_loop()
        producer = self._producer = confluent_kafka.Producer(self._config)
        # Polled first: an OAUTHBEARER token is asked for (oauth_cb) from poll.
        self._poller = threading.Thread(target=self._poll, name="rdkafka-producer", daemon=True)
        self._poller.start()
        try:
            await in_thread(functools.partial(producer.list_topics, timeout=_START_TIMEOUT_S))
        except confluent_kafka.KafkaException as exc:
            self._producer = None
            self._closing.set()
            await in_thread(self._poller.join)
            await _destroy(producer)
            raise from_rd_error(exc) from None

    def _poll(self) -> None:
        """The poll thread: until ``stop`` (or a stop given up), or until the event loop
        that awaits the reports has closed (a forced exit leaves the client open)."""
        producer, loop = self._producer, self._loop
        assert producer is not None and loop is not None
        while not self._closing.is_set() and not loop.is_closed():
            try:
                producer.poll(0.1)
            except confluent_kafka.KafkaException as exc:
                # A fatal error is raised from poll, once. Polling goes on: the records the
                # producer fails from then on have delivery reports to hand over, and the
                # producer's own calls raise the error to the code that replaces it.
                log.error("kafka_producer_fatal_error", error=str(exc.args[0]))
            self._hand_over(loop)

    def _hand_over(self, loop: asyncio.AbstractEventLoop) -> None:
        """Ask the loop to settle the reports gathered so far (from any thread); nothing
        once it has closed: no one awaits them any more."""
        if self._reports and not self._handing_over:
            self._handing_over = True
            # The loop may close between the poll and this call (a forced exit abandons
            # the producer's stop): call_soon_threadsafe raises on a closed loop.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._settle_reports)

    def _settle_reports(self) -> None:
        self._handing_over = False
        reports = self._reports
        while reports:
            future, error, message = reports.popleft()
            if isinstance(future, _Group):
                future.report(error, message)
                continue
            if future.done():
                continue
            if error is not None:
                future.set_exception(from_rd_error(error))
            else:
                future.set_result(message)

    async def send(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers | None
    ) -> asyncio.Future[Any]:
        """Queue one record; the future is its delivery report (aiokafka's error classes)."""
        producer = self.handle
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        reports = self._reports

        def delivered(error: Any, message: Any) -> None:
            reports.append((future, error, message))

        while True:
            try:
                producer.produce(
                    topic,
                    value=value,
                    key=key,
                    headers=list(headers) if headers else None,
                    on_delivery=delivered,
                )
                return future
            except BufferError:
                # librdkafka's queue is full: its threads are sending; try again shortly.
                await asyncio.sleep(_QUEUE_FULL_WAIT_S)
            except confluent_kafka.KafkaException as exc:
                raise from_rd_error(exc) from None

    async def send_group(
        self,
        topic: str,
        records: Sequence[tuple[bytes | None, bytes, Headers]],
        enqueued: Callable[[], None] | None = None,
    ) -> list[BaseException | None]:
        """Queue every record, with one delivery callback for them all (then call
        ``enqueued()``), and wait for every report: per record, None once delivered, else
        its error (aiokafka's classes)."""
        producer = self.handle
        group = _Group(asyncio.get_running_loop().create_future(), self._reports)
        outcomes: list[BaseException | None] = [None] * len(records)
        for i, (key, value, headers) in enumerate(records):
            while True:
                try:
                    producer.produce(
                        topic,
                        value=value,
                        key=key,
                        headers=list(headers) if headers else None,
                        on_delivery=group,
                    )
                    group.left += 1
                    break
                except BufferError:
                    # librdkafka's queue is full: its threads are sending; try again shortly.
                    await asyncio.sleep(_QUEUE_FULL_WAIT_S)
                except confluent_kafka.KafkaException as exc:
                    outcomes[i] = from_rd_error(exc)  # refused before it was queued
                    break
        group.seal()
        if enqueued is not None:
            enqueued()
        await group.future
        for error, message in group.errors:
            index = _index_of(message, records, outcomes)
            if index is not None:
                outcomes[index] = from_rd_error(error)
                continue
            # Never taken for delivered: every record not known to be refused is written
            # again alone (at least once: one delivered may appear twice).
            for i, outcome in enumerate(outcomes):
                if outcome is None:
                    outcomes[i] = from_rd_error(error)
            break
        return outcomes

    async def stop(self) -> None:
        """Flush what is queued (bounded), stop the poll thread and destroy the client (its
        threads joined). Idempotent."""
        producer = self._producer
        if producer is None:
            return
        self._producer = None
        try:
            await in_thread(producer.flush, _FLUSH_TIMEOUT_S)
        finally:
            # Also when the stop is given up (cancelled: a broker that does not answer, a
            # second signal): the poll thread ends at its next turn, not with the process.
            self._closing.set()
        if self._poller is not None:
            await in_thread(self._poller.join)
        await _destroy(producer)
        self._settle_reports()  # those the flush delivered, and those the destruction failed


def _index_of(
    message: Any,
    records: Sequence[tuple[bytes | None, bytes, Headers]],
    outcomes: Sequence[BaseException | None],
) -> int | None:
    """Which of the group's records a refused message is, the first not known refused yet:
    by its key and value, and, among records of the same key and value, by its headers (a
    result names its source record in them) where the report still carries them
    (librdkafka's reports of refused messages may not)."""
    key, value = message.key(), message.value()
    alike = [
        i for i, (k, v, _) in enumerate(records) if outcomes[i] is None and k == key and v == value
    ]
    if len(alike) <= 1:
        return alike[0] if alike else None
    try:
        wanted = [(n, None if x is None else bytes(x)) for n, x in message.headers() or []]
    except Exception:  # a header the binding cannot read
        return alike[0]
    for i in alike:
        if [(n, None if x is None else bytes(x)) for n, x in records[i][2]] == wanted:
            return i
    return alike[0]


async def _destroy(producer: confluent_kafka.Producer) -> None:
    """Destroy the client now, its threads joined, rather than whenever its last reference
    goes: what the flush left is dropped first (its records are not acknowledged, so not
    done; ``close`` would flush them for ever with the broker down)."""

    def destroy() -> None:
        producer.purge(in_queue=True, in_flight=True, blocking=False)
        producer.close()

    await teardown(destroy, "producer", _DESTROY_TIMEOUT_S)


class RdProducers:
    """The publisher's producer on librdkafka (``Producer``): the producer of every write,
    and one whose batches hold one record, started when first needed."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._rd = RdProducer(config)
        # One record per batch: a record refused for its size did not share its batch.
        self._solo = RdProducer({**config, "batch.num.messages": 1, "linger.ms": 0})
        self._solo_started = False
        self._solo_lock = asyncio.Lock()

    async def start(self) -> None:
        await self._rd.start()

    async def stop(self) -> None:
        """Flush what is pending and close. Idempotent."""
        await self._rd.stop()
        await self._solo.stop()

    async def write(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers
    ) -> Any:
        return await (await self._rd.send(topic, value, key, headers))

    async def write_alone(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers
    ) -> Any:
        async with self._solo_lock:
            if not self._solo_started:
                await self._solo.start()
                self._solo_started = True
        return await (await self._solo.send(topic, value, key, headers))

    def replaced(self, exc: KafkaError) -> bool:
        """Never: librdkafka's producer is not replaced."""
        return False

    async def send_in_order(
        self, topic: str, key: bytes | None, results: Sequence[tuple[bytes, Headers]]
    ) -> int:
        sent: list[asyncio.Future[Any]] = []
        with contextlib.suppress(KafkaError):
            for value, headers in results:
                sent.append(await self._rd.send(topic, value, key, headers))
        acks = await asyncio.gather(*sent, return_exceptions=True)
        return next((i for i, ack in enumerate(acks) if isinstance(ack, BaseException)), len(sent))

    async def send_together(
        self,
        topic: str,
        records: Sequence[tuple[bytes | None, bytes, Headers]],
        enqueued: Callable[[], None] | None = None,
    ) -> list[BaseException | None]:
        return await self._rd.send_group(topic, records, enqueued)

    async def send_audit(self, topic: str, value: bytes, key: bytes | None) -> Any:
        return await (await self._rd.send(topic, value, key, None))
