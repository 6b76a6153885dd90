"""What is in flight, and what is stuck: /debug/inflight, the oldest-record gauge, record_stuck.

A worker runs in this process against the real Kafka and Triton, with the ``faulty``
model answering slowly (its four instances let fast requests pass the slow ones).
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import structlog

from devtools.devstack.process import free_port
from devtools.samples import faulty_request
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    running_worker,
    send,
    settings_for,
)

pytestmark = pytest.mark.timeout(180)

#: Long enough to read the endpoint and watch the gauge grow past the stuck bound.
_SLOW_MS = 8000
_STUCK_AFTER_S = 1.0


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


async def _inflight(port: int, path: str = "/debug/inflight") -> dict[str, Any]:
    status, body = await asyncio.to_thread(_get, port, path)
    assert status == 200, (status, body)
    snapshot: dict[str, Any] = json.loads(body)
    return snapshot


async def _gauge(port: int) -> float:
    status, text = await asyncio.to_thread(_get, port, "/metrics")
    assert status == 200
    line = next(x for x in text.splitlines() if x.startswith("worker_oldest_in_flight_seconds "))
    return float(line.rsplit(" ", 1)[1])


async def _until(what: str, check: Callable[[], Any], timeout_s: float = 30) -> None:
    """Poll the worker's endpoints (``check`` is a coroutine function) until it is true."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not seen in {timeout_s} s: {what}"
        await asyncio.sleep(0.1)  # the worker's HTTP answers are what is awaited


def _by_partition(snapshot: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {p["partition"]: p for p in snapshot["partitions"]}


async def test_inflight_lists_slow_records_with_their_partitions_and_commit_points(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Slow records: listed with offsets, state and age; commit points; gauge rises; stuck once."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    port = free_port()
    settings = settings_for(
        kafka,
        triton,
        topics,
        metrics_port=str(port),
        debug_endpoints="true",
        stuck_after_s=str(_STUCK_AFTER_S),
        # Triton answers a stream's requests in order: with a stream each (least-loaded
        # first), a fast request never waits behind a slow one.
        triton_streams="8",
    )
    rng = np.random.default_rng(16)
    # Partition 0: a slow record at offset 0, two fast ones after it (done beyond the
    # commit point). Partition 1: two slow records.
    p0 = [
        faulty_request(rng, "slow-p0-0", delay_ms=_SLOW_MS),
        faulty_request(rng, "fast-p0-1"),
        faulty_request(rng, "fast-p0-2"),
    ]
    p1 = [
        faulty_request(rng, "slow-p1-0", delay_ms=_SLOW_MS),
        faulty_request(rng, "slow-p1-1", delay_ms=_SLOW_MS),
    ]
    slow = {(0, 0): "slow-p0-0", (1, 0): "slow-p1-0", (1, 1): "slow-p1-1"}

    with structlog.testing.capture_logs() as logs:
        async with running_worker(settings):
            await send(kafka.bootstrap_servers, topics.input, p0, partition=0)
            await send(kafka.bootstrap_servers, topics.input, p1, partition=1)
            fast = await collect(kafka.bootstrap_servers, topics, expected=2)
            assert set(fast.results) == {"fast-p0-1", "fast-p0-2"}

            async def only_slow_left() -> bool:
                snap = await _inflight(port)
                parts = _by_partition(snap)
                return bool(snap["in_flight"] == 3 and parts[0]["done_beyond_commit"] == 2)

            await _until("the fast records done, the slow ones in flight", only_slow_left)
            snap = await _inflight(port)
            gauge_first = await _gauge(port)

            async def gauge_past_the_bound() -> bool:
                return await _gauge(port) > gauge_first + 3 * _STUCK_AFTER_S

            # Several stuck checks (every 0.25 s) run past each record's first report.
            await _until("the gauge rising", gauge_past_the_bound)
            gauge_later = await _gauge(port)
            limited = await _inflight(port, "/debug/inflight?limit=1")
            stuck_then = [e for e in logs if e["event"] == "record_stuck"]

            answers = await collect(kafka.bootstrap_servers, topics, expected=5, into=fast)
            assert len(answers.results) == 5

            async def all_done() -> bool:
                in_flight: int = (await _inflight(port))["in_flight"]
                return in_flight == 0

            await _until("nothing in flight", all_done)
            after = await _inflight(port)
            gauge_after = await _gauge(port)

    # The three slow records, oldest first, sent to Triton and waiting for it.
    assert snap["in_flight"] == 3 and snap["stuck_after_s"] == _STUCK_AFTER_S
    assert {k: v for k, v in snap["by_state"].items() if v} == {"sent": 3}
    listed = snap["oldest"]
    assert {(e["partition"], e["offset"]): e["request_id"] for e in listed} == slow
    assert all(e["topic"] == topics.input and e["model"] == "faulty" for e in listed)
    assert all(e["state"] == "sent" and 0 < e["age_s"] < _SLOW_MS / 1000 for e in listed)
    ages = [e["age_s"] for e in listed]
    assert ages == sorted(ages, reverse=True) and snap["oldest_age_s"] == ages[0]
    assert len(limited["oldest"]) == 1 and limited["in_flight"] == 3
    # Per partition: the commit point waits at the slow head; the fast ones are done beyond it.
    parts = _by_partition(snap)
    assert parts[0] == {
        "topic": topics.input,
        "partition": 0,
        "commit_point": 0,
        "highest_dispatched": 2,
        "done_beyond_commit": 2,
        "in_flight": 1,
    }
    assert parts[1] == {
        "topic": topics.input,
        "partition": 1,
        "commit_point": 0,
        "highest_dispatched": 1,
        "done_beyond_commit": 0,
        "in_flight": 2,
    }
    # The gauge follows the oldest record, and drops to 0 once nothing is in flight.
    assert 0 < gauge_first < gauge_later < _SLOW_MS / 1000
    assert gauge_after == 0.0
    # record_stuck: once per slow record (not repeated by later checks), with its state.
    assert Counter((e["partition"], e["offset"]) for e in stuck_then) == dict.fromkeys(slow, 1)
    stuck_all = [e for e in logs if e["event"] == "record_stuck"]
    assert len(stuck_all) == 3
    for event in stuck_all:
        assert event["request_id"] == slow[(event["partition"], event["offset"])]
        assert event["state"] == "sent" and event["model"] == "faulty"
        assert event["age_s"] >= _STUCK_AFTER_S and event["log_level"] == "warning"
    # Everything done: nothing listed, each commit point past the partition's last record.
    assert after["oldest"] == [] and {k for k, v in after["by_state"].items() if v} == set()
    done = {
        p: (x["commit_point"], x["done_beyond_commit"]) for p, x in _by_partition(after).items()
    }
    assert done == {0: (3, 0), 1: (2, 0)}


async def test_inflight_is_not_found_unless_debug_endpoints_are_on(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """With WORKER_DEBUG_ENDPOINTS unset, /debug/inflight is 404 while /metrics has the gauge."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    port = free_port()
    async with running_worker(settings_for(kafka, triton, topics, metrics_port=str(port))):
        status, _ = await asyncio.to_thread(_get, port, "/debug/inflight")
        gauge = await _gauge(port)
    assert status == 404
    assert gauge == 0.0
