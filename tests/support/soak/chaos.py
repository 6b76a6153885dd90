"""The running system under its schedule: the current worker, the servers, the faults applied.

Every fault tells the progress watcher whether it makes progress impossible (and for
how long after it ends), so that a partition stalled outside those windows fails the
soak while it runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from devtools.devstack.process import free_port, tail
from tests.support import Topics, metric_sum, metrics_text, worker_env
from tests.support.soak.outcomes import Collector, Tripwire
from tests.support.soak.processes import WorkerProcess
from tests.support.soak.progress import OffsetReader, Progress
from tests.support.soak.schedule import Fault
from tests.support.soak.servers import Servers, Stack
from tests.support.worker import kafka_client_under_test

WORKER_CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
STEP_TIMEOUT_S = 60.0  # any one fault, restart or recovery
#: A worker draining after SIGTERM for longer than this has its records in flight printed.
DRAIN_NOTE_S = 5.0
#: A SIGKILLed member keeps its partitions until its session expires (the worker's
#: WORKER_SESSION_TIMEOUT_MS in the soak).
SESSION_TIMEOUT_S = 6.0
#: On librdkafka under exactly_once the new owner's offset fetch also waits for the broker
#: to abort the dead member's open transaction (the worker's transaction.timeout.ms).
TRANSACTION_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Applied:
    """A fault as applied: when it began, when the worker answered again, how long it took."""

    fault: Fault
    started_wall_ms: int
    ended_wall_ms: int
    took_s: float


class Chaos:
    """The current worker, the servers and the faults; the watchers that trip the soak."""

    def __init__(
        self,
        stack: Stack,
        topics: Topics,
        logs: Path,
        seed: int,
        collector: Collector,
        settings: Mapping[str, str],
    ) -> None:
        self.stack, self.topics, self.logs = stack, topics, logs
        self.collector = collector
        self.settings = dict(settings)
        self.workers: list[WorkerProcess] = []
        self.applied: list[Applied] = []
        self.kills_wall_ms: list[int] = []
        #: (start, end) wall ms of every disturbance: the faults and the final hand-over.
        self.windows: list[tuple[int, int]] = []
        self.tripwire = Tripwire(self.context)
        self.servers = Servers(stack, self.tripwire, self.say)
        self.progress: Progress | None = None
        self._codecs = random.Random(f"{seed}-worker-codecs")
        self.t0 = time.monotonic()
        self.t0_wall_ms = int(time.time() * 1000)
        #: The current worker's records in flight when the worst stall was last noted.
        self.worst_inflight = ""
        self._noted_at = 0.0

    @property
    def current(self) -> WorkerProcess:
        return self.workers[-1]

    def context(self) -> str:
        """What a failure message should show: the worker's log, the servers' state."""
        parts = []
        if self.workers:
            parts.append(f"last lines of {self.current.name}:\n{tail(self.current.log_path, 30)}")
            parts.append(self._partition_state())
        for triton in self.stack.tritons:
            parts.append(triton.death_report() or f"triton {triton.grpc_address}: up or stopped")
        parts.append(f"broker nodes running: {self.stack.kafka.running_nodes()}")
        parts.append(f"registry running: {self.stack.registry.running()}")
        return "\n".join(parts)

    def _partition_state(self) -> str:
        """The current worker's readiness and per-partition gauges (a stall's context)."""
        port = self.current.port
        names = ("worker_consumer_lag", "worker_partitions_assigned", "worker_paused_partitions")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as got:
                ready = got.read().decode()
        except urllib.error.HTTPError as refused:
            ready = refused.read().decode()
        except OSError as exc:
            return f"{self.current.name}: no answer on its port ({exc})"
        with contextlib.suppress(OSError):
            gauges = [line for line in metrics_text(port).splitlines() if line.startswith(names)]
            ready += "\n" + "\n".join(gauges)
        return f"{self.current.name} /readyz and partition gauges:\n{ready}"

    def say(self, line: str) -> None:
        print(f"SOAK t={time.monotonic() - self.t0:6.1f}s {line}", flush=True)

    def excuse(self, reason: str = "fault") -> None:
        if self.progress is not None:
            self.progress.excuse(reason)

    def resume(self, reason: str = "fault", settle_s: float = 0.0) -> None:
        if self.progress is not None:
            self.progress.resume(reason, time.monotonic(), settle_s)

    async def start_worker(self) -> WorkerProcess:
        """A new worker process (seeded producer codec); returns once it is ready."""
        name = f"w{len(self.workers)}"
        codec = self._codecs.choice(WORKER_CODECS)
        port = free_port()
        # Its own client id unless the run's settings give every worker one.
        settings = {"client_id": f"soak-{name}", **self.settings}
        env = worker_env(
            self.stack.kafka,
            self.stack.tritons[0],
            self.topics,
            **settings,
            triton_url=",".join(t.grpc_address for t in self.stack.tritons),
            metrics_port=str(port),
            compression_type=codec,
        )
        worker = WorkerProcess(name, env, self.logs / f"{name}.log", port)
        self.workers.append(worker)
        await worker.start(self.tripwire)
        await self.tripwire.guard(worker.wait_fully_ready(), STEP_TIMEOUT_S, f"{name} ready")
        self.say(f"{name} (pid {worker.pid}, producer codec {codec}) ready")
        return worker

    async def stop_worker(self, how: signal.Signals) -> None:
        worker = self.current
        if how == signal.SIGKILL:
            self.kills_wall_ms.append(int(time.time() * 1000))
        worker.signal(how)
        exiting = asyncio.ensure_future(worker.wait())
        done, _ = await asyncio.wait({exiting}, timeout=DRAIN_NOTE_S)
        if not done:  # still draining: say where its records are
            self.say(f"{worker.name} still draining: {await asyncio.to_thread(worker.inflight)}")
        code = await self.tripwire.guard(exiting, STEP_TIMEOUT_S, f"{worker.name} exit")
        if how == signal.SIGTERM and b'"drain_timeout"' in worker.log_path.read_bytes():
            worker.expected_exit = 1  # records still held at the drain's bound were abandoned
        assert code == worker.expected_exit, (
            f"{worker.name} exited {code} after {how.name}, expected {worker.expected_exit}:\n"
            f"{tail(worker.log_path, 40)}"
        )

    async def apply(self, fault: Fault) -> float:
        """Apply one fault and bring the failed part back; returns the seconds it took."""
        started = time.monotonic()
        kind = fault.kind
        if kind in ("worker_kill", "worker_stop"):
            await self._replace_worker(fault)
        elif kind == "endpoint_kill":
            # One endpoint down is no outage: the other serves, progress must go on.
            victim = (self.stack.tritons[fault.endpoint],)
            await self.servers.bounce_tritons(victim, kill=True, down_s=fault.down_s)
        else:
            # The others make progress impossible for a while: the broker or every Triton
            # down, a model away, or the registry (their records hold their offsets: no
            # partition can commit past them).
            self.excuse()
            if kind == "broker_restart":
                await self.servers.restart_broker(fault.down_s)
            elif kind == "registry_restart":
                await self.servers.restart_registry(fault.down_s)
            elif kind == "model_reload":
                await self.servers.reload_model(fault.model, fault.down_s)
            else:
                kill = kind == "triton_kill"
                await self.servers.bounce_tritons(self.stack.tritons, kill, fault.down_s)
            self.resume()
        took_s = time.monotonic() - started
        detail = {"model_reload": f" {fault.model}", "endpoint_kill": f" {fault.endpoint}"}
        self.say(f"{kind}{detail.get(kind, '')} (down {fault.down_s:.1f} s) in {took_s:.1f} s")
        return took_s

    async def _replace_worker(self, fault: Fault) -> None:
        self.excuse()  # no worker in the group for a while
        killed = fault.kind == "worker_kill"
        await self.stop_worker(signal.SIGKILL if killed else signal.SIGTERM)
        await asyncio.sleep(fault.down_s)  # no worker at all for this long
        await self.start_worker()
        settle_s = 0.0
        if killed:
            settle_s = SESSION_TIMEOUT_S
            transactional = self.settings.get("delivery") == "exactly_once"
            if transactional and kafka_client_under_test() == "confluent":
                settle_s += TRANSACTION_TIMEOUT_S
        self.resume(settle_s=settle_s)

    async def recovered(self, after: str) -> None:
        """The current worker is ready with no model held, a new outcome has arrived, and
        every Triton endpoint is in its rotation again (a sequence started meanwhile on the
        other endpoint moves back then, and loses its state: part of the disturbance)."""
        answered = len(self.collector.outcomes)
        await self.tripwire.guard(
            self.current.wait_fully_ready(), STEP_TIMEOUT_S, f"worker ready after {after}"
        )
        await self.tripwire.guard(
            self.collector.wait_for(lambda: len(self.collector.outcomes) > answered),
            STEP_TIMEOUT_S,
            f"progress after {after}",
        )
        await self.tripwire.guard(
            self._endpoints_in_rotation(), STEP_TIMEOUT_S, f"endpoints in rotation after {after}"
        )
        self.current.mark_warm()

    async def _endpoints_in_rotation(self) -> None:
        want, port = len(self.stack.tritons), self.current.port
        while True:
            if await asyncio.to_thread(metric_sum, port, "worker_triton_endpoint_up") >= want:
                return
            await asyncio.sleep(0.2)  # polling another process's metrics: nothing to await

    async def run_fault(self, fault: Fault) -> None:
        """One fault of the schedule, applied and recovered from, and noted."""
        wall_ms = int(time.time() * 1000)
        took_s = await self.tripwire.guard(self.apply(fault), 2 * STEP_TIMEOUT_S, fault.kind)
        await self.recovered(fault.kind)
        ended_ms = int(time.time() * 1000)
        self.applied.append(Applied(fault, wall_ms, ended_ms, took_s))
        self.windows.append((wall_ms, ended_ms))

    async def watch_servers(self, stop: asyncio.Event) -> None:
        """The supervisor: a Triton that dies by itself is started again (progress excused
        while none serves); a broker that dies by itself trips the soak."""

        def all_down(down: bool) -> None:
            if down:
                self.excuse("no Triton")
            else:
                self.resume("no Triton")

        await self.servers.supervise(stop, all_down)

    async def _note_worst(self) -> None:
        """Keep where the records were when the worst stall so far, once past half its
        bound, was seen (printed with the run's figures)."""
        assert self.progress is not None and self.progress.worst is not None
        worst = self.progress.worst
        if worst.seconds >= self.progress.bound_s / 2 and worst.at - self._noted_at >= 2.0:
            self._noted_at = worst.at
            self.worst_inflight = await asyncio.to_thread(self.current.inflight)

    async def watch_progress(
        self, stop: asyncio.Event, reader: OffsetReader, ends: Mapping[int, int], every_s: float
    ) -> None:
        """Every ``every_s``: the committed offsets against the ends (a stall over the bound
        trips the soak), and the current worker's resident memory."""
        assert self.progress is not None
        while not stop.is_set():
            committed = await reader.read()
            worst = self.progress.worst
            stall = self.progress.observe(time.monotonic(), committed, ends)
            if self.progress.worst is not worst and self.workers:
                await self._note_worst()
            if stall is not None:
                inflight = await asyncio.to_thread(self.current.inflight)
                self.tripwire.trip(
                    f"{stall.describe(self.progress.bound_s)}\n{self.context()}\n{inflight}"
                )
            if self.workers:
                self.current.sample_rss()
            await _pause(stop, every_s)  # sampling other processes' state: no event to await


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
