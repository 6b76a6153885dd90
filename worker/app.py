"""Wiring and lifecycle: ``start()`` → ``run()`` → ``stop()``, every task in one TaskGroup.

Shutdown (``request_stop``, the first SIGTERM/SIGINT): stop fetching, let the
in-flight records finish within ``shutdown_timeout_s``, commit, close. A second
signal (``force_stop``) abandons what is still in flight; those records are not
committed and will be consumed again.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Mapping
from typing import Any

import structlog
from aiokafka.structs import ConsumerRecord, TopicPartition

from worker import errors, preflight, security
from worker.audit import Audit
from worker.batching import MicroBatcher
from worker.breaker import CircuitBreaker
from worker.config import Settings
from worker.handler import RecordHandler, Sink
from worker.intake import Intake
from worker.limiter import AdaptiveLimiter
from worker.model_gate import ModelGate
from worker.observability import HealthServer, Metrics
from worker.offsets import OffsetTracker
from worker.ordering import Ticket, Turns
from worker.publisher import PRODUCER_HEADROOM_BYTES, Publisher
from worker.transactions import TransactionalSink
from worker.triton import TritonPool
from worker.window import Window

log = structlog.get_logger(__name__)

#: Bound on each last step of a shutdown (the final commit, closing the producer, closing
#: the consumer): an unreachable broker must not keep the process alive. Offsets not
#: committed then are consumed again by the partition's next owner (at-least-once).
CLOSE_TIMEOUT_S = 5.0
#: The same bound once a second signal has asked to exit now.
FORCED_CLOSE_TIMEOUT_S = 1.0


class Worker:
    """The inference worker: Kafka in, Triton streams, Kafka out."""

    def __init__(self, settings: Settings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.window = Window(settings.max_in_flight, settings.max_in_flight_per_partition)
        self.offsets = OffsetTracker()
        self.pool = TritonPool(
            settings.triton_url,
            settings.triton_streams,
            client_kwargs=security.triton_client_kwargs(settings),
            auth=security.TritonAuth(settings),
            shm_min_bytes=settings.shm_min_bytes if settings.triton_shm == "system" else None,
            shm_pool_bytes=settings.shm_pool_bytes,
        )
        # A dead letter carries the request as it came: up to max_request_bytes.
        largest_record = (
            max(settings.max_output_bytes, settings.max_request_bytes) + PRODUCER_HEADROOM_BYTES
        )
        self.publisher = Publisher(
            settings.bootstrap_servers,
            output_topic=settings.output_topic,
            dlq_topic=settings.dlq_topic,
            client_id=settings.client_id,
            linger_ms=settings.linger_ms,
            max_request_bytes=largest_record,
            client_kwargs=security.kafka_client_kwargs(settings),
            compression_type=settings.compression_type,
            on_value_omitted=self.metrics.dead_letter_values_omitted_total.inc,
        )
        self.txn: TransactionalSink | None = None
        sink: Sink = self.publisher
        if settings.delivery == "exactly_once":
            self.txn = sink = TransactionalSink(
                settings,
                self.offsets,
                self.metrics,
                security.kafka_client_kwargs(settings),
                max_request_bytes=largest_record,
            )
        self.audit = Audit(settings, self.publisher.send_audit)
        self.breaker = CircuitBreaker(
            settings.breaker_failure_threshold,
            on_change=lambda is_open: self.metrics.breaker_open.set(1 if is_open else 0),
        )
        self.batcher = MicroBatcher(
            self.pool, settings.batch_max_size, settings.batch_delay_ms / 1000
        )
        self.limiter = (
            AdaptiveLimiter(self.window, settings.min_in_flight, settings.max_in_flight)
            if settings.window_mode == "adaptive"
            else None
        )
        self.models = ModelGate(
            seen_ready=self.pool.has_spec,
            listed=self.pool.repository_lists,
            ready=self.pool.model_ready,
            released=lambda name, _version: self.pool.forget_model(name),
            interval_s=settings.breaker_probe_interval_ms / 1000,
        )
        self.handler = RecordHandler(
            settings,
            self.pool,
            sink,
            self.metrics,
            self.audit,
            self.breaker,
            self.batcher,
            self.limiter,
            self.models,
        )
        self.intake = Intake(
            settings,
            self.window,
            self.offsets,
            self.metrics,
            self.breaker,
            self._dispatch,
            txn=self.txn,
        )
        self._turns = Turns()
        self.health: HealthServer | None = None
        self.triton_up = False
        self.started = asyncio.Event()
        self._tasks: asyncio.TaskGroup | None = None
        self._records: set[asyncio.Task[None]] = set()
        self._stop = asyncio.Event()
        self._forced = asyncio.Event()
        self._stopped = False
        # Read at scrape time rather than set on every record.
        self.metrics.window_limit.set_function(lambda: self.window.limit)
        self.metrics.in_flight.set_function(lambda: self.window.in_flight)
        self.metrics.models_not_ready.set_function(lambda: len(self.models.held()))

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Connect everything; the consumer joins its group last, when all else is ready."""
        await preflight.run_checks(self.settings)
        if self.settings.metrics_port:
            self.health = HealthServer(
                self.metrics.registry, self.readiness, port=self.settings.metrics_port
            )
            await self.health.start()
        await self.pool.start()
        await self.publisher.start()
        await self.intake.start()
        log.info("worker_started", settings=self.settings.redacted())

    async def run(self) -> None:
        """Run until ``request_stop``; then drain, commit and close."""
        await self.start()
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                fetching = tasks.create_task(self.intake.run(), name="intake")
                background = [
                    tasks.create_task(self.intake.commit_loop(), name="commits"),
                    tasks.create_task(
                        self.breaker.probe_loop(
                            self.pool.server_ready,
                            self.settings.breaker_probe_interval_ms / 1000,
                            self._report_health,
                        ),
                        name="triton-health",
                    ),
                    tasks.create_task(self.models.probe_loop(), name="model-readiness"),
                ]
                self.started.set()
                await self._stop.wait()
                self.intake.request_stop()
                await fetching
                await self._drain()
                for task in background:
                    task.cancel()
        finally:
            self._tasks = None
            await self.stop()

    def request_stop(self) -> None:
        """Begin a graceful shutdown (first signal)."""
        self._stop.set()

    def force_stop(self) -> None:
        """Abandon in-flight records (second signal); they stay uncommitted.

        A final commit or a client close still waiting (on an unreachable broker) is
        abandoned too, so that the process ends now.
        """
        self._stop.set()
        self._forced.set()
        for task in list(self._records):
            task.cancel()

    async def _drain(self) -> None:
        """Wait for in-flight records within the bound, then commit what is done."""
        timeout_s = self.settings.shutdown_timeout_s
        try:
            await asyncio.wait_for(self.window.wait_empty(), timeout_s)
        except TimeoutError:
            log.warning("drain_timeout", in_flight=self.window.in_flight, timeout_s=timeout_s)
            for task in list(self._records):
                task.cancel()
        await asyncio.gather(*self._records, return_exceptions=True)
        await bounded_step(self.intake.commit(), "final_commit", self._forced)

    async def stop(self) -> None:
        """Close Triton streams, the producer, the consumer, the HTTP server. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.batcher.close()
        await self.pool.close(drain_timeout_s=5.0)
        if self.txn is not None:
            await bounded_step(self.txn.close(), "transactions_close", self._forced)
        await bounded_step(self.publisher.stop(), "producer_close", self._forced)
        await bounded_step(self.intake.stop(), "consumer_close", self._forced)
        if self.health is not None:
            await self.health.stop()
        log.info("worker_stopped")

    # -- records -----------------------------------------------------------------

    def _dispatch(self, record: ConsumerRecord[bytes, bytes], generation: int) -> None:
        assert self._tasks is not None
        tp = TopicPartition(record.topic, record.partition)
        # Tickets are taken here, synchronously, because dispatch runs in offset order.
        mode = self.settings.ordering
        key_turn = (
            self._turns.ticket((tp, record.key))
            if mode == "key" and record.key is not None
            else None
        )
        publish_turn = self._turns.ticket(tp) if mode == "partition" else None
        task = self._tasks.create_task(self._process(record, generation, key_turn, publish_turn))
        self._records.add(task)
        task.add_done_callback(self._records.discard)

    async def _process(
        self,
        record: ConsumerRecord[bytes, bytes],
        generation: int,
        key_turn: Ticket | None,
        publish_turn: Ticket | None,
    ) -> None:
        tp = TopicPartition(record.topic, record.partition)
        structlog.contextvars.bind_contextvars(
            topic=record.topic, partition=record.partition, offset=record.offset
        )
        try:
            if key_turn is not None:
                await key_turn.wait()
            outcome = await self.handler.evaluate(record)
            if publish_turn is not None:
                await publish_turn.wait()
            if self.txn is None:
                await self.handler.deliver(outcome)
                # Done only after the broker acknowledged the result or dead letter.
                self.offsets.done(tp, record.offset, generation)
            else:
                await self.txn.ready(tp)
                if self.offsets.done(tp, record.offset, generation):
                    # exactly_once: done when staged (deliver stages it before its
                    # first pause); it returns once the transaction carrying the
                    # outcome and the offsets has committed.
                    await self.handler.deliver(outcome)
        except errors.PartitionRevoked:
            pass  # the partition moved away; its next owner redoes the record
        except errors.Fatal:
            raise
        except Exception as exc:
            # A bug in the bookkeeping around the record: never a crash for every member
            # that takes the partition. The record stays uncommitted.
            self.handler.internal_failure(exc)
        finally:
            # Forced stop (cancelled) lands here too: the record is not done and
            # its offset is not committed.
            for turn in (key_turn, publish_turn):
                if turn is not None:
                    turn.done()
            self.window.release(tp)

    # -- health ------------------------------------------------------------------

    def _report_health(self, triton_up: bool, breaker_open: bool) -> None:
        if triton_up and not self.triton_up:
            # Streams broken during an outage re-open now rather than after their backoff.
            self.pool.wake()
        self.triton_up = triton_up
        self.metrics.triton_up.set(1 if triton_up else 0)
        self.metrics.breaker_open.set(1 if breaker_open else 0)

    def readiness(self) -> tuple[bool, Mapping[str, object]]:
        """Ready when the consumer runs, Triton is reachable and the breaker is closed."""
        detail: dict[str, object] = {
            "consumer": "running" if self.intake.running else "stopped",
            "triton": "up" if self.triton_up else "down",
            "breaker": "open" if self.breaker.is_open else "closed",
        }
        if held := self.models.held():
            # Other models keep flowing: a model being reloaded does not make the worker unready.
            detail["models_not_ready"] = held
        ready = self.intake.running and self.triton_up and not self.breaker.is_open
        return ready, detail


async def bounded_step(step: Awaitable[None], what: str, forced: asyncio.Event) -> None:
    """Await a shutdown step for at most CLOSE_TIMEOUT_S, or until ``forced`` is set.

    aiokafka retries a commit, a flush or a group leave for as long as the broker is
    unreachable: without a bound, SIGTERM (and even a second one) during a broker
    outage would never end the process. A step still running then is cancelled and
    logged; a step that finishes in time returns (or raises) as it would have.
    """
    task = asyncio.ensure_future(step)
    # After a second signal a step still gets a moment: a reachable broker commits
    # what is done in milliseconds, and fewer records are redone.
    forced_already = forced.is_set()
    timeout_s = FORCED_CLOSE_TIMEOUT_S if forced_already else CLOSE_TIMEOUT_S
    forcing = asyncio.ensure_future(forced.wait())
    waiting: set[asyncio.Future[Any]] = {task} if forced_already else {task, forcing}
    try:
        done, _ = await asyncio.wait(
            waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        forcing.cancel()
    if task in done:
        task.result()
        return
    reason = "second signal" if forced.is_set() else f"{timeout_s} s passed"
    log.warning("shutdown_step_abandoned", step=what, reason=reason)
    task.cancel()
    # A client that does not even honour the cancellation is left to the process exit.
    await asyncio.wait({task}, timeout=1.0)


async def serve(settings: Settings, worker: Worker | None = None) -> int:
    """Run a worker under SIGTERM/SIGINT handling; return the process exit code."""
    import signal

    worker = worker or Worker(settings)
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    received = 0

    def on_signal(signum: int) -> None:
        nonlocal received
        received += 1
        if received == 1:
            log.info("shutdown_requested", signal=signal.Signals(signum).name)
            worker.request_stop()
        else:
            log.warning("forced_exit", signal=signal.Signals(signum).name)
            worker.force_stop()

    for signum in signals:
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        await worker.run()
    finally:
        for signum in signals:
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(signum)
    return 0 if received <= 1 else 1
