"""The settings as librdkafka configuration, and the settings librdkafka cannot honour."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import confluent_kafka
import pytest
from aiokafka.errors import CommitFailedError, KafkaError, MessageSizeTooLargeError
from confluent_kafka.aio import AIOConsumer

from devtools.devstack.process import free_port
from worker.kafka.rdkafka import log as rdkafka_log
from worker.kafka.rdkafka.config import (
    OAUTH_DEFAULT_LIFETIME_S,
    consumer_config,
    oauth_token,
    producer_config,
)
from worker.kafka.rdkafka.types import from_rd_error
from worker.settings import ConfigError, Settings, load_settings

REQUIRED = {
    "WORKER_INPUT_TOPICS": "requests",
    "WORKER_OUTPUT_TOPIC": "results",
    "WORKER_DLQ_TOPIC": "dead-letters",
    "WORKER_KAFKA_CLIENT": "confluent",
}


def _settings(**extra: str) -> Settings:
    return load_settings({**REQUIRED, **{f"WORKER_{k}": v for k, v in extra.items()}})


def _error(**extra: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        settings = _settings(**extra)
        consumer_config(settings.kafka, settings.kafka_auth)
        producer_config(settings.kafka, settings.kafka_auth, max_request_bytes=1 << 20)
    assert "\n" not in info.value.message
    return info.value


def test_consumer_config_carries_the_group_and_fetch_settings() -> None:
    """Group, client id, offsets reset, poll interval and session timeout map one to one."""
    settings = _settings(
        BOOTSTRAP_SERVERS="k1:9092,k2:9092",
        GROUP_ID="g",
        CLIENT_ID="c",
        AUTO_OFFSET_RESET="latest",
        MAX_POLL_INTERVAL_MS="60000",
        SESSION_TIMEOUT_MS="6000",
    )
    config = consumer_config(settings.kafka, settings.kafka_auth)
    assert config["bootstrap.servers"] == "k1:9092,k2:9092"
    assert (config["group.id"], config["client.id"]) == ("g", "c")
    assert config["auto.offset.reset"] == "latest"
    assert config["enable.auto.commit"] is False
    assert config["isolation.level"] == "read_committed"
    assert config["max.poll.interval.ms"] == 60000
    assert config["session.timeout.ms"] == 6000
    assert config["group.protocol"] == "classic"
    # Prefetch bounded: 16 MiB, two polls' worth per partition (not librdkafka's 100,000).
    assert config["queued.max.messages.kbytes"] == 16 * 1024
    assert config["queued.min.messages"] == 1000
    # A queue that small is drained in well under librdkafka's 1 s refetch backoff.
    assert config["fetch.queue.backoff.ms"] == 20
    more = _settings(MAX_POLL_RECORDS="2000")
    assert consumer_config(more.kafka, more.kafka_auth)["queued.min.messages"] == 4000
    confluent_kafka.Consumer(config).close()  # librdkafka accepts every property


async def test_the_consumer_reports_client_errors_and_consumes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The consumer's configuration on the asyncio API, no broker at its address: each error
    is reported and consume goes on (a plain error_cb made consume raise TypeError)."""
    reported: list[str] = []

    def record(error: Any, *_: Any) -> None:
        reported.append(str(error.name()))

    monkeypatch.setattr(rdkafka_log, "on_error", record)
    settings = _settings(BOOTSTRAP_SERVERS=f"127.0.0.1:{free_port()}", GROUP_ID="g")
    consumer = AIOConsumer(consumer_config(settings.kafka, settings.kafka_auth), max_workers=2)
    await consumer.subscribe(["requests"])
    deadline = time.monotonic() + 30
    try:
        while not reported:
            assert time.monotonic() < deadline, "librdkafka reported no error in 30 s"
            assert await consumer.consume(10, timeout=0.1) == []
    finally:
        await consumer.close()
    assert "_TRANSPORT" in reported


def test_consumer_protocol_leaves_the_session_to_the_broker() -> None:
    """group.protocol=consumer: no session or heartbeat settings (the broker owns them)."""
    settings = _settings(GROUP_PROTOCOL="consumer")
    config = consumer_config(settings.kafka, settings.kafka_auth)
    assert config["group.protocol"] == "consumer"
    assert "session.timeout.ms" not in config and "heartbeat.interval.ms" not in config
    assert "partition.assignment.strategy" not in config
    confluent_kafka.Consumer(config).close()


def test_a_session_timeout_under_the_consumer_protocol_is_refused() -> None:
    """The consumer protocol cannot honour WORKER_SESSION_TIMEOUT_MS: named at start-up."""
    error = _error(GROUP_PROTOCOL="consumer", SESSION_TIMEOUT_MS="6000")
    assert error.setting == "WORKER_SESSION_TIMEOUT_MS"


def test_a_poll_interval_below_the_session_timeout_is_refused() -> None:
    """librdkafka refuses max.poll.interval.ms under session.timeout.ms: named at start-up."""
    error = _error(MAX_POLL_INTERVAL_MS="1000", SESSION_TIMEOUT_MS="6000")
    assert error.setting == "WORKER_MAX_POLL_INTERVAL_MS"


def test_consumer_protocol_needs_the_confluent_client() -> None:
    """aiokafka speaks only the classic protocol: the combination is refused in one line."""
    error = _error(KAFKA_CLIENT="aiokafka", GROUP_PROTOCOL="consumer")
    assert error.setting == "WORKER_GROUP_PROTOCOL"


def test_producer_config_is_idempotent_with_the_asked_compression_and_linger() -> None:
    """acks=all, idempotence, linger, compression and the size bound reach librdkafka."""
    settings = _settings(LINGER_MS="7", COMPRESSION_TYPE="zstd")
    config = producer_config(settings.kafka, settings.kafka_auth, max_request_bytes=2 << 20)
    assert config["acks"] == "all" and config["enable.idempotence"] is True
    assert (config["linger.ms"], config["compression.type"]) == (7, "zstd")
    assert config["message.max.bytes"] == 2 << 20
    assert config["batch.size"] <= config["message.max.bytes"]
    confluent_kafka.Producer(config).flush(0)


def test_tls_files_are_checked_and_passed_as_locations(tmp_path: Path) -> None:
    """SSL: the CA, certificate and key paths go to librdkafka; a missing one is named."""
    ca = tmp_path / "ca.pem"
    ca.write_text("not read by this test")
    settings = _settings(SECURITY_PROTOCOL="SSL", SSL_CAFILE=str(ca))
    config = producer_config(settings.kafka, settings.kafka_auth, max_request_bytes=1 << 20)
    assert config["security.protocol"] == "ssl"
    assert config["ssl.ca.location"] == str(ca)
    error = _error(SECURITY_PROTOCOL="SSL", SSL_CAFILE=str(tmp_path / "missing.pem"))
    assert error.setting == "WORKER_SSL_CAFILE"


def test_a_tls_file_without_tls_is_refused(tmp_path: Path) -> None:
    """A CA or certificate file with PLAINTEXT would be ignored: refused, as on aiokafka."""
    pem = tmp_path / "ca.pem"
    pem.write_text("not read by this test")
    given: list[dict[str, str]] = [
        {"SSL_CAFILE": str(pem)},
        {"SSL_CERTFILE": str(pem), "SSL_KEYFILE": str(pem)},  # a certificate needs its key
    ]
    for extra, name in zip(given, ("SSL_CAFILE", "SSL_CERTFILE"), strict=True):
        error = _error(**extra)
        assert error.setting == f"WORKER_{name}"
        assert "needs WORKER_SECURITY_PROTOCOL SSL or SASL_SSL" in str(error)


def test_sasl_scram_takes_the_password_file(tmp_path: Path) -> None:
    """SCRAM: user name and the password read from its file; a missing user is named."""
    secret = tmp_path / "password"
    secret.write_text("s3cret\n")
    settings = _settings(
        SECURITY_PROTOCOL="SASL_PLAINTEXT",
        SASL_MECHANISM="SCRAM-SHA-512",
        SASL_USERNAME="worker",
        SASL_PASSWORD_FILE=str(secret),
    )
    config = consumer_config(settings.kafka, settings.kafka_auth)
    assert config["sasl.mechanism"] == "SCRAM-SHA-512"
    assert (config["sasl.username"], config["sasl.password"]) == ("worker", "s3cret")
    error = _error(
        SECURITY_PROTOCOL="SASL_PLAINTEXT", SASL_MECHANISM="PLAIN", SASL_PASSWORD_FILE=str(secret)
    )
    assert error.setting == "WORKER_SASL_USERNAME" and "s3cret" not in error.message


def _jwt(claims: dict[str, object]) -> str:
    def part(data: dict[str, object]) -> str:
        return base64.urlsafe_b64encode(json.dumps(data).encode()).decode().rstrip("=")

    return f"{part({'alg': 'none'})}.{part(claims)}."


def test_oauth_token_file_gives_the_jwt_expiry_and_subject(tmp_path: Path) -> None:
    """OAUTHBEARER from a file: the token as read, with its JWT exp and sub; re-read each time."""
    path = tmp_path / "token"
    path.write_text(_jwt({"sub": "svc", "exp": 2_000_000_000}))
    settings = _settings(
        SECURITY_PROTOCOL="SASL_PLAINTEXT",
        SASL_MECHANISM="OAUTHBEARER",
        SASL_OAUTH_TOKEN_FILE=str(path),
    )
    config = consumer_config(settings.kafka, settings.kafka_auth)
    token, expiry, principal = config["oauth_cb"]("")
    assert token == path.read_text() and expiry == 2_000_000_000.0 and principal == "svc"
    path.write_text("opaque-token")
    token, expiry, principal = oauth_token(settings.kafka_auth, now_s=lambda: 100.0)
    assert (token, expiry) == ("opaque-token", 100.0 + OAUTH_DEFAULT_LIFETIME_S)


def test_oauth_token_command_failure_is_named() -> None:
    """A token command that fails is a ConfigError naming the setting, never the output."""
    settings = _settings(
        SECURITY_PROTOCOL="SASL_PLAINTEXT",
        SASL_MECHANISM="OAUTHBEARER",
        SASL_OAUTH_TOKEN_COMMAND="sh -c 'echo leaked; exit 3'",
    )
    with pytest.raises(ConfigError) as info:
        oauth_token(settings.kafka_auth)
    assert info.value.setting == "WORKER_SASL_OAUTH_TOKEN_COMMAND"
    assert "status 3" in info.value.message and "leaked" not in info.value.message


def test_librdkafka_errors_become_the_edge_error_classes() -> None:
    """Size refusals, rebalance refusals and the rest map to aiokafka's classes."""
    size = confluent_kafka.KafkaError(confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE)
    assert isinstance(from_rd_error(size), MessageSizeTooLargeError)
    fenced = confluent_kafka.KafkaException(
        confluent_kafka.KafkaError(confluent_kafka.KafkaError.REBALANCE_IN_PROGRESS)
    )
    assert isinstance(from_rd_error(fenced), CommitFailedError)
    other = from_rd_error(confluent_kafka.KafkaError(confluent_kafka.KafkaError._TRANSPORT))
    assert isinstance(other, KafkaError) and not isinstance(other, CommitFailedError)
