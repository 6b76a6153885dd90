"""Measurements beyond the side-by-side table: backlog memory, adaptive window, shared memory.

- ``drain``: a backlog produced up front (large producer batches, acks awaited
  per batch), one worker process draining it; its results counter and RSS are
  sampled from ``/metrics`` and ``/proc`` every ``sample_s``. Throughput is the
  slope of the results counter after the first samples (start-up left out);
  the inference p99 comes from the worker's own histogram.
- ``window_sweep``: ``drain`` for a few fixed windows and the adaptive one.
- ``shm_gain``: large ``double`` tensors sent straight to Triton with and
  without system shared memory.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from tritonclient.grpc import service_pb2

from devtools import samples
from devtools.bench.loops import samples_for
from devtools.bench.measure import cpu_s, create_topics, peak_rss_bytes, spawn, stop
from devtools.devstack.process import free_port
from worker.triton.pool import TritonPool

__all__ = ["Drain", "compression", "drain", "shm_gain", "window_sweep"]


@dataclass(frozen=True, slots=True)
class Drain:
    """One worker draining a backlog: throughput, inference p99, and the RSS curve."""

    label: str
    settings: dict[str, str]
    backlog: int
    records_per_s: float
    inference_p99_ms: float
    #: (seconds since start, results so far, RSS MiB), every sample_s.
    samples: list[tuple[float, int, float]] = field(default_factory=list)
    peak_rss_mib: float = 0.0
    #: The worker's own CPU (user + system) per 1,000 results, from /proc.
    cpu_s_per_1k: float = 0.0
    #: The same from the first tenth of the results on (its start-up left out).
    cpu_s_per_1k_steady: float = 0.0
    #: Where the results went, for measurements that read them back.
    output_topic: str = ""
    #: Decoupled models: time to the first response, p50 and p99 ms (worker's histogram).
    first_response_ms: tuple[float, float] = (0.0, 0.0)


async def produce_backlog(
    bootstrap: str,
    topic: str,
    request: samples.SampleRequest | Sequence[samples.SampleRequest],
    count: int,
    partitions: int,
) -> None:
    """``count`` records cycling over ``request`` (one or several), written in large batches
    round-robin over partitions."""
    cycle = [request] if isinstance(request, samples.SampleRequest) else list(request)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks=1, max_request_size=4 << 20, max_batch_size=1 << 20
    )
    await producer.start()
    try:
        sent, partition, pending = 0, 0, []
        while sent < count:
            batch = producer.create_batch()
            while sent < count:
                one = cycle[sent % len(cycle)]
                headers = list(one.headers)
                if batch.append(key=None, value=one.value, timestamp=None, headers=headers):
                    sent += 1
                else:
                    break
            batch.close()
            pending.append(await producer.send_batch(batch, topic, partition=partition))
            partition = (partition + 1) % partitions
            if len(pending) >= 4 * partitions:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


def _scrape(port: int) -> dict[str, float]:
    """Sums per metric name (labels folded), plus histogram buckets by their ``le``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith("_bucket"):
            le = name_labels.split('le="', 1)[1].split('"', 1)[0]
            name = f"{name}:{le}"
        out[name] = out.get(name, 0.0) + float(value)
    return out


_INFERENCE = "worker_inference_latency_seconds"
_FIRST_RESPONSE = "worker_stream_first_response_seconds"


def _quantile_ms(metrics: Mapping[str, float], histogram: str, q: float = 0.99) -> float:
    prefix = f"{histogram}_bucket:"
    buckets = sorted(
        (float(k.removeprefix(prefix)), v) for k, v in metrics.items() if k.startswith(prefix)
    )
    if not buckets or buckets[-1][1] == 0:
        return 0.0
    # Linear interpolation inside the bucket, as Prometheus' histogram_quantile does.
    rank = q * buckets[-1][1]
    lower_s, below = 0.0, 0.0
    for upper_s, count in buckets:
        if count >= rank:
            if upper_s == float("inf"):
                return lower_s * 1000
            share = (rank - below) / (count - below) if count > below else 1.0
            return (lower_s + (upper_s - lower_s) * share) * 1000
        lower_s, below = upper_s, count
    return float("inf")


async def drain(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    label: str,
    model: str,
    backlog: int,
    settings: Mapping[str, str],
    partitions: int = 4,
    until_results: int | None = None,
    sample_s: float = 1.0,
    timeout_s: float = 600.0,
    distinct: int = 1,
    request: samples.SampleRequest | Sequence[samples.SampleRequest] | None = None,
    on_sample: Callable[[int, int], Awaitable[None]] | None = None,
    stall_s: float = 60.0,
    mapping: str | None = None,
    before_start: Callable[[str], Awaitable[None]] | None = None,
) -> Drain:
    """Produce ``backlog`` records (copies of ``request``, or of several, else ``distinct``
    samples for ``model``), start one worker, sample it until ``until_results``.

    ``on_sample(pid, results)`` is awaited after every sample (the profiler attaches so).
    A drain with no new result for ``stall_s`` fails (Triton died under it, say).
    ``mapping``: a mapping file's text for the input topic (``{topic}`` in it names it).
    ``before_start(input_topic)`` is awaited before the worker starts (the Avro payload
    registers its events' schema under the topic's subject so).
    """
    run = f"drain-{uuid.uuid4().hex[:8]}"
    topic_in, topic_out, topic_dlq = f"{run}-in", f"{run}-out", f"{run}-dlq"
    await create_topics(bootstrap, [topic_in, topic_out, topic_dlq], partitions)
    # Copies of ``request``, or ``distinct`` different samples (for what compression saves).
    requests = request or samples.good_requests(distinct, seed=5, models=(model,))
    await produce_backlog(bootstrap, topic_in, requests, backlog, partitions)
    port = free_port()
    env = {
        "WORKER_BOOTSTRAP_SERVERS": bootstrap,
        "WORKER_TRITON_URL": triton_url,
        "WORKER_INPUT_TOPICS": topic_in,
        "WORKER_OUTPUT_TOPIC": topic_out,
        "WORKER_DLQ_TOPIC": topic_dlq,
        "WORKER_GROUP_ID": f"{run}-group",
        "WORKER_METRICS_PORT": str(port),
        "WORKER_LOG_FORMAT": "json",
        "WORKER_LOG_LEVEL": "warning",
        **{f"WORKER_{k}": v for k, v in settings.items()},
    }
    if mapping is not None:
        mapping_file = out_dir / f"{label}-mapping.toml"
        mapping_file.write_text(mapping.format(topic=topic_in))
        env["WORKER_MAPPING_FILE"] = str(mapping_file)
    if before_start is not None:
        await before_start(topic_in)
    child = spawn([_python(), "-m", "worker", "run"], env, out_dir / f"{label}.log")
    target = until_results or backlog
    points: list[tuple[float, int, float]] = []
    started = time.monotonic()
    metrics: dict[str, float] = {}
    progressed, last_done = started, -1
    steady_from: tuple[int, float] | None = None  # (results, CPU s) at a tenth of the target
    try:
        while time.monotonic() - started < timeout_s:
            await asyncio.sleep(sample_s)  # a fixed sampling period, not synchronisation
            if child.poll() is not None:
                raise RuntimeError(f"the worker exited with {child.returncode} ({label}.log)")
            try:
                metrics = await asyncio.to_thread(_scrape, port)
            except OSError:
                continue  # not listening yet
            done = int(metrics.get("worker_results_published_total", 0))
            now = time.monotonic()
            if done != last_done:
                progressed, last_done = now, done
            elif now - progressed > stall_s:
                raise RuntimeError(f"{label}: no new result for {stall_s:.0f} s ({label}.log)")
            points.append((now - started, done, _rss_mib(child.pid)))
            if steady_from is None and done >= target // 10:
                steady_from = (done, cpu_s(child.pid))
            if on_sample is not None:
                await on_sample(child.pid, done)
            if done >= target:
                break
        peak = peak_rss_bytes(child.pid) / (1 << 20)
        cpu = cpu_s(child.pid)
    finally:
        await stop(child)
    results = points[-1][1] if points else 0
    steady_results = results - steady_from[0] if steady_from else 0
    steady_cpu = cpu - steady_from[1] if steady_from else 0.0
    return Drain(
        label,
        dict(settings),
        backlog,
        _slope(points),
        _quantile_ms(metrics, _INFERENCE),
        points,
        peak_rss_mib=peak,
        cpu_s_per_1k=cpu / results * 1000 if results else 0.0,
        cpu_s_per_1k_steady=steady_cpu / steady_results * 1000 if steady_results else 0.0,
        output_topic=topic_out,
        first_response_ms=(
            _quantile_ms(metrics, _FIRST_RESPONSE, 0.5),
            _quantile_ms(metrics, _FIRST_RESPONSE, 0.99),
        ),
    )


def _slope(points: Sequence[tuple[float, int, float]]) -> float:
    """Results per second between the first sample with results and the last one.

    A drain finished within one sample period has a single sample with results: its
    rate is then taken from the sample before it (none done yet), or from the worker's
    start (time 0) when it had none: a lower bound.
    """
    first = next((i for i, p in enumerate(points) if p[1] > 0), None)
    if first is None:
        return 0.0
    if len(points) - first >= 2:
        (t0, n0, _), (t1, n1, _) = points[first], points[-1]
    else:
        (t0, n0), (t1, n1, _) = (points[first - 1][:2] if first else (0.0, 0)), points[-1]
    return (n1 - n0) / max(t1 - t0, 1e-3)


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


async def window_sweep(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    model: str,
    records: int,
    base: Mapping[str, str],
    fixed: Sequence[int] = (8, 32, 128, 512, 2048),
) -> list[Drain]:
    """The same backlog drained with each fixed window and with the adaptive one."""
    runs: list[tuple[str, dict[str, str]]] = [
        (f"fixed-{w}", {"MAX_IN_FLIGHT": str(w), "MAX_IN_FLIGHT_PER_PARTITION": str(w)})
        for w in fixed
    ]
    runs.append(
        (
            "adaptive",
            {
                "WINDOW_MODE": "adaptive",
                "MAX_IN_FLIGHT": str(max(fixed)),
                "MAX_IN_FLIGHT_PER_PARTITION": str(max(fixed)),
            },
        )
    )
    out = []
    for label, extra in runs:
        out.append(
            await drain(
                bootstrap,
                triton_url,
                out_dir,
                label=label,
                model=model,
                backlog=records,
                settings={**base, **extra},
                sample_s=0.5,
            )
        )
    return out


async def shm_gain(
    triton_url: str, *, tensor_bytes: int, requests: int, concurrency: int = 4
) -> dict[str, float]:
    """MB/s of ``double`` requests of ``tensor_bytes`` each, over gRPC and via shared memory."""
    values = np.random.default_rng(9).standard_normal(tensor_bytes // 4).astype(np.float32)
    raw = values.tobytes()
    out: dict[str, float] = {}
    for label, shm in (("grpc", False), ("system_shm", True)):
        pool = TritonPool(
            triton_url,
            concurrency,
            shm_min_bytes=1 if shm else None,
            shm_pool_bytes=4 * concurrency * max(tensor_bytes, 1 << 20),
        )
        await pool.start()
        try:
            await _send_many(pool, raw, values.size, 2 * concurrency, concurrency)  # warm-up
            started = time.perf_counter()
            await _send_many(pool, raw, values.size, requests, concurrency)
            elapsed_s = time.perf_counter() - started
        finally:
            await pool.close()
        out[f"{label}_requests_per_s"] = requests / elapsed_s
        out[f"{label}_mb_per_s"] = requests * tensor_bytes / elapsed_s / 1e6
    out["tensor_bytes"] = float(tensor_bytes)
    out["gain"] = out["system_shm_requests_per_s"] / out["grpc_requests_per_s"]
    return out


async def _send_many(
    pool: TritonPool, raw: bytes, elements: int, count: int, concurrency: int
) -> None:
    semaphore = asyncio.Semaphore(concurrency)

    async def one() -> Any:
        async with semaphore:
            request = service_pb2.ModelInferRequest(model_name="double")
            request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, elements])
            request.raw_input_contents.append(raw)
            return await pool.infer(request, 60)

    await asyncio.gather(*(one() for _ in range(count)))


def _python() -> str:
    import sys

    return sys.executable


async def compression(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    model: str,
    records: int,
    base: Mapping[str, str],
) -> dict[str, Any]:
    """The worker draining a backlog with WORKER_COMPRESSION_TYPE none, lz4 and zstd.

    Throughput and the worker's CPU per 1,000 records come from each drain; how much
    each codec saves is measured on the results of the first run, compressed the
    way the producer compresses a batch (the concatenated record values).
    """
    import cramjam

    runs = [
        await drain(
            bootstrap,
            triton_url,
            out_dir,
            label=f"compression-{codec}",
            model=model,
            backlog=records,
            settings={**base, "COMPRESSION_TYPE": codec},
            sample_s=0.5,
            distinct=1000,
        )
        for codec in ("none", "lz4", "zstd")
    ]
    values = await _read_values(bootstrap, runs[0].output_topic, limit=2000)
    raw = b"".join(values)
    ratios = {
        "lz4": len(bytes(cramjam.lz4.compress_block(raw))) / max(1, len(raw)),
        "zstd": len(bytes(cramjam.zstd.compress(raw))) / max(1, len(raw)),
    }
    return {"runs": runs, "ratios": ratios, "sample_bytes": len(raw)}


#: The payloads measured side by side: (model, encoding) of each drain; ``events`` are
#: plain JSON events of the same floats on a mapped topic (WORKER_MAPPING_FILE), ``avro``
#: the same events in Avro through a Schema Registry (results in Avro too).
PAYLOADS: tuple[tuple[str, str], ...] = (
    ("mlp", "json"),
    ("mlp", "binary"),
    ("mlp", "events"),
    ("mlp", "avro"),
    ("embedding", "json"),
    ("embedding", "binary"),
)
#: The mapping of the ``events`` payload: the event's floats to ``mlp``'s input, its id
#: and the probabilities as the result event (as an OIP result has them).
EVENTS_MAPPING = samples.MLP_EVENTS_MAPPING
#: The ``avro`` payload's: the same, of Avro events.
AVRO_MAPPING = EVENTS_MAPPING.replace('model = "mlp"\n', 'model = "mlp"\nformat = "avro"\n', 1)
#: The ``avro`` payload's events: an id and the 64 floats.
AVRO_EVENT = orjson.dumps(
    {
        "type": "record",
        "name": "MlpEvent",
        "namespace": "bench",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "features", "type": {"type": "array", "items": "float"}},
        ],
    }
).decode()
#: Floats per request of the payloads' models.
PAYLOAD_FLOATS = {"mlp": 64, "embedding": 768}


def payload_of(run: Drain) -> tuple[str, str]:
    """(model, encoding) of a drain of ``payloads``, from its label."""
    _, model, encoding = run.label.split("-")
    return model, encoding


async def payloads(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    records: int,
    base: Mapping[str, str],
    registry_url: str | None = None,
    only: Sequence[tuple[str, str]] = PAYLOADS,
) -> list[Drain]:
    """The tuned worker draining ``records`` requests of each of ``PAYLOADS`` (or
    ``only``): 64 floats (``mlp``) and 768 (``embedding``), as OIP JSON and with the
    binary extension, and ``mlp``'s as events (JSON, and Avro when a ``registry_url`` is
    given)."""
    runs = []
    for model, encoding in only:
        if encoding == "avro" and registry_url is None:
            continue
        settings, before_start, mapping = dict(base), None, None
        if encoding == "events":
            mapping, requests = EVENTS_MAPPING, _events(samples_for(model, 200, seed=5))
        elif encoding == "avro":
            assert registry_url is not None
            schema_id = await asyncio.to_thread(_register, registry_url, "bench-mlp-event")
            mapping = AVRO_MAPPING
            requests = _avro_events(_events(samples_for(model, 200, seed=5)), schema_id)
            settings |= {
                "SCHEMA_REGISTRY_URL": registry_url,
                "SCHEMA_REGISTRY_AUTO_REGISTER": "true",
            }

            async def before_start(topic: str, url: str = registry_url) -> None:
                await asyncio.to_thread(_register, url, f"{topic}-value")

        else:
            requests = samples_for(model, 200, seed=5, encoding=encoding)  # type: ignore[arg-type]
        runs.append(
            await drain(
                bootstrap,
                triton_url,
                out_dir,
                label=f"payloads-{model}-{encoding}",
                model=model,
                backlog=records,
                settings=settings,
                sample_s=0.5,
                request=requests,
                mapping=mapping,
                before_start=before_start,
            )
        )
    return runs


def _register(url: str, subject: str) -> int:
    """Register the Avro events' schema under ``subject``; its id (the same for every
    subject: the registry's id is the schema's)."""
    import urllib.request

    body = orjson.dumps({"schema": AVRO_EVENT})
    request = urllib.request.Request(
        f"{url}/subjects/{subject}/versions",
        body,
        {"Content-Type": "application/vnd.schemaregistry.v1+json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        return int(orjson.loads(answer.read())["id"])


def _avro_events(
    events: list[samples.SampleRequest], schema_id: int
) -> list[samples.SampleRequest]:
    """The JSON events as Avro in the Confluent wire format (as AvroSerializer frames it)."""
    import io

    import fastavro

    from worker.registry.framing import frame

    schema = fastavro.parse_schema(orjson.loads(AVRO_EVENT))
    out = []
    for event in events:
        buffer = io.BytesIO()
        fastavro.schemaless_writer(buffer, schema, orjson.loads(event.value))
        value = frame(schema_id, buffer.getvalue())
        out.append(samples.SampleRequest(value, [], event.model, "json", event.request_id))
    return out


def _events(requests: list[samples.SampleRequest]) -> list[samples.SampleRequest]:
    """The JSON requests' floats as plain events: ``{"id": ..., "features": [...]}``."""
    out = []
    for request in requests:
        body = orjson.loads(request.value)
        (row,) = np.asarray(body["inputs"][0]["data"], dtype=np.float32).reshape(1, -1).tolist()
        event = orjson.dumps({"id": request.request_id, "features": row})
        out.append(samples.SampleRequest(event, [], request.model, "json", request.request_id))
    return out


async def _read_values(bootstrap: str, topic: str, limit: int) -> list[bytes]:
    consumer = AIOKafkaConsumer(topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest")
    await consumer.start()
    values: list[bytes] = []
    try:
        async with asyncio.timeout(30):
            while len(values) < limit:
                batch = await consumer.getmany(timeout_ms=1000, max_records=limit)
                if not batch:
                    break
                values += [r.value or b"" for rs in batch.values() for r in rs]
    finally:
        await consumer.stop()
    return values[:limit]
