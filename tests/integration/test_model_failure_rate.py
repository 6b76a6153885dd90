"""A bad model release is held by its failure-rate breaker, not dead-lettered; poison pills are.

The release is a model of the test's own (``double``'s configuration under another
name), loaded through Triton's repository API with its configuration and model
file in the load request, so nothing is added to the session's model repository
and the other tests sharing the session's Triton never see it. Each release is a
new version (1 good, 2 bad, 3 good): loading it replaces the previous version in
place, as a rollout does (Triton 2.51 does not reload an overridden version whose
files changed). It is unloaded at the end.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaProducer

from devtools.devstack.paths import models_dir
from devtools.samples import (
    ENCODINGS,
    MODEL_INPUTS,
    SampleRequest,
    Tensor,
    encode_request,
    faulty_request,
)
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    headers_dict,
    result_outputs,
    running_worker,
    send,
    settings_for,
)
from worker.app import Worker

pytestmark = pytest.mark.timeout(240)

_RATE_PER_S = 40  # requests per second for each of the release and double
_RUN_S = 12.0
#: How long the bad release stays loaded before the good one comes back.
_BAD_S = 3.0
_PROBE_INTERVAL_MS = 200
_WINDOW, _MIN_SAMPLES = 20, 10  # the defaults

_GOOD_MODEL = (models_dir() / "double" / "1" / "model.py").read_bytes()
#: The same module up to its class (the stub needs its sys.path preamble), then a bad class.
_BAD_MODEL = (
    _GOOD_MODEL.split(b"class TritonPythonModel")[0]
    + b'''
class TritonPythonModel:
    """Raises on every call, as a release with a broken dependency would."""

    def execute(self, requests):
        raise RuntimeError("bad release: weights do not match the code")
'''
)


def _config(name: str) -> str:
    """``double``'s configuration, as JSON, under ``name`` (one instance)."""
    tensor = {"data_type": "TYPE_FP32", "dims": [-1]}
    return json.dumps(
        {
            "name": name,
            "backend": "python",
            "max_batch_size": 64,
            "input": [{"name": "INPUT0", **tensor}],
            "output": [{"name": "OUTPUT0", **tensor}],
            "dynamic_batching": {"max_queue_delay_microseconds": 100},
            "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        }
    )


def _post(triton: TritonUnderTest, path: str, body: dict[str, Any]) -> None:
    request = urllib.request.Request(
        f"http://{triton.http_address}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200, (path, response.status)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{path}: {exc.code} {exc.read().decode()}") from exc


async def _load_release(triton: TritonUnderTest, name: str, version: int, model_py: bytes) -> None:
    """Load ``name`` with ``model_py`` as its only version; returns once loaded."""
    parameters = {
        "config": _config(name),
        f"file:{version}/model.py": base64.b64encode(model_py).decode(),
    }
    await asyncio.to_thread(
        _post, triton, f"/v2/repository/models/{name}/load", {"parameters": parameters}
    )


@contextlib.asynccontextmanager
async def _release(triton: TritonUnderTest, name: str) -> AsyncIterator[None]:
    """The good release of ``name`` loaded; unloaded on exit whatever happens."""
    await _load_release(triton, name, 1, _GOOD_MODEL)
    try:
        yield
    finally:
        await asyncio.to_thread(_post, triton, f"/v2/repository/models/{name}/unload", {})


def _failed_inferences(triton: TritonUnderTest, name: str) -> int:
    """Triton's count of failed inference requests of ``name`` (its statistics API)."""
    url = f"http://{triton.http_address}/v2/models/{name}/stats"
    with urllib.request.urlopen(url, timeout=10) as response:
        stats = json.loads(response.read())["model_stats"]
    return sum(int(s["inference_stats"]["fail"]["count"]) for s in stats)


def _sample(worker: Worker, metric: str, **labels: str) -> float:
    return worker.metrics.registry.get_sample_value(metric, labels) or 0.0


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll the in-process worker's state until ``condition`` holds, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.02)  # the worker's state changes in its own tasks: poll it


class Flow:
    """Requests for the release and for double at a steady rate, remembered for checking."""

    def __init__(self, bootstrap: str, topic: str, release: str) -> None:
        self._bootstrap = bootstrap
        self._topic = topic
        self._models = (release, "double")
        self.inputs: dict[str, tuple[str, list[Tensor]]] = {}
        self._rng = np.random.default_rng(23)

    async def run(self, duration_s: float) -> None:
        """Produce ``_RATE_PER_S`` requests a second for each model for ``duration_s``."""
        producer = AIOKafkaProducer(bootstrap_servers=self._bootstrap, acks="all", linger_ms=5)
        await producer.start()
        try:
            acks = []
            started = time.monotonic()
            for i in range(int(duration_s * _RATE_PER_S)):
                # Pacing the producer to a steady rate: this is the traffic, not a wait.
                await asyncio.sleep(max(0.0, started + i / _RATE_PER_S - time.monotonic()))
                for model in self._models:
                    request_id = f"{model}-{i}"
                    tensors = MODEL_INPUTS["double"](self._rng)
                    value, headers = encode_request(
                        model, tensors, ENCODINGS[i % len(ENCODINGS)], request_id
                    )
                    self.inputs[request_id] = (model, tensors)
                    send_ = producer.send(
                        self._topic, value, key=request_id.encode(), headers=headers
                    )
                    acks.append(await send_)
            await asyncio.gather(*acks)
        finally:
            await producer.stop()


async def test_a_release_failing_every_request_is_held_until_the_good_one_is_back(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Bad release loaded in place of a good one, then the good one back: only the sample dies."""
    release = f"release_{unique}"
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    settings = settings_for(
        kafka,
        triton,
        topics,
        max_in_flight="1024",
        max_in_flight_per_partition="512",
        breaker_probe_interval_ms=str(_PROBE_INTERVAL_MS),
    )
    key = (release, "")
    flow = Flow(kafka.bootstrap_servers, topics.input, release)
    seen: dict[str, Any] = {}
    async with _release(triton, release), running_worker(settings) as worker:
        producing = asyncio.create_task(flow.run(_RUN_S))
        try:
            # A full window of successes first: the release was good.
            published = "worker_results_published_total"
            await _until(
                lambda: _sample(worker, published, model=release) >= 2 * _WINDOW,
                30,
                "the good release's results",
            )
            await _load_release(triton, release, 2, _BAD_MODEL)
            bad_at = time.time()
            await _until(lambda: worker.model_health.is_open(*key), 10, "the breaker open")
            opened_at = time.time()
            seen["open"] = worker.readiness()
            seen["gauge"] = _sample(worker, "worker_model_breaker_open", model=release)
            # Records failing in flight when it opened have come back by now; from here on
            # only probes reach the bad release.
            await asyncio.sleep(0.5)  # a scenario phase (the release stays bad), not a sync
            failed_before = await asyncio.to_thread(_failed_inferences, triton, release)
            letters_before = _sample(worker, "worker_dead_letters_total", code="INFERENCE_ERROR")
            # The bad release stays loaded this long, whatever the worker does.
            await asyncio.sleep(max(0.0, bad_at + _BAD_S - time.time()))
            probes = await asyncio.to_thread(_failed_inferences, triton, release) - failed_before
            probing_s = time.time() - opened_at - 0.5
            letters_after = _sample(worker, "worker_dead_letters_total", code="INFERENCE_ERROR")
            assert worker.model_health.is_open(*key)
            good_at = time.time()
            await _load_release(triton, release, 3, _GOOD_MODEL)
            await _until(lambda: not worker.model_health.is_open(*key), 10, "the breaker closed")
            seen["closed"] = worker.readiness()
            await producing
        finally:
            producing.cancel()
        got = await collect(kafka.bootstrap_servers, topics, len(flow.inputs), timeout_s=90)
        transitions = {
            state: _sample(
                worker,
                "worker_model_breaker_transitions_total",
                model=release,
                state=state,
            )
            for state in ("open", "closed")
        }
        trip = worker.model_health.last_trip[key]

    # The sample that tripped the breaker is dead-lettered, on its first try; nothing else.
    assert _MIN_SAMPLES <= trip.failures <= _WINDOW and trip.failures > trip.outcomes / 2, trip
    assert len(got.dead_letters) == trip.failures, (len(got.dead_letters), trip)
    for rid, letter in got.dead_letters.items():
        headers = headers_dict(letter.headers)
        assert rid.startswith(f"{release}-"), rid
        assert headers["x-error-code"] == b"INFERENCE_ERROR", headers
        assert int(headers["x-attempts"]) == 1, headers
    # While open: no more dead letters; only probes, about one per interval, reached Triton.
    assert letters_after == letters_before == trip.failures
    assert 1 <= probes <= probing_s * 1000 / _PROBE_INTERVAL_MS + 2, (probes, probing_s)
    # Every other request has exactly one result, with the right values.
    assert got.duplicates == 0
    assert set(got.results) == set(flow.inputs) - set(got.dead_letters)
    for rid, record in got.results.items():
        model, tensors = flow.inputs[rid]
        expected = np.asarray(tensors[0].values, dtype=np.float32) * 2
        actual = np.asarray(result_outputs(record)["OUTPUT0"]).reshape(expected.shape)
        np.testing.assert_allclose(actual, expected, rtol=1e-6, err_msg=rid)
        assert headers_dict(record.headers)["x-model-name"] == model.encode()
    # double was answered all along; the release's held records only after the good load.
    stamps = {m: sorted(r.timestamp / 1000 for r in got.results.values()
                        if headers_dict(r.headers)["x-model-name"] == m.encode())
              for m in ("double", release)}  # fmt: skip
    doubles = [t for t in stamps["double"] if opened_at <= t <= good_at]
    assert len(doubles) >= 0.5 * _RATE_PER_S * (good_at - opened_at), len(doubles)
    assert not [t for t in stamps[release] if opened_at + 0.5 <= t < good_at]
    # Metrics and /readyz: open, then closed; the worker stayed ready throughout.
    assert seen["gauge"] == 1
    ready, detail = seen["open"]
    assert ready and detail.get("models_failing") == [release], detail
    ready, detail = seen["closed"]
    assert ready and "models_failing" not in detail, detail
    assert transitions == {"open": 1, "closed": 1}, transitions
    print(
        f"\nBAD RELEASE | sample {trip.failures}/{trip.outcomes} dead-lettered | "
        f"{probes} probes in {probing_s:.1f} s | {len(doubles)} double results while open | "
        f"{len(got.results)} results"
    )


async def test_a_poison_pill_among_good_requests_is_dead_lettered_alone(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Pills first and amid good requests: each dead-lettered at once; the breaker stays closed."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    rng = np.random.default_rng(5)
    pills = {0, 25}  # the first record (nothing known of the model yet) and one amid others
    requests: list[SampleRequest] = [
        faulty_request(rng, f"faulty-{i}", fail=i in pills) for i in range(50)
    ]
    async with running_worker(settings_for(kafka, triton, topics)) as worker:
        sent_at = time.time()
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, len(requests), timeout_s=60)
        assert worker.model_health.failing() == []
        opened = _sample(
            worker, "worker_model_breaker_transitions_total", model="faulty", state="open"
        )

    assert set(got.dead_letters) == {f"faulty-{i}" for i in pills}, sorted(got.dead_letters)
    for letter in got.dead_letters.values():
        headers = headers_dict(letter.headers)
        assert headers["x-error-code"] == b"INFERENCE_ERROR", headers
        assert int(headers["x-attempts"]) == 1, headers
        assert letter.timestamp / 1000 - sent_at < 5.0
    assert set(got.results) == {r.request_id for r in requests} - set(got.dead_letters)
    assert opened == 0
