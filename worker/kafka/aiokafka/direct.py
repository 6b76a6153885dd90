"""Kafka written and read without a group on aiokafka (``worker.kafka.direct``).

The writer is an idempotent ``AIOKafkaProducer``; the reader an ``AIOKafkaConsumer``
without a group, its partitions assigned and sought by the caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from worker.kafka.aiokafka import clients
from worker.kafka.options import kafka_client_kwargs
from worker.kafka.publisher import Headers
from worker.kafka.types import ConsumerRecord, TopicPartition
from worker.settings import KafkaAuthSettings, KafkaSettings

__all__ = ["AioReader", "AioWriter", "reader", "writer"]


class AioWriter:
    """An idempotent aiokafka producer (``worker.kafka.direct.Writer``)."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self._producer = producer

    async def start(self) -> None:
        try:
            await self._producer.start()
        except BaseException:
            await self._producer.stop()  # its client is open even when the start failed
            raise

    async def send(
        self, topic: str, value: bytes | None, key: bytes | None, headers: Headers | None
    ) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = await self._producer.send(
            topic, value, key=key, headers=list(headers) if headers else None
        )
        return future

    async def stop(self) -> None:
        await self._producer.stop()


class AioReader:
    """An aiokafka consumer without a group (``worker.kafka.direct.Reader``)."""

    def __init__(self, consumer: AIOKafkaConsumer) -> None:
        self._consumer = consumer

    async def start(self) -> None:
        try:
            await self._consumer.start()
        except BaseException:
            await self._consumer.stop()
            raise

    async def offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, range]:
        wanted = list(partitions)
        starts = await self._consumer.beginning_offsets(wanted)
        ends = await self._consumer.end_offsets(wanted)
        return {tp: range(starts[tp], ends[tp]) for tp in wanted}

    async def assign(self, starts: Mapping[TopicPartition, int]) -> None:
        self._consumer.assign(list(starts))
        for tp, offset in starts.items():
            self._consumer.seek(tp, offset)

    async def position(self, tp: TopicPartition) -> int:
        return int(await self._consumer.position(tp))

    async def fetch(self, timeout_s: float) -> list[ConsumerRecord[bytes, bytes]]:
        batch = await self._consumer.getmany(timeout_ms=int(timeout_s * 1000))
        return [record for records in batch.values() for record in records]

    async def stop(self) -> None:
        await self._consumer.stop()


def writer(
    kafka: KafkaSettings, auth: KafkaAuthSettings, *, suffix: str, max_request_bytes: int
) -> AioWriter:
    """An idempotent producer of records up to ``max_request_bytes``, its client id
    ``<client id>-<suffix>`` (ConfigError for unusable security settings)."""
    producer = clients.producer(
        kafka,
        kafka_client_kwargs(auth),
        suffix=suffix,
        **clients.idempotent(max_request_bytes),
    )
    return AioWriter(producer)


def reader(kafka: KafkaSettings, auth: KafkaAuthSettings, *, suffix: str) -> AioReader:
    """A consumer without a group, ``read_committed``, its client id ``<client id>-<suffix>``
    (ConfigError for unusable security settings)."""
    consumer = clients.consumer(
        kafka,
        kafka_client_kwargs(auth),
        suffix=suffix,
        group_id=None,
        enable_auto_commit=False,
        # An offset deleted by retention since it was asked for: read from the oldest left.
        auto_offset_reset="earliest",
        isolation_level="read_committed",
    )
    return AioReader(consumer)
