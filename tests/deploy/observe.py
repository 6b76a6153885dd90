"""What the compose test looks at from the host: the consumer group, offsets, Prometheus.

Everything through the ports the compose file publishes on localhost: Kafka's external
listener and Prometheus's API.
"""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec

KAFKA = "localhost:29092"
PROMETHEUS = "http://localhost:9090"
GROUP = "kafka-triton-worker"
INPUT_TOPIC = "inference-requests"

_T = TypeVar("_T")


def poll(check: Callable[[], _T | None], timeout_s: float, what: str) -> _T:
    """``check()`` again every half second until it returns something; AssertionError after
    ``timeout_s`` with ``what`` and the last value seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found is not None:
            return found
        assert time.monotonic() < deadline, f"{what} not within {timeout_s:.0f} s"
        time.sleep(0.5)


def _admin() -> AdminClient:
    # Warnings and errors only: a short-lived client logs its own shutdown at info level.
    return AdminClient({"bootstrap.servers": KAFKA, "log_level": 4})


def group_assignment() -> dict[str, set[int]]:
    """The group's members (by member id) and the input partitions each holds, when stable."""
    admin = _admin()  # kept referenced: a client destroyed early never resolves its futures
    (future,) = admin.describe_consumer_groups([GROUP], request_timeout=10).values()
    group = future.result(timeout=30)
    if str(group.state.name) != "STABLE":
        return {}
    return {
        member.member_id: {
            tp.partition for tp in member.assignment.topic_partitions if tp.topic == INPUT_TOPIC
        }
        for member in group.members
    }


def shared_assignment(members: int, partitions: int) -> dict[str, set[int]] | None:
    """The assignment when ``members`` members hold every partition, evenly; else None."""
    found = group_assignment()
    held = [p for owned in found.values() for p in owned]
    even = {len(owned) for owned in found.values()} == {partitions // members}
    if len(found) == members and sorted(held) == list(range(partitions)) and even:
        return found
    return None


def committed_and_end_offsets() -> tuple[dict[int, int], dict[int, int]]:
    """The group's committed offset and the end offset of each input partition."""
    admin = _admin()
    request = ConsumerGroupTopicPartitions(GROUP)
    (future,) = admin.list_consumer_group_offsets([request], request_timeout=10).values()
    offsets = future.result(timeout=30).topic_partitions
    committed = {tp.partition: tp.offset for tp in offsets if tp.topic == INPUT_TOPIC}
    topic = admin.list_topics(INPUT_TOPIC, timeout=10).topics[INPUT_TOPIC]
    # OffsetSpec.latest is unannotated in confluent_kafka.
    asks = {TopicPartition(INPUT_TOPIC, p): OffsetSpec.latest() for p in topic.partitions}  # type: ignore[no-untyped-call]
    answers = admin.list_offsets(asks, request_timeout=10)
    ends = {tp.partition: f.result(timeout=30).offset for tp, f in answers.items()}
    return committed, ends


def prometheus(path: str, **params: str) -> Any:
    """GET Prometheus's HTTP API; the ``data`` of a successful answer."""
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{PROMETHEUS}{path}{query}", timeout=10) as response:
        answer = json.load(response)
    assert answer["status"] == "success", answer
    return answer["data"]


def active_targets() -> list[dict[str, Any]]:
    """Prometheus's active scrape targets: labels, health, last error."""
    targets: list[dict[str, Any]] = prometheus("/api/v1/targets")["activeTargets"]
    return targets


def series_count(metric: str) -> int:
    """How many series of ``metric`` Prometheus has now."""
    result = prometheus("/api/v1/query", query=f'count({{__name__="{metric}"}})')["result"]
    return int(result[0]["value"][1]) if result else 0
