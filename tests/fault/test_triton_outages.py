"""Triton dies or goes away for a while: nothing lost, nothing dead-lettered, quick resume.

These tests own a Triton server of their own, so killing it never disturbs the
session's shared one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from devtools import samples
from devtools.devstack.paths import models_dir
from devtools.devstack.triton import TritonServer, ensure_triton
from tests.support import (
    KafkaUnderTest,
    Topics,
    collect,
    create,
    report,
    running_worker,
    send,
    settings_for,
)

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def own_triton(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TritonServer]:
    """A Triton server for this module alone (only `double` and `faulty`: quick restarts)."""
    server = TritonServer(
        ensure_triton(log=lambda _: None),
        models_dir(),
        tmp_path_factory.mktemp("triton"),
        models=["double", "faulty"],
    )
    server.start()
    yield server
    server.stop()


async def test_triton_killed_and_restarted_mid_stream(
    kafka: KafkaUnderTest, own_triton: TritonServer, unique: str
) -> None:
    """SIGKILL Triton while requests flow, start it again: every request answered, none dead."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    requests = samples.good_requests(1500, seed=41, models=("double",))
    # The last 500 are written while Triton is down, so the stream outlasts the kill however
    # fast the worker answers. Throttled (a small window, no batching) so that it is still
    # answering the first 1,000 then.
    settings = settings_for(kafka, own_triton, topics, max_in_flight="12", batch_max_size="1")
    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, requests[:1000])
        got = await collect(kafka.bootstrap_servers, topics, 200)
        await asyncio.to_thread(own_triton.kill)
        death = own_triton.death_report()
        assert death is not None, "the kill left no trace"
        await send(kafka.bootstrap_servers, topics.input, requests[1000:])
        await asyncio.to_thread(own_triton.start)
        got = await collect(kafka.bootstrap_servers, topics, len(requests), 120, into=got)
    report("Triton killed (SIGKILL) and restarted mid-stream", len(requests), got)
    assert got.duplicates <= 256, "duplicates beyond the window"
    assert got.dead_letters == {}
    assert set(got.results) == {r.request_id for r in requests}


async def test_triton_down_30s_no_dead_letters_resume_within_5s(
    kafka: KafkaUnderTest, own_triton: TritonServer, unique: str
) -> None:
    """A 30 s outage: breaker opens, /readyz false, zero dead letters; resume ≤ 5 s after ready."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    first = samples.good_requests(300, seed=42, models=("double",))
    during = samples.good_requests(300, seed=43, models=("double",))
    settings = settings_for(kafka, own_triton, topics, breaker_probe_interval_ms="500")
    async with running_worker(settings) as worker:
        await send(kafka.bootstrap_servers, topics.input, first)
        got = await collect(kafka.bootstrap_servers, topics, len(first))
        await asyncio.to_thread(own_triton.stop)
        outage_started = time.monotonic()
        await send(kafka.bootstrap_servers, topics.input, during)
        await asyncio.wait_for(worker.breaker.wait_open(), 20)
        assert worker.readiness()[0] is False
        assert worker.metrics.breaker_open._value.get() == 1
        remaining = 30 - (time.monotonic() - outage_started)
        await asyncio.sleep(max(0.0, remaining))  # the outage itself, not synchronisation
        answered_during_outage = len(got)
        await asyncio.to_thread(own_triton.start)
        ready_at = time.monotonic()
        got = await collect(kafka.bootstrap_servers, topics, answered_during_outage + 1, into=got)
        resume_s = time.monotonic() - ready_at
        got = await collect(kafka.bootstrap_servers, topics, len(first) + len(during), into=got)
    report("Triton down for 30 s", len(first) + len(during), got, resume_s)
    assert got.dead_letters == {}
    assert resume_s <= 5.0, f"processing resumed {resume_s:.1f} s after Triton was ready"
