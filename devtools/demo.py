"""``demo`` (the whole pipeline on a local stack) and ``produce`` (send sample requests)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from devtools import samples
from worker.commands.produce import MAX_REQUEST_BYTES, Outgoing, progress_bar, send_all
from worker.events.cloudevents import STRUCTURED
from worker.kafka.aiokafka.direct import AioWriter
from worker.wire import header_value

#: Small enough that the "oversized" sample still fits a default broker message.
DEMO_MAX_REQUEST_BYTES = samples.BAD_SAMPLES_MAX_REQUEST_BYTES
#: What the decoupled ``tokens`` model is asked to stream, one response per token.
DEMO_PROMPT = "every token of this sentence travels as its own Triton response"
DEMO_STREAMS = 3
#: The mapped topic of the demo's plain events (examples/payments.toml maps it to ``mlp``).
PAYMENTS_TOPIC = "payments"
DEMO_PAYMENTS = 20
#: The mapped topic of the demo's CloudEvents (examples/readings.json maps it to ``double``).
READINGS_TOPIC = "readings"
DEMO_READINGS = 4
#: The mapped topic of the demo's Avro events (examples/payments-avro.toml maps it to
#: ``mlp``), their schema in the stack's Schema Registry.
AVRO_TOPIC = "payments-avro"
DEMO_AVRO = 5


def add_demo_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser("demo", help="run the pipeline end to end on a local stack")
    demo.add_argument("--requests", type=int, default=3000, help="good requests (default 3000)")
    demo.add_argument("--keep", action="store_true", help="leave the stack and worker running")
    demo.set_defaults(handler=run_demo)

    produce = commands.add_parser(
        "produce", help="send generated sample requests (every encoding) to a topic"
    )
    produce.add_argument("--bootstrap-servers", default="localhost:9092")
    produce.add_argument("--topic", required=True)
    produce.add_argument("--generate", type=int, metavar="N", required=True)
    produce.add_argument(
        "--models", default="double,mlp,echo_bytes", help="models for generated requests"
    )
    produce.add_argument(
        "--bad",
        action="store_true",
        help="add one request per bad kind (the oversized one assumes "
        "WORKER_MAX_REQUEST_BYTES=256KiB)",
    )
    produce.set_defaults(handler=run_produce)


def outgoing(requests: Sequence[samples.SampleRequest]) -> list[Outgoing]:
    """Sample requests as records keyed by request id."""
    return [Outgoing(r.value, r.request_id.encode(), r.headers) for r in requests]


async def send_requests(
    bootstrap: str, topic: str, records: Sequence[Outgoing], progress: Progress
) -> list[float]:
    """``send_all`` on a producer of the dev stack's (no TLS, no SASL, linger 5 ms)."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", linger_ms=5, max_request_size=MAX_REQUEST_BYTES
    )
    return await send_all(AioWriter(producer), topic, records, progress)


def run_produce(args: argparse.Namespace) -> int:
    console = Console()
    requests = samples.good_requests(args.generate, models=args.models.split(","))
    if args.bad:
        requests += samples.bad_requests()
    with progress_bar(console) as progress:
        asyncio.run(send_requests(args.bootstrap_servers, args.topic, outgoing(requests), progress))
    console.print(f"sent {len(requests)} requests to [bold]{args.topic}[/bold]")
    return 0


# -- demo ------------------------------------------------------------------------------


def run_demo(args: argparse.Namespace) -> int:
    from devtools.devstack.paths import run_dir
    from devtools.devstack.stack import LocalStack

    console = Console()
    workdir = run_dir() / "demo"
    shutil.rmtree(workdir, ignore_errors=True)
    with console.status("starting a local Kafka broker, Triton server and Schema Registry..."):
        stack = LocalStack.create(workdir, registry=True, log=console.print)
        stack.start()
    assert stack.registry is not None
    console.print(
        f"stack ready in {stack.timings_s['total']:.1f}s: "
        f"kafka {stack.kafka.bootstrap_servers}, triton {stack.triton.grpc_address}, "
        f"schema registry {stack.registry.url}"
    )
    try:
        code = asyncio.run(_demo(stack, args, console, workdir))
    except BaseException:
        stack.stop()
        raise
    if args.keep:
        stack.save()
        for name, address in stack.describe().items():
            console.print(f"{name}: {address}")
        console.print(
            "the stack is left running (topics and data kept); run a worker against it "
            "with [bold]python -m worker run[/bold], stop it with "
            "[bold]python -m devtools dev down[/bold]"
        )
    else:
        stack.stop()
    return code


async def _demo(stack: Any, args: argparse.Namespace, console: Console, workdir: Path) -> int:
    from devtools.devstack.paths import PROJECT_ROOT
    from devtools.devstack.stack import DEFAULT_TOPICS, INPUT_PARTITIONS
    from worker.app import Worker
    from worker.observability import configure_logging
    from worker.settings import load_settings

    topics = DEFAULT_TOPICS
    await stack.kafka.create_topics([topics["input"]], partitions=INPUT_PARTITIONS)
    await stack.kafka.create_topics([PAYMENTS_TOPIC, READINGS_TOPIC, AVRO_TOPIC], partitions=1)
    avro = AvroPayments(stack.registry.url, PROJECT_ROOT / "examples" / "payment.avsc")
    await stack.kafka.create_topics([topics["output"], topics["dlq"]], partitions=INPUT_PARTITIONS)
    settings = load_settings(
        {
            "WORKER_BOOTSTRAP_SERVERS": stack.kafka.bootstrap_servers,
            "WORKER_INPUT_TOPICS": (
                f"{topics['input']},{PAYMENTS_TOPIC},{READINGS_TOPIC},{AVRO_TOPIC}"
            ),
            "WORKER_SCHEMA_REGISTRY_URL": stack.registry.url,
            "WORKER_SCHEMA_REGISTRY_AUTO_REGISTER": "true",
            "WORKER_MAPPING_FILE": str(_examples_mapping(PROJECT_ROOT / "examples", workdir)),
            "WORKER_OUTPUT_TOPIC": topics["output"],
            "WORKER_DLQ_TOPIC": topics["dlq"],
            "WORKER_GROUP_ID": "demo-worker",
            "WORKER_TRITON_URL": stack.triton.grpc_address,
            "WORKER_METRICS_PORT": "0",
            "WORKER_MAX_REQUEST_BYTES": str(DEMO_MAX_REQUEST_BYTES),
            "WORKER_LOG_FORMAT": "json",
        }
    )
    log_path = workdir / "worker.log"
    log_file = log_path.open("w")
    configure_logging("json", "info", stream=log_file)
    worker = Worker(settings)
    running = asyncio.create_task(worker.run())
    await worker.started.wait()

    burst = samples.good_requests(args.requests) + samples.bad_requests(DEMO_MAX_REQUEST_BYTES)
    words = len(DEMO_PROMPT.split())
    streams = [
        samples.token_request(f"demo-tokens-{i}", DEMO_PROMPT, words) for i in range(DEMO_STREAMS)
    ]
    events = samples.payment_events(DEMO_PAYMENTS)
    readings = samples.reading_events(DEMO_READINGS)
    requests = burst + streams + events + readings
    sent_at: dict[str, float] = {}
    answers: dict[str, tuple[str, str | None, Any]] = {}
    with progress_bar(console) as progress:
        # The token streams go after the burst is answered: tritonserver 2.51 was seen
        # to abort when decoupled and ordinary requests meet under a burst (docs/decisions/0009).
        for phase, topic in (
            (burst, topics["input"]),
            (streams, topics["input"]),
            (events, PAYMENTS_TOPIC),
            (readings, READINGS_TOPIC),
        ):
            times = await send_requests(
                stack.kafka.bootstrap_servers, topic, outgoing(phase), progress
            )
            sent_at.update((r.request_id, t) for r, t in zip(phase, times, strict=True))
            answers |= await collect(
                stack.kafka.bootstrap_servers,
                [topics["output"], topics["dlq"]],
                {r.request_id for r in phase},
                progress,
            )
        avro_events = avro.events(DEMO_AVRO)
        await send_requests(stack.kafka.bootstrap_servers, AVRO_TOPIC, avro_events, progress)
        avro_answers = await collect(
            stack.kafka.bootstrap_servers,
            [topics["output"], topics["dlq"]],
            {(r.key or b"").decode() for r in avro_events},
            progress,
        )
    worker.request_stop()
    await running
    log_file.close()
    _summary(console, requests, answers, sent_at, topics)
    _show_events(console, events, answers)
    _show_cloud_events(console, readings, answers)
    avro_ok = avro.show(console, avro_answers, topics["output"], len(avro_events))
    console.print(f"worker log: {log_path}")
    expected = {r.request_id: r.expected_code for r in requests}
    wrong = [rid for rid, (topic, code, _) in answers.items() if code != expected[rid]]
    return 1 if wrong or len(answers) != len(requests) or not avro_ok else 0


class AvroPayments:
    """The demo's Avro payments: written by confluent-kafka's AvroSerializer against the
    stack's registry (the schema registered before the worker starts: the results' schema
    copies its field types), their results read back by its AvroDeserializer."""

    def __init__(self, url: str, schema_file: Path) -> None:
        from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

        # Its HTTP client logs each request at info, into the worker's log stream.
        for name in ("httpx", "httpx2"):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._closing = contextlib.ExitStack()
        self._client = self._closing.enter_context(SchemaRegistryClient({"url": url}))
        self._schema = schema_file.read_text()
        self._client.register_schema(f"{AVRO_TOPIC}-value", Schema(self._schema, "AVRO"))

    def events(self, count: int, seed: int = 21) -> list[Outgoing]:
        """``count`` payments in the Confluent wire format, keyed by their id."""
        import numpy as np
        from confluent_kafka.schema_registry.avro import AvroSerializer
        from confluent_kafka.serialization import MessageField, SerializationContext

        serialize = AvroSerializer(self._client, self._schema)
        context = SerializationContext(AVRO_TOPIC, MessageField.VALUE)
        rng = np.random.default_rng(seed)
        out = []
        for i in range(count):
            payment_id = f"avro-payment-{i}"
            payment = {
                "payment_id": payment_id,
                "amount": round(float(rng.uniform(1, 500)), 2),
                "features": [float(x) for x in rng.standard_normal(64).astype(np.float32)],
            }
            value = serialize(payment, context)
            out.append(Outgoing(value, payment_id.encode(), []))
        return out

    def show(
        self,
        console: Console,
        answers: dict[str, tuple[str, str | None, Any]],
        output_topic: str,
        sent: int,
    ) -> bool:
        """The first payment's result as AvroDeserializer reads it; True when every payment
        was answered with a result."""
        from confluent_kafka.schema_registry.avro import AvroDeserializer
        from confluent_kafka.serialization import MessageField, SerializationContext

        read = AvroDeserializer(self._client)
        context = SerializationContext(output_topic, MessageField.VALUE)
        results = sorted((rid, a) for rid, a in answers.items() if a[1] is None)
        if results:
            # The first payment's, whichever partition answered first.
            value = results[0][1][2][1]
            schema_id = int.from_bytes(value[1:5], "big")
            line = (
                f"[bold]{AVRO_TOPIC}[/bold] Avro event scored, read back by AvroDeserializer "
                f"(schema id {schema_id}): {escape(str(read(value, context)))}"
            )
            console.print(line, soft_wrap=True, highlight=False)
        for rid, (_, code, (_, _, headers)) in answers.items():
            if code is not None:
                message = (header_value(headers, "x-error-message") or b"").decode()
                console.print(f"[bold]{AVRO_TOPIC}[/bold] event {rid}: {code} {escape(message)}")
        self._closing.close()
        return len(results) == sent


async def collect(
    bootstrap: str,
    topics: Sequence[str],
    want: set[str],
    progress: Progress,
    timeout_s: float = 120.0,
) -> dict[str, tuple[str, str | None, Any]]:
    """Read results and dead letters until every wanted request id has an answer."""
    task = progress.add_task("results + dead letters", total=len(want))
    consumer = AIOKafkaConsumer(
        *topics, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    answers: dict[str, tuple[str, str | None, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(answers) < len(want) and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for r in records:
                    code = header_value(r.headers, "x-error-code")
                    rid = (header_value(r.headers, "x-request-id") or b"").decode()
                    if not rid and r.key:
                        rid = r.key.decode()
                    if rid in want and rid not in answers:
                        answers[rid] = (
                            r.topic,
                            code.decode() if code else None,
                            (r.timestamp / 1000, r.value, r.headers),
                        )
                        progress.advance(task)
    finally:
        await consumer.stop()
    return answers


def _summary(
    console: Console,
    requests: Sequence[samples.SampleRequest],
    answers: dict[str, tuple[str, str | None, Any]],
    sent_at: dict[str, float],
    topics: dict[str, str],
) -> None:
    latencies = sorted(answers[r][2][0] - sent_at[r] for r in answers)
    codes = Counter(code for _, code, _ in answers.values() if code)
    results = sum(1 for _, code, _ in answers.values() if code is None)
    span = max(a[2][0] for a in answers.values()) - min(sent_at.values()) if answers else 0
    table = Table(title="demo summary", show_header=False)
    table.add_row("requests sent", str(len(requests)))
    table.add_row(f"results ({topics['output']})", str(results))
    for code, n in sorted(codes.items()):
        table.add_row(f"dead letters {code}", str(n))
    table.add_row("unanswered", str(len(requests) - len(answers)))
    if latencies:
        table.add_row("throughput", f"{len(answers) / max(span, 1e-3):,.0f} records/s")
        table.add_row("latency p50", f"{statistics.median(latencies) * 1000:.1f} ms")
        table.add_row("latency p99", f"{latencies[int(0.99 * (len(latencies) - 1))] * 1000:.1f} ms")
    console.print(table)
    _show_stream(console, requests, answers)
    shown: set[str] = set()
    for request in requests:
        answer = answers.get(request.request_id)
        if answer is None or answer[1] or request.encoding != "json" or request.model in shown:
            continue
        shown.add(request.model)
        console.print(f"[bold]{request.model}[/bold] result: {answer[2][1][:200].decode()}")


def _show_events(
    console: Console,
    events: Sequence[samples.SampleRequest],
    answers: dict[str, tuple[str, str | None, Any]],
) -> None:
    """A few payment events as they came back: scored by ``mlp`` through the mapping."""
    shown = 0
    for event in events:
        answer = answers.get(event.request_id)
        if answer is None:
            continue
        _, code, (_, value, headers) = answer
        if code is not None:
            message = (header_value(headers, "x-error-message") or b"").decode()
            console.print(
                f"[bold]{PAYMENTS_TOPIC}[/bold] event {event.request_id}: {code} {escape(message)}"
            )
        elif shown < 3:
            shown += 1
            line = f"[bold]{PAYMENTS_TOPIC}[/bold] event scored: {escape(value.decode())}"
            console.print(line, soft_wrap=True, highlight=False)


def _show_cloud_events(
    console: Console,
    readings: Sequence[samples.SampleRequest],
    answers: dict[str, tuple[str, str | None, Any]],
) -> None:
    """The first binary and the first structured reading as they came back: CloudEvents in
    the request's mode, enriched with ``double``'s outputs through the mapping."""
    shown: set[str] = set()
    for reading in readings:
        answer = answers.get(reading.request_id)
        if answer is None or answer[1] is not None:
            continue
        _, value, headers = answer[2]
        structured = header_value(headers, "content-type") == STRUCTURED.encode()
        mode = "structured" if structured else "binary"
        if mode in shown:
            continue
        shown.add(mode)
        attributes = (
            ""
            if structured
            else " ".join(f"{k}={v.decode()}" for k, v in headers if k.startswith("ce_"))
        )
        line = f"[bold]{READINGS_TOPIC}[/bold] CloudEvent ({mode}) answered: "
        line += escape(f"{attributes} {value.decode()}".strip())
        console.print(line, soft_wrap=True, highlight=False)


def _examples_mapping(examples: Path, workdir: Path) -> Path:
    """One mapping file of the examples' three (the worker takes one): the payments, the
    readings and the Avro payments."""
    import json
    import tomllib

    topics = tomllib.loads((examples / "payments.toml").read_text())["topics"]
    topics |= json.loads((examples / "readings.json").read_text())["topics"]
    topics |= tomllib.loads((examples / "payments-avro.toml").read_text())["topics"]
    path = workdir / "mapping.json"
    path.write_text(json.dumps({"topics": topics}, indent=2))
    return path


def _show_stream(
    console: Console,
    requests: Sequence[samples.SampleRequest],
    answers: dict[str, tuple[str, str | None, Any]],
) -> None:
    """The first token stream's result: how many responses it joined, and their text."""
    import json

    for request in requests:
        answer = answers.get(request.request_id)
        if request.model != "tokens" or answer is None or answer[1]:
            continue
        _, value, headers = answer[2]
        count = (header_value(headers, "x-response-count") or b"?").decode()
        pieces = [p for output in json.loads(value)["outputs"] for p in output["data"]]
        console.print(
            f"[bold]tokens[/bold] (decoupled) stream: {count} responses joined into one "
            f"result, text_output = {pieces[:4]!r}... = {''.join(pieces)!r}"
        )
        return
