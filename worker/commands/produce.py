"""``produce``: send inference requests from a file (or standard input) to a topic.

The file holds Open Inference Protocol JSON requests: one document, a JSON list of
them, or one per line (NDJSON). Each is sent keyed by its ``id`` (or
``<file>-<n>``), with ``content-type: application/json``, and the command waits for
every acknowledgement, with a progress bar.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from worker.checks import probes
from worker.commands.session import (
    CommandFailed,
    Connection,
    add_connection_arguments,
    reach,
    read_connection,
    run_command,
    topic_name,
    topic_problem,
)
from worker.errors import ExitCode
from worker.kafka.direct import Writer
from worker.kafka.edge import new_writer
from worker.settings import ConfigError

__all__ = [
    "MAX_REQUEST_BYTES",
    "Outgoing",
    "add_produce_parser",
    "progress_bar",
    "read_requests",
    "send_all",
]

#: The largest request the command sends (the topic's own limit may be lower).
MAX_REQUEST_BYTES = 8 << 20


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One record to send: value, key and headers."""

    value: bytes
    key: bytes | None
    headers: list[tuple[str, bytes]] = field(default_factory=list)


def progress_bar(console: Console, *, disable: bool = False) -> Progress:
    """The progress bar of long sends and collections (``disable``: shown nowhere)."""
    return Progress(
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=disable,
    )


async def send_all(
    writer: Writer,
    topic: str,
    records: Sequence[Outgoing],
    progress: Progress,
) -> list[float]:
    """Produce every record and wait for the acks; return each one's send time (epoch s).

    ``writer`` is started here and stopped before returning.
    """
    task = progress.add_task(f"producing to {topic}", total=len(records))
    sent_at: list[float] = []
    await writer.start()
    try:
        futures = []
        for record in records:
            sent_at.append(time.time())
            futures.append(await writer.send(topic, record.value, record.key, record.headers))
            progress.advance(task)
        await asyncio.gather(*futures)
    finally:
        await writer.stop()
    return sent_at


def read_requests(text: str, name: str) -> list[Outgoing]:
    """Requests from a JSON document, a JSON list, or NDJSON text; ValueError if neither."""
    try:
        loaded = json.loads(text)
        docs = loaded if isinstance(loaded, list) else [loaded]
    except json.JSONDecodeError:
        try:
            docs = [json.loads(line) for line in text.splitlines() if line.strip()]
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: neither JSON nor NDJSON ({exc})") from None
    out = []
    for i, doc in enumerate(docs):
        if not isinstance(doc, dict):
            raise ValueError(f"{name}: request {i} is not a JSON object")
        out.append(
            Outgoing(
                json.dumps(doc).encode(),
                str(doc.get("id", f"{name}-{i}")).encode(),
                [("content-type", b"application/json")],
            )
        )
    return out


def add_produce_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``produce``; it reaches Kafka with the worker's WORKER_* settings and flags."""
    produce = commands.add_parser(
        "produce",
        help="send JSON inference requests from a file (or stdin) to a topic",
        description="Send Open Inference Protocol JSON requests (one document, a JSON list, "
        "or NDJSON) to a topic, each keyed by its id, and wait for every acknowledgement. "
        "Kafka is reached as `run` reaches it: every flag below can also be set by its "
        "WORKER_* environment variable.",
    )
    produce.add_argument(
        "--file",
        required=True,
        metavar="PATH",
        help="JSON (one request or a list) or NDJSON file; - for standard input",
    )
    produce.add_argument(
        "--topic",
        metavar="TOPIC",
        type=topic_name,
        help="topic to send to [default: the first of WORKER_INPUT_TOPICS]",
    )
    add_connection_arguments(produce, "input_topics")
    produce.set_defaults(handler=run_produce)


def run_produce(args: argparse.Namespace) -> int:
    """``produce``: 0 once every request is acknowledged; 2 for a file, a setting, a topic or
    a credential to fix; 5 when Kafka is unreachable; 4 when it did not take every request."""
    try:
        # The input topics are read only to default --topic (and only then judged).
        connection = read_connection(args, optional=[] if args.topic else ["input_topics"])
        topic = args.topic or _first_input_topic(connection)
        records = _records(args.file)
    except (ConfigError, CommandFailed) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    return run_command(_produce(connection, topic, records))


def _first_input_topic(connection: Connection) -> str:
    topics: tuple[str, ...] = connection.values.get("input_topics", ())
    if not topics:
        raise CommandFailed("--topic: required (or set WORKER_INPUT_TOPICS)", ExitCode.CONFIG)
    return topics[0]


def _records(path: str) -> list[Outgoing]:
    name = "stdin" if path == "-" else Path(path).name
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise CommandFailed(f"--file: cannot read {path!r}: {why}", ExitCode.CONFIG) from None
    try:
        return read_requests(text, name)
    except ValueError as exc:
        raise CommandFailed(f"--file: {exc}", ExitCode.CONFIG) from None


async def _produce(connection: Connection, topic: str, records: list[Outgoing]) -> int:
    problem = topic_problem(await reach(connection, [topic]), topic, probes.WRITE)
    if problem is not None:
        raise CommandFailed(problem, ExitCode.CONFIG)
    console = Console(stderr=True)
    writer = new_writer(
        connection.kafka, connection.auth, suffix="produce", max_request_bytes=MAX_REQUEST_BYTES
    )
    with progress_bar(console, disable=not console.is_terminal) as progress:
        await send_all(writer, topic, records, progress)
    console.print(f"sent {len(records)} requests to [bold]{topic}[/bold]")
    return ExitCode.OK
