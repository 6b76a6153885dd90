"""The in-flight registry: states, oldest first, stuck records told once, the gauge, the route."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import structlog
from aiokafka.structs import ConsumerRecord, TopicPartition

from tests.unit.observability.test_observability import Readiness, _get
from worker.delivery.offsets import OffsetTracker
from worker.observability import HealthServer, Metrics
from worker.observability.inflight import MAX_LIMIT, STATES, InFlightRegistry

pytestmark = [pytest.mark.unit, pytest.mark.timeout(10)]


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def rec(partition: int, offset: int, topic: str = "requests") -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(
        topic, partition, offset, 0, 0, None, b"{}", None, 0, 2, [("x-request-id", b"r")]
    )


def registry(stuck_after_s: float = 60.0, **kwargs: Any) -> tuple[InFlightRegistry, Clock]:
    clock = Clock()
    return InFlightRegistry(stuck_after_s, clock=clock, **kwargs), clock


def test_snapshot_counts_states_and_lists_the_oldest_first() -> None:
    """Entries are listed oldest first with their coordinates, age and state; limit bounds them."""
    reg, clock = registry()
    first = reg.add(rec(0, 5))
    clock.now += 1.0
    second = reg.add(rec(1, 7))
    clock.now += 1.0
    third = reg.add(rec(0, 6))
    first.state, first.request_id, first.model = "sent", "r-5", "faulty"
    second.state = "waiting_batch"
    third.state = "sent"
    clock.now += 0.5

    snap = reg.snapshot(limit=2)

    assert snap["in_flight"] == 3 and snap["oldest_age_s"] == 2.5
    by_state = snap["by_state"]
    assert isinstance(by_state, dict) and list(by_state) == list(STATES)
    assert {k: v for k, v in by_state.items() if v} == {"sent": 2, "waiting_batch": 1}
    assert snap["oldest"] == [
        {
            "topic": "requests",
            "partition": 0,
            "offset": 5,
            "request_id": "r-5",
            "model": "faulty",
            "state": "sent",
            "age_s": 2.5,
            "attempt": 1,
        },
        {
            "topic": "requests",
            "partition": 1,
            "offset": 7,
            "request_id": None,
            "model": None,
            "state": "waiting_batch",
            "age_s": 1.5,
            "attempt": 1,
        },
    ]


def test_a_retrying_record_shows_its_attempt_and_next_try() -> None:
    """While retrying, the entry tells the coming try's number and when it is due."""
    reg, clock = registry()
    entry = reg.add(rec(0, 1))
    entry.state, entry.attempt, entry.next_try_at = "retrying", 3, clock.now + 0.25
    oldest = reg.snapshot()["oldest"]
    assert isinstance(oldest, list)
    (listed,) = oldest
    assert listed["state"] == "retrying" and listed["attempt"] == 3
    assert listed["next_try_in_s"] == 0.25


def test_removed_records_leave_and_a_stale_entry_cannot_remove_a_newer_one() -> None:
    """remove() drops the entry; the same offset re-added goes last and survives the old one."""
    reg, clock = registry()
    old = reg.add(rec(0, 1))
    clock.now += 1
    other = reg.add(rec(0, 2))
    clock.now += 1
    again = reg.add(rec(0, 1))  # re-assigned while the first task still ran
    reg.remove(old)
    assert len(reg) == 2
    oldest = reg.snapshot()["oldest"]
    assert [(e["offset"], e["age_s"]) for e in oldest] == [(2, 1.0), (1, 0.0)]  # type: ignore[attr-defined]
    reg.remove(other)
    reg.remove(again)
    assert len(reg) == 0 and reg.snapshot()["oldest"] == []


def test_a_stuck_record_of_a_re_assigned_offset_is_told_though_younger_ones_follow() -> None:
    """Offset 1 re-assigned, then younger records: the older task ends, the new one still ages."""
    reg, clock = registry(stuck_after_s=10.0)
    old = reg.add(rec(0, 1))
    clock.now += 1
    again = reg.add(rec(0, 1))  # re-assigned to this member while the first task still ran
    clock.now += 1
    young = reg.add(rec(0, 2))
    reg.remove(old)
    assert [e["offset"] for e in reg.snapshot()["oldest"]] == [1, 2]  # type: ignore[attr-defined]
    clock.now += 9  # `again` is 10 s old, `young` 9 s
    with structlog.testing.capture_logs():
        assert reg.report_stuck() == [again]
    assert reg.oldest_age_s() == 10.0
    reg.remove(again)
    reg.remove(again)  # a second removal changes nothing
    assert list(reg.snapshot()["oldest"]) == [young.describe(clock.now)]  # type: ignore[call-overload]


def test_both_tasks_of_a_re_assigned_offset_are_listed() -> None:
    """While the earlier task of an offset still runs beside the new one, both are in flight."""
    reg, clock = registry()
    reg.add(rec(0, 1))
    clock.now += 1
    reg.add(rec(0, 1))
    assert len(reg) == 2
    assert [e["age_s"] for e in reg.snapshot()["oldest"]] == [1.0, 0.0]  # type: ignore[attr-defined]


def test_limit_is_capped() -> None:
    """A limit above MAX_LIMIT lists at most MAX_LIMIT records; below 1 lists one."""
    reg, _ = registry()
    for offset in range(MAX_LIMIT + 5):
        reg.add(rec(0, offset))
    assert len(reg.snapshot(limit=10**6)["oldest"]) == MAX_LIMIT  # type: ignore[arg-type]
    assert len(reg.snapshot(limit=0)["oldest"]) == 1  # type: ignore[arg-type]


def test_partitions_show_commit_point_highest_dispatched_and_done_count() -> None:
    """Per partition: the offset tracker's commit point, last tracked offset and done offsets."""
    offsets = OffsetTracker()
    tp = TopicPartition("requests", 0)
    generation = offsets.assign(tp, 10)
    for offset in (10, 11, 12, 13):
        offsets.track(tp, offset)
    offsets.done(tp, 11, generation)
    offsets.done(tp, 13, generation)
    reg, _ = registry(progress=offsets.progress)
    reg.add(rec(0, 10))
    reg.add(rec(0, 12))
    assert reg.snapshot()["partitions"] == [
        {
            "topic": "requests",
            "partition": 0,
            "commit_point": 10,
            "highest_dispatched": 13,
            "done_beyond_commit": 2,
            "in_flight": 2,
        }
    ]


def test_a_stuck_record_is_logged_once() -> None:
    """record_stuck names each record past the bound once; younger ones are not told."""
    reg, clock = registry(stuck_after_s=10.0)
    slow = reg.add(rec(0, 1))
    slow.state, slow.request_id, slow.model = "held_model", "r-1", "mlp"
    clock.now += 6
    young = reg.add(rec(1, 2))
    with structlog.testing.capture_logs() as logs:
        assert reg.report_stuck() == []
        clock.now += 5
        assert reg.report_stuck() == [slow]
        clock.now += 5
        assert reg.report_stuck() == [young]
        clock.now += 50
        assert reg.report_stuck() == []
    assert logs == [
        {
            "event": "record_stuck",
            "log_level": "warning",
            "topic": "requests",
            "partition": 0,
            "offset": 1,
            "request_id": "r-1",
            "model": "mlp",
            "state": "held_model",
            "attempt": 1,
            "age_s": 11.0,
            "stuck_after_s": 10.0,
        },
        {
            "event": "record_stuck",
            "log_level": "warning",
            "topic": "requests",
            "partition": 1,
            "offset": 2,
            "request_id": None,
            "model": None,
            "state": "decoding",
            "attempt": 1,
            "age_s": 10.0,
            "stuck_after_s": 10.0,
        },
    ]


def test_the_check_runs_every_few_seconds_at_most() -> None:
    """The check interval is a quarter of the bound, at most 5 s; a bound <= 0 is refused."""
    assert InFlightRegistry(60.0).check_interval_s == 5.0
    assert InFlightRegistry(1.0).check_interval_s == 0.25
    with pytest.raises(ValueError, match="stuck_after_s"):
        InFlightRegistry(0)


def test_the_gauge_reads_the_oldest_age_at_scrape_time() -> None:
    """worker_oldest_in_flight_seconds is the oldest entry's age, 0 when nothing is in flight."""
    reg, clock = registry()
    metrics = Metrics(version="test")
    metrics.oldest_in_flight_seconds.set_function(reg.oldest_age_s)

    def gauge() -> float | None:
        return metrics.registry.get_sample_value("worker_oldest_in_flight_seconds")

    assert gauge() == 0.0
    first = reg.add(rec(0, 1))
    clock.now += 3
    second = reg.add(rec(0, 2))
    clock.now += 1
    assert gauge() == 4.0
    reg.remove(first)
    assert gauge() == 1.0
    reg.remove(second)
    assert gauge() == 0.0


@pytest.fixture
async def debug_server() -> AsyncIterator[tuple[HealthServer, InFlightRegistry]]:
    """A health server with /debug/inflight on, over a registry holding 25 records."""
    reg, _ = registry()
    for offset in range(25):
        reg.add(rec(0, offset))
    health = HealthServer(
        Metrics(version="test").registry,
        Readiness(),
        host="127.0.0.1",
        port=0,
        inflight=reg.snapshot,
    )
    await health.start()
    yield health, reg
    await health.stop()


async def test_debug_inflight_serves_the_snapshot(
    debug_server: tuple[HealthServer, InFlightRegistry],
) -> None:
    """/debug/inflight is JSON: 20 oldest by default, ?limit=N bounds the list, bad limits 400."""
    health, _ = debug_server
    status, headers, body = await _get(health.port, "/debug/inflight")
    assert status == 200 and headers["content-type"] == "application/json"
    snap = json.loads(body)
    assert snap["in_flight"] == 25 and [e["offset"] for e in snap["oldest"]] == list(range(20))
    status, _, body = await _get(health.port, "/debug/inflight?limit=2")
    assert status == 200 and [e["offset"] for e in json.loads(body)["oldest"]] == [0, 1]
    for bad in ("0", "-1", "x", ""):
        assert (await _get(health.port, f"/debug/inflight?limit={bad}"))[0] == 400


async def test_debug_inflight_is_not_found_unless_enabled() -> None:
    """Without a snapshot (WORKER_DEBUG_ENDPOINTS=false) the path is 404."""
    health = HealthServer(Metrics(version="test").registry, Readiness(), host="127.0.0.1", port=0)
    await health.start()
    try:
        assert (await _get(health.port, "/debug/inflight"))[0] == 404
    finally:
        await health.stop()
