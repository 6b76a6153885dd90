"""The private aiokafka parts the worker reads, against aiokafka's own objects."""

from __future__ import annotations

import asyncio

from aiokafka import AIOKafkaConsumer
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.structs import TopicPartition

from worker.kafka.aiokafka._compat import rebalancing


class _Coordinator:
    """Just what GroupCoordinator.need_rejoin reads, with aiokafka's own method."""

    need_rejoin = GroupCoordinator.need_rejoin

    def __init__(self) -> None:
        self._rejoin_needed_fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()


async def test_rebalancing_follows_the_subscription_and_the_rejoin_flag() -> None:
    """Rebalancing until an assignment exists, not once assigned, again when a rejoin is due."""
    consumer = AIOKafkaConsumer("t", bootstrap_servers="127.0.0.1:1")
    try:
        assert rebalancing(consumer)  # not started: no coordinator
        coordinator = _Coordinator()
        consumer._coordinator = coordinator
        assert rebalancing(consumer)  # subscribed, nothing assigned yet
        consumer._subscription.assign_from_subscribed({TopicPartition("t", 0)})
        assert not rebalancing(consumer)
        coordinator._rejoin_needed_fut.set_result(None)
        assert rebalancing(consumer)
    finally:
        consumer._coordinator = None
        await consumer.stop()
