"""Every metric the dashboard and the Prometheus rules query exists on a real worker's /metrics."""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from devtools import samples
from devtools.devstack.process import free_port
from tests.contract.test_deploy import base_metric_name, referenced_metric_names
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

pytestmark = pytest.mark.timeout(120)

_TYPE_RE = re.compile(r"^# TYPE (\S+) (\S+)$", re.M)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


def _families(text: str) -> dict[str, str]:
    """Metric family names of an exposition text, with their types."""
    return dict(_TYPE_RE.findall(text))


def _missing(referenced: set[str], families: dict[str, str]) -> set[str]:
    histograms = {name for name, kind in families.items() if kind in ("histogram", "summary")}
    return {name for name in referenced if base_metric_name(name, histograms) not in families}


async def test_dashboard_metrics_exist_on_a_running_worker(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """After results and a dead letter, /metrics has each worker_* name queried; Triton its nv_*."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    port = free_port()
    settings = settings_for(kafka, triton, topics, metrics_port=str(port))
    good = samples.good_requests(6, models=("double",))
    bad = next(r for r in samples.bad_requests() if r.expected_code == "DECODE_ERROR")

    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, [*good, bad])
        answers = await collect(kafka.bootstrap_servers, topics, expected=len(good) + 1)
        text = await asyncio.to_thread(_scrape, f"http://127.0.0.1:{port}/metrics")

    assert len(answers.results) == len(good) and list(answers.dead_letters) == [bad.request_id]
    # The labelled series the dashboard plots were really observed, not just declared.
    for series in (
        'worker_results_published_total{model="double"}',
        'worker_dead_letters_total{code="DECODE_ERROR"}',
        'worker_inference_latency_seconds_bucket{le="+Inf",model="double"}',
        "worker_end_to_end_latency_seconds_count",
        "worker_records_consumed_total{partition=",
    ):
        assert series in text, series

    referenced = referenced_metric_names()
    worker_names = {name for name in referenced if name.startswith("worker_")}
    assert _missing(worker_names, _families(text)) == set()

    triton_names = {name for name in referenced if name.startswith("nv_")}
    triton_text = await asyncio.to_thread(_scrape, f"http://{triton.metrics_address}/metrics")
    assert triton_names and _missing(triton_names, _families(triton_text)) == set()
