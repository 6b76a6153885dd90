"""The commands' group-less reader on librdkafka, against a fake consumer at its seam.

What librdkafka does that a real broker shows only now and then is scripted here: the
position of a partition assigned again stays the one it had reached until a record is
consumed, an OAUTHBEARER token is asked for only from a poll, a consume hands over
errors beside the records.
"""

from __future__ import annotations

from typing import Any

import confluent_kafka
import pytest

from worker.kafka.rdkafka import direct
from worker.kafka.rdkafka.direct import RdReader
from worker.kafka.types import KafkaError, TopicPartition
from worker.settings import KafkaAuthSettings, KafkaSettings

pytestmark = pytest.mark.timeout(10)

TP = TopicPartition("dlq", 0)
INVALID = confluent_kafka.OFFSET_INVALID


class FakeConsumer:
    """What ``RdReader`` uses of ``confluent_kafka.Consumer``, librdkafka's quirks kept."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.calls: list[str] = []
        self.position_of = INVALID  # as librdkafka reports it
        self.messages: list[Any] = []
        self.closed = False

    def poll(self, timeout: float = 0) -> Any:
        self.calls.append("poll")
        return self.messages.pop(0) if self.messages else None

    def list_topics(self, timeout: float | None = None) -> None:
        self.calls.append("list_topics")

    def unassign(self) -> None:
        self.calls.append("unassign")
        self.position_of = INVALID

    def assign(self, partitions: list[Any]) -> None:
        self.calls.append(f"assign {[(p.topic, p.partition, p.offset) for p in partitions]}")

    def position(self, partitions: list[Any]) -> list[Any]:
        (asked,) = partitions
        return [confluent_kafka.TopicPartition(asked.topic, asked.partition, self.position_of)]

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Any]:
        taken, self.messages = self.messages[:num_messages], self.messages[num_messages:]
        return taken

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def consumers(monkeypatch: pytest.MonkeyPatch) -> list[FakeConsumer]:
    """Every consumer a reader makes in the test, fake."""
    made: list[FakeConsumer] = []

    def consumer(config: dict[str, Any]) -> FakeConsumer:
        made.append(FakeConsumer(config))
        return made[-1]

    monkeypatch.setattr(confluent_kafka, "Consumer", consumer)
    return made


def _message(offset: int, error: Any = None, topic: str | None = "dlq") -> Any:
    return confluent_kafka.Message(topic=topic, partition=0, offset=offset, error=error)


async def test_a_partition_read_again_starts_at_its_new_offset(
    consumers: list[FakeConsumer],
) -> None:
    """Assigned again from an earlier offset, a partition's position is that offset, not
    the one reached before (librdkafka keeps the old one until unassigned): a second pass
    over a range reads it, rather than finding it read already."""
    reader = RdReader({})
    await reader.start()
    (consumer,) = consumers
    await reader.assign({TP: 0})
    assert await reader.position(TP) == 0
    consumer.position_of = 8  # read to the end
    assert await reader.position(TP) == 8
    await reader.assign({TP: 3})
    assert consumer.calls[-2:] == ["unassign", "assign [('dlq', 0, 3)]"]
    assert await reader.position(TP) == 3
    await reader.stop()
    assert consumer.closed


async def test_the_reader_polls_before_it_asks_a_broker(consumers: list[FakeConsumer]) -> None:
    """An OAUTHBEARER token is asked for from a poll: the first call is one."""
    reader = RdReader({})
    await reader.start()
    assert consumers[0].calls == ["poll", "list_topics"]
    await reader.stop()


async def test_a_fetch_skips_passing_errors_and_raises_a_refused_topic(
    consumers: list[FakeConsumer],
) -> None:
    """Errors librdkafka retries by itself (a group lookup refused) are left out of the
    records; a topic the principal may not read ends the fetch with a KafkaError."""
    reader = RdReader({})
    await reader.start()
    consumer = consumers[0]
    group_refused = confluent_kafka.KafkaError(30)  # GROUP_AUTHORIZATION_FAILED
    consumer.messages = [_message(0), _message(-1, group_refused, topic=None), _message(1)]
    assert [record.offset for record in await reader.fetch(0)] == [0, 1]
    consumer.messages = [_message(2, confluent_kafka.KafkaError(29))]
    with pytest.raises(KafkaError):
        await reader.fetch(0)
    await reader.stop()


def test_the_config_reads_committed_and_never_commits() -> None:
    """read_committed, no commits, a client id naming the command, short fetch waits."""
    config = direct.reader_config(KafkaSettings(client_id="c"), KafkaAuthSettings(), suffix="tail")
    assert config["isolation.level"] == "read_committed"
    assert (config["enable.auto.commit"], config["enable.auto.offset.store"]) == (False, False)
    assert config["client.id"] == "c-tail"
    assert config["fetch.wait.max.ms"] <= 100
