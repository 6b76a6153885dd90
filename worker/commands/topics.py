"""``topics``: create the worker's topics (input, output, dead-letter, audit) where missing.

The topics are the ones the settings name, read as ``run`` reads them. Topics that
exist are left as they are; missing ones are created with ``--partitions`` and
``--replication-factor`` (by default as many replicas as there are brokers, up to 3),
and the command waits until each has a leader for every partition, so that a
``produce`` or a worker started next finds them ready.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from rich.console import Console

from worker.commands.session import (
    CommandFailed,
    Connection,
    add_connection_arguments,
    contact,
    describe,
    read_connection,
    run_command,
)
from worker.errors import ExitCode
from worker.kafka.admin import Admin
from worker.settings import ConfigError

__all__ = ["add_topics_parser", "run_topics"]

_TOPIC_FIELDS = ("input_topics", "output_topic", "dlq_topic")
_ALREADY_EXISTS = 36
#: How long created topics may take to get a leader for every partition.
_LEADERS_TIMEOUT_S = 30.0


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def add_topics_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``topics``; it takes the worker's WORKER_* topic and Kafka settings."""
    parser = commands.add_parser(
        "topics",
        help="create the worker's topics (input, output, dead-letter, audit) where missing",
        description="Create the topics the settings name, where missing; existing topics are "
        "left as they are. Every flag below can also be set by its WORKER_* environment "
        "variable, as for `run`.",
    )
    parser.add_argument(
        "--partitions",
        type=_count,
        default=4,
        metavar="N",
        help="partitions of each topic created (input partitions bound how many workers "
        "share the load) [default: 4]",
    )
    parser.add_argument(
        "--replication-factor",
        type=_count,
        metavar="N",
        help="replicas of each topic created [default: the number of brokers, at most 3]",
    )
    add_connection_arguments(parser, *_TOPIC_FIELDS, "audit_topic")
    parser.set_defaults(handler=run_topics)


def run_topics(args: argparse.Namespace) -> int:
    """``topics``: 0 when every topic exists now; 2 for a setting or permission to fix;
    5 when Kafka is unreachable."""
    try:
        connection = read_connection(args, _TOPIC_FIELDS, optional=["audit_topic"])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    names = _names(connection)
    return run_command(_create(connection, names, args.partitions, args.replication_factor))


def _names(connection: Connection) -> list[str]:
    values = connection.values
    names = [*values["input_topics"], values["output_topic"], values["dlq_topic"]]
    if values.get("audit_topic"):
        names.append(values["audit_topic"])
    return names


async def _create(
    connection: Connection, names: list[str], partitions: int, replication: int | None
) -> int:
    async with contact(connection.kafka, connection.auth) as admin:
        metadata = await describe(admin, names)
        existing = {t["topic"] for t in metadata["topics"] if int(t["error_code"]) == 0}
        missing = [name for name in names if name not in existing]
        console = Console()
        for name in names:
            if name in existing:
                console.print(f"exists   {name}")
        if not missing:
            return ExitCode.OK
        factor = replication or min(3, len(metadata["brokers"]))
        await _create_missing(admin, missing, partitions, factor)
        await _wait_for_leaders(admin, missing)
    for name in missing:
        console.print(f"created  {name} ({partitions} partitions, {factor} replicas)")
    return ExitCode.OK


async def _create_missing(admin: Admin, names: list[str], partitions: int, factor: int) -> None:
    answers = await admin.create_topics(names, partitions=partitions, replication=factor)
    for topic, code, detail in answers:
        if code and code != _ALREADY_EXISTS:
            why = detail or f"Kafka error code {code}"
            raise CommandFailed(f"cannot create topic {topic!r}: {why}", ExitCode.CONFIG)


async def _wait_for_leaders(admin: Admin, names: list[str]) -> None:
    deadline = time.monotonic() + _LEADERS_TIMEOUT_S
    while True:
        metadata = await describe(admin, names)
        ready = [
            t["topic"]
            for t in metadata["topics"]
            if int(t["error_code"]) == 0 and all(p["leader"] >= 0 for p in t["partitions"])
        ]
        if set(ready) >= set(names):
            return
        if time.monotonic() > deadline:
            waiting = sorted(set(names) - set(ready))
            message = f"topics {waiting} have no leader after {_LEADERS_TIMEOUT_S:g} s"
            raise CommandFailed(message, ExitCode.INCOMPLETE)
        await asyncio.sleep(0.1)  # a new topic's leaders are elected by the controller
