"""The loops the worker is compared with, each run as its own process by the benchmark.

``python -m devtools.bench.loops VARIANT ...``:

- ``sync``: consume one record, unary infer, produce and wait, commit, repeat;
- ``naive``: a semaphore of concurrent unary infers, auto-commit, no waiting
  for produce acks (what a quick script does);
- ``kafka``: consume and produce the same records, decoding and encoding the
  JSON, no inference (the Kafka ceiling);
- ``kafka_confluent``: the same on librdkafka (confluent-kafka's own consumer
  and producer, as a user of that client writes it: ``consume`` of up to 1,000
  records off the event loop, ``produce`` with a delivery callback, the batch's
  acks awaited before the next fetch), the Kafka ceiling of the other client;
- ``triton``: unary infers of the same payloads driven at saturation (or at a
  fixed rate), no Kafka (the Triton ceiling); prints its measurement as JSON;
- ``triton_batched``: the same payloads through the worker's own client path
  (``TritonPool`` streams and ``MicroBatcher``) with the tuned worker's batch
  size, streams and in-flight window, no Kafka (the Triton ceiling comparable
  with the tuned worker); prints its measurement, in rows, as JSON.

Each is written as its users would write it (JSON with orjson, inputs through
``InferInput``), and runs on the same event loop as the worker (uvloop).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from tritonclient.grpc.aio import InferenceServerClient, InferInput
from tritonclient.utils import triton_to_np_dtype

from devtools import samples

if TYPE_CHECKING:
    from worker.wire.requests import DecodedRequest


def _inputs(doc: dict[str, Any]) -> list[InferInput]:
    """OIP JSON inputs → tritonclient inputs (a numpy array per tensor)."""
    inputs = []
    for spec in doc["inputs"]:
        dtype = object if spec["datatype"] == "BYTES" else triton_to_np_dtype(spec["datatype"])
        data = spec["data"]
        if spec["datatype"] == "BYTES":
            data = [str(item).encode() for item in data]
        array = np.asarray(data, dtype=dtype).reshape(spec["shape"])
        tensor = InferInput(spec["name"], list(array.shape), spec["datatype"])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _result(doc: dict[str, Any], response: Any) -> bytes:
    """An OIP JSON result from a tritonclient response."""
    outputs = []
    for out in response.get_response().outputs:
        array = response.as_numpy(out.name)
        data = [v.decode() for v in array.reshape(-1)] if out.datatype == "BYTES" else array
        outputs.append(
            {
                "name": out.name,
                "datatype": out.datatype,
                "shape": list(array.shape),
                "data": data.reshape(-1).tolist() if isinstance(data, np.ndarray) else data,
            }
        )
    return orjson.dumps(
        {"id": doc.get("id", ""), "model_name": doc["model_name"], "outputs": outputs}
    )


async def _infer(client: InferenceServerClient, doc: dict[str, Any]) -> Any:
    return await client.infer(doc["model_name"], _inputs(doc))


async def run_sync(args: argparse.Namespace) -> None:
    """One record at a time, every step awaited, offsets committed per record."""
    consumer = AIOKafkaConsumer(
        args.input,
        bootstrap_servers=args.bootstrap,
        group_id=args.group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, acks="all")
    client = InferenceServerClient(args.triton)
    await consumer.start()
    await producer.start()
    while True:
        record = await consumer.getone()
        doc = orjson.loads(record.value)
        response = await _infer(client, doc)
        await producer.send_and_wait(args.output, _result(doc, response), key=record.key)
        await consumer.commit()


async def run_naive(args: argparse.Namespace) -> None:
    """Concurrent infers under a semaphore; auto-commit; produce acks not awaited."""
    consumer = AIOKafkaConsumer(
        args.input,
        bootstrap_servers=args.bootstrap,
        group_id=args.group,
        enable_auto_commit=True,
        auto_offset_reset="earliest",
    )
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, linger_ms=5)
    client = InferenceServerClient(args.triton)
    await consumer.start()
    await producer.start()
    semaphore = asyncio.Semaphore(args.concurrency)
    tasks: set[asyncio.Task[None]] = set()

    async def handle(key: bytes | None, value: bytes) -> None:
        try:
            doc = orjson.loads(value)
            response = await _infer(client, doc)
            await producer.send(args.output, _result(doc, response), key=key)
        finally:
            semaphore.release()

    async for record in consumer:
        await semaphore.acquire()
        task = asyncio.create_task(handle(record.key, record.value))
        tasks.add(task)
        task.add_done_callback(tasks.discard)


async def run_kafka(args: argparse.Namespace) -> None:
    """Consume, decode, encode and produce every record: Kafka's own ceiling here."""
    consumer = AIOKafkaConsumer(
        args.input,
        bootstrap_servers=args.bootstrap,
        group_id=args.group,
        enable_auto_commit=True,
        auto_offset_reset="earliest",
        max_poll_records=1000,
    )
    producer = AIOKafkaProducer(bootstrap_servers=args.bootstrap, linger_ms=5, acks="all")
    await consumer.start()
    await producer.start()
    while True:
        batches = await consumer.getmany(timeout_ms=1000)
        acks = []
        for records in batches.values():
            for record in records:
                doc = orjson.loads(record.value)
                value = orjson.dumps({"id": doc.get("id", ""), "outputs": doc["inputs"]})
                acks.append(await producer.send(args.output, value, key=record.key))
        await asyncio.gather(*acks)


async def run_kafka_confluent(args: argparse.Namespace) -> None:
    """Kafka alone on librdkafka: the same work as ``run_kafka``, the other client."""
    from confluent_kafka import Consumer, Producer

    consumer = Consumer(
        {
            "bootstrap.servers": args.bootstrap,
            "group.id": args.group,
            "enable.auto.commit": True,
            "auto.offset.reset": "earliest",
        }
    )
    producer = Producer({"bootstrap.servers": args.bootstrap, "linger.ms": 5, "acks": "all"})
    consumer.subscribe([args.input])
    failed: list[str] = []

    def delivered(err: Any, _msg: Any) -> None:
        if err is not None:
            failed.append(str(err))

    while not failed:
        # A short wait: consume() waits for the whole 1,000 or the timeout, whichever first.
        records = await asyncio.to_thread(consumer.consume, 1000, 0.02)
        for record in records:
            value = record.value()
            if record.error() is not None or value is None:
                continue
            doc = orjson.loads(value)
            result = orjson.dumps({"id": doc.get("id", ""), "outputs": doc["inputs"]})
            producer.produce(args.output, result, key=record.key(), on_delivery=delivered)
            producer.poll(0)
        await asyncio.to_thread(producer.flush)
    raise RuntimeError(f"a produce failed: {failed[0]}")


async def run_triton(args: argparse.Namespace) -> None:
    """Unary infers of the benchmark payloads, no Kafka; prints a JSON measurement."""
    requests = samples_for(args.model, args.records, args.seed)
    docs = [orjson.loads(r.value) for r in requests]
    prepared = [_inputs(doc) for doc in docs]
    client = InferenceServerClient(args.triton)
    await client.infer(args.model, prepared[0])  # warm-up: channel and model

    async def one(inputs: list[InferInput]) -> int:
        await client.infer(args.model, inputs)
        return 1

    try:
        await _drive(args, [functools.partial(one, inputs) for inputs in prepared])
    finally:
        await client.close()


async def run_triton_batched(args: argparse.Namespace) -> None:
    """The worker's own client path without Kafka: its stream pool and micro-batcher.

    The records are decoded as the worker decodes them, before the clock starts
    (as the unbatched loop prepares its inputs), then sent through
    ``MicroBatcher.infer`` with ``--concurrency`` requests in flight; prints a
    JSON measurement counting rows.
    """
    from worker.triton.batching import MicroBatcher
    from worker.triton.pool import TritonPool
    from worker.wire.headers import Source
    from worker.wire.requests import DecodeLimits, decode_request

    limits = DecodeLimits(max_request_bytes=8 << 20)
    requests = samples_for(args.model, args.records + 1, args.seed)
    decoded = [
        decode_request(r.value, r.headers, Source("bench", 0, i), limits)
        for i, r in enumerate(requests)
    ]
    pool = TritonPool(args.triton, args.streams)
    await pool.start()
    batcher = MicroBatcher(pool, args.batch_size, args.batch_delay_ms / 1000)
    spec = await pool.model_spec(args.model, "")
    await batcher.infer(decoded.pop(), spec, 60)  # warm-up: channel, streams and model

    async def one(request: DecodedRequest) -> int:
        await batcher.infer(request, spec, 60)
        return int(request.infer_request.inputs[0].shape[0])

    try:
        await _drive(args, [functools.partial(one, request) for request in decoded])
    finally:
        await batcher.close()
        await pool.close()


async def _drive(args: argparse.Namespace, calls: Sequence[Callable[[], Awaitable[int]]]) -> None:
    """Run ``calls`` with ``--concurrency`` in flight, at saturation or paced at ``--rate``;
    print records (rows), seconds, per-call latencies, CPU and peak RSS as JSON."""
    latencies_s: list[float] = []
    semaphore = asyncio.Semaphore(args.concurrency)

    async def timed(call: Callable[[], Awaitable[int]]) -> int:
        try:
            started = time.perf_counter()
            rows = await call()
            latencies_s.append(time.perf_counter() - started)
            return rows
        finally:
            semaphore.release()

    cpu_before = _cpu_s()
    started = time.perf_counter()
    tasks = []
    for index, call in enumerate(calls):
        if args.rate:
            # Open loop at a fixed rate: request i leaves at i / rate.
            delay_s = started + index / args.rate - time.perf_counter()
            if delay_s > 0:
                await asyncio.sleep(delay_s)
        await semaphore.acquire()
        tasks.append(asyncio.create_task(timed(call)))
    rows = sum(await asyncio.gather(*tasks))
    elapsed_s = time.perf_counter() - started
    report = {
        "records": rows,
        "requests": len(tasks),
        "seconds": elapsed_s,
        "latencies_ms": [s * 1000 for s in latencies_s],
        "cpu_s": _cpu_s() - cpu_before,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }
    sys.stdout.write(orjson.dumps(report).decode() + "\n")


def samples_for(
    model: str, count: int, seed: int, encoding: samples.Encoding = "json"
) -> list[samples.SampleRequest]:
    """The benchmark's payloads: ``count`` requests for ``model`` (JSON unless told), ids
    bench-<seed>-<i>."""
    rng = np.random.default_rng(seed)
    make = samples.MODEL_INPUTS[model]
    out = []
    for i in range(count):
        request_id = f"bench-{seed}-{i}"
        value, headers = samples.encode_request(model, make(rng), encoding, request_id)
        out.append(samples.SampleRequest(value, headers, model, encoding, request_id))
    return out


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


_LOOPS: dict[str, Callable[[argparse.Namespace], Awaitable[None]]] = {
    "sync": run_sync,
    "naive": run_naive,
    "kafka": run_kafka,
    "kafka_confluent": run_kafka_confluent,
    "triton": run_triton,
    "triton_batched": run_triton_batched,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m devtools.bench.loops``."""
    parser = argparse.ArgumentParser(prog="python -m devtools.bench.loops")
    parser.add_argument("variant", choices=sorted(_LOOPS))
    parser.add_argument("--bootstrap", default="localhost:9092")
    parser.add_argument("--triton", default="localhost:8001")
    parser.add_argument("--input", default="")
    parser.add_argument("--output", default="")
    parser.add_argument("--group", default="bench")
    parser.add_argument("--model", default="mlp")
    parser.add_argument("--records", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--rate", type=float, default=0.0, help="requests/s (0: saturate)")
    parser.add_argument("--streams", type=int, default=4, help="triton_batched: gRPC streams")
    parser.add_argument("--batch-size", type=int, default=32, help="triton_batched: rows")
    parser.add_argument("--batch-delay-ms", type=float, default=2.0, help="triton_batched")
    args = parser.parse_args(argv)
    from worker.app import run_async

    async def run() -> int:
        await _LOOPS[args.variant](args)
        return 0

    return run_async(run())


if __name__ == "__main__":
    raise SystemExit(main())
