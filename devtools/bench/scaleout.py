"""Scale-out: records/s of N worker processes in one consumer group, latency-bound model.

The model is ``faulty`` with a ``DELAY_MS`` sleep, so a request costs time, not
CPU. Each worker gets a small window (``max_in_flight``), so one worker is
limited by its window: its throughput is about ``max_in_flight`` / (model delay
+ the Kafka round trip). N workers bring N windows; as long as Triton has
instances to spare (``faulty`` has four), throughput grows with N.

Method, for each N: fresh topics; N ``python -m worker run`` processes in one
group; wait until their latest assignments are disjoint and cover every
partition (read from their ``partitions_assigned`` log events); a warm-up
round trip; then a burst of records, timed from its first result to its last
(broker ``LogAppendTime``).
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from devtools import samples
from devtools.bench.measure import Collector, Producer, create_topics, spawn, stop

__all__ = ["ScaleOutPoint", "measure_workers"]


@dataclass(frozen=True, slots=True)
class ScaleOutPoint:
    """Throughput of ``workers`` processes on one burst."""

    workers: int
    records: int
    records_per_s: float


def _requests(count: int, delay_ms: int, seed: int) -> list[samples.SampleRequest]:
    rng = np.random.default_rng(seed)
    return [
        samples.faulty_request(rng, f"scale-{seed}-{i}", delay_ms=delay_ms) for i in range(count)
    ]


def _latest_assignments(log_path: Path) -> set[str] | None:
    latest = None
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if '"partitions_assigned"' not in line:
            continue
        try:
            latest = set(json.loads(line)["partitions"])
        except (ValueError, KeyError):
            continue
    return latest


async def _wait_balanced(
    logs: list[Path], partitions: int, procs: list[subprocess.Popen[bytes]], timeout_s: float
) -> None:
    """Until every worker's latest assignment is disjoint from the others' and all are covered."""
    deadline = time.monotonic() + timeout_s
    while True:
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"a worker exited with {proc.returncode} (see {log})")
        sets = [_latest_assignments(log) for log in logs]
        if all(sets):
            union = set().union(*(s for s in sets if s))
            if len(union) == partitions and sum(len(s or ()) for s in sets) == partitions:
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the group did not settle within {timeout_s:.0f} s: {sets}")
        # Log files have no change notification to wait on: poll them.
        await asyncio.sleep(0.1)


async def measure_workers(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    workers: int,
    records: int,
    delay_ms: int = 20,
    max_in_flight: int = 1,
    partitions: int = 6,
    extra_env: Mapping[str, str] | None = None,
) -> ScaleOutPoint:
    """Start ``workers`` processes in one group; time a burst of ``records`` through them."""
    run = f"scale-{uuid.uuid4().hex[:8]}-{workers}"
    topic_in, topic_out, topic_dlq = f"{run}-in", f"{run}-out", f"{run}-dlq"
    await create_topics(bootstrap, [topic_in], partitions)
    await create_topics(bootstrap, [topic_out, topic_dlq], 1)
    env = {
        "WORKER_BOOTSTRAP_SERVERS": bootstrap,
        "WORKER_TRITON_URL": triton_url,
        "WORKER_INPUT_TOPICS": topic_in,
        "WORKER_OUTPUT_TOPIC": topic_out,
        "WORKER_DLQ_TOPIC": topic_dlq,
        "WORKER_GROUP_ID": f"{run}-group",
        "WORKER_METRICS_PORT": "0",
        "WORKER_LOG_FORMAT": "json",
        "WORKER_LOG_LEVEL": "info",
        "WORKER_MAX_IN_FLIGHT": str(max_in_flight),
        "WORKER_MAX_IN_FLIGHT_PER_PARTITION": str(max_in_flight),
        **(extra_env or {}),
    }
    logs = _log_paths(out_dir, run, workers)
    procs = [spawn([sys.executable, "-m", "worker", "run"], env, log) for log in logs]
    collector = Collector(bootstrap, topic_out)
    producer = Producer(bootstrap)
    await collector.start()
    await producer.start()
    try:
        await _wait_balanced(logs, partitions, procs, timeout_s=60)
        warm = _requests(2 * partitions, delay_ms, seed=1)
        await producer.send(topic_in, warm)
        await collector.gather([r.request_id.encode() for r in warm], timeout_s=60)
        burst = _requests(records, delay_ms, seed=2)
        await producer.send(topic_in, burst)
        collected = await collector.gather(
            [r.request_id.encode() for r in burst], timeout_s=60 + records / 10
        )
        if len(collected.result_ms) != records:
            raise RuntimeError(f"only {len(collected.result_ms)}/{records} results")
        return ScaleOutPoint(workers, records, collected.records_per_s())
    finally:
        await producer.stop()
        await collector.stop()
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        await asyncio.gather(*(stop(proc) for proc in procs))


def _log_paths(out_dir: Path, run: str, workers: int) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    return [out_dir / f"{run}-worker-{i}.log" for i in range(workers)]
