"""Security against real servers: Kafka SASL_SSL with SCRAM and ACLs, Triton TLS and tokens.

The secure Kafka (SASL_SSL listener, SCRAM users, StandardAuthorizer) is the session's
(tests/integration/conftest.py); a second Triton (mutual TLS, restricted protocols) is
started for this module; audit and limits run on the session's plain stack.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer

from devtools.devstack.certs import LocalPki
from devtools.devstack.kafka import KafkaCluster
from devtools.devstack.paths import models_dir
from devtools.devstack.triton import TritonServer, ensure_triton
from devtools.samples import SampleRequest, Tensor, double_inputs, encode_request
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    create,
    headers_dict,
    run_to_exit,
    running_worker,
    send,
    settings_for,
    worker_env,
)
from tests.support.acls import ALICE_PASSWORD, BOB_PASSWORD
from worker.settings import load_settings
from worker.triton.auth import TritonAuth, triton_client_kwargs
from worker.triton.pool import TritonPool

pytestmark = pytest.mark.timeout(180)

TOKEN = "Bearer token-5d2e"
#: Triton's restricted-protocol check reads this header for the key "authorization".
TOKEN_HEADER = "triton-grpc-protocol-authorization"
#: Bound on a refused worker's start-up: one attempt, no retry storm.
REFUSAL_BOUND_S = 30.0


@pytest.fixture(scope="module")
def secure_triton(
    pki: LocalPki, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TritonServer]:
    """Triton serving ``double`` over mutual TLS, every gRPC protocol behind a token."""
    server = TritonServer(
        ensure_triton(lambda _: None),
        models_dir(),
        tmp_path_factory.mktemp("secure-triton"),
        models=["double"],
        extra_args=[
            "--grpc-use-ssl=true",
            "--grpc-use-ssl-mutual=true",
            f"--grpc-server-cert={pki.server.cert}",
            f"--grpc-server-key={pki.server.key}",
            f"--grpc-root-cert={pki.ca_cert}",
            "--grpc-restricted-protocol=health,metadata,model-config,inference:"
            f"authorization={TOKEN}",
        ],
    )
    server.start()
    yield server
    server.stop()


def _sasl_env(kafka: KafkaCluster, pki: LocalPki, user: str, password: str) -> dict[str, str]:
    return {
        "bootstrap_servers": kafka.sasl_bootstrap_servers,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": user,
        "sasl_password": password,
        "ssl_cafile": str(pki.ca_cert),
    }


def _triton_env(server: TritonServer, pki: LocalPki, token_file: Path) -> dict[str, str]:
    return {
        "triton_url": server.grpc_address,
        "triton_ssl": "true",
        "triton_ssl_cafile": str(pki.ca_cert),
        "triton_ssl_certfile": str(pki.client.cert),
        "triton_ssl_keyfile": str(pki.client.key),
        "triton_auth_header": TOKEN_HEADER,
        "triton_auth_token_file": str(token_file),
    }


def _double_requests(count: int, prefix: str) -> list[SampleRequest]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(count):
        request_id = f"{prefix}-{i}"
        value, headers = encode_request("double", double_inputs(rng), "json", request_id)
        out.append(SampleRequest(value, headers, "double", "json", request_id))
    return out


# -- Kafka -------------------------------------------------------------------------


async def test_worker_round_trips_over_sasl_ssl_with_scram(
    secure_kafka: KafkaCluster, triton: TritonUnderTest, pki: LocalPki, unique: str
) -> None:
    """A worker authenticated as alice over SASL_SSL answers every request."""
    topics = Topics.fresh(unique)
    await create(secure_kafka, topics)
    settings = settings_for(
        secure_kafka, triton, topics, **_sasl_env(secure_kafka, pki, "alice", ALICE_PASSWORD)
    )
    requests = _double_requests(5, "sasl")
    async with running_worker(settings):
        await send(secure_kafka.bootstrap_servers, topics.input, requests)
        got = await collect(secure_kafka.bootstrap_servers, topics, expected=len(requests))
    assert sorted(got.results) == sorted(r.request_id for r in requests)
    assert got.dead_letters == {}


@pytest.mark.parametrize(
    ("case", "user", "password", "ca", "expected"),
    [
        ("wrong password", "alice", "not-the-password", "ca", "authentication failed"),
        ("untrusted CA", "alice", ALICE_PASSWORD, "other", "certificate not trusted"),
        ("missing ACL", "bob", BOB_PASSWORD, "ca", "not authorized to describe it"),
    ],
)
def test_worker_refuses_to_start_on_kafka_security_errors(
    secure_kafka: KafkaCluster,
    triton: TritonUnderTest,
    pki: LocalPki,
    unique: str,
    tmp_path: Path,
    case: str,
    user: str,
    password: str,
    ca: str,
    expected: str,
) -> None:
    """Wrong password, untrusted CA, missing ACL: one error line, exit 2, quickly, no secret."""
    topics = Topics.fresh(unique)
    asyncio.run(create(secure_kafka, topics))
    extra = _sasl_env(secure_kafka, pki, user, password)
    extra["ssl_cafile"] = str(pki.ca_cert if ca == "ca" else pki.other_ca_cert)
    env = worker_env(secure_kafka, triton, topics, **extra)
    exited = run_to_exit(env, tmp_path / "worker.log", REFUSAL_BOUND_S)
    assert exited.code == 2, f"{case}: exit {exited.code}\n{exited.lines[-20:]}"
    assert expected in exited.error_line(), case
    assert password not in "\n".join(exited.lines)


# -- Triton ------------------------------------------------------------------------


async def test_worker_infers_over_mutual_tls_with_token(
    kafka: KafkaUnderTest, secure_triton: TritonServer, pki: LocalPki, unique: str, tmp_path: Path
) -> None:
    """With the CA, a client certificate and the right token, results come back over TLS."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    settings = settings_for(
        kafka, secure_triton, topics, **_triton_env(secure_triton, pki, token_file)
    )
    requests = _double_requests(4, "tls")
    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, expected=len(requests))
    assert sorted(got.results) == sorted(r.request_id for r in requests)
    document = json.loads(got.results["tls-0"].value)
    assert document["model_name"] == "double"


@pytest.mark.parametrize(
    ("case", "change", "expected"),
    [
        ("no CA", {"triton_ssl_cafile": ""}, "TLS failed"),
        ("no client certificate", {"triton_ssl_certfile": "", "triton_ssl_keyfile": ""}, "TLS"),
        ("wrong token", {"token": "Bearer wrong"}, "refused the request's credentials"),
        ("no token", {"triton_auth_token_file": ""}, "refused the request's credentials"),
    ],
)
def test_worker_refuses_to_start_on_triton_security_errors(
    kafka: KafkaUnderTest,
    secure_triton: TritonServer,
    pki: LocalPki,
    unique: str,
    tmp_path: Path,
    case: str,
    change: dict[str, str],
    expected: str,
) -> None:
    """Without the CA, the client certificate or the right token: one error line and exit 2."""
    token_file = tmp_path / "token"
    token_file.write_text(change.pop("token", TOKEN))
    topics = Topics.fresh(unique)
    asyncio.run(create(kafka, topics))
    extra = {**_triton_env(secure_triton, pki, token_file), **change}
    env = worker_env(kafka, secure_triton, topics, **extra)
    exited = run_to_exit(env, tmp_path / "worker.log", REFUSAL_BOUND_S)
    assert exited.code == 2, f"{case}: exit {exited.code}\n{exited.lines[-20:]}"
    errors = [line for line in exited.lines if line.startswith("error: ")]
    assert len(errors) == 1 and expected in errors[0], f"{case}: {exited.lines[-20:]}"
    assert "token-5d2e" not in "\n".join(exited.lines)


async def test_rotated_token_file_is_used_without_restart(
    secure_triton: TritonServer, pki: LocalPki, tmp_path: Path
) -> None:
    """A pool started with a wrong token is refused, then works once the file holds the right."""
    token_file = tmp_path / "token"
    token_file.write_text("Bearer stale")
    env = {
        "WORKER_INPUT_TOPICS": "in",
        "WORKER_OUTPUT_TOPIC": "out",
        "WORKER_DLQ_TOPIC": "dlq",
        **{
            f"WORKER_{k.upper()}": v for k, v in _triton_env(secure_triton, pki, token_file).items()
        },
    }
    settings = load_settings(env)
    pool = TritonPool(
        settings.triton.triton_url,
        1,
        client_kwargs=triton_client_kwargs(settings.triton),
        auth=TritonAuth(settings.triton),
    )
    await pool.start()
    try:
        refused = await pool.server_ready()
        token_file.write_text(TOKEN)
        accepted = await pool.server_ready()
        spec = await pool.model_spec("double", "")
    finally:
        await pool.close(drain_timeout_s=1.0)
    assert (refused, accepted) == (False, True)
    assert [i.name for i in spec.inputs] == ["INPUT0"]


# -- audit and limits (plain stack) ---------------------------------------------------


async def _read_audit(bootstrap: str, topic: str, expected: int) -> list[dict[str, Any]]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    records: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60
    try:
        while len(records) < expected:
            assert time.monotonic() < deadline, f"only {len(records)}/{expected} audit records"
            batch = await consumer.getmany(timeout_ms=500)
            for items in batch.values():
                records += [json.loads(item.value) for item in items]
        # Anything beyond `expected` would be a duplicate: read what is already there.
        batch = await consumer.getmany(timeout_ms=500)
        for items in batch.values():
            records += [json.loads(item.value) for item in items]
    finally:
        await consumer.stop()
    return records


def _limit_requests() -> list[SampleRequest]:
    """Good ``double`` requests, one for a model not allowed, one tensor over the element limit."""
    good = _double_requests(4, "ok")
    rng = np.random.default_rng(5)
    mlp = Tensor("INPUT0", "FP32", (1, 64), rng.standard_normal((1, 64)).astype(np.float32))
    forbidden_value, forbidden_headers = encode_request("mlp", [mlp], "json", "forbidden")
    wide = Tensor("INPUT0", "FP32", (1, 100), np.zeros((1, 100), dtype=np.float32))
    large_value, large_headers = encode_request("double", [wide], "binary", "too-large")
    return [
        *good,
        SampleRequest(forbidden_value, forbidden_headers, "mlp", "json", "forbidden", "FORBIDDEN"),
        SampleRequest(large_value, large_headers, "double", "binary", "too-large", "TOO_LARGE"),
        SampleRequest(b"{not json", [], "double", "json", "garbage", "DECODE_ERROR"),
    ]


async def test_one_audit_record_per_request_including_dead_letters(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """audit=topic: each request, result or dead letter, has exactly one record, without payload."""
    topics = Topics.fresh(unique)
    audit_topic = f"audit-{unique}"
    await create(kafka, topics)
    await kafka.create_topics([audit_topic])
    settings = settings_for(
        kafka,
        triton,
        topics,
        audit="topic",
        audit_topic=audit_topic,
        model_allowlist=f"{topics.input}=double",
        max_tensor_elements="64",
    )
    requests = _limit_requests()
    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, requests, partition=0)
        await collect(kafka.bootstrap_servers, topics, expected=len(requests))
        audit = await _read_audit(kafka.bootstrap_servers, audit_topic, len(requests))
    # One partition, sent in order: request i is at offset i.
    by_offset: dict[int, list[dict[str, Any]]] = {}
    for entry in audit:
        by_offset.setdefault(entry["source_offset"], []).append(entry)
    assert len(audit) == len(requests)
    assert sorted(by_offset) == list(range(len(requests)))
    outcomes = [
        (v[0]["request_id"], v[0]["outcome"], v[0]["error_code"])
        for _, v in sorted(by_offset.items())
    ]
    assert outcomes == [
        *((f"ok-{i}", "result", None) for i in range(4)),
        ("forbidden", "dead_letter", "FORBIDDEN"),
        (None, "dead_letter", "TOO_LARGE"),  # refused while decoding: no request id yet
        (None, "dead_letter", "DECODE_ERROR"),
    ]
    raw = json.dumps(audit)
    assert "not json" not in raw and all(e["worker_id"] == settings.kafka.client_id for e in audit)


async def test_limits_dead_letter_forbidden_and_too_large_through_the_worker(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Allowlist: FORBIDDEN; a 100-element tensor over a limit of 64: TOO_LARGE; others pass."""
    topics = Topics.fresh(unique)
    await create(kafka, topics)
    settings = settings_for(
        kafka, triton, topics, model_allowlist=f"{topics.input}=double", max_tensor_elements="64"
    )
    requests = _limit_requests()
    async with running_worker(settings):
        await send(kafka.bootstrap_servers, topics.input, requests)
        got = await collect(kafka.bootstrap_servers, topics, expected=len(requests))
    codes = {rid: headers_dict(r.headers)["x-error-code"] for rid, r in got.dead_letters.items()}
    assert codes["forbidden"] == b"FORBIDDEN"
    assert codes["too-large"] == b"TOO_LARGE"
    assert sorted(got.results) == [f"ok-{i}" for i in range(4)]
    message = headers_dict(got.dead_letters["too-large"].headers)["x-error-message"]
    assert b"64-element limit" in message
