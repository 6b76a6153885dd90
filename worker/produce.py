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

from aiokafka import AIOKafkaProducer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from worker.errors import ExitCode

__all__ = ["Outgoing", "add_produce_parser", "progress_bar", "read_requests", "send_all"]


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
    bootstrap: str, topic: str, records: Sequence[Outgoing], progress: Progress
) -> list[float]:
    """Produce every record and wait for the acks; return each one's send time (epoch s)."""
    task = progress.add_task(f"producing to {topic}", total=len(records))
    sent_at: list[float] = []
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=8 << 20
    )
    await producer.start()
    try:
        futures = []
        for record in records:
            sent_at.append(time.time())
            futures.append(
                await producer.send(topic, record.value, key=record.key, headers=record.headers)
            )
            progress.advance(task)
        await asyncio.gather(*futures)
    finally:
        await producer.stop()
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
    """Register ``produce``."""
    produce = commands.add_parser(
        "produce", help="send JSON inference requests from a file (or stdin) to a topic"
    )
    produce.add_argument("--bootstrap-servers", default="localhost:9092")
    produce.add_argument("--topic", required=True)
    produce.add_argument(
        "--file", required=True, help="JSON (one request or a list) or NDJSON file; - for stdin"
    )
    produce.set_defaults(handler=run_produce)


def run_produce(args: argparse.Namespace) -> int:
    """``produce``: 0 once every request is acknowledged, 2 when the file cannot be read."""
    name = "stdin" if args.file == "-" else Path(args.file).name
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
        records = read_requests(text, name)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    console = Console(stderr=True)
    with progress_bar(console) as progress:
        asyncio.run(send_all(args.bootstrap_servers, args.topic, records, progress))
    console.print(f"sent {len(records)} requests to [bold]{args.topic}[/bold]")
    return ExitCode.OK
