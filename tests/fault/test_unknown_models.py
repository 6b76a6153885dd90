"""A producer naming a different unknown model in every record: memory stays flat.

Everything the worker keeps per model name or version comes from records, so a
buggy producer controls how many there are. Real Kafka, real Triton, the worker
as a process: records each naming a model Triton has never heard of, each must
become a MODEL_NOT_FOUND dead letter while the worker's RSS stays flat.

Each unknown name costs the worker a lookup in Triton (under a millisecond of CPU),
so 200,000 of them take minutes on a 2-core machine: the test sends 60,000 by
default (before the caches were bounded, that grew RSS by over 1.5 GiB), and
``WORKER_TEST_UNKNOWN_MODELS=200000`` runs the full count.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import confluent_kafka
import pytest

from devtools.devstack.process import free_port
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    create,
    metric_sum,
    metrics_text,
    rss_bytes,
    spawn_worker,
    wait_ready,
    worker_env,
)

pytestmark = pytest.mark.timeout(600)

#: Records naming one unknown model, answered before the baseline is read.
WARM_UP = 5_000
DISTINCT = int(os.environ.get("WORKER_TEST_UNKNOWN_MODELS", "60000"))
PARTITIONS = 4
MAX_GROWTH_MIB = 32


def _value(request_id: str, model: str) -> bytes:
    inputs = [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1.0]}]
    return json.dumps({"id": request_id, "model_name": model, "inputs": inputs}).encode()


def _produce(bootstrap: str, topic: str) -> None:
    """The warm-up records first in every partition, then one unknown model per record."""
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": bootstrap, "linger.ms": 20, "batch.size": 1_000_000}
    )
    names = [("warm", "no-such-model")] * WARM_UP + [
        ("u", f"no-such-model-{i}") for i in range(DISTINCT)
    ]
    for i, (prefix, model) in enumerate(names):
        rid = f"{prefix}{i}"
        while True:
            try:
                producer.produce(topic, _value(rid, model), rid.encode(), partition=i % PARTITIONS)
                break
            except BufferError:
                producer.poll(0.1)  # librdkafka's queue is full: let it send
    assert producer.flush(60) == 0


def _dead_letters(bootstrap: str, topics: Topics) -> dict[str, int]:
    """How many dead letters carry each error code, read to the topic's end; keys counted."""
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"{topics.group}-reader",
            "enable.partition.eof": True,
        }
    )
    consumer.assign([confluent_kafka.TopicPartition(topics.dlq, 0, 0)])
    codes: dict[str, int] = {}
    keys: set[bytes | None] = set()
    try:
        while True:
            records = consumer.consume(10_000, timeout=10)
            assert records, "the dead-letter topic was not read to its end in time"
            for record in records:
                if (error := record.error()) is not None:
                    if error.code() == confluent_kafka.KafkaError._PARTITION_EOF:
                        codes["keys"] = len(keys)
                        return codes
                    raise AssertionError(error)
                code_header = dict(record.headers() or [])["x-error-code"]
                assert isinstance(code_header, bytes), code_header
                code = code_header.decode()
                codes[code] = codes.get(code, 0) + 1
                keys.add(record.key())
    finally:
        consumer.close()


async def _until_answered(
    port: int, count: int, proc: subprocess.Popen[bytes], max_rss: float = float("inf")
) -> None:
    """Poll the worker's dead-letter counter until ``count``; fails as soon as the worker
    exits or its RSS passes ``max_rss`` bytes."""
    while (done := await asyncio.to_thread(metric_sum, port, "worker_dead_letters_total")) < count:
        assert proc.poll() is None, f"worker exited {proc.returncode}"
        rss = rss_bytes(proc.pid)
        assert rss <= max_rss, f"RSS {rss / 2**20:.0f} MiB after {done:.0f} dead letters"
        await asyncio.sleep(0.5)  # polling another process's endpoint: nothing to await


async def test_distinct_unknown_models_keep_memory_flat(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """Records each naming another unknown model: every one a dead letter, RSS flat."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=PARTITIONS)
    await asyncio.to_thread(_produce, kafka.bootstrap_servers, topics.input)
    port, log = free_port(), tmp_path / "worker.log"
    proc = spawn_worker(worker_env(kafka, triton, topics, metrics_port=str(port)), log)
    try:
        await wait_ready(port, proc)
        await _until_answered(port, WARM_UP, proc)
        rss_early, started = rss_bytes(proc.pid), time.monotonic()
        limit = rss_early + MAX_GROWTH_MIB * 2**20
        await _until_answered(port, WARM_UP + DISTINCT, proc, max_rss=limit)
        rss_late, elapsed_s = rss_bytes(proc.pid), time.monotonic() - started
        exposition = await asyncio.to_thread(metrics_text, port)
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    growth_mib = (rss_late - rss_early) / 2**20
    print(f"\n{DISTINCT} unknown models in {elapsed_s:.1f} s, RSS grew {growth_mib:.1f} MiB")
    assert code == 0
    assert growth_mib <= MAX_GROWTH_MIB, f"RSS grew {growth_mib:.1f} MiB"
    assert "no-such-model" not in exposition  # no metric label per model name asked for
    codes = await asyncio.to_thread(_dead_letters, kafka.bootstrap_servers, topics)
    assert codes == {"MODEL_NOT_FOUND": WARM_UP + DISTINCT, "keys": WARM_UP + DISTINCT}
