"""``tail``: print the last records of the result or dead-letter topic, with their headers.

One JSON object per line: topic, partition, offset, timestamp, key, headers (decoded
as UTF-8; a name repeated keeps its last value) and the value (the JSON document it
holds, else its text, else base64).
Nothing is committed and no group is joined, so it is safe beside running workers;
it reads ``read_committed``, as the workers' consumers do. ``--wait`` waits for
records that have not arrived yet (a request just produced).
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import time
from typing import Any

from worker.checks import probes
from worker.commands.session import (
    CommandFailed,
    Connection,
    add_connection_arguments,
    reach,
    read_connection,
    run_command,
    topic_problem,
)
from worker.errors import ExitCode
from worker.kafka.direct import Reader
from worker.kafka.edge import new_reader
from worker.kafka.types import ConsumerRecord, TopicPartition
from worker.settings import ConfigError

__all__ = ["add_tail_parser", "record_line", "run_tail"]

#: Which setting names the topic of each choice.
_TOPICS = {"results": "output_topic", "dead-letters": "dlq_topic"}


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def add_tail_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``tail``; it takes the worker's WORKER_* Kafka and topic settings."""
    parser = commands.add_parser(
        "tail",
        help="print the last results or dead letters, with their headers, as JSON lines",
        description="Print the last records of the output topic (results) or of the "
        "dead-letter topic, one JSON object per line. Joins no group, commits nothing. "
        "Every flag below can also be set by its WORKER_* environment variable.",
    )
    parser.add_argument(
        "which", choices=sorted(_TOPICS), help="results (WORKER_OUTPUT_TOPIC) or dead-letters"
    )
    parser.add_argument(
        "-n", "--records", type=_count, default=10, metavar="N", help="how many [default: 10]"
    )
    parser.add_argument(
        "--wait",
        type=_seconds,
        default=0.0,
        metavar="SECONDS",
        help="wait up to this long for N records; exit 4 if fewer came [default: 0]",
    )
    add_connection_arguments(parser, *_TOPICS.values())
    parser.set_defaults(handler=run_tail)


def run_tail(args: argparse.Namespace) -> int:
    """``tail``: 0 when the records were printed; 2 for a setting or permission to fix;
    5 when Kafka is unreachable; 4 when ``--wait`` ran out before N records came."""
    field = _TOPICS[args.which]
    try:
        connection = read_connection(args, [field])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    topic: str = connection.values[field]
    return run_command(_tail(connection, topic, args.records, args.wait))


async def _tail(connection: Connection, topic: str, count: int, wait_s: float) -> int:
    metadata = await reach(connection, [topic])
    problem = topic_problem(metadata, topic, probes.READ)
    if problem is not None:
        raise CommandFailed(problem, ExitCode.CONFIG)
    found = next(t for t in metadata["topics"] if t["topic"] == topic)
    partitions = [TopicPartition(topic, p["partition"]) for p in found["partitions"]]
    records = await _last(connection, partitions, count, wait_s)
    for record in records:
        print(json.dumps(record_line(record), ensure_ascii=False))
    if wait_s and len(records) < count:
        message = f"{topic}: {len(records)} of {count} records after waiting {wait_s:g} s"
        raise CommandFailed(message, ExitCode.INCOMPLETE)
    return ExitCode.OK


async def _last(
    connection: Connection, partitions: list[TopicPartition], count: int, wait_s: float
) -> list[ConsumerRecord[bytes, bytes]]:
    """The last ``count`` records of the partitions by timestamp, waiting up to ``wait_s``."""
    reader = new_reader(connection.kafka, connection.auth, suffix="tail")
    await reader.start()
    try:
        spans = await reader.offsets(partitions)
        await reader.assign({tp: max(span.start, span.stop - count) for tp, span in spans.items()})
        ends = {tp: span.stop for tp, span in spans.items()}
        found: list[ConsumerRecord[bytes, bytes]] = []
        deadline = time.monotonic() + wait_s
        while not await _read_up_to(reader, ends) or (
            len(found) < count and time.monotonic() < deadline
        ):
            found += await reader.fetch(0.2)
    finally:
        await reader.stop()
    found.sort(key=lambda r: (r.timestamp, r.partition, r.offset))
    return found[-count:]


async def _read_up_to(reader: Reader, ends: dict[TopicPartition, int]) -> bool:
    """True once every partition's position reached its end offset at the start."""
    return all([await reader.position(tp) >= end for tp, end in ends.items()])


def record_line(record: ConsumerRecord[bytes, bytes]) -> dict[str, Any]:
    """A record as plain data: coordinates, key, headers, and the value it holds."""
    return {
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "timestamp": record.timestamp,
        "key": None if record.key is None else record.key.decode("utf-8", "replace"),
        "headers": {
            name: None if value is None else value.decode("utf-8", "replace")
            for name, value in record.headers
        },
        **_value(record.value),
    }


def _value(value: bytes | None) -> dict[str, Any]:
    if value is None:
        return {"value": None}
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return {"value_base64": base64.b64encode(value).decode()}
    try:
        return {"value": json.loads(text)}
    except json.JSONDecodeError:
        return {"value": text}
