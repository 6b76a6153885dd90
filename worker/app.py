"""Wiring and lifecycle: ``start()`` → ``run()`` → ``stop()``, every task in one TaskGroup.

Shutdown (``request_stop``, the first SIGTERM/SIGINT): during start-up, abandon it;
once running, stop fetching, let the in-flight records finish within
``shutdown_timeout_s``, commit, close. A second signal (``force_stop``), or a drain
that runs out of time, abandons what is still in flight; those records are not
committed and will be consumed again (exit 1, ``ExitCode.FORCED``).
"""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Coroutine, Mapping
from typing import Any

import structlog

from worker.audit import Audit
from worker.checks.startup import CHECK_TIMEOUT_S, run_startup_checks
from worker.delivery import build_delivery
from worker.errors import ExitCode, TritonTimeout
from worker.events.result_schemas import ResultSchemas
from worker.flow.bounded import CLOSE_TIMEOUT_S, Forced, bounded_step, within
from worker.flow.breaker import CircuitBreaker
from worker.flow.holds import ModelGate
from worker.flow.limiter import AdaptiveLimiter
from worker.flow.model_health import ModelHealth
from worker.flow.window import Window
from worker.kafka.edge import build_edge
from worker.kafka.types import TopicPartition
from worker.observability import HealthServer, InFlightRegistry, Metrics
from worker.observability.readiness import readiness_of
from worker.observability.tracing import Tracing, build_tracing
from worker.records import RecordRules, Steps, build_dispatcher
from worker.registry import Registry
from worker.settings import Settings
from worker.shutdown import TwoStageSignals
from worker.triton import auth as triton_auth
from worker.triton.batching import MicroBatcher
from worker.triton.pool import TritonPool
from worker.wire.validation import ModelSpec

log = structlog.get_logger(__name__)

#: How often the records still running after their cancellation are cancelled again.
_RECANCEL_S = 0.5


class Worker:
    """The inference worker: Kafka in, Triton streams, Kafka out."""

    #: ``freeze_heap()`` once started: for a process that runs this worker alone (``serve``).
    freezes_heap = False

    def __init__(
        self, settings: Settings, metrics: Metrics | None = None, tracing: Tracing | None = None
    ) -> None:
        """Built in order: the Kafka edge, the delivery mode, the steps, the dispatcher;
        ``start`` and ``_serve`` connect them at run time. ``tracing``: spans of the
        records; by default as the OTEL_* variables say."""
        self.settings = settings
        self.metrics = metrics = metrics or Metrics()
        self.tracing = tracing or build_tracing(os.environ, settings)
        self.window = Window(settings.flow.max_in_flight, settings.flow.max_in_flight_per_partition)
        self.pool, self.batcher = build_triton(settings, metrics)
        self.breaker = CircuitBreaker(
            settings.retry.breaker_failure_threshold,
            on_change=lambda is_open: metrics.breaker_open.set(1 if is_open else 0),
        )
        self.publisher, self.intake, transactions = build_edge(
            settings, window=self.window, breaker=self.breaker, metrics=metrics
        )
        self.delivery = build_delivery(
            settings, self.publisher, self.intake, metrics, transactions=transactions
        )
        self.models, self.model_health = build_model_holds(settings, self.pool, metrics)
        self.audit = Audit(
            settings, self.publisher.send_audit, send_many=self.publisher.send_audit_many
        )
        self.steps = Steps(
            RecordRules.from_settings(settings),
            metrics=metrics,
            breaker=self.breaker,
            limiter=build_limiter(settings, self.window),
            models=self.models,
            health=self.model_health,
            audit=self.audit,
        )
        self.registry, self.result_schemas = build_result_schemas(settings, self.steps)
        self.inflight = InFlightRegistry(
            settings.ops.stuck_after_s, progress=self.delivery.offsets.progress
        )
        self.dispatcher = build_dispatcher(
            settings,
            steps=self.steps,
            pool=self.pool,
            batcher=self.batcher,
            delivery=self.delivery,
            window=self.window,
            inflight=self.inflight,
            tracing=self.tracing,
        )
        self._init_lifecycle()

    def _init_lifecycle(self) -> None:
        """The state of the lifecycle, and the gauges read at scrape time."""
        self.health: HealthServer | None = None
        self.triton_up = False
        self.started = asyncio.Event()
        self._stop = asyncio.Event()
        self._forced = Forced()
        self._stopped = False
        #: True once a shutdown left records undone (a second signal, or the drain's bound).
        self.abandoned = False
        # Read at scrape time rather than set on every record.
        self.metrics.window_limit.set_function(lambda: self.window.limit)
        self.metrics.in_flight.set_function(lambda: self.window.in_flight)
        self.metrics.models_not_ready.set_function(lambda: len(self.models.held()))
        self.metrics.oldest_in_flight_seconds.set_function(self.inflight.oldest_age_s)

    # -- lifecycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Connect everything; the consumer joins its group last, when all else is ready."""
        await run_startup_checks(self.settings, self.steps.rules.mappings)
        if self.settings.ops.metrics_port:
            self.health = HealthServer(
                self.metrics.registry,
                self.readiness,
                port=self.settings.ops.metrics_port,
                inflight=self.inflight.snapshot if self.settings.ops.debug_endpoints else None,
            )
            await self.health.start()
        await self.pool.start()
        if self.result_schemas is not None:
            # Refused (exit 2) here, before the group is joined; what Triton or the registry
            # cannot answer yet is resolved once they do, its records waiting meanwhile.
            await self.result_schemas.resolve(self._model_spec)
        await self.publisher.start()
        await self.intake.start(self)
        log.info("worker_started", settings=self.settings.redacted())

    async def run(self) -> None:
        """Start, run until ``request_stop``; then drain, commit and close.

        A stop requested during start-up abandons it: nothing is fetched, and what had
        started is closed. A start that fails closes what it had built, too.
        """
        try:
            if await self._start_unless_stopped():
                if self.freezes_heap:
                    log.debug("heap_frozen", objects=freeze_heap())
                await self._serve()
        finally:
            await self.stop()

    async def _start_unless_stopped(self) -> bool:
        """``start()``; False when a stop came first (the start-up's error is raised)."""
        starting = asyncio.ensure_future(self.start())
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if starting.done():
            starting.result()
            return True
        log.info("startup_abandoned")
        starting.cancel()
        # Whatever it ends with now concerns no one: retrieved, so it is never reported.
        starting.add_done_callback(lambda task: task.cancelled() or task.exception())
        # Cancelled mid-call a client may take a moment; one that does not answer at all
        # (a broker that accepts and never replies) is left behind, bounded.
        if not await within(starting, self._forced, CLOSE_TIMEOUT_S):
            log.warning("shutdown_step_abandoned", step="startup", reason="no answer")
        return False

    async def _serve(self) -> None:
        """Fetch and process until ``request_stop``; then stop fetching and drain."""
        async with asyncio.TaskGroup() as tasks:
            dispatch = self.dispatcher.run(tasks)
            fetching = tasks.create_task(
                self.intake.run(dispatch, self.delivery.admits), name="intake"
            )
            background = [
                tasks.create_task(self.delivery.commit_loop(), name="commits"),
                tasks.create_task(
                    self.breaker.probe_loop(
                        self.pool.server_live,
                        self.settings.retry.breaker_probe_interval_ms / 1000,
                        self._report_health,
                    ),
                    name="triton-health",
                ),
                tasks.create_task(self.models.probe_loop(), name="model-readiness"),
                tasks.create_task(self.model_health.probe_loop(), name="model-health"),
                tasks.create_task(self.inflight.watch(), name="stuck-records"),
            ]
            if self.registry is not None:
                interval_s = self.settings.retry.breaker_probe_interval_ms / 1000
                background.append(
                    tasks.create_task(self.registry.probe_loop(interval_s), name="registry-health")
                )
            if self.result_schemas is not None and self.result_schemas.pending:
                background.append(
                    tasks.create_task(
                        self.result_schemas.resolve_loop(self._model_spec, interval_s),
                        name="result-schemas",
                    )
                )
            self.started.set()
            await self._stop.wait()
            self.intake.request_stop()
            await fetching
            await self._drain()
            for task in background:
                task.cancel()

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
        self.abandoned = True
        self.dispatcher.cancel_all()

    async def _drain(self) -> None:
        """Wait for in-flight records within the bound, then commit what is done."""
        timeout_s = self.settings.ops.shutdown_timeout_s
        if not await within(self.window.wait_empty(), self._forced, timeout_s):
            if not self._forced.is_set():
                log.warning("drain_timeout", in_flight=self.window.in_flight, timeout_s=timeout_s)
            self.abandoned = True
            self.dispatcher.cancel_all()
        await self._cancelled_records_end()
        await bounded_step(self.delivery.commit(), "final_commit", self._forced)

    async def _cancelled_records_end(self) -> None:
        """Wait (bounded) for the records' tasks to end, cancelling again those that go on.

        A cancellation can be lost: ``asyncio.wait_for`` (Python 3.11) returns a response
        that arrived as it was cancelled, and its record then goes on to publish, to a
        broker that may not answer. Cancelled again, it ends at its next wait.
        """
        deadline = asyncio.get_running_loop().time() + CLOSE_TIMEOUT_S
        while self.dispatcher.running:
            running = asyncio.gather(*self.dispatcher.running, return_exceptions=True)
            # On timeout `within` cancels the gathering, which cancels each record again.
            if await within(running, self._forced, _RECANCEL_S):
                return
            if self._forced.is_set() or asyncio.get_running_loop().time() > deadline:
                log.warning("shutdown_step_abandoned", step="records", reason="still running")
                return

    async def stop(self) -> None:
        """Close Triton streams, the producer, the consumer, the HTTP server. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        await self.batcher.close()
        await bounded_step(
            self.pool.close(drain_timeout_s=5.0), "triton_close", self._forced, unbounded=True
        )
        await bounded_step(self.delivery.close(), "transactions_close", self._forced)
        await bounded_step(self.publisher.stop(), "producer_close", self._forced)
        await bounded_step(self.intake.stop(), "consumer_close", self._forced)
        if self.health is not None:
            await self.health.stop()
        self.tracing.shutdown()
        log.info("worker_stopped")

    # -- rebalances ---------------------------------------------------------------

    async def on_revoked(self, partitions: set[TopicPartition], *, lost: bool = False) -> None:
        """Wait (bounded) for the revoked partitions' in-flight records, then hand them over;
        lost ones (the group has moved on) at once: nothing of them can be committed."""
        if partitions:  # the first join reports an empty revocation (aiokafka)
            in_flight = sum(self.window.in_flight_for(tp) for tp in partitions)
            log.info(
                "partitions_revoked",
                partitions=sorted(map(str, partitions)),
                in_flight=in_flight,
                lost=lost,
            )
        if not lost:
            waits = [self.window.wait_empty(tp) for tp in partitions]
            try:
                await asyncio.wait_for(asyncio.gather(*waits), self.settings.kafka.revoke_timeout_s)
            except TimeoutError:
                log.warning("revoke_drain_timeout", partitions=sorted(map(str, partitions)))
        await self.delivery.revoked(partitions, lost=lost)

    async def on_assigned(self, partitions: set[TopicPartition]) -> None:
        """Prepare what the delivery mode needs before the partitions' records are done."""
        await self.delivery.assigned(partitions)

    async def _model_spec(self, name: str, version: str) -> ModelSpec:
        """The model's spec from Triton, bounded: one that does not answer is late."""
        try:
            return await asyncio.wait_for(self.pool.model_spec(name, version), CHECK_TIMEOUT_S)
        except TimeoutError:
            raise TritonTimeout(f"model {name!r}: no metadata in {CHECK_TIMEOUT_S:.0f} s") from None

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
        return readiness_of(
            consumer_running=self.intake.running,
            triton_up=self.triton_up,
            breaker_open=self.breaker.is_open,
            models_not_ready=self.models.held(),
            models_failing=self.model_health.failing(),
            partitions_not_ready=self.delivery.not_ready(),
        )


def build_triton(settings: Settings, metrics: Metrics) -> tuple[TritonPool, MicroBatcher]:
    """The pool of streams to the Triton endpoints ``WORKER_TRITON_URL`` names, and the
    micro-batcher of the per-record path in front of it."""
    triton = settings.triton
    pool = TritonPool(
        triton.triton_url,
        triton.triton_streams,
        client_kwargs=triton_auth.triton_client_kwargs(triton),
        auth=triton_auth.TritonAuth(triton),
        shm_min_bytes=triton.shm_min_bytes if triton.triton_shm == "system" else None,
        shm_pool_bytes=triton.shm_pool_bytes,
        resolve_interval_s=triton.triton_resolve_interval_s,
        metrics=metrics,
        trace_unary=triton.triton_trace == "unary",
    )
    flow = settings.flow
    return pool, MicroBatcher(pool, flow.batch_max_size, flow.batch_delay_ms / 1000)


def build_result_schemas(
    settings: Settings, steps: Steps
) -> tuple[Registry | None, ResultSchemas | None]:
    """The Schema Registry of the registry-format topics (as the steps read it) and the
    resolution of their results' schemas; (None, None) without such a topic."""
    registry = steps.rules.registry
    if registry is None:
        return None, None
    # The registry's failed requests are counted as retries, by their code.
    registry.writers.on_retry = steps.retried
    results = ResultSchemas(
        registry,
        steps.rules.mappings,
        settings.topics.output_topic,
        settings.registry.schema_registry_auto_register,
    )
    return registry, results


def build_model_holds(
    settings: Settings, pool: TritonPool, metrics: Metrics
) -> tuple[ModelGate, ModelHealth]:
    """The models' holds: reloads waited for (``ModelGate``), failure rates (``ModelHealth``)."""
    models = ModelGate(
        seen_ready=pool.has_spec,
        listed=pool.repository_listing,
        ready=pool.model_ready,
        released=lambda name, _version: pool.forget_model(name),
        interval_s=settings.retry.breaker_probe_interval_ms / 1000,
    )
    health = ModelHealth.from_settings(
        settings.retry, lambda name, _, is_open: metrics.model_breaker_changed(name, is_open)
    )
    return models, health


def build_limiter(settings: Settings, window: Window) -> AdaptiveLimiter | None:
    """The adaptive in-flight limit (``WORKER_WINDOW_MODE=adaptive``), or None."""
    flow = settings.flow
    if flow.window_mode != "adaptive":
        return None
    return AdaptiveLimiter(window, flow.min_in_flight, flow.max_in_flight)


#: aiokafka's fetcher leaves a reference cycle (a partition's fetched records and the
#: generator unpacking them) for each fetch it does not iterate to the end, holding that
#: fetch's bytes until the cyclic collector runs. Python 3.13 raised the young
#: generation's threshold from 700 allocations to 2,000, and the fast path allocates
#: little per record: on 3.13 such garbage was seen to reach about 100 MiB while a
#: backlog drained. 700 is the threshold of 3.11 and 3.12.
GC_YOUNG_THRESHOLD = 700


def freeze_heap() -> int:
    """Collect, then move every object alive into the collector's permanent generation;
    the number of objects frozen.

    A full collection goes through every object the collector tracks: once the worker has
    started, some 65,000 of them (modules, clients, protobuf descriptors) that live as
    long as the process. While a backlog drained, each full pass took 20-30 ms, a third of
    the collector's time (a tenth of the worker's CPU went to the collector); with them
    frozen, 2 ms. What they let go of later is freed by reference counting as before; one
    of them dropped in a reference cycle would stay, which a process serving one worker
    does not do to its start-up objects.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def run_async(main: Coroutine[Any, Any, int]) -> int:
    """Run on uvloop where it is installed (faster I/O), else on asyncio's own loop.

    The cyclic collector's young generation is collected at least every
    ``GC_YOUNG_THRESHOLD`` allocations (see there).
    """
    young, *older = gc.get_threshold()
    if young > GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, *older)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def serve(settings: Settings, worker: Worker | None = None) -> int:
    """The process's main: run a worker under SIGTERM/SIGINT; return the exit code.

    0 after a clean stop; 1 (``ExitCode.FORCED``) when records were abandoned: a second
    signal, or a drain that outlived ``WORKER_SHUTDOWN_TIMEOUT_S``. After a second
    signal the process ends within ``FORCED_EXIT_S`` (``worker.shutdown``), even from
    outside the event loop: call it only as the process's last act.
    """
    if worker is None:
        worker = Worker(settings)
        worker.freezes_heap = True
    signals = TwoStageSignals(worker)
    signals.install()
    try:
        await worker.run()
    finally:
        signals.uninstall()
    return ExitCode.FORCED if signals.received > 1 or worker.abandoned else ExitCode.OK
