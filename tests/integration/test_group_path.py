"""The group path in every mode, on real Kafka and Triton: a record is a group of one.

Whatever the delivery mode, the ordering or the audit, records of a batchable model whose
spec the worker knows are answered by the group path (``worker_fast_path_records_total``
counts them), once each, in the order their mode promises: each key's results in offset
order under ``key``, each partition's under ``partition``; and under an audit topic each
one is audited.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import ConsumerRecord, TopicPartition

from devtools import samples
from devtools.samples import good_requests
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    headers_dict,
    running_worker,
    send,
    settings_for,
)
from worker.app import Worker
from worker.records.steps import FALLBACK_REASONS

pytestmark = pytest.mark.timeout(120)

RECORDS = 120
KEYS = [b"k%d" % k for k in range(6)]


def _sample(worker: Worker, metric: str, **labels: str) -> float:
    return worker.metrics.registry.get_sample_value(metric, labels) or 0.0


async def _read(bootstrap: str, topic: str, count: int) -> list[ConsumerRecord[bytes, bytes]]:
    """The first ``count`` records of the topic's partition 0, in order (read_committed)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, isolation_level="read_committed"
    )
    await consumer.start()
    got: list[ConsumerRecord[bytes, bytes]] = []
    deadline = time.monotonic() + 30
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        while len(got) < count:
            assert time.monotonic() < deadline, f"{topic}: {len(got)} of {count} read"
            for records in (await consumer.getmany(timeout_ms=500)).values():
                got += records
    finally:
        await consumer.stop()
    return got[:count]


@pytest.mark.parametrize(
    ("delivery", "ordering", "audit"),
    [
        pytest.param("at_least_once", "unordered", False, id="at_least_once"),
        pytest.param("exactly_once", "unordered", False, id="exactly_once"),
        pytest.param("at_least_once", "key", False, id="key"),
        pytest.param("exactly_once", "partition", False, id="exactly_once-partition"),
        pytest.param("at_least_once", "unordered", True, id="audit"),
    ],
)
async def test_every_mode_answers_batchable_records_on_the_group_path(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    unique: str,
    delivery: str,
    ordering: str,
    audit: bool,
) -> None:
    """120 mlp requests on 2 partitions under 6 keys, the model's spec known: every one
    answered by the group path, once, in its mode's order (and audited)."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    audit_topic = f"audit-{unique}"
    extra = {"delivery": delivery, "ordering": ordering}
    if audit:
        await kafka.create_topics([audit_topic], partitions=1)
        extra |= {"audit": "topic", "audit_topic": audit_topic}
    warm = good_requests(1, seed=21, models=("mlp",))
    requests = good_requests(RECORDS, seed=22, models=("mlp",))
    async with running_worker(settings_for(kafka, triton, topics, **extra)) as worker:
        # The first record of a model takes the per-record path: it learns the spec.
        await send(kafka.bootstrap_servers, topics.input, warm, partition=0)
        await collect(kafka.bootstrap_servers, topics, 1, timeout_s=60)
        keys = [KEYS[i % len(KEYS)] for i in range(RECORDS)]
        await send(kafka.bootstrap_servers, topics.input, requests, keys=keys)
        got = await collect(kafka.bootstrap_servers, topics, RECORDS + 1, timeout_s=60)
    # Read once the worker has stopped: a result is visible before its group's books are
    # kept (with an audit, its audit record is written between the two).
    grouped = _sample(worker, "worker_fast_path_records_total")
    assert got.duplicates == 0 and got.dead_letters == {}
    assert set(got.results) == {r.request_id for r in warm + requests}
    reasons = {
        r: _sample(worker, "worker_fast_path_fallbacks_total", reason=r) for r in FALLBACK_REASONS
    }
    assert grouped == RECORDS, (grouped, reasons)
    results = await _read(kafka.bootstrap_servers, topics.output, RECORDS + 1)
    by_order: dict[object, list[int]] = defaultdict(list)
    for result in results:
        headers = headers_dict(result.headers)
        partition, offset = int(headers["x-source-partition"]), int(headers["x-source-offset"])
        if ordering == "key":
            by_order[(partition, result.key)].append(offset)
        elif ordering == "partition":
            by_order[partition].append(offset)
    for offsets in by_order.values():
        assert offsets == sorted(offsets), by_order
    if audit:
        audited = await _read(kafka.bootstrap_servers, audit_topic, RECORDS + 1)
        assert {a.key.decode() for a in audited if a.key} == set(got.results)


async def test_key_ordering_a_keys_records_after_a_failed_one_follow_it(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """ordering=key, 60 mlp requests of 3 keys in one fetch, every tenth with an id too long
    for its result (OUTPUT_TOO_LARGE): those go to the per-record path, the later records
    of their key in the group follow them there (fallback reason ``order``), each key's
    results still in offset order; every other key's records stay on the group path."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    rng = np.random.default_rng(23)

    def request(i: int) -> samples.SampleRequest:
        rid = f"long-{i}-" + "x" * 2000 if i % 10 == 3 else f"key-{i}"
        value, headers = samples.encode_request("mlp", samples.mlp_inputs(rng), "json", rid)
        # The id in a header too: a dead letter keeps its request's headers (and its key is
        # shared here).
        headers = [*headers, ("x-request-id", rid.encode())]
        return samples.SampleRequest(value, headers, "mlp", "json", rid)

    requests = [request(i) for i in range(60)]
    keys = [KEYS[i % 3] for i in range(60)]
    settings = settings_for(kafka, triton, topics, ordering="key", max_output_bytes="1500")
    async with running_worker(settings) as worker:
        await send(
            kafka.bootstrap_servers, topics.input, good_requests(1, seed=24, models=("mlp",))
        )
        await collect(kafka.bootstrap_servers, topics, 1, timeout_s=60)
        await send(kafka.bootstrap_servers, topics.input, requests, keys=keys)
        got = await collect(kafka.bootstrap_servers, topics, 61, timeout_s=60)
    long = {r.request_id for r in requests if r.request_id.startswith("long-")}
    assert set(got.dead_letters) == long and got.duplicates == 0
    codes = {headers_dict(d.headers)["x-error-code"] for d in got.dead_letters.values()}
    assert codes == {b"OUTPUT_TOO_LARGE"}
    assert set(got.results) >= {r.request_id for r in requests} - long
    assert _sample(worker, "worker_fast_path_fallbacks_total", reason="order") >= 1
    assert _sample(worker, "worker_fast_path_records_total") >= 30
    by_key: dict[object, list[int]] = defaultdict(list)
    for result in await _read(kafka.bootstrap_servers, topics.output, 61 - len(long)):
        by_key[result.key].append(int(headers_dict(result.headers)["x-source-offset"]))
    for offsets in by_key.values():
        assert offsets == sorted(offsets), by_key
