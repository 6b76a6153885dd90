"""Running one benchmark variant at a time: its process, its topics, its measurement."""

from __future__ import annotations

import argparse
import asyncio
import sys
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from rich.progress import Progress

from devtools.bench import loops
from devtools.bench.measure import (
    Collector,
    Producer,
    cpu_s,
    create_topics,
    peak_rss_bytes,
    percentiles_ms,
    spawn,
    stop,
    tree_cpu_s,
)
from devtools.bench.report import LoadPoint, VariantResult

#: The tuned worker in another mode: what each such variant adds to the tuned settings
#: (its ``_confluent`` twin the same on librdkafka).
MODE_SETTINGS: dict[str, dict[str, str]] = {
    "worker_eos": {"DELIVERY": "exactly_once"},
    "worker_key": {"ORDERING": "key"},
    "worker_audit": {"AUDIT": "topic"},
}


def worker_settings(key: str, tuned: Mapping[str, str]) -> dict[str, str]:
    """The settings (``WORKER_`` left out) of a worker variant: none beyond the defaults
    for ``worker``, the tuned ones for the others, plus its mode's, plus the client."""
    base = key.removesuffix("_confluent")
    settings = {} if base == "worker" else {**tuned, **MODE_SETTINGS.get(base, {})}
    if key.endswith("_confluent"):
        # The same settings on the other Kafka client, in the same run.
        settings["KAFKA_CLIENT"] = "confluent"
    return settings


@dataclass
class Servers:
    bootstrap: str
    triton: str
    triton_pid: int | None = None
    kafka_pids: tuple[int, ...] = ()
    #: The Schema Registry's Confluent API (the Avro payload), when one runs.
    registry_url: str | None = None

    def server_cpu_s(self) -> tuple[float, float]:
        return tree_cpu_s(self.triton_pid), sum(cpu_s(pid) for pid in self.kafka_pids)


class Runner:
    """Runs one variant at a time against the servers."""

    def __init__(self, args: argparse.Namespace, servers: Servers, out: Path) -> None:
        self.args = args
        self.servers = servers
        self.out = out
        self.run_id = uuid.uuid4().hex[:8]
        self.payloads = loops.samples_for(args.model, args.records, seed=11)

    def command(
        self, key: str, tuned: Mapping[str, str]
    ) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """The child process of a Kafka variant: argv, extra env, settings to report."""
        if key.startswith("worker"):
            settings = worker_settings(key, tuned)
            return [sys.executable, "-m", "worker", "run"], settings, settings
        servers = ["--bootstrap", self.servers.bootstrap, "--triton", self.servers.triton]
        if key == "quix":
            from devtools.bench import quix

            # Its own virtualenv's interpreter (ensure_quix builds it before the run).
            argv = [str(quix.quix_python()), str(quix.APP), *servers]
            argv += ["--state-dir", str(self.out / "quix-state")]
            return (
                argv,
                {},
                {
                    "library": f"quixstreams {quix.QUIX_VERSION}",
                    "call": "tritonclient.grpc infer per message, in sdf.apply",
                },
            )
        argv = [sys.executable, "-m", "devtools.bench.loops", key, *servers]
        return argv, {}, {"concurrency": "128"} if key == "naive" else {}

    def topics(self, key: str) -> tuple[str, str, str, str]:
        base = f"bench-{self.run_id}-{key}"
        return f"{base}-in", f"{base}-out", f"{base}-dlq", f"{base}-group"

    def audit_topic(self, key: str) -> str:
        """The audit topic of a variant that writes audit records to one."""
        return f"bench-{self.run_id}-{key}-audit"

    def keys(self, key: str) -> int:
        """How many record keys the requests of ``key`` get: ``--keys`` for the key-ordering
        variants, 0 (each request its own id) for the others."""
        return int(self.args.keys) if key.startswith("worker_key") else 0

    def env(self, key: str, settings: Mapping[str, str]) -> dict[str, str]:
        """The environment of a variant's process: servers, its topics, its settings."""
        topic_in, topic_out, topic_dlq, group = self.topics(key)
        env = {
            "WORKER_BOOTSTRAP_SERVERS": self.servers.bootstrap,
            "WORKER_TRITON_URL": self.servers.triton,
            "WORKER_INPUT_TOPICS": topic_in,
            "WORKER_OUTPUT_TOPIC": topic_out,
            "WORKER_DLQ_TOPIC": topic_dlq,
            "WORKER_GROUP_ID": group,
            "WORKER_METRICS_PORT": "0",
            "WORKER_LOG_FORMAT": "json",
            "WORKER_LOG_LEVEL": "warning",
            **{f"WORKER_{k}": v for k, v in settings.items()},
        }
        if settings.get("AUDIT") in ("topic", "both"):
            env["WORKER_AUDIT_TOPIC"] = self.audit_topic(key)
        if settings.get("DELIVERY") == "exactly_once":
            # Transactional ids of their own: a variant never fences another's producers,
            # nor a worker of another run on the same cluster.
            env["WORKER_TRANSACTIONAL_ID_PREFIX"] = f"bench-{self.run_id}-{key}"
        return env

    async def kafka_variant(
        self,
        key: str,
        name: str,
        command: list[str],
        settings: dict[str, str],
        count: int,
        progress: Progress,
        reported: dict[str, str],
        sweep_into: list[LoadPoint] | None,
    ) -> VariantResult:
        """Start the variant's process, warm it up, send the burst, measure, stop it."""
        bootstrap = self.servers.bootstrap
        topic_in, topic_out, command, env = await self._prepare(key, command, settings)
        burst = self.payloads[:count]
        # The backlog is written before the variant starts, so that producing it
        # takes no CPU from the variant while it is measured.
        producer = Producer(bootstrap, self.keys(key))
        await producer.start()
        try:
            sending = progress.add_task(f"producing for {key}", total=count)
            await producer.send(topic_in, burst, advance=lambda n: progress.advance(sending, n))
        finally:
            await producer.stop()
        progress.remove_task(sending)
        collector = Collector(bootstrap, topic_out)
        await collector.start()
        child = spawn(command, env, self.out / f"{key}.log")
        try:
            task = progress.add_task(name, total=count)
            marks: dict[str, tuple[float, float, float]] = {}

            def first() -> None:
                marks["first"] = (cpu_s(child.pid), *self.servers.server_cpu_s())

            # Counted from the first result: the variant's start-up is left out.
            collected = await collector.gather(
                [r.request_id.encode() for r in burst],
                timeout_s=90 + count / 100,
                advance=lambda n: progress.advance(task, n),
                on_first=first,
            )
            end = (cpu_s(child.pid), *self.servers.server_cpu_s())
            if not collected.result_ms:
                raise RuntimeError(f"{name} answered nothing (see {key}.log)")
            start = marks.get("first", end)
            done = max(1, len(collected.result_ms) - 1)
            peak = collected.records_per_s()
            # Latency at half this variant's own peak: queueing behind a backlog
            # would say nothing about the variant.
            fractions = (0.25, 0.5, 0.75, 1.0) if sweep_into is not None else (0.5,)
            points = [
                await self._load_point(topic_in, collector, peak * f, progress, f, key)
                for f in fractions
            ]
            if sweep_into is not None:
                sweep_into.extend(points)
            result = VariantResult(
                variant=key,
                records=len(collected.result_ms),
                records_per_s=peak,
                latency_ms=next(
                    p for p, f in zip(points, fractions, strict=True) if f == 0.5
                ).latency_ms,
                cpu_s_per_1k=(end[0] - start[0]) / done * 1000,
                peak_rss_mib=peak_rss_bytes(child.pid) / (1 << 20),
                cpu_of="variant process",
                triton_cpu_s_per_1k=self._per_1k(end[1] - start[1], done, self.servers.triton_pid),
                kafka_cpu_s_per_1k=self._per_1k(end[2] - start[2], done, self.servers.kafka_pids),
                settings={k: v for k, v in reported.items()},
                latency_at_per_s=peak / 2,
            )
            return result
        finally:
            await collector.stop()
            await stop(child)

    async def _prepare(
        self, key: str, command: list[str], settings: Mapping[str, str]
    ) -> tuple[str, str, list[str], dict[str, str]]:
        """Fresh topics for ``key``; the input and output topic, the argv and env to run."""
        bootstrap = self.servers.bootstrap
        topic_in, topic_out, topic_dlq, group = self.topics(key)
        env = self.env(key, settings)
        await create_topics(bootstrap, [topic_in], self.args.partitions)
        outputs = [topic_out, topic_dlq]
        if "WORKER_AUDIT_TOPIC" in env:
            outputs.append(env["WORKER_AUDIT_TOPIC"])
        await create_topics(bootstrap, outputs, self.args.partitions)
        if not command[-1] == "run":
            command = [*command, "--input", topic_in, "--output", topic_out, "--group", group]
        return topic_in, topic_out, command, env

    async def kafka_at(
        self,
        key: str,
        command: list[str],
        settings: dict[str, str],
        rate: float,
        progress: Progress,
    ) -> LoadPoint:
        """A Kafka variant on fresh topics, warmed up, then fed ``rate`` records/s."""
        topic_in, topic_out, command, env = await self._prepare(f"{key}-common", command, settings)
        collector = Collector(self.servers.bootstrap, topic_out)
        await collector.start()
        child = spawn(command, env, self.out / f"{key}-common.log")
        try:
            # Warm-up: a few requests answered end to end before the clock matters.
            warm = loops.samples_for(self.args.model, 50, seed=7)
            producer = Producer(self.servers.bootstrap, self.keys(key))
            await producer.start()
            try:
                await producer.send(topic_in, warm)
            finally:
                await producer.stop()
            answered = await collector.gather([r.request_id.encode() for r in warm], timeout_s=90)
            if len(answered.result_ms) < len(warm):
                raise RuntimeError(f"{key} did not answer its warm-up (see {key}-common.log)")
            return await self._load_point(topic_in, collector, rate, progress, 2.0, key)
        finally:
            await collector.stop()
            await stop(child)

    @staticmethod
    def _per_1k(seconds: float, records: int, pid: object) -> float | None:
        return seconds / records * 1000 if pid else None

    async def _load_point(
        self,
        topic: str,
        collector: Collector,
        rate: float,
        progress: Progress,
        fraction: float,
        key: str,
    ) -> LoadPoint:
        """Feed ``rate`` records/s of variant ``key`` for ``sweep_s`` seconds; latency of
        their results."""
        count = max(20, int(rate * self.args.sweep_s))
        requests = loops.samples_for(self.args.model, count, seed=100 + int(fraction * 100))
        task = progress.add_task(f"  load {rate:,.0f}/s", total=count)
        producer = Producer(self.servers.bootstrap, self.keys(key))
        await producer.start()
        sending = asyncio.create_task(producer.send(topic, requests, rate=rate))
        try:
            collected = await collector.gather(
                [r.request_id.encode() for r in requests],
                timeout_s=self.args.sweep_s + 60,
                advance=lambda n: progress.advance(task, n),
            )
            await sending
        finally:
            sending.cancel()
            await producer.stop()
        progress.remove_task(task)
        return LoadPoint(
            rate,
            collected.records_per_s(),
            percentiles_ms(collected.latencies_ms(producer.sent_ms)),
        )

    async def triton(
        self, name: str, progress: Progress, tuned: Mapping[str, str] | None = None
    ) -> VariantResult:
        """Ceiling 1: the same payloads straight to Triton at saturation, then at half of it.

        ``tuned`` given: through the worker's own client path with those settings
        (``triton_batched``), else unary infers, 64 concurrent (``triton``).
        """
        task = progress.add_task(name, total=self.args.records)
        before = self.servers.server_cpu_s()
        measured = await self._triton_child(self.args.records, 0.0, tuned)
        after = self.servers.server_cpu_s()
        progress.update(task, completed=self.args.records)
        records = int(measured["records"])
        peak = records / float(measured["seconds"])
        half = await self.triton_at(peak / 2, progress, tuned)
        return VariantResult(
            variant="triton" if tuned is None else "triton_batched",
            records=records,
            records_per_s=peak,
            latency_ms=half.latency_ms,
            cpu_s_per_1k=float(measured["cpu_s"]) / records * 1000,
            peak_rss_mib=int(measured["peak_rss_bytes"]) / (1 << 20),
            cpu_of="client process",
            triton_cpu_s_per_1k=self._per_1k(
                after[0] - before[0], records, self.servers.triton_pid
            ),
            settings=_client_settings(tuned),
            latency_at_per_s=peak / 2,
        )

    async def triton_at(
        self, rate: float, progress: Progress, tuned: Mapping[str, str] | None = None
    ) -> LoadPoint:
        """Triton alone at a fixed rate (batched with ``tuned``): latency references."""
        count = max(20, int(rate * self.args.sweep_s))
        label = "Triton alone" if tuned is None else "Triton alone, batched"
        task = progress.add_task(f"  {label} {rate:,.0f}/s", total=count)
        measured = await self._triton_child(count, rate, tuned)
        progress.remove_task(task)
        return LoadPoint(
            rate,
            int(measured["records"]) / float(measured["seconds"]),
            percentiles_ms(measured["latencies_ms"]),
        )

    async def _triton_child(
        self, records: int, rate: float, tuned: Mapping[str, str] | None
    ) -> dict[str, Any]:
        argv = [
            sys.executable, "-m", "devtools.bench.loops",
            "triton" if tuned is None else "triton_batched",
            "--triton", self.servers.triton, "--model", self.args.model,
            "--records", str(records), "--rate", str(rate),
        ]  # fmt: skip
        if tuned is None:
            # Unary calls: 64 at saturation; open loop (no bound that matters) at a rate.
            argv += ["--concurrency", "4096" if rate else "64"]
        else:
            client = _client_settings(tuned)
            argv += [
                "--concurrency", client["in flight"], "--streams", client["streams"],
                "--batch-size", client["batch"], "--batch-delay-ms", client["batch delay ms"],
            ]  # fmt: skip
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        stdout, stderr = await process.communicate()
        if process.returncode != 0:
            raise RuntimeError(f"the Triton-alone run failed:\n{stderr.decode()[-2000:]}")
        measured: dict[str, Any] = orjson.loads(stdout.splitlines()[-1])
        return measured


def _client_settings(tuned: Mapping[str, str] | None) -> dict[str, str]:
    """The Triton-alone client's settings: unary, or the tuned worker's client path."""
    if tuned is None:
        return {"concurrency": "64", "call": "unary infer"}
    return {
        "call": "stream pool + micro-batcher",
        "in flight": tuned.get("MAX_IN_FLIGHT", "512"),
        "streams": tuned.get("TRITON_STREAMS", "4"),
        "batch": tuned.get("BATCH_MAX_SIZE", "32"),
        "batch delay ms": tuned.get("BATCH_DELAY_MS", "2"),
    }
