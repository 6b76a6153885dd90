"""The soak's producers: one lane per input partition, librdkafka or aiokafka, paced.

Every record goes in the ledger as it is produced, and every delivery report after:
the oracle judges only what the broker acknowledged. The input partitions of the soak's
topics (the requests', the mapped events' and the Avro events') are numbered from 0
(``Inputs``): a record's source is its input's number and its offset.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import confluent_kafka
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition
from confluent_kafka.schema_registry import SchemaRegistryClient

from tests.support.soak.avro import AvroTraffic
from tests.support.soak.events import EventTraffic
from tests.support.soak.traffic import PRODUCER_MAX_BYTES, NotYet, Sent, Traffic


@dataclass(frozen=True)
class Inputs:
    """The soak's input partitions across its topics, numbered from 0 in this order."""

    partitions: tuple[tuple[str, int], ...]

    def number(self, topic: str, partition: int) -> int:
        """The input's number; KeyError for a partition that is not an input."""
        try:
            return self.partitions.index((topic, partition))
        except ValueError:
            raise KeyError(f"{topic}[{partition}] is not an input of the soak") from None

    def __len__(self) -> int:
        return len(self.partitions)

    def topic_partitions(self) -> list[TopicPartition]:
        return [TopicPartition(t, p) for t, p in self.partitions]


@dataclass(slots=True)
class Ledger:
    """Records as produced (by request id) and every delivery report."""

    sent: dict[str, Sent] = field(default_factory=dict)
    # (request id, input number, offset) for each record the broker acknowledged.
    acked: list[tuple[str, int, int]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, error)
    #: Each input's end as far as acknowledged: one past its highest acked offset.
    ends: dict[int, int] = field(default_factory=dict)

    def delivered(self, rid: str, number: int, offset: int) -> None:
        self.acked.append((rid, number, offset))  # list.append: safe from flush's thread
        self.ends[number] = max(self.ends.get(number, 0), offset + 1)

    def refused(self, rid: str, error: str) -> None:
        self.failed.append((rid, error))

    def accepted(self) -> dict[tuple[int, int], str]:
        """(input number, offset) → request id of every acknowledged record."""
        return {(p, o): rid for rid, p, o in self.acked}


class Pace:
    """How many records a lane should have produced by now, at ``rate_per_s``."""

    def __init__(self, rate_per_s: float) -> None:
        self._rate = rate_per_s
        self._started = time.monotonic()

    def due(self, produced: int, burst: int = 200) -> int:
        return max(0, min(burst, int((time.monotonic() - self._started) * self._rate) - produced))


_TICK_S = 0.02


async def _tick(stop: asyncio.Event) -> None:
    # The producers' pacing: one tick, or less if the soak ends meanwhile.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), _TICK_S)


@dataclass(frozen=True)
class LaneSpec:
    """Where a lane writes and how: its partition, its codec, its traffic's seed and pace."""

    bootstrap: str
    topic: str
    partition: int
    compression: str
    seed: int
    rate_per_s: float
    tag: str  # the run, in sequence keys
    number: int  # the input's number (Inputs)
    #: Inference requests, the mapped topic's JSON events, or the Avro topic's events.
    input: Literal["requests", "events", "avro"] = "requests"
    #: The Avro topic's: the registry its producer writes its schemas to, and the record
    #: from which on it writes the schema's second version.
    registry: SchemaRegistryClient | None = None
    evolve_at: int = 0

    def traffic(self, *, librdkafka: bool) -> Traffic | EventTraffic | AvroTraffic:
        if self.input == "events":
            return EventTraffic(self.seed, self.number, librdkafka=librdkafka)
        if self.input == "avro":
            assert self.registry is not None, "an Avro lane writes through a registry"
            return AvroTraffic(
                self.seed,
                self.number,
                self.registry,
                self.topic,
                self.evolve_at,
                librdkafka=librdkafka,
            )
        compressed = self.compression != "none"
        return Traffic(
            self.seed, self.number, librdkafka=librdkafka, tag=self.tag, compressed=compressed
        )


class ConfluentLane:
    """One partition fed by a librdkafka producer (acks=all, idempotent, its own codec)."""

    def __init__(self, spec: LaneSpec, ledger: Ledger) -> None:
        self.spec = spec
        self.produced = 0
        self._traffic = spec.traffic(librdkafka=True)
        self._ledger = ledger
        self._producer = confluent_kafka.Producer(
            {
                "bootstrap.servers": spec.bootstrap,
                "acks": "all",
                "enable.idempotence": True,
                "compression.type": spec.compression,
                "linger.ms": 10,
                "message.max.bytes": PRODUCER_MAX_BYTES,
                # Longer than any broker restart of the soak: librdkafka retries until then.
                "message.timeout.ms": 120_000,
            },
            logger=logging.getLogger(f"soak.librdkafka.p{spec.partition}"),
        )

    def _report(self, rid: str, err: Any, msg: Any) -> None:
        if err is not None:
            self._ledger.refused(rid, str(err))
        else:
            self._ledger.delivered(rid, self.spec.number, msg.offset())

    async def run(self, stop: asyncio.Event) -> None:
        pace, spec = Pace(self.spec.rate_per_s), self.spec
        pending = None
        while not stop.is_set():
            for _ in range(pace.due(self.produced)):
                try:
                    record = pending or self._traffic.make(self.produced)
                except NotYet:
                    break  # the registry is out as the producer moves to a new schema
                headers: list[tuple[str, str | bytes | None]] = list(record.headers)
                try:
                    self._producer.produce(
                        spec.topic,
                        value=record.value,
                        key=record.key,
                        headers=headers,
                        partition=spec.partition,
                        on_delivery=functools.partial(self._report, record.sent.rid),
                    )
                except BufferError:
                    pending = record  # librdkafka's queue is full (broker down): next tick
                    break
                pending = None
                self._ledger.sent[record.sent.rid] = record.sent
                self.produced += 1
            self._producer.poll(0)
            await _tick(stop)
        # Flushed a second at a time, so that a cancelled soak leaves no thread behind for long.
        deadline = time.monotonic() + 150
        while (left := len(self._producer)) and time.monotonic() < deadline:
            await asyncio.to_thread(self._producer.flush, 1.0)
        assert left == 0, f"p{spec.partition}: {left} records without a delivery report"


class AiokafkaLane:
    """One partition fed by an aiokafka producer (acks=all, idempotent, its own codec)."""

    def __init__(self, spec: LaneSpec, ledger: Ledger) -> None:
        self.spec = spec
        self.produced = 0
        self._traffic = spec.traffic(librdkafka=False)
        self._ledger = ledger

    async def run(self, stop: asyncio.Event) -> None:
        spec = self.spec
        producer = AIOKafkaProducer(
            bootstrap_servers=spec.bootstrap,
            acks="all",
            enable_idempotence=True,
            compression_type=spec.compression,
            linger_ms=10,
            max_request_size=PRODUCER_MAX_BYTES,
            request_timeout_ms=120_000,
        )
        await producer.start()
        pending: list[asyncio.Future[Any]] = []
        try:
            pace = Pace(spec.rate_per_s)
            while not stop.is_set():
                for _ in range(pace.due(self.produced)):
                    try:
                        record = self._traffic.make(self.produced)
                    except NotYet:
                        break  # the registry is out as the producer moves to a new schema
                    rid = record.sent.rid
                    self._ledger.sent[rid] = record.sent
                    self.produced += 1
                    try:
                        future = await producer.send(
                            spec.topic,
                            record.value,
                            key=record.key,
                            headers=[(k, v or b"") for k, v in record.headers],
                            partition=spec.partition,
                        )
                    except KafkaError as exc:
                        self._ledger.refused(rid, repr(exc))
                        continue
                    future.add_done_callback(functools.partial(self._report, rid))
                    pending.append(future)
                await _tick(stop)
            await producer.flush()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            await producer.stop()

    def _report(self, rid: str, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            self._ledger.refused(rid, "cancelled")
        elif (exc := future.exception()) is not None:
            self._ledger.refused(rid, repr(exc))
        else:
            meta = future.result()
            self._ledger.delivered(rid, self.spec.number, meta.offset)
