"""Model rollouts: a model unloaded and loaded again in Triton holds its records; others flow.

The session's Triton runs with explicit model control, so the tests unload and load
``mlp`` through its repository API. That Triton is shared with every other test of
the session: each test here loads ``mlp`` back in a ``finally`` block. The test of
versions loads ``embedding`` as two versions (its own code, given in the load request),
then the repository's again: from then on the index also lists an ``embedding`` version
2, unloaded, which no other test names.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.structs import ConsumerRecord

from devtools.samples import (
    ENCODINGS,
    MLP_EVENTS_MAPPING,
    MODEL_INPUTS,
    SampleRequest,
    Tensor,
    encode_request,
)
from tests.integration.test_foreign_traffic import Out, produce
from tests.support import (
    Collected,
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    headers_dict,
    mlp_reference,
    result_outputs,
    running_worker,
    send,
    settings_for,
)
from tests.support.models import load_versions, version_states
from worker.app import Worker
from worker.checks.mappings import inspect_mappings, mapping_rows

pytestmark = pytest.mark.timeout(240)

_RATE_PER_S = 50  # requests per second for each of mlp and double
_RUN_S = 10.0
#: The rollout's gap: how long mlp stays unloaded before it is loaded again.
_GAP_S = 4.0


# -- Triton's repository API ---------------------------------------------------------


def _post(triton: TritonUnderTest, path: str) -> Any:
    request = urllib.request.Request(
        f"http://{triton.http_address}{path}",
        data=b"{}",
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200, (path, response.status)
        body = response.read()
    return json.loads(body) if body else None


def _model_ready(triton: TritonUnderTest, model: str) -> bool:
    url = f"http://{triton.http_address}/v2/models/{model}/ready"
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return bool(response.status == 200)
    except urllib.error.HTTPError:
        return False


async def _unload(triton: TritonUnderTest, model: str) -> None:
    await asyncio.to_thread(_post, triton, f"/v2/repository/models/{model}/unload")


async def _load(triton: TritonUnderTest, model: str) -> None:
    await asyncio.to_thread(_post, triton, f"/v2/repository/models/{model}/load")


def _load_broken(triton: TritonUnderTest, model: str) -> tuple[int, str]:
    """Load ``model`` with a configuration naming a backend that does not exist: it fails."""
    config = json.dumps({"name": model, "backend": "no_such_backend", "max_batch_size": 0})
    request = urllib.request.Request(
        f"http://{triton.http_address}/v2/repository/models/{model}/load",
        data=json.dumps({"parameters": {"config": config}}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


async def _index_state(triton: TritonUnderTest, model: str) -> set[str]:
    """The states Triton's repository index gives for ``model``'s versions."""
    index = await asyncio.to_thread(_post, triton, "/v2/repository/index")
    return {entry.get("state", "") for entry in index if entry["name"] == model}


async def _until_state(
    triton: TritonUnderTest, model: str, state: str, timeout_s: float = 30
) -> None:
    """Wait until the index gives ``state`` for ``model`` (an unload finishes in the background)."""
    deadline = time.monotonic() + timeout_s
    while (states := await _index_state(triton, model)) != {state}:
        assert time.monotonic() < deadline, f"{model} still {states} after {timeout_s} s"
        await asyncio.sleep(0.1)  # polling Triton, another process: nothing to await


@contextlib.asynccontextmanager
async def _loaded_afterwards(triton: TritonUnderTest, model: str) -> AsyncIterator[None]:
    """Whatever happens inside, ``model`` is loaded (and ready) again on exit."""
    try:
        yield
    finally:
        if not await asyncio.to_thread(_model_ready, triton, model):
            await _load(triton, model)
        assert await asyncio.to_thread(_model_ready, triton, model)


# -- requests and checks ---------------------------------------------------------------


class Flow:
    """Requests for mlp and double produced at a steady rate, remembered for checking."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self._bootstrap = bootstrap
        self._topic = topic
        self.tensors: dict[str, tuple[str, list[Tensor]]] = {}
        self._rng = np.random.default_rng(17)

    def request(self, model: str, request_id: str, index: int) -> SampleRequest:
        tensors = MODEL_INPUTS[model](self._rng)
        encoding = ENCODINGS[index % len(ENCODINGS)]
        value, headers = encode_request(model, tensors, encoding, request_id)
        self.tensors[request_id] = (model, tensors)
        return SampleRequest(value, headers, model, encoding, request_id)

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
                for model in ("mlp", "double"):
                    r = self.request(model, f"{model}-{i}", i)
                    key = r.request_id.encode()
                    acks.append(
                        await producer.send(self._topic, r.value, key=key, headers=r.headers)
                    )
            await asyncio.gather(*acks)
        finally:
            await producer.stop()


def _check_result(record: ConsumerRecord[bytes, bytes], model: str, tensors: list[Tensor]) -> None:
    values = np.asarray(tensors[0].values, dtype=np.float32)
    name, expected = ("PROBS", mlp_reference(values)) if model == "mlp" else ("OUTPUT0", values * 2)
    got = np.asarray(result_outputs(record)[name]).reshape(expected.shape)
    np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=str(record.key))
    assert headers_dict(record.headers)["x-model-name"] == model.encode()


def _stamps_s(got: Collected, prefix: str) -> list[float]:
    """Publish times (record timestamps, in s) of the results whose request id has ``prefix``."""
    return sorted(r.timestamp / 1000 for rid, r in got.results.items() if rid.startswith(prefix))


def _published(worker: Worker, model: str) -> float:
    value = worker.metrics.registry.get_sample_value(
        "worker_results_published_total", {"model": model}
    )
    return value or 0.0


def _not_ready_gauge(worker: Worker) -> float | None:
    return worker.metrics.registry.get_sample_value("worker_models_not_ready")


async def _until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll the in-process worker's state until ``condition`` holds, or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)  # the worker's state changes in its own tasks: poll it


# -- tests ---------------------------------------------------------------------------------


async def test_rollout_holds_the_model_while_others_flow(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """mlp unloaded for 4 s and loaded again mid-stream: every request answered, none lost."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=2)
    # The window holds the gap's mlp records (~50/s for the gap plus the probe's second)
    # with room to spare, so that double keeps its slots while they wait.
    settings = settings_for(
        kafka, triton, topics, max_in_flight="1024", max_in_flight_per_partition="512"
    )
    flow = Flow(kafka.bootstrap_servers, topics.input)
    tensors = MODEL_INPUTS["double"](np.random.default_rng(3))
    value, unknown_headers = encode_request("no_such_model", tensors, "json", "unknown-model")
    unknown = SampleRequest(value, unknown_headers, "no_such_model", "json", "unknown-model")
    seen: dict[str, Any] = {}
    async with _loaded_afterwards(triton, "mlp"), running_worker(settings) as worker:
        producing = asyncio.create_task(flow.run(_RUN_S))
        try:
            await _until(lambda: _published(worker, "mlp") > 0, 30, "an mlp result")
            assert not producing.done()
            await _unload(triton, "mlp")
            unloaded_at = time.time()
            # A model the repository does not know, asked for while mlp is out.
            unknown_sent_at = time.time()
            await send(kafka.bootstrap_servers, topics.input, [unknown])
            await _until(lambda: worker.models.is_held("mlp", ""), _GAP_S, "mlp held")
            seen["early"] = (_not_ready_gauge(worker), worker.readiness())
            # The rollout's gap itself: the model stays out this long, whatever the worker does.
            await asyncio.sleep(max(0.0, unloaded_at + _GAP_S - time.time()))
            seen["late"] = (_not_ready_gauge(worker), worker.readiness())
            assert worker.models.is_held("mlp", "")
            loading_at = time.time()
            await _load(triton, "mlp")
            loaded_at = time.time()
            await _until(lambda: not worker.models.held(), 10, "mlp released")
            seen["after"] = (_not_ready_gauge(worker), worker.readiness())
            await producing
        finally:
            producing.cancel()
        expected = len(flow.tensors) + 1
        got = await collect(kafka.bootstrap_servers, topics, expected, timeout_s=60)

    # While mlp was out: the gauge said so, /readyz named it, and the worker stayed ready.
    for moment in ("early", "late"):
        gauge, (ready, detail) = seen[moment]
        assert gauge == 1, (moment, gauge)
        assert detail.get("models_not_ready") == ["mlp"], (moment, detail)
        assert ready, (moment, detail)
    gauge, (ready, detail) = seen["after"]
    assert gauge == 0 and "models_not_ready" not in detail and ready, (gauge, detail)

    # The unknown model: MODEL_NOT_FOUND at once, on its first try; it is the only dead letter.
    assert set(got.dead_letters) == {"unknown-model"}, sorted(got.dead_letters)[:10]
    letter = got.dead_letters["unknown-model"]
    headers = headers_dict(letter.headers)
    assert headers["x-error-code"] == b"MODEL_NOT_FOUND"
    assert int(headers["x-attempts"]) == 1, headers["x-attempts"]
    assert letter.timestamp / 1000 - unknown_sent_at < 2.0
    assert letter.timestamp / 1000 < loading_at  # not held until mlp came back

    # Every other request has exactly one result, with the right values.
    assert got.duplicates == 0
    assert set(got.results) == set(flow.tensors)
    for rid, (model, tensors) in flow.tensors.items():
        _check_result(got.results[rid], model, tensors)

    # double kept being answered through the gap; mlp was answered neither in it (it was
    # really out: Triton's unload finishes what it has in flight first) nor before its load.
    doubles = [t for t in _stamps_s(got, "double-") if unloaded_at <= t <= loading_at]
    gap_s = loading_at - unloaded_at
    assert len(doubles) >= 0.5 * _RATE_PER_S * gap_s, (len(doubles), gap_s)
    pauses = np.diff([unloaded_at, *doubles, loading_at])
    assert pauses.max() < 1.0, f"double stalled {pauses.max():.2f} s while mlp was out"
    mlps = [t for t in _stamps_s(got, "mlp-") if unloaded_at + 0.5 <= t < loaded_at]
    assert not mlps, f"{len(mlps)} mlp results while it was unloaded"
    print(
        f"\nROLLOUT | gap {gap_s:.1f} s, load {loaded_at - loading_at:.1f} s | "
        f"{len(doubles)} double results in the gap | longest double pause "
        f"{pauses.max():.2f} s | {len(got.results)} results"
    )


async def test_model_unloaded_before_first_request_is_held_until_loaded(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """mlp unloaded before a fresh worker ever saw it ready: its requests wait, then answer."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    flow = Flow(kafka.bootstrap_servers, topics.input)
    mlps = [flow.request("mlp", f"mlp-{i}", i) for i in range(15)]
    doubles = [flow.request("double", f"double-{i}", i) for i in range(15)]
    async with _loaded_afterwards(triton, "mlp"):
        await _unload(triton, "mlp")
        # Unloaded, the repository index still lists it: a rollout may bring it back.
        await _until_state(triton, "mlp", "UNAVAILABLE")
        async with running_worker(settings_for(kafka, triton, topics)) as worker:
            assert not worker.pool.has_spec("mlp", "")
            await send(kafka.bootstrap_servers, topics.input, [*mlps, *doubles])
            await _until(lambda: worker.models.is_held("mlp", ""), 30, "mlp held")
            # Meanwhile double is answered; mlp is neither answered nor dead-lettered.
            got = await collect(kafka.bootstrap_servers, topics, len(doubles), timeout_s=60)
            assert set(got.results) == {r.request_id for r in doubles}, sorted(got.results)
            assert not got.dead_letters
            assert _not_ready_gauge(worker) == 1
            assert worker.readiness()[1].get("models_not_ready") == ["mlp"]
            loading_at = time.time()
            await _load(triton, "mlp")
            got = await collect(kafka.bootstrap_servers, topics, len(flow.tensors), into=got)
            assert _not_ready_gauge(worker) == 0

    assert not got.dead_letters, sorted(got.dead_letters)
    assert got.duplicates == 0
    assert set(got.results) == set(flow.tensors)
    for rid, (model, tensors) in flow.tensors.items():
        _check_result(got.results[rid], model, tensors)
    # mlp's results came only once it was loaded: they were held, not failed and retried.
    assert min(_stamps_s(got, "mlp-")) >= loading_at


async def test_model_that_failed_to_load_stops_no_other_model(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """mlp's load fails (Triton not ready from then on): double flows, the worker stays ready."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    flow = Flow(kafka.bootstrap_servers, topics.input)
    mlps = [flow.request("mlp", f"mlp-{i}", i) for i in range(10)]
    doubles = [flow.request("double", f"double-{i}", i) for i in range(10)]
    # Probes ten times a second: five failed ones in a row would open the breaker in 0.5 s.
    settings = settings_for(kafka, triton, topics, breaker_probe_interval_ms="100")
    async with _loaded_afterwards(triton, "mlp"):
        await _unload(triton, "mlp")
        status, body = await asyncio.to_thread(_load_broken, triton, "mlp")
        assert status == 400, body
        # Listed, but not servable: with strict readiness Triton's ServerReady says no now.
        assert await _index_state(triton, "mlp") == {"UNAVAILABLE"}
        async with running_worker(settings) as worker:
            # The scenario: the worker idles for ten probe intervals with no inference at all.
            await asyncio.sleep(1.0)
            await send(kafka.bootstrap_servers, topics.input, [*mlps, *doubles])
            got = await collect(kafka.bootstrap_servers, topics, len(doubles), timeout_s=30)
            assert set(got.results) == {r.request_id for r in doubles}, sorted(got.results)
            assert not got.dead_letters
            # mlp's records wait for a good load rather than fail; the worker stays ready.
            assert worker.models.held() == ["mlp"]
            ready, detail = worker.readiness()
            assert ready and detail["triton"] == "up" and detail["breaker"] == "closed", detail
            loading_at = time.time()
            await _load(triton, "mlp")
            got = await collect(kafka.bootstrap_servers, topics, len(flow.tensors), into=got)

    assert not got.dead_letters, sorted(got.dead_letters)
    assert set(got.results) == set(flow.tensors)
    for rid, (model, tensors) in flow.tensors.items():
        _check_result(got.results[rid], model, tensors)
    assert min(_stamps_s(got, "mlp-")) >= loading_at


async def test_mapped_model_in_a_rollout_at_start_holds_its_events_until_loaded(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """A worker started while its mapped model is unloaded starts (a rollout is no mapping
    problem), holds the model's events and answers them once it is loaded again."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    mapping = tmp_path / "mapping.toml"
    mapping.write_text(MLP_EVENTS_MAPPING.format(topic=topics.input))
    settings = settings_for(kafka, triton, topics, mapping_file=str(mapping))
    rng = np.random.default_rng(23)
    features = {f"ev-{i}": rng.standard_normal(64).astype(np.float32) for i in range(8)}
    events = [
        Out(orjson.dumps({"id": rid, "features": row.tolist()}), rid.encode())
        for rid, row in features.items()
    ]
    async with _loaded_afterwards(triton, "mlp"):
        await _unload(triton, "mlp")
        await _until_state(triton, "mlp", "UNAVAILABLE")
        # check: the mapping's rows are skipped, saying why.
        rows = {row.check: row for row in mapping_rows(await inspect_mappings(settings, 10.0))}
        unchecked = rows[f"mapping {topics.input} INPUT0"]
        assert unchecked.outcome == "skip", unchecked
        assert "'mlp' as UNAVAILABLE (a rollout)" in unchecked.detail, unchecked
        async with running_worker(settings) as worker:
            await produce(kafka.bootstrap_servers, topics.input, events)
            await _until(lambda: worker.models.is_held("mlp", ""), 30, "mlp held")
            loading_at = time.time()
            await _load(triton, "mlp")
            got = await collect(kafka.bootstrap_servers, topics, len(events))

    assert not got.dead_letters, sorted(got.dead_letters)
    expected = mlp_reference(np.stack(list(features.values())))
    for (rid, _), want in zip(features.items(), expected, strict=True):
        body = orjson.loads(got.results[rid].value)
        assert body["id"] == rid
        np.testing.assert_allclose(body["probs"], want, rtol=1e-5)
    assert min(_stamps_s(got, "ev-")) >= loading_at


# -- versions Triton no longer serves while it serves the model -----------------------------


async def _until_versions(triton: TritonUnderTest, model: str, states: dict[str, set[str]]) -> None:
    """Wait until the index gives one of these states for each of these versions of ``model``."""
    deadline = time.monotonic() + 30
    while True:
        got = await asyncio.to_thread(version_states, triton.http_address, model)
        if all(got.get(version) in wanted for version, wanted in states.items()):
            return
        assert time.monotonic() < deadline, f"{model}: {got}, not {states}, after 30 s"
        await asyncio.sleep(0.1)  # polling Triton, another process: nothing to await


async def test_a_version_retired_or_failed_while_others_serve_is_model_not_found(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """embedding v2 fails to load (v1 serves), later v1 is retired by the version policy
    (v2 serves): a record naming the version not served is MODEL_NOT_FOUND after a short hold,
    naming the version and its state; records of the served versions are answered meanwhile."""
    topics = Topics.fresh(unique)
    await create(kafka, topics, partitions=1)
    rng = np.random.default_rng(29)

    def request(rid: str, version: str) -> SampleRequest:
        value, headers = encode_request("embedding", MODEL_INPUTS["embedding"](rng), "json", rid)
        headers = [*headers, ("x-model-version", version.encode())] if version else headers
        return SampleRequest(value, headers, "embedding", "json", rid)

    try:
        status, body = await asyncio.to_thread(
            load_versions, triton.http_address, "embedding", {"all": {}}, "2"
        )
        assert status == 400, body
        await _until_versions(triton, "embedding", {"1": {"READY"}, "2": {"UNAVAILABLE"}})
        async with running_worker(settings_for(kafka, triton, topics)):
            failed = [request("failed-v2", "2"), request("served-v1", "1"), request("any", "")]
            await send(kafka.bootstrap_servers, topics.input, failed)
            got = await collect(kafka.bootstrap_servers, topics, len(failed), timeout_s=30)

            status, body = await asyncio.to_thread(
                load_versions, triton.http_address, "embedding", {"all": {}}
            )
            assert status == 200, body
            await send(kafka.bootstrap_servers, topics.input, [request("seen-v1", "1")])
            got = await collect(kafka.bootstrap_servers, topics, 4, timeout_s=30, into=got)
            status, body = await asyncio.to_thread(
                load_versions, triton.http_address, "embedding", {"latest": {"num_versions": 1}}
            )
            assert status == 200, body
            # Still UNLOADING while the worker's streams are open: Triton 2.51 finishes
            # unloading a version only once every stream that carried a request for it closed.
            await _until_versions(
                triton, "embedding", {"1": {"UNLOADING", "UNAVAILABLE"}, "2": {"READY"}}
            )
            retired = [request("retired-v1", "1"), request("served-v2", "2"), request("now", "")]
            await send(kafka.bootstrap_servers, topics.input, retired)
            got = await collect(kafka.bootstrap_servers, topics, 7, timeout_s=30, into=got)
    finally:
        # The repository's own embedding again, and version 2 no longer failed (a failed
        # version keeps Triton not ready, for the tests after this one).
        await asyncio.to_thread(load_versions, triton.http_address, "embedding", {"all": {}})
        await _load(triton, "embedding")
        await _until_versions(triton, "embedding", {"1": {"READY"}, "2": {"UNAVAILABLE"}})

    assert set(got.results) == {"served-v1", "any", "seen-v1", "served-v2", "now"}
    assert set(got.dead_letters) == {"failed-v2", "retired-v1"}
    for rid, (version, state) in {
        "failed-v2": ("2", r"UNAVAILABLE \(.*cannot load\)"),
        "retired-v1": ("1", r"(UNLOADING|UNAVAILABLE \(unloaded\))"),
    }.items():
        headers = headers_dict(got.dead_letters[rid].headers)
        assert headers["x-error-code"] == b"MODEL_NOT_FOUND", (rid, headers)
        message = headers["x-error-message"].decode()
        assert re.search(rf"version {version} as {state} while version", message), message
        assert int(headers["x-attempts"]) == 1, (rid, headers["x-attempts"])
