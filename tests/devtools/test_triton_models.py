"""The project's Triton models, served by a real local tritonserver."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from devtools.devstack.paths import models_dir
from devtools.devstack.process import StartupError
from devtools.devstack.triton import (
    SITE_PACKAGES_ENV,
    TritonInstall,
    TritonPorts,
    TritonServer,
    ensure_triton,
    triton_env,
)
from tests.support import mlp_reference

TIMEOUT_S = 20.0


def _report(request: pytest.FixtureRequest, line: str) -> None:
    """Show a line in the test log whether or not output is captured."""
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        print(f"\n{line}")


@pytest.fixture(scope="module")
def install() -> TritonInstall:
    return ensure_triton()


@pytest.fixture(scope="module")
def server(
    install: TritonInstall, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[TritonServer]:
    server = TritonServer(install, models_dir(), tmp_path_factory.mktemp("triton"))
    seconds = server.start()
    _report(request, f"triton ready in {seconds:.1f}s (all models)")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: TritonServer) -> Iterator[grpcclient.InferenceServerClient]:
    client = grpcclient.InferenceServerClient(server.grpc_address)
    yield client
    client.close()


def _tensor(name: str, values: npt.NDArray[np.generic], datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(values.shape), datatype)
    tensor.set_data_from_numpy(values)
    return tensor


def _infer(
    client: grpcclient.InferenceServerClient,
    server: TritonServer,
    model: str,
    inputs: Sequence[grpcclient.InferInput],
) -> grpcclient.InferResult:
    """Infer; if it fails because Triton died, say so with its exit status and log."""
    try:
        return client.infer(model, list(inputs), client_timeout=TIMEOUT_S)
    except InferenceServerException as exc:
        report = server.death_report()
        if report is not None:
            pytest.fail(f"{exc}\n{report}")
        raise


def _faulty_inputs(
    values: npt.NDArray[np.float32], fail: bool, delay_ms: int
) -> list[grpcclient.InferInput]:
    return [
        _tensor("INPUT0", values, "FP32"),
        _tensor("FAIL", np.array([fail]), "BOOL"),
        _tensor("DELAY_MS", np.array([delay_ms], dtype=np.int32), "INT32"),
    ]


def test_double_doubles_a_batch(
    client: grpcclient.InferenceServerClient, server: TritonServer
) -> None:
    """A batch of 3 rows of 5 floats comes back doubled, exactly."""
    values = np.random.default_rng(7).standard_normal((3, 5)).astype(np.float32)

    result = _infer(client, server, "double", [_tensor("INPUT0", values, "FP32")])

    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values * 2)


def test_mlp_matches_the_numpy_reference(
    client: grpcclient.InferenceServerClient, server: TritonServer
) -> None:
    """mlp returns, per row, the softmax of the seeded 64-128-10 network computed here."""
    rows = np.random.default_rng(8).standard_normal((4, 64)).astype(np.float32)

    probs = _infer(client, server, "mlp", [_tensor("INPUT0", rows, "FP32")]).as_numpy("PROBS")

    assert probs.shape == (4, 10)
    np.testing.assert_allclose(probs, mlp_reference(rows), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(probs.sum(axis=1), np.ones(4), rtol=1e-5)


def test_echo_bytes_upper_cases_non_ascii_utf8(
    client: grpcclient.InferenceServerClient, server: TritonServer
) -> None:
    """UTF-8 strings, non-ASCII included, come back upper-cased and intact."""
    texts = ["straße", "héllo wörld", "日本語", "abc"]
    values = np.array([[text.encode() for text in texts]], dtype=np.object_)

    result = _infer(client, server, "echo_bytes", [_tensor("TEXT", values, "BYTES")])

    upper = result.as_numpy("TEXT_UPPER")
    assert [value.decode() for value in upper.reshape(-1)] == [text.upper() for text in texts]
    assert upper.shape == (1, 4)


def test_faulty_copies_its_input_when_not_asked_to_fail(
    client: grpcclient.InferenceServerClient, server: TritonServer
) -> None:
    """FAIL=false and no delay: OUTPUT0 is INPUT0."""
    values = np.array([1.5, -2.0, 3.25], dtype=np.float32)

    result = _infer(client, server, "faulty", _faulty_inputs(values, fail=False, delay_ms=0))

    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)


def test_faulty_needs_only_input0(
    client: grpcclient.InferenceServerClient, server: TritonServer
) -> None:
    """FAIL and DELAY_MS are optional: INPUT0 alone is answered."""
    values = np.array([4.0, 5.0], dtype=np.float32)

    result = _infer(client, server, "faulty", [_tensor("INPUT0", values, "FP32")])

    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)


def test_faulty_fails_on_request(
    client: grpcclient.InferenceServerClient, server: TritonServer
) -> None:
    """FAIL=true answers with the model's error, and the server stays up."""
    values = np.array([1.0], dtype=np.float32)

    with pytest.raises(InferenceServerException, match="faulty: failure requested"):
        client.infer("faulty", _faulty_inputs(values, fail=True, delay_ms=0))

    assert server.death_report() is None
    assert server.running()


def test_faulty_delays_its_answer(
    client: grpcclient.InferenceServerClient, server: TritonServer
) -> None:
    """DELAY_MS=300 makes the answer take at least 300 ms."""
    values = np.array([1.0], dtype=np.float32)

    started = time.monotonic()
    result = _infer(client, server, "faulty", _faulty_inputs(values, fail=False, delay_ms=300))
    elapsed_s = time.monotonic() - started

    assert elapsed_s >= 0.3
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values)


def test_faulty_slow_request_does_not_hold_up_a_fast_one(
    client: grpcclient.InferenceServerClient, server: TritonServer
) -> None:
    """A request delayed 1 s is still pending when a later undelayed request is answered."""
    slow_done = threading.Event()
    slow_outcome: list[object] = []

    def on_slow(result: object, error: object) -> None:
        slow_outcome.append(error if error is not None else result)
        slow_done.set()

    slow = _faulty_inputs(np.array([1.0], dtype=np.float32), fail=False, delay_ms=1000)
    client.async_infer("faulty", slow, on_slow, client_timeout=TIMEOUT_S)
    fast = np.array([2.0], dtype=np.float32)
    result = _infer(client, server, "faulty", _faulty_inputs(fast, fail=False, delay_ms=0))
    slow_pending_when_fast_answered = not slow_done.is_set()

    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), fast)
    assert slow_pending_when_fast_answered
    assert slow_done.wait(TIMEOUT_S)
    assert isinstance(slow_outcome[0], grpcclient.InferResult)


def test_metrics_endpoint_counts_inferences(
    client: grpcclient.InferenceServerClient, server: TritonServer
) -> None:
    """The metrics endpoint serves Triton's per-model success counter."""
    _infer(client, server, "double", [_tensor("INPUT0", np.ones((1, 2), np.float32), "FP32")])

    url = f"http://{server.metrics_address}/metrics"
    with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
        text = response.read().decode()

    assert 'nv_inference_request_success{model="double",version="1"}' in text


def test_restart_brings_the_server_back_on_the_same_ports(
    client: grpcclient.InferenceServerClient, server: TritonServer, request: pytest.FixtureRequest
) -> None:
    """After restart() the same client, on the same address, is answered again."""
    address = server.grpc_address
    old_pid = server.pid

    seconds = server.restart()
    _report(request, f"triton ready in {seconds:.1f}s after restart")

    values = np.array([[1.0, 2.0]], dtype=np.float32)
    result = _infer(client, server, "double", [_tensor("INPUT0", values, "FP32")])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), values * 2)
    assert server.grpc_address == address
    assert server.pid != old_pid


def test_a_server_found_from_its_state_can_be_stopped(
    install: TritonInstall, tmp_path: Path
) -> None:
    """A server rebuilt from its saved state (as another process would) stops the original."""
    original = TritonServer(install, models_dir(), tmp_path, models=["echo_bytes"])
    original.start()
    try:
        found = TritonServer.from_state(json.loads(json.dumps(original.to_state())))
        assert found.running()
        assert (found.pid, found.grpc_address) == (original.pid, original.grpc_address)

        found.stop()

        assert not original.running()
    finally:
        original.stop()


def test_a_picked_port_taken_before_the_start_is_picked_again(
    install: TritonInstall, tmp_path: Path
) -> None:
    """Servers prepared together pick their ports before any of them listens: a port
    taken by the time one starts (here by a socket listening on its gRPC port) makes it
    exit at once; it starts again on fresh ports. Ports given by the caller are not
    changed: the same start fails."""
    server = TritonServer(install, models_dir(), tmp_path / "picked", models=["double"])
    taken = server.ports.grpc
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", taken))
        holder.listen()
        server.start(timeout_s=60)
        try:
            assert server.ports.grpc != taken
            with grpcclient.InferenceServerClient(server.grpc_address) as client:
                assert client.is_model_ready("double")
        finally:
            server.stop()
        given = TritonServer(
            install,
            models_dir(),
            tmp_path / "given",
            models=["double"],
            ports=TritonPorts(grpc=taken, http=server.ports.http, metrics=server.ports.metrics),
        )
        with pytest.raises(StartupError, match="already in use"):
            given.start(timeout_s=60)
        assert given.ports.grpc == taken and not given.running()


def test_models_fail_without_the_numpy_site_fix(install: TritonInstall, tmp_path: Path) -> None:
    """Without TRITON_MODEL_SITE_PACKAGES the stub lacks a usable numpy: `double` fails."""
    env = triton_env(install, os.environ)
    del env[SITE_PACKAGES_ENV]
    server = TritonServer(install, models_dir(), tmp_path, models=["double"], env=env)

    try:
        server.start(timeout_s=60)
    except StartupError as exc:
        failure = str(exc)  # the base interpreter has no numpy: the model does not load
    else:
        # A base interpreter with numpy 2.x loads the model, but its outputs break.
        try:
            with grpcclient.InferenceServerClient(server.grpc_address) as client:
                values = np.ones((1, 2), np.float32)
                with pytest.raises(InferenceServerException) as caught:
                    client.infer("double", [_tensor("INPUT0", values, "FP32")])
            failure = str(caught.value)
        finally:
            server.stop()

    assert "No module named 'numpy'" in failure or "does not match size" in failure
    assert not server.running()
