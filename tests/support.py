"""Helpers shared by the pipeline tests: run a worker on fresh topics, send, collect."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from devtools.devstack.kafka import KafkaCluster, ensure_kafka_jars
from devtools.samples import Encoding, SampleRequest, Tensor, encode_request
from worker import wire
from worker.app import Worker
from worker.settings import Settings, load_settings
from worker.wire import header_value


@contextlib.contextmanager
def local_kafka(nodes: int) -> Iterator[KafkaCluster]:
    """A Kafka cluster of its own (``nodes`` KRaft nodes), stopped with nothing left behind."""
    with tempfile.TemporaryDirectory() as tmp:
        cluster = KafkaCluster(ensure_kafka_jars(log=lambda _: None), Path(tmp), nodes=nodes)
        cluster.start()
        try:
            yield cluster
        finally:
            cluster.stop()
        assert cluster.running_nodes() == []


def decode_sample(
    model: str, tensors: Sequence[Tensor], request_id: str, encoding: Encoding = "protobuf"
) -> wire.DecodedRequest:
    """Encode tensors as a request for ``model`` and decode it as the worker would."""
    value, headers = encode_request(model, tensors, encoding, request_id)
    return wire.decode_request(
        value,
        headers,
        source=wire.Source("t", 0, 0),
        default_model=None,
        limits=wire.DecodeLimits(1 << 20),
    )


def mlp_reference(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """The ``mlp`` model computed here, from the same seeded weights."""
    rng = np.random.default_rng(1234)
    w1 = (rng.standard_normal((64, 128)) / 8.0).astype(np.float32)
    b1 = (rng.standard_normal(128) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((128, 10)) / np.sqrt(128.0)).astype(np.float32)
    b2 = (rng.standard_normal(10) * 0.1).astype(np.float32)
    hidden = np.maximum(rows @ w1 + b1, 0.0)
    logits = hidden @ w2 + b2
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    return (exp / exp.sum(axis=1, keepdims=True)).astype(np.float32)


@dataclass
class Topics:
    input: str
    output: str
    dlq: str
    group: str

    @classmethod
    def fresh(cls, unique: str) -> Topics:
        return cls(f"req-{unique}", f"res-{unique}", f"dlq-{unique}", f"grp-{unique}")


async def create(kafka: Any, topics: Topics, partitions: int = 1) -> None:
    await kafka.create_topics([topics.input], partitions=partitions)
    await kafka.create_topics([topics.output, topics.dlq], partitions=1)


def worker_env(kafka: Any, triton: Any, topics: Topics, **extra: str) -> dict[str, str]:
    """WORKER_* settings for a worker on these topics (extra: SETTING_NAME=value)."""
    env = {
        "WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "WORKER_INPUT_TOPICS": topics.input,
        "WORKER_OUTPUT_TOPIC": topics.output,
        "WORKER_DLQ_TOPIC": topics.dlq,
        "WORKER_GROUP_ID": topics.group,
        "WORKER_TRITON_URL": triton.grpc_address,
        "WORKER_METRICS_PORT": "0",
        "WORKER_COMMIT_INTERVAL_MS": "200",
        "WORKER_LOG_FORMAT": "json",
    }
    env.update({f"WORKER_{k.upper()}": v for k, v in extra.items()})
    return env


def settings_for(kafka: Any, triton: Any, topics: Topics, **extra: str) -> Settings:
    return load_settings(worker_env(kafka, triton, topics, **extra))


@contextlib.asynccontextmanager
async def running_worker(settings: Settings, worker: Worker | None = None) -> AsyncIterator[Worker]:
    """A worker running in this event loop; stopped gracefully (and checked) on exit."""
    worker = worker or Worker(settings)
    task = asyncio.create_task(worker.run())
    started = asyncio.create_task(worker.started.wait())
    done, _ = await asyncio.wait({task, started}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        started.cancel()
        task.result()  # start-up failed: raise its error here
    try:
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)


async def send(
    bootstrap: str, topic: str, requests: Sequence[SampleRequest], partition: int | None = None
) -> None:
    """Produce requests keyed by request id and wait for every ack."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        futures = [
            await producer.send(
                topic, r.value, key=r.request_id.encode(), headers=r.headers, partition=partition
            )
            for r in requests
        ]
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


@dataclass
class Collected:
    results: dict[str, ConsumerRecord[bytes, bytes]] = field(default_factory=dict)
    dead_letters: dict[str, ConsumerRecord[bytes, bytes]] = field(default_factory=dict)
    duplicates: int = 0
    # (topic, partition, offset) already read, so that collecting again from the
    # start does not count the same records twice.
    seen: set[tuple[str, int, int]] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.results) + len(self.dead_letters)


def request_id_of(record: ConsumerRecord[bytes, bytes]) -> str:
    found = header_value(record.headers, "x-request-id")
    if found is not None:
        return found.decode()
    return (record.key or b"").decode()


async def collect(
    bootstrap: str,
    topics: Topics,
    expected: int,
    timeout_s: float = 60.0,
    into: Collected | None = None,
) -> Collected:
    """Read results and dead letters until ``expected`` distinct request ids have answers."""
    got = into or Collected()
    consumer = AIOKafkaConsumer(
        topics.output,
        topics.dlq,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    await consumer.start()
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < expected:
            assert time.monotonic() < deadline, f"only {len(got)}/{expected} answers in time"
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                for record in records:
                    position = (record.topic, record.partition, record.offset)
                    if position in got.seen:
                        continue
                    got.seen.add(position)
                    target = got.results if record.topic == topics.output else got.dead_letters
                    rid = request_id_of(record)
                    if rid in got.results or rid in got.dead_letters:
                        got.duplicates += 1
                    target[rid] = record
    finally:
        await consumer.stop()
    return got


def headers_dict(headers: Sequence[tuple[str, bytes]]) -> dict[str, bytes]:
    return dict(headers)


def spawn_worker(env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """``python -m worker run`` as a separate process, its log in ``log_path``."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    full_env.update(env)
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "worker", "run"],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _answers_ready(port: int) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


async def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    """Wait until a worker process answers ``/readyz`` with 200 (fails if it exits first)."""
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(_answers_ready, port):
        assert proc.poll() is None, f"worker exited with {proc.returncode} before it was ready"
        assert time.monotonic() < deadline, f"worker on port {port} not ready in {timeout_s} s"
        await asyncio.sleep(0.1)  # polling another process's endpoint: nothing to await


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def result_outputs(record: ConsumerRecord[bytes, bytes]) -> dict[str, Any]:
    """Decode a result value, whatever its encoding, into {output name: numpy array or list}."""
    import json

    from tritonclient.grpc import service_pb2

    from worker.wire.tensors import deserialize_bytes_tensor, raw_to_numpy

    content_type = (header_value(record.headers, "content-type") or b"").decode()
    value = record.value or b""

    def decode(datatype: str, shape: list[int], raw: bytes) -> Any:
        if datatype == "BYTES":
            return [item.decode() for item in deserialize_bytes_tensor(raw)]
        return raw_to_numpy(datatype, shape, raw)

    if content_type == "application/x-protobuf":
        response = service_pb2.ModelInferResponse.FromString(value)
        return {
            o.name: decode(o.datatype, list(o.shape), raw)
            for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
        }
    if content_type == "application/octet-stream":
        length = int(header_value(record.headers, "inference-header-content-length") or b"0")
        doc = json.loads(value[:length])
        out, position = {}, length
        for o in doc["outputs"]:
            size = o["parameters"]["binary_data_size"]
            out[o["name"]] = decode(o["datatype"], o["shape"], value[position : position + size])
            position += size
        return out
    doc = json.loads(value)
    return {
        o["name"]: (
            o["data"]
            if o["datatype"] == "BYTES"
            else np.asarray(o["data"], dtype=np.float64).reshape(o["shape"])
        )
        for o in doc["outputs"]
    }


def report(scenario: str, sent: int, got: Collected, recovery_s: float | None = None) -> None:
    """Print one line of the README's reliability table (visible with ``pytest -s``)."""
    answered = len(got)
    recovery = f"{recovery_s:.1f} s" if recovery_s is not None else "-"
    print(
        f"\nRELIABILITY | {scenario} | {sent} | {sent - answered} | {got.duplicates} | "
        f"{len(got.dead_letters)} | {recovery} |"
    )
