"""A seeded chaos soak per delivery mode: mixed traffic while workers, Tritons, models, the
broker and the Schema Registry fail.

Four input partitions are fed continuously (librdkafka with zstd, snappy and no
compression, aiokafka with lz4) with good requests for every model and encoding, token
streams of the decoupled ``tokens`` model, ``running_sum`` sequences keyed by the
record's key, about 5 % hostile records, a stream of model names no Triton serves and
now and then a request whose result is over the output topic's limit; each record
carries its partition and sequence number in its request id ("p{partition}-s{seq}").
A fifth input, a topic of its own mapped to ``mlp`` by a mapping file (librdkafka, gzip),
carries payment events: plain JSON, CloudEvents in binary and structured mode, and about
10 % hostile events (tests/support/soak/events.py); its request ids are "p4-s{seq}".
A sixth, a topic mapped to ``mlp`` as Avro (librdkafka, lz4), carries payment events in
the Confluent wire format written by confluent-kafka's ``AvroSerializer`` against the
soak's Schema Registry, the producer moving to a second, compatible schema version a
quarter into the run, and about 10 % hostile values (tests/support/soak/avro.py); its
request ids are "p5-s{seq}".
Two Triton endpoints serve every model (``double`` as two versions, the first retired by
the version policy, which a share of the requests name). Meanwhile a schedule drawn from the seed
SIGKILLs or SIGTERMs the worker and starts a new one, restarts or kills both Tritons,
kills one of them, reloads a model, restarts the broker and restarts the registry. A
watcher reads the
group's committed offsets every commit interval and fails the run as soon as a
partition with records waiting goes without progress for longer than its bound
outside the faults that make progress impossible, and samples the worker's memory.
Then a final worker drains everything and the oracle checks every record the broker
acknowledged.

The run is parametrised by delivery mode, each on the Kafka client under test
(``WORKER_TEST_KAFKA_CLIENT``). The soak owns its broker, its Tritons and its registry
(shared by the two modes' runs), so restarting them disturbs no other test. ``SOAK_SEED`` replays a
run (the seed is printed first); ``SOAK_S`` sets how long faults are applied in each
mode (default 30 s: the two modes share the minute a CI pass affords the soak).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

from devtools import samples
from devtools.devstack.paths import models_dir
from devtools.devstack.registry import SchemaRegistry, ensure_registry_jar
from devtools.devstack.triton import TritonServer, ensure_triton
from tests.support import COMMIT_SLACK_MS, Topics, local_kafka
from tests.support.models import load_versions, version_states
from tests.support.soak import (
    FIRST_KINDS,
    MODELS,
    OUTPUT_MAX_BYTES,
    AiokafkaLane,
    Chaos,
    Collector,
    ConfluentLane,
    Inputs,
    LaneSpec,
    Ledger,
    OffsetReader,
    Progress,
    Stack,
    schedule,
    triton_model_call,
    triton_model_ready,
)
from tests.support.soak.avro import avro_mapping_text, payment_schema
from tests.support.soak.events import mapping_text
from tests.support.soak.oracle import Limits, Run, describe, judge, measure
from tests.support.soak.schedule import TYPICAL_S
from tests.support.soak.traffic import RETIRED_VERSION
from tests.support.worker import kafka_client_under_test

SOAK_S = float(os.environ.get("SOAK_S", "30"))

PARTITIONS = 4
RATE_PER_PARTITION_S = 75.0  # 300 records/s in all: the 2-core machine stays responsive
#: (partition, client, compression) of each producer.
LANES = (
    (0, "librdkafka", "zstd"),
    (1, "librdkafka", "snappy"),
    (2, "librdkafka", "none"),
    (3, "aiokafka", "lz4"),
)
#: The mapped topic's one partition: its producer, codec and rate.
EVENTS_LANE = ("librdkafka", "gzip")
EVENTS_RATE_S = 50.0
#: The Avro topic's one partition: its producer, codec and rate.
AVRO_LANE = ("librdkafka", "lz4")
AVRO_RATE_S = 40.0
MAX_IN_FLIGHT = 128
COMMIT_INTERVAL_MS = 250
WORKER_SETTINGS = {
    "max_in_flight": str(MAX_IN_FLIGHT),
    "max_in_flight_per_partition": "64",
    "commit_interval_ms": str(COMMIT_INTERVAL_MS),
    "session_timeout_ms": "6000",  # the broker's minimum: a SIGKILLed member leaves in 6 s
    "max_request_bytes": str(samples.BAD_SAMPLES_MAX_REQUEST_BYTES),
    "breaker_probe_interval_ms": "500",
    "shutdown_timeout_s": "20",
    "sequence_from_key": "true",
    "debug_endpoints": "true",  # /debug/inflight: where the records were in a stall
    # Every worker of the run under one client id, as one set for quotas would be (each
    # exactly_once member's transactional id must still be its own).
    "client_id": "soak-shared-client",
}
#: A partition with records waiting must commit at least every STALL_INTERVALS commit
#: intervals outside the faults that make progress impossible.
STALL_INTERVALS = 40
STALL_BOUND_S = STALL_INTERVALS * COMMIT_INTERVAL_MS / 1000
#: The final drain's bound: a fixed part, and the backlog it starts with at this rate (the
#: watcher still fails a partition without progress for STALL_BOUND_S meanwhile). Under
#: exactly_once a run of 900 s can end tens of thousands of records behind: every worker
#: SIGKILL holds the partitions for the transaction timeout.
DRAIN_BOUND_S = 120.0
DRAIN_FLOOR_PER_S = 100.0
#: The run's own bound: the faults, the producers' flush (180 s), the final drain's bound
#: were it behind by everything produced, the read to the end (60 s), and the workers'
#: starts and stops around them. (A bound of SOAK_S + 300 cut a 900 s exactly_once run on
#: librdkafka short in its drain, 80,000 records behind, before its own drain bound.)
RUN_BOUND_S = (
    SOAK_S
    + 180
    + DRAIN_BOUND_S
    + SOAK_S * (PARTITIONS * RATE_PER_PARTITION_S + EVENTS_RATE_S + AVRO_RATE_S) / DRAIN_FLOOR_PER_S
    + 60
    + 120
)
pytestmark = [pytest.mark.fault, pytest.mark.timeout(int(RUN_BOUND_S))]
#: How far a worker's resident memory may grow past what it had once it answered.
RSS_GROWTH_BOUND_MIB = 64.0


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """A broker, two Tritons (every model) and a Schema Registry of the soak's own, started
    side by side."""
    install = ensure_triton(log=lambda _: None)
    root = tmp_path_factory.mktemp("soak-servers")
    tritons = tuple(
        TritonServer(install, models_dir(), root / f"triton-{name}", models=list(MODELS))
        for name in ("a", "b")
    )
    registry = SchemaRegistry(ensure_registry_jar(log=lambda _: None), root / "registry")
    with concurrent.futures.ThreadPoolExecutor(len(tritons) + 1) as pool:
        started = [pool.submit(t.start) for t in tritons]
        started.append(pool.submit(registry.start))
        try:
            with local_kafka(nodes=1) as kafka:
                for future in started:
                    future.result()
                yield Stack(kafka, tritons, registry)
        finally:
            for future in started:
                with contextlib.suppress(Exception):
                    future.result()
            for triton in tritons:
                triton.stop()
            registry.stop()


@pytest.fixture(autouse=True)
def quiet_clients(caplog: pytest.LogCaptureFixture) -> None:
    """The soak's own clients report every planned outage (connections refused while the
    broker restarts) by the thousand: kept out of a failure's report, which they drown."""
    for name in ("aiokafka", "soak.librdkafka"):
        caplog.set_level(logging.CRITICAL, logger=name)


@pytest.fixture
def stack(servers: Stack) -> Stack:
    """The soak's servers, each up with every model (a failed run may have left one down)."""
    if not servers.kafka.running_nodes():
        servers.kafka.start_node(1)
    if not servers.registry.running():
        servers.registry.start()
    for triton in servers.tritons:
        if not triton.running():
            triton.start()
        for model in MODELS:
            if not triton_model_ready(triton.http_address, model):
                triton_model_call(triton.http_address, model, "load")
        _retire_double_v1(triton.http_address)
    return servers


@pytest.fixture
def registry_client(stack: Stack) -> Iterator[SchemaRegistryClient]:
    """confluent-kafka's client of the soak's registry, as the Avro producer and the oracle
    use it: no retries of its own (a request that fails while the registry is out is
    tried again by the producer, which the event loop waits on), closed after the run."""
    conf = {"url": stack.registry.url, "max.retries": 0, "timeout": 5}
    with SchemaRegistryClient(conf) as client:
        yield client


def _retire_double_v1(http_address: str) -> None:
    """``double`` as versions 1 and 2, then version 1 retired by the version policy (2
    serves): the traffic's requests naming version 1 must be MODEL_NOT_FOUND, not held."""
    policies: list[dict[str, Any]] = [{"all": {}}, {"latest": {"num_versions": 1}}]
    for policy in policies:
        status, body = load_versions(http_address, "double", policy)
        assert status == 200, body
    states = version_states(http_address, "double")
    assert states.get("2") == "READY" and states.get(RETIRED_VERSION) != "READY", states


async def _end_offsets(
    bootstrap: str, partitions: list[TopicPartition]
) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, isolation_level="read_committed")
    await consumer.start()
    try:
        return dict(await consumer.end_offsets(partitions))
    finally:
        await consumer.stop()


def _inputs(topics: Topics) -> Inputs:
    """The request topic's partitions, then the mapped topic's, then the Avro topic's."""
    requests = ((topics.input, p) for p in range(PARTITIONS))
    return Inputs((*requests, (_events_topic(topics), 0), (_avro_topic(topics), 0)))


def _events_topic(topics: Topics) -> str:
    return topics.input.replace("req-", "events-", 1)


def _avro_topic(topics: Topics) -> str:
    return topics.input.replace("req-", "avro-", 1)


async def _create_topics(stack: Stack, topics: Topics) -> None:
    kafka = stack.kafka
    await kafka.create_topics([topics.input], partitions=PARTITIONS)
    await kafka.create_topics([_events_topic(topics), _avro_topic(topics)], partitions=1)
    # The broker stamps outcomes on append: the duplicate bound reads throughput from them.
    stamped = {"message.timestamp.type": "LogAppendTime"}
    await kafka.create_topics(
        [topics.output],
        partitions=2,
        configs={**stamped, "max.message.bytes": str(OUTPUT_MAX_BYTES)},
    )
    await kafka.create_topics([topics.dlq], partitions=2, configs=stamped)


def _lanes(
    stack: Stack,
    topics: Topics,
    seed: int,
    delivery: str,
    ledger: Ledger,
    registry: SchemaRegistryClient,
) -> list[ConfluentLane | AiokafkaLane]:
    bootstrap = stack.kafka.bootstrap_servers
    specs = [
        (
            client,
            LaneSpec(
                bootstrap, topics.input, p, codec, seed, RATE_PER_PARTITION_S, delivery, number=p
            ),
        )
        for p, client, codec in LANES
    ]
    client, codec = EVENTS_LANE
    events = LaneSpec(
        bootstrap,
        _events_topic(topics),
        0,
        codec,
        seed,
        EVENTS_RATE_S,
        delivery,
        number=PARTITIONS,  # after the request topic's partitions (``_inputs``)
        input="events",
    )
    specs.append((client, events))
    client, codec = AVRO_LANE
    avro = LaneSpec(
        bootstrap,
        _avro_topic(topics),
        0,
        codec,
        seed,
        AVRO_RATE_S,
        delivery,
        number=PARTITIONS + 1,  # after the mapped topic's (``_inputs``)
        input="avro",
        registry=registry,
        # A quarter in: even a short run (CI's) produces well past it once its first faults
        # are applied.
        evolve_at=int(AVRO_RATE_S * SOAK_S / 4),
    )
    specs.append((client, avro))
    return [
        (ConfluentLane if client == "librdkafka" else AiokafkaLane)(spec, ledger)
        for client, spec in specs
    ]


async def _run_schedule(chaos: Chaos, seed: int, delivery: str) -> None:
    """Faults from the seed while the next one would end within SOAK_S, and at least the
    mode's first kinds."""
    ends_at = time.monotonic() + SOAK_S
    first = FIRST_KINDS[delivery]
    for fault in schedule(seed, first):
        done = {a.fault.kind for a in chaos.applied}
        expected_end = time.monotonic() + fault.gap_s + TYPICAL_S[fault.kind]
        if set(first) <= done and expected_end > ends_at:
            return
        # The schedule's quiet time between two faults (traffic flows meanwhile).
        await chaos.tripwire.guard(asyncio.sleep(fault.gap_s), fault.gap_s + 5, "quiet")
        await chaos.run_fault(fault)


async def _drain(chaos: Chaos, ledger: Ledger, collector: Collector, seed: int) -> None:
    """The traffic has stopped: hand over to a final worker, which must answer everything."""
    started_ms = int(time.time() * 1000)
    chaos.excuse()  # no worker in the group for a while
    await chaos.stop_worker(signal.SIGTERM)
    await chaos.start_worker()
    chaos.resume()
    accepted = ledger.accepted()
    missing = set(accepted)

    def all_answered() -> bool:
        nonlocal missing
        missing = {s for s in missing if s not in collector.by_source}
        return not missing

    all_answered()
    behind, drain_started = len(missing), time.monotonic()
    bound_s = DRAIN_BOUND_S + behind / DRAIN_FLOOR_PER_S
    try:
        await chaos.tripwire.guard(collector.wait_for(all_answered), bound_s, "final drain")
    except AssertionError as exc:
        unanswered = describe(sorted(missing), accepted)
        raise AssertionError(f"seed {seed}: {len(missing)} unanswered, e.g. {unanswered}") from exc
    took_s = time.monotonic() - drain_started
    chaos.say(f"final drain: {behind} records behind, answered in {took_s:.0f} s")
    chaos.windows.append((started_ms, int(time.time() * 1000)))


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
async def test_seeded_chaos_soak(
    stack: Stack, registry_client: SchemaRegistryClient, tmp_path: Path, delivery: str
) -> None:
    """Mixed traffic, mapped JSON and Avro events under seeded faults: each record answered
    right, stalls and RSS bounded."""
    seed = int(os.environ.get("SOAK_SEED") or secrets.randbelow(2**31))
    client = kafka_client_under_test()
    print(
        f"\nSOAK seed={seed} delivery={delivery} client={client} duration={SOAK_S:.0f}s "
        f"(replay: SOAK_SEED={seed})",
        flush=True,
    )
    topics = Topics.fresh(f"soak-{delivery.replace('_', '-')}-{seed}")
    await _create_topics(stack, topics)
    inputs = _inputs(topics)
    mapping = tmp_path / "mapping.toml"
    mapping.write_text(mapping_text(_events_topic(topics)) + avro_mapping_text(_avro_topic(topics)))
    # The producers' first schema, registered before any worker starts (as a pipeline's
    # owners do): the mapping's copied fields are typed by it.
    events_subject = f"{_avro_topic(topics)}-value"
    registry_client.register_schema(events_subject, Schema(payment_schema(1), "AVRO"))
    ledger = Ledger()
    collector = Collector(stack.kafka.bootstrap_servers, topics, inputs, ledger)
    settings = {
        **WORKER_SETTINGS,
        "delivery": delivery,
        "input_topics": ",".join(sorted({t for t, _ in inputs.partitions})),
        "mapping_file": str(mapping),
        "schema_registry_url": stack.registry.url,
        "schema_registry_auto_register": "true",
    }
    chaos = Chaos(stack, topics, tmp_path, seed, collector, settings)
    chaos.progress = Progress(len(inputs), STALL_BOUND_S, time.monotonic())
    chaos.excuse()  # until the first worker is up
    reader = OffsetReader(stack.kafka.bootstrap_servers, topics.group, inputs)
    lanes = _lanes(stack, topics, seed, delivery, ledger, registry_client)
    traffic_stop, reading_stop = asyncio.Event(), asyncio.Event()
    wall_started = time.monotonic()
    try:  # the reader closed whatever ends the run (a failure cancels the background)
        async with asyncio.TaskGroup() as background:
            background.create_task(collector.run(reading_stop))
            background.create_task(chaos.watch_servers(reading_stop))
            every_s = COMMIT_INTERVAL_MS / 1000
            background.create_task(chaos.watch_progress(reading_stop, reader, ledger.ends, every_s))
            producing = [background.create_task(lane.run(traffic_stop)) for lane in lanes]
            try:
                await chaos.start_worker()
                chaos.resume()
                await chaos.recovered("the first worker's start")
                await _run_schedule(chaos, seed, delivery)
                chaos_s = time.monotonic() - wall_started
                traffic_stop.set()
                await chaos.tripwire.guard(asyncio.gather(*producing), 180, "producers' flush")
                chaos.say(
                    f"traffic stopped: {len(ledger.acked)} acked, {len(ledger.failed)} refused"
                )
                await _drain(chaos, ledger, collector, seed)
                chaos.excuse()  # the final worker leaves
                final = chaos.current
                await chaos.stop_worker(signal.SIGTERM)
                assert final.returncode == 0
                outputs = [
                    TopicPartition(t, p) for t in (topics.output, topics.dlq) for p in range(2)
                ]
                outcome_ends = await _end_offsets(stack.kafka.bootstrap_servers, outputs)
                await chaos.tripwire.guard(
                    collector.wait_for(lambda: collector.read_up_to(outcome_ends)),
                    60,
                    "read to end",
                )
                ends = await _end_offsets(stack.kafka.bootstrap_servers, inputs.topic_partitions())
                input_ends = {inputs.number(tp.topic, tp.partition): e for tp, e in ends.items()}
                committed = await reader.read_answered()
            finally:
                traffic_stop.set()
                reading_stop.set()
                for worker in chaos.workers:
                    await worker.reap()
    finally:
        await reader.close()
    wall_s = time.monotonic() - wall_started
    chaos.say(f"chaos {chaos_s:.0f} s, wall {wall_s:.0f} s")
    if (worst := chaos.progress.worst) is not None:
        chaos.say(f"worst stall at t={worst.at - chaos.t0:.1f}s: {worst.describe(STALL_BOUND_S)}")
        if chaos.worst_inflight:
            chaos.say(f"in flight then: {chaos.worst_inflight}")
    deserializer = AvroDeserializer(registry_client)
    results = SerializationContext(topics.output, MessageField.VALUE)
    run = Run(
        seed,
        delivery,
        ledger,
        collector,
        chaos,
        committed,
        input_ends,
        read_avro=lambda value: deserializer(value, results),
    )
    limits = Limits(MAX_IN_FLIGHT, COMMIT_INTERVAL_MS + COMMIT_SLACK_MS, RSS_GROWTH_BOUND_MIB)
    figures = measure(run, limits)
    print(f"SOAK seed {seed}, {delivery}, {client}: {figures.summary()}")
    print(figures.row(delivery, client, seed, SOAK_S))
    judge(run, figures, limits)
