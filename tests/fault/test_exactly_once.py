"""exactly_once on one worker: ordering modes at full speed, outcomes refused for size,
a transactional id the broker refuses.

Real Kafka and real Triton; a ``read_committed`` reader reads every result and
dead letter back to the end of both topics, so a duplicate would show. The ACL
tests start a second Kafka of their own (SASL_SSL, SCRAM, StandardAuthorizer).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer
from confluent_kafka.admin import (
    AclBinding,
    AclBindingFilter,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
)

from devtools.devstack.certs import LocalPki, make_pki
from devtools.devstack.kafka import KafkaCluster, KafkaSecurity, ensure_kafka_jars
from devtools.samples import SampleRequest, Tensor, encode_request, faulty_request
from tests.support import (
    Collected,
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    headers_dict,
    read_all,
    report,
    running_worker,
    send,
    settings_for,
    spawn_worker,
    worker_env,
)
from tests.support.worker import kafka_client_under_test

pytestmark = pytest.mark.timeout(120)

COMMIT_INTERVAL_MS = 200
#: 200 records on one partition must take at most this many commit intervals.
ORDERING_BOUND_INTERVALS = 20


def _counter(value: Any) -> float:
    return float(value._value.get())


async def _send_keyed(
    bootstrap: str, topic: str, requests: list[SampleRequest], keys: list[bytes]
) -> None:
    """Produce to partition 0 with the given keys, in order, and wait for every ack."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [
            await producer.send(topic, r.value, key=key, headers=r.headers, partition=0)
            for r, key in zip(requests, keys, strict=True)
        ]
        for future in futures:
            await future
    finally:
        await producer.stop()


def _source_offset(record: Any) -> int:
    return int(headers_dict(record.headers)["x-source-offset"])


async def _warm_up(kafka: KafkaUnderTest, topics: Topics) -> Collected:
    """One request answered: the partition is assigned and its producer started."""
    warm = faulty_request(np.random.default_rng(0), "warm-up")
    await send(kafka.bootstrap_servers, topics.input, [warm], partition=0)
    return await collect(kafka.bootstrap_servers, topics, 1, timeout_s=60)


@pytest.mark.parametrize("ordering", ["unordered", "key", "partition"])
async def test_exactly_once_ordering_modes_answer_within_a_few_commits(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, ordering: str
) -> None:
    """exactly_once, each ordering: 200 records of a partition in a few commits, in order, once."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    rng = np.random.default_rng(41)
    # Random model delays so that, unordered, records finish out of offset order.
    requests = [faulty_request(rng, f"o{i}", delay_ms=int(rng.integers(0, 6))) for i in range(200)]
    keys = [f"key-{i % 4}".encode() for i in range(200)]
    settings = settings_for(
        kafka,
        triton,
        topics,
        delivery="exactly_once",
        ordering=ordering,
        commit_interval_ms=str(COMMIT_INTERVAL_MS),
    )
    async with running_worker(settings) as worker:
        got = await _warm_up(kafka, topics)
        transactions_before = _counter(worker.metrics.transactions_total)
        started = time.monotonic()
        await _send_keyed(kafka.bootstrap_servers, topics.input, requests, keys)
        bound_s = ORDERING_BOUND_INTERVALS * COMMIT_INTERVAL_MS / 1000
        # Twice the bound to wait, so that a slow run fails on the bound below, with numbers.
        got = await collect(
            kafka.bootstrap_servers, topics, len(requests) + 1, timeout_s=2 * bound_s, into=got
        )
        elapsed_s = time.monotonic() - started
        transactions = _counter(worker.metrics.transactions_total) - transactions_before
    everything = await read_all(kafka.bootstrap_servers, topics)
    report(
        f"exactly_once, WORKER_ORDERING={ordering}, 200 records on one partition",
        len(requests) + 1,  # and the warm-up
        everything,
        elapsed_s,
    )
    assert everything.duplicates == 0
    assert everything.dead_letters == {}
    assert set(everything.results) == {r.request_id for r in requests} | {"warm-up"}
    assert elapsed_s < bound_s, f"{elapsed_s:.1f} s for 200 records ({transactions:.0f} txns)"
    # Before turns passed on at staging, key and partition took one commit per record.
    assert transactions <= ORDERING_BOUND_INTERVALS, f"{transactions:.0f} transactions"
    in_output_order = sorted(
        (r for rid, r in everything.results.items() if rid != "warm-up"), key=lambda r: r.offset
    )
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for record in in_output_order:
        by_key[record.key or b""].append(_source_offset(record))
    assert all(offsets == sorted(offsets) for offsets in by_key.values()), by_key
    if ordering == "partition":
        offsets = [_source_offset(r) for r in in_output_order]
        assert offsets == sorted(offsets)


def _faulty_wide(request_id: str, width: int, *, fail: bool = False) -> SampleRequest:
    """A binary ``faulty`` request of ``width`` floats: its result is about as large."""
    values = np.arange(width, dtype=np.float32)
    tensors = [
        Tensor("INPUT0", "FP32", (width,), values),
        Tensor("FAIL", "BOOL", (1,), np.array([fail], dtype=np.bool_)),
        Tensor("DELAY_MS", "INT32", (1,), np.array([0], dtype=np.int32)),
    ]
    value, headers = encode_request("faulty", tensors, "binary", request_id)
    code = "INFERENCE_ERROR" if fail else None
    return SampleRequest(value, headers, "faulty", "binary", request_id, code)


#: The output topic takes records up to 40,000 bytes, the dead-letter topic 64 KiB
#: (both above the producers' 16 KiB batches, so small records batched together pass).
OUTPUT_MAX_BYTES = 40_000
DLQ_MAX_BYTES = 65_536


async def test_exactly_once_outcomes_refused_for_size_do_not_stall_the_partition(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """exactly_once: a result over the output topic's limit, dead letters over the DLQ's (one
    of a gzip request over the request limit once decompressed, one whose key alone is too
    large); every request around them answered, once."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input], partitions=1)
    await kafka.create_topics(
        [topics.output], partitions=1, configs={"max.message.bytes": str(OUTPUT_MAX_BYTES)}
    )
    await kafka.create_topics(
        [topics.dlq], partitions=1, configs={"max.message.bytes": str(DLQ_MAX_BYTES)}
    )
    rng = np.random.default_rng(42)
    big_result = _faulty_wide("big-result", 12_000)  # ~48 KB result; its dead letter fits
    big_dead_letter = _faulty_wide("big-dead-letter", 20_000, fail=True)  # ~80 KB value
    assert len(big_result.value) < DLQ_MAX_BYTES < len(big_dead_letter.value)
    first = [
        faulty_request(rng, "good-0"),
        big_result,
        faulty_request(rng, "good-1"),
        big_dead_letter,
        faulty_request(rng, "good-2"),
    ]
    after = [faulty_request(rng, f"good-{i}") for i in range(3, 43)]
    settings = settings_for(kafka, triton, topics, delivery="exactly_once")
    async with running_worker(settings) as worker:
        await send(kafka.bootstrap_servers, topics.input, first, partition=0)
        got = await collect(kafka.bootstrap_servers, topics, len(first), timeout_s=60)
        oversized = await _send_oversized(kafka.bootstrap_servers, topics.input)
        # The partition keeps flowing: the requests after them are answered too.
        await send(kafka.bootstrap_servers, topics.input, after, partition=0)
        expected = len(first) + len(oversized) + len(after)
        got = await collect(kafka.bootstrap_servers, topics, expected, 60, into=got)
        omitted = _counter(worker.metrics.dead_letter_values_omitted_total)
    everything = await read_all(kafka.bootstrap_servers, topics)
    report(
        "exactly_once, a result and dead letters over their topics' limits",
        expected,
        everything,
    )
    assert everything.duplicates == 0
    assert set(everything.results) == {f"good-{i}" for i in range(43)}
    assert set(everything.dead_letters) == {"big-result", "big-dead-letter", *oversized}
    too_large = everything.dead_letters["big-result"]
    assert headers_dict(too_large.headers)["x-error-code"] == b"OUTPUT_TOO_LARGE"
    assert too_large.value == big_result.value  # the request as it came
    slim = everything.dead_letters["big-dead-letter"]
    slim_headers = headers_dict(slim.headers)
    assert slim_headers["x-error-code"] == b"INFERENCE_ERROR"
    assert slim_headers["x-value-omitted"] == b"true"
    assert slim_headers["x-original-value-bytes"] == str(len(big_dead_letter.value)).encode()
    assert not slim.value
    for request_id, (code, value, key) in oversized.items():
        letter = everything.dead_letters[request_id]
        names = [name for name, _ in letter.headers]
        assert headers_dict(letter.headers)["x-error-code"] == code
        assert (letter.value, letter.key) == (b"", None if len(key) > DLQ_MAX_BYTES else key)
        # One description of the original value, even after a second slimming (the key).
        assert names.count("x-original-value-bytes") == 1, (request_id, names)
        original = headers_dict(letter.headers)["x-original-value-bytes"]
        assert original == str(len(value)).encode(), request_id
    assert omitted == 3


async def _send_oversized(bootstrap: str, topic: str) -> dict[str, tuple[bytes, bytes, bytes]]:
    """Two requests whose dead letters the 64 KiB DLQ refuses, to partition 0: a JSON request
    of 9 MiB sent gzip-compressed (TOO_LARGE: over the 8 MiB request limit once
    decompressed; aiokafka's producer refused its dead letter in ``send`` itself, which
    looped the partition's transaction for ever), and an undecodable one whose 100 KB key
    alone is over the DLQ's limit (its dead letter loses its value, then its key). Returns
    each one's expected code, value and key by request id."""
    huge = b'{"id": "huge-gzip", "pad": "' + b"x" * (9 * 2**20) + b'"}'
    bad = b'{"inputs": [' + bytes(70_000)
    sent = {
        "huge-gzip": (b"TOO_LARGE", huge, b"huge-gzip"),
        "big-key": (b"DECODE_ERROR", bad, b"k" * 100_000),
    }
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        compression_type="gzip",
        max_request_size=16 * 2**20,
    )
    await producer.start()
    try:
        for request_id, (_, value, key) in sent.items():
            headers = [("content-type", b"application/json"), ("x-request-id", request_id.encode())]
            await producer.send_and_wait(topic, value, key=key, headers=headers, partition=0)
    finally:
        await producer.stop()
    return sent


# -- a transactional id the broker refuses ------------------------------------------

CAROL_PASSWORD = "carol-Secret-4b1"
#: Bound on a worker refused its transactional ids: start-up, one join, one refusal.
REFUSAL_BOUND_S = 60.0


@pytest.fixture(scope="module")
def acl_kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[KafkaCluster, LocalPki]]:
    """One Kafka node with a SASL_SSL listener and ACLs: carol has none until granted."""
    pki = make_pki(tmp_path_factory.mktemp("pki"))
    security = KafkaSecurity(
        keystore_pem=pki.server.bundle,
        truststore_pem=pki.ca_cert,
        scram_users={"carol": CAROL_PASSWORD},
    )
    cluster = KafkaCluster(
        ensure_kafka_jars(log=lambda _: None),
        tmp_path_factory.mktemp("acl-kafka"),
        security=security,
    )
    cluster.start()
    yield cluster, pki
    cluster.stop()


def _grant(
    bootstrap: str, grants: list[tuple[ResourceType, str, ResourcePatternType, AclOperation]]
) -> None:
    """Allow carol these operations (as ANONYMOUS over PLAINTEXT, a super user), and wait
    until the broker's authorizer lists them."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    bindings = [
        AclBinding(kind, name, pattern, "User:carol", "*", operation, AclPermissionType.ALLOW)
        for kind, name, pattern, operation in grants
    ]
    for future in admin.create_acls(bindings).values():
        future.result(timeout=30)
    # None matches any name and any host; confluent_kafka's annotations say str.
    every = AclBindingFilter(
        ResourceType.ANY,
        None,  # type: ignore[arg-type]
        ResourcePatternType.ANY,
        "User:carol",
        None,  # type: ignore[arg-type]
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    deadline = time.monotonic() + 30
    while not set(bindings) <= set(admin.describe_acls(every).result(timeout=30)):
        assert time.monotonic() < deadline, "ACLs not visible on the broker in 30 s"
        time.sleep(0.2)  # polling the broker's ACL cache: nothing to await


def _worker_grants(
    topics: Topics,
) -> list[tuple[ResourceType, str, ResourcePatternType, AclOperation]]:
    """Everything the worker needs except its transactional ids."""
    literal = ResourcePatternType.LITERAL
    grants = [
        (ResourceType.TOPIC, topics.input, literal, AclOperation.READ),
        (ResourceType.TOPIC, topics.input, literal, AclOperation.DESCRIBE),
        (ResourceType.GROUP, topics.group, literal, AclOperation.READ),
        (ResourceType.GROUP, topics.group, literal, AclOperation.DESCRIBE),
    ]
    for topic in (topics.output, topics.dlq):
        grants += [
            (ResourceType.TOPIC, topic, literal, AclOperation.WRITE),
            (ResourceType.TOPIC, topic, literal, AclOperation.DESCRIBE),
        ]
    return grants


def _as_carol(cluster: KafkaCluster, pki: LocalPki) -> dict[str, str]:
    """Settings of an exactly_once worker signed in as carol over SASL_SSL."""
    return {
        "bootstrap_servers": cluster.sasl_bootstrap_servers,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": "carol",
        "sasl_password": CAROL_PASSWORD,
        "ssl_cafile": str(pki.ca_cert),
        "delivery": "exactly_once",
    }


async def test_exactly_once_without_transactional_id_acl_exits_3_naming_the_id(
    acl_kafka: tuple[KafkaCluster, LocalPki], triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """No Write ACL on the transactional ids: exit 3 and one line naming the id, no stall."""
    cluster, pki = acl_kafka
    topics = Topics.fresh(unique)
    await create(cluster, topics)
    await asyncio.to_thread(_grant, cluster.bootstrap_servers, _worker_grants(topics))
    env = worker_env(cluster, triton, topics, **_as_carol(cluster, pki))
    log_path = tmp_path / "worker.log"
    process = spawn_worker(env, log_path)
    try:
        code = await asyncio.to_thread(process.wait, REFUSAL_BOUND_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(
            f"worker still running after {REFUSAL_BOUND_S} s:\n{log_path.read_text()[-3000:]}"
        ) from None
    log = log_path.read_text()
    assert code == 3, f"exit {code}\n{log[-3000:]}"
    fatal = [line for line in log.splitlines() if line.startswith("fatal: ")]
    # aiokafka: one id per input partition; librdkafka: one per worker (its client id).
    transactional_id = (
        f"kafka-triton-worker-{topics.group}-kafka-triton-worker-"
        if kafka_client_under_test() == "confluent"
        else f"kafka-triton-worker-{topics.group}-{topics.input}-0'"
    )
    assert len(fatal) == 1, log[-3000:]
    assert f"exactly_once: the broker refuses transactional id '{transactional_id}" in fatal[0]
    assert CAROL_PASSWORD not in log


async def test_exactly_once_with_transactional_id_acl_answers(
    acl_kafka: tuple[KafkaCluster, LocalPki], triton: TritonUnderTest, unique: str
) -> None:
    """The same grants plus Write and Describe on the transactional ids: requests answered."""
    cluster, pki = acl_kafka
    topics = Topics.fresh(unique)
    await create(cluster, topics)
    prefix = f"kafka-triton-worker-{topics.group}-"
    prefixed = ResourcePatternType.PREFIXED
    grants = [
        *_worker_grants(topics),
        (ResourceType.TRANSACTIONAL_ID, prefix, prefixed, AclOperation.WRITE),
        (ResourceType.TRANSACTIONAL_ID, prefix, prefixed, AclOperation.DESCRIBE),
    ]
    await asyncio.to_thread(_grant, cluster.bootstrap_servers, grants)
    rng = np.random.default_rng(43)
    requests = [faulty_request(rng, f"acl-{i}") for i in range(5)]
    settings = settings_for(cluster, triton, topics, **_as_carol(cluster, pki))
    async with running_worker(settings):
        await send(cluster.bootstrap_servers, topics.input, requests)
        await collect(cluster.bootstrap_servers, topics, len(requests))
    everything = await read_all(cluster.bootstrap_servers, topics)
    assert everything.duplicates == 0
    assert set(everything.results) == {r.request_id for r in requests}
