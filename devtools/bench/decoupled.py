"""Decoupled models: responses per second and time to first response, worker against Triton.

The ``tokens`` model streams ``tokens`` responses per request as fast as it can
(``delay_ms`` 0), so what is measured is the cost of a response, not the model.

- Triton alone: the worker's own stream pool (``TritonPool.infer_stream``) with
  ``concurrency`` requests in flight, timed from the first request to the last
  final response; the time to first response is measured per request.
- The worker, ``WORKER_STREAM_OUTPUT=each``: one process draining a backlog of
  the same request with ``WORKER_MAX_IN_FLIGHT=concurrency``; every response is a
  result, so responses/s is the slope of its results counter; the time to first
  response comes from its ``worker_stream_first_response_seconds`` histogram.
- The worker, ``final``: the same, one result per request (responses/s = results/s
  x ``tokens``).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tritonclient.grpc import service_pb2

from devtools import samples
from devtools.bench.extras import drain
from worker.triton.decoupled import is_final
from worker.triton.pool import TritonPool
from worker.wire.bytes_tensor import serialize_bytes_tensor
from worker.wire.streams import has_outputs

__all__ = ["StreamPoint", "markdown", "measure"]

PROMPT = "one response per token of this sentence"


@dataclass(frozen=True, slots=True)
class StreamPoint:
    """One way of serving token streams: its responses per second and time to first one."""

    label: str
    requests: int
    tokens: int
    responses_per_s: float
    first_p50_ms: float
    first_p99_ms: float


def _request(tokens: int) -> service_pb2.ModelInferRequest:
    request = service_pb2.ModelInferRequest(model_name="tokens")
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(serialize_bytes_tensor([PROMPT.encode()]))
    for name, value in (("max_tokens", tokens), ("delay_ms", 0)):
        request.inputs.add(name=name, datatype="INT32", shape=[1])
        request.raw_input_contents.append(value.to_bytes(4, "little", signed=True))
    return request


async def triton_alone(
    triton_url: str, *, requests: int, tokens: int, concurrency: int
) -> StreamPoint:
    """Token streams straight to Triton on the worker's stream pool."""
    pool = TritonPool(triton_url, 2)
    await pool.start()
    firsts: list[float] = []
    semaphore = asyncio.Semaphore(concurrency)

    async def one() -> int:
        async with semaphore:
            responses = pool.infer_stream(_request(tokens))
            received = 0
            try:
                while (response := await responses.next(time.monotonic() + 60)) is not None:
                    if not received:
                        firsts.append(responses.last_arrival - responses.sent_at)
                    received += has_outputs(response)
                    if is_final(response):
                        break
            finally:
                responses.close()
            return received

    try:
        await asyncio.gather(*(one() for _ in range(concurrency)))  # warm-up
        firsts.clear()
        started = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(requests)))
        elapsed_s = time.perf_counter() - started
    finally:
        await pool.close()
    firsts.sort()
    return StreamPoint(
        "Triton alone (stream pool)",
        requests,
        tokens,
        sum(counts) / elapsed_s,
        statistics.median(firsts) * 1000,
        firsts[int(0.99 * (len(firsts) - 1))] * 1000,
    )


async def measure(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    requests: int,
    tokens: int = 16,
    concurrency: int = 64,
) -> list[StreamPoint]:
    """Triton alone, then the worker in each mode and in final mode."""
    points = [
        await triton_alone(triton_url, requests=requests, tokens=tokens, concurrency=concurrency)
    ]
    sample = samples.token_request("bench", PROMPT, tokens, delay_ms=0)
    window = {"MAX_IN_FLIGHT": str(concurrency), "MAX_IN_FLIGHT_PER_PARTITION": str(concurrency)}
    for mode, per_request in (("each", tokens), ("final", 1)):
        run = await drain(
            bootstrap,
            triton_url,
            out_dir,
            label=f"decoupled-{mode}",
            model="tokens",
            backlog=requests,
            settings={**window, "STREAM_OUTPUT": mode},
            until_results=requests * per_request,
            sample_s=0.5,
            request=sample,
        )
        points.append(
            StreamPoint(
                f"worker, WORKER_STREAM_OUTPUT={mode}",
                requests,
                tokens,
                run.records_per_s * tokens / per_request,
                *run.first_response_ms,
            )
        )
    return points


def markdown(points: list[StreamPoint] | None) -> str:
    """The decoupled measurement as a Markdown table (empty when not measured)."""
    if not points:
        return ""
    first = points[0]
    lines = [
        "",
        f"Decoupled `tokens` model, {first.requests:,} requests of {first.tokens} responses "
        f"each, {first.requests * first.tokens:,} responses; the same number of streams in "
        "flight for each row:",
        "",
        "| run | responses/s | first response p50 ms | first response p99 ms |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {p.label} | {p.responses_per_s:,.0f} | {p.first_p50_ms:,.1f} | {p.first_p99_ms:,.1f} |"
        for p in points
    ]
    return "\n".join(lines) + "\n"
