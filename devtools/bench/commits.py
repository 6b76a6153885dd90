"""The commit interval's trade-off: commits sent to the group coordinator against crash cost.

For each interval: one worker drains a backlog; after a third of it is answered the
worker is SIGKILLed and a second one finishes. The first worker's commits per second
(``worker_commits_total`` over its run) is what each worker of a fleet sends to the
coordinator; the duplicates (outcomes of the same input offset written twice) are
what a crash costs.
"""

from __future__ import annotations

import asyncio
import signal
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer

from devtools import samples
from devtools.bench.extras import _python, _scrape, produce_backlog
from devtools.bench.measure import create_topics, spawn, stop
from devtools.devstack.process import free_port
from worker.wire import header_value

__all__ = ["CommitPoint", "commit_intervals"]


@dataclass(frozen=True, slots=True)
class CommitPoint:
    """One interval: what it costs the coordinator, and what a crash costs."""

    interval_ms: int
    records: int
    records_per_s: float
    commits_per_s: float
    duplicates: int


async def _count_outcomes(
    bootstrap: str, topic: str, until: int, timeout_s: float
) -> dict[tuple[bytes, bytes], int]:
    """Outcomes per input (partition, offset), read until ``until`` distinct ones are there."""
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    seen: dict[tuple[bytes, bytes], int] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(seen) < until and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for r in records:
                    key = (
                        header_value(r.headers, "x-source-partition") or b"",
                        header_value(r.headers, "x-source-offset") or b"",
                    )
                    seen[key] = seen.get(key, 0) + 1
    finally:
        await consumer.stop()
    return seen


async def _one(
    bootstrap: str,
    triton: str,
    out_dir: Path,
    interval_ms: int,
    records: int,
    settings: Mapping[str, str],
) -> CommitPoint:
    run = f"commits-{uuid.uuid4().hex[:8]}"
    topics = (f"{run}-in", f"{run}-out", f"{run}-dlq")
    await create_topics(bootstrap, list(topics), 4)
    request = samples.good_requests(1, seed=5, models=("double",))[0]
    await produce_backlog(bootstrap, topics[0], request, records, 4)
    port = free_port()
    env: dict[str, Any] = {
        "WORKER_BOOTSTRAP_SERVERS": bootstrap,
        "WORKER_TRITON_URL": triton,
        "WORKER_INPUT_TOPICS": topics[0],
        "WORKER_OUTPUT_TOPIC": topics[1],
        "WORKER_DLQ_TOPIC": topics[2],
        "WORKER_GROUP_ID": f"{run}-group",
        "WORKER_METRICS_PORT": str(port),
        "WORKER_LOG_LEVEL": "warning",
        "WORKER_COMMIT_INTERVAL_MS": str(interval_ms),
        **{f"WORKER_{k}": v for k, v in settings.items()},
    }
    first = spawn([_python(), "-m", "worker", "run"], env, out_dir / f"{run}-first.log")
    started, metrics, done = time.monotonic(), {}, 0
    try:
        while done < records // 2:
            await asyncio.sleep(0.2)  # sampling the worker's metrics, not synchronisation
            if first.poll() is not None:
                raise RuntimeError(f"the worker exited with {first.returncode}")
            try:
                metrics = await asyncio.to_thread(_scrape, port)
            except OSError:
                continue
            done = int(metrics.get("worker_results_published_total", 0))
        elapsed = time.monotonic() - started
        first.send_signal(signal.SIGKILL)
        await asyncio.to_thread(first.wait)
    finally:
        if first.poll() is None:
            first.kill()
    env["WORKER_METRICS_PORT"] = "0"
    second = spawn([_python(), "-m", "worker", "run"], env, out_dir / f"{run}-second.log")
    try:
        seen = await _count_outcomes(bootstrap, topics[1], records, timeout_s=300)
    finally:
        await stop(second)
    return CommitPoint(
        interval_ms=interval_ms,
        records=records,
        records_per_s=done / elapsed if elapsed else 0.0,
        commits_per_s=metrics.get("worker_commits_total", 0.0) / elapsed if elapsed else 0.0,
        duplicates=sum(n - 1 for n in seen.values()),
    )


async def commit_intervals(
    bootstrap: str,
    triton: str,
    out_dir: Path,
    *,
    records: int,
    settings: Mapping[str, str],
    intervals_ms: tuple[int, ...] = (100, 250, 500, 1000, 2000),
) -> list[CommitPoint]:
    """One CommitPoint per interval, in turn."""
    return [await _one(bootstrap, triton, out_dir, ms, records, settings) for ms in intervals_ms]
