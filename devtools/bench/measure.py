"""Measuring a variant: topics, producing requests, collecting results, process CPU and memory.

End-to-end latency is the broker's timestamp of a result (the output topic uses
``LogAppendTime``) minus the time its request was produced (the request's
``CreateTime``, set here at send). Results are read ``read_committed``, as a reader of
the results of an exactly_once worker reads them: a result of a transaction later
aborted is never counted (the worker writes a transaction's results when it commits
it, so their append time is within milliseconds of the commit). A result is matched
with its request by its ``x-request-id`` header (the worker's results carry it), else
by its key (the loops keep the request's key, its id). CPU and memory come from
``/proc`` of the process that does the work, so the benchmark's own producer and
collector are not counted.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from devtools.samples import SampleRequest

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def tree_cpu_s(pid: int | None) -> float:
    """CPU seconds of ``pid`` and of its child processes alive now: Triton runs each
    Python-backend model instance in a stub process of its own, whose CPU is the model's."""
    if pid is None:
        return 0.0
    return cpu_s(pid) + sum(cpu_s(child) for child in _children(pid))


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (read from each one's ``/proc`` stat)."""
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) and int(fields[1]) == pid:
            children.append(int(entry))
    return children


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (which may contain
    spaces, closed by ')'), from the state on; None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of ``pid`` so far (0 when unknown or gone)."""
    fields = None if pid is None else _stat_fields(pid)
    if not fields:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def peak_rss_bytes(pid: int | None) -> int:
    """Peak resident memory (VmHWM) of ``pid``; 0 when unknown or gone."""
    if pid is None:
        return 0
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def percentiles_ms(latencies_ms: Sequence[float]) -> dict[str, float]:
    """p50, p95 and p99 of ``latencies_ms`` (zeros for an empty list)."""
    if not latencies_ms:
        return {"p50": 0.0, "p95": 0.0, "p99": 0.0}
    p50, p95, p99 = np.percentile(np.asarray(latencies_ms), [50, 95, 99])
    return {"p50": float(p50), "p95": float(p95), "p99": float(p99)}


async def create_topics(bootstrap: str, names: Sequence[str], partitions: int) -> None:
    """Create topics whose records the broker timestamps on append; wait for their leaders."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await admin.start()
    try:
        config = {"message.timestamp.type": "LogAppendTime"}
        await admin.create_topics([NewTopic(n, partitions, 1, topic_configs=config) for n in names])
    finally:
        await admin.close()
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        for _ in range(100):
            await consumer._client.force_metadata_update()
            if all(len(consumer.partitions_for_topic(n) or ()) == partitions for n in names):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"topics {list(names)} have no leaders after 10 s")
    finally:
        await consumer.stop()


def ordering_key(request_id: str, keys: int) -> bytes:
    """The record key of a request: one of ``keys`` keys, the same for the same id (a hash
    of it); with ``keys`` 0, the request's id itself (every key distinct)."""
    if keys <= 0:
        return request_id.encode()
    return f"key-{zlib.crc32(request_id.encode()) % keys}".encode()


def result_id(key: bytes | None, headers: Sequence[tuple[str, bytes]]) -> bytes | None:
    """The id of the request a result answers: its ``x-request-id`` header, else its key."""
    for name, value in headers:
        if name == "x-request-id":
            return value
    return key


class Producer:
    """Sends benchmark requests, remembering when each was produced (by request id)."""

    def __init__(self, bootstrap: str, keys: int = 0) -> None:
        self._producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=8 << 20
        )
        #: Record keys: see ``ordering_key``.
        self._keys = keys
        self.sent_ms: dict[bytes, int] = {}

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def send(
        self,
        topic: str,
        requests: Sequence[SampleRequest],
        rate: float | None = None,
        advance: Callable[[int], None] | None = None,
    ) -> None:
        """Produce ``requests`` as fast as possible, or paced at ``rate`` per second."""
        started = time.monotonic()
        acks = []
        for index, request in enumerate(requests):
            if rate:
                delay_s = started + index / rate - time.monotonic()
                if delay_s > 0:
                    await asyncio.sleep(delay_s)
            key = ordering_key(request.request_id, self._keys)
            now_ms = int(time.time() * 1000)
            self.sent_ms[request.request_id.encode()] = now_ms
            acks.append(
                await self._producer.send(
                    topic, request.value, key=key, headers=request.headers, timestamp_ms=now_ms
                )
            )
            if advance is not None:
                advance(1)
        await asyncio.gather(*acks)


@dataclass(frozen=True, slots=True)
class Collected:
    """When each wanted result arrived (broker time, ms)."""

    result_ms: dict[bytes, int]

    def latencies_ms(self, sent_ms: dict[bytes, int]) -> list[float]:
        return [float(ts - sent_ms[key]) for key, ts in self.result_ms.items() if key in sent_ms]

    def records_per_s(self) -> float:
        """Throughput between the first and the last result."""
        stamps = sorted(self.result_ms.values())
        if len(stamps) < 2:
            return 0.0
        return (len(stamps) - 1) / max((stamps[-1] - stamps[0]) / 1000, 1e-3)


class Collector:
    """Reads a result topic from its start, committed results only; hands them out by
    request id."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            enable_auto_commit=False,
            fetch_max_wait_ms=50,
            isolation_level="read_committed",
        )
        self._topic = topic
        self._seen: dict[bytes, int] = {}

    async def start(self) -> None:
        await self._consumer.start()
        partitions = self._consumer.partitions_for_topic(self._topic)
        if not partitions:
            await self._consumer._client.force_metadata_update()
            partitions = self._consumer.partitions_for_topic(self._topic) or set()
        assigned = [TopicPartition(self._topic, p) for p in sorted(partitions)]
        self._consumer.assign(assigned)
        await self._consumer.seek_to_beginning(*assigned)

    async def stop(self) -> None:
        await self._consumer.stop()

    async def gather(
        self,
        keys: Sequence[bytes],
        timeout_s: float,
        advance: Callable[[int], None] | None = None,
        on_first: Callable[[], None] | None = None,
    ) -> Collected:
        """Wait until every request id in ``keys`` has a result (or the timeout); return
        their broker times."""
        wanted = set(keys)
        found = {k: self._seen[k] for k in wanted if k in self._seen}
        deadline = time.monotonic() + timeout_s
        while len(found) < len(wanted) and time.monotonic() < deadline:
            batches = await self._consumer.getmany(timeout_ms=200, max_records=5000)
            new = 0
            for records in batches.values():
                for record in records:
                    request_id = result_id(record.key, record.headers)
                    if request_id is None:
                        continue
                    self._seen.setdefault(request_id, record.timestamp)
                    if request_id in wanted and request_id not in found:
                        if not found and on_first is not None:
                            on_first()
                        found[request_id] = record.timestamp
                        new += 1
            if advance is not None and new:
                advance(new)
        return Collected(found)


def spawn(command: list[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start a worker process (or a loop) with ``env`` over an environment without the
    caller's WORKER_* variables, its output to ``log_path``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    full_env.update(env)
    with log_path.open("wb") as log:
        return subprocess.Popen(command, env=full_env, stdout=log, stderr=subprocess.STDOUT)


async def stop(child: subprocess.Popen[bytes], timeout_s: float = 20.0) -> None:
    """SIGTERM (the worker drains and commits), then SIGKILL after the timeout."""
    child.terminate()
    try:
        await asyncio.to_thread(child.wait, timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        await asyncio.to_thread(child.wait)
