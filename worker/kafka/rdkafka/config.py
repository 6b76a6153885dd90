"""The settings turned into librdkafka configuration (``WORKER_KAFKA_CLIENT=confluent``).

The same settings as for aiokafka, mapped to librdkafka's property names: security
(TLS files, SASL PLAIN/SCRAM, OAUTHBEARER from the token file or command through an
``oauth_cb``), compression, linger, timeouts, client id. A setting librdkafka cannot
honour as asked is refused here, at start-up, with one line naming it. Secrets go
into the configuration handed to librdkafka, never into an error or a log line.
librdkafka's own log lines and errors go to the worker's log (``rdkafka_log``).
"""

from __future__ import annotations

import base64
import json
import shlex
import subprocess
import time
from collections.abc import Callable
from typing import Any

from worker.kafka.options import refuse_tls_files_without_tls, sasl_credentials
from worker.kafka.rdkafka import log as rdkafka_log
from worker.settings import ConfigError, KafkaAuthSettings, KafkaSettings
from worker.settings.secrets import check_file, read_secret

__all__ = [
    "OAUTH_DEFAULT_LIFETIME_S",
    "config_refused",
    "consumer_config",
    "oauth_token",
    "producer_config",
    "security_config",
]

#: Producer batch per partition (as for aiokafka: the default fills after a few results).
_MAX_BATCH_BYTES = 512 * 1024

#: Lifetime given to an OAUTHBEARER token whose ``exp`` cannot be read: librdkafka asks
#: for a new one at 80% of it, so the file is re-read (the command re-run) that often.
OAUTH_DEFAULT_LIFETIME_S = 60.0

#: Bound on one run of WORKER_SASL_OAUTH_TOKEN_COMMAND.
_TOKEN_COMMAND_TIMEOUT_S = 30.0

#: librdkafka's properties set from files the settings name, for its refusals of them.
_FILE_SETTINGS = {
    "ssl.ca.location": "WORKER_SSL_CAFILE",
    "ssl.certificate.location": "WORKER_SSL_CERTFILE",
    "ssl.key.location": "WORKER_SSL_KEYFILE",
}

#: How long librdkafka waits before fetching again for a partition whose prefetch queue was
#: over its bounds (``queued.min.messages``, ``queued.max.messages.kbytes``). Its default,
#: 1 s, outlasts the 1,000-record queue the bounds below leave: a worker draining a
#: backlog consumed the queue in 0.2 s and then stood still for up to 0.9 s, in bursts
#: at twice its average rate (and a SIGKILL in a burst redid twice what the average said).
#: One consume wait (``rdkafka_intake``) instead.
_FETCH_QUEUE_BACKOFF_MS = 20

#: The classic protocol's defaults that the consumer protocol takes from the broker instead.
_SESSION_TIMEOUT_DEFAULT_MS = 10_000


def _jwt_claims(token: str) -> dict[str, Any]:
    """The claims of a JWT (unverified: the broker verifies), or {} for another token."""
    parts = token.split(".")
    if len(parts) != 3:
        return {}
    payload = parts[1] + "=" * (-len(parts[1]) % 4)
    try:
        claims = json.loads(base64.urlsafe_b64decode(payload))
    except (ValueError, UnicodeDecodeError):
        return {}
    return claims if isinstance(claims, dict) else {}


def _run_token_command(command: str) -> str:
    setting = "WORKER_SASL_OAUTH_TOKEN_COMMAND"
    argv = shlex.split(command)
    try:
        done = subprocess.run(
            argv, capture_output=True, timeout=_TOKEN_COMMAND_TIMEOUT_S, check=False
        )
    except OSError as exc:
        raise ConfigError(setting, f"{setting}: cannot run {argv[0]!r}: {exc.strerror}") from None
    except subprocess.TimeoutExpired:
        raise ConfigError(
            setting, f"{setting}: {argv[0]!r} printed no token within {_TOKEN_COMMAND_TIMEOUT_S}s"
        ) from None
    token = done.stdout.decode("utf-8", errors="replace").strip()
    if done.returncode != 0 or not token:
        raise ConfigError(
            setting,
            f"{setting}: {argv[0]!r} exited with status {done.returncode} "
            f"and {'a' if token else 'no'} token",
        )
    return token


def oauth_token(
    auth: KafkaAuthSettings, now_s: Callable[[], float] = time.time
) -> tuple[str, float, str]:
    """A current OAUTHBEARER token, its expiry (epoch seconds) and principal, as
    librdkafka's ``oauth_cb`` returns them. The expiry and principal are the JWT's
    ``exp`` and ``sub`` when the token is a JWT; else a short lifetime, so that a token
    renewed on disk (or by the command) is picked up soon."""
    if auth.sasl_oauth_token_file is not None:
        token = read_secret(auth.sasl_oauth_token_file, "WORKER_SASL_OAUTH_TOKEN_FILE")
    else:
        assert auth.sasl_oauth_token_command is not None
        token = _run_token_command(auth.sasl_oauth_token_command)
    claims = _jwt_claims(token)
    expiry = claims.get("exp")
    if not isinstance(expiry, int | float) or expiry <= now_s():
        expiry = now_s() + OAUTH_DEFAULT_LIFETIME_S
    principal = claims.get("sub")
    return token, float(expiry), principal if isinstance(principal, str) and principal else "worker"


def config_refused(text: str) -> ConfigError:
    """librdkafka refusing to build a client (a PEM file it cannot use), as the setting
    to correct."""
    setting = next((s for p, s in _FILE_SETTINGS.items() if p in text), "WORKER_SSL_CAFILE")
    return ConfigError(setting, f"{setting}: librdkafka cannot use it ({text})")


def security_config(auth: KafkaAuthSettings) -> dict[str, Any]:
    """librdkafka properties for TLS and SASL, for the consumer and every producer."""
    protocol = auth.security_protocol
    config: dict[str, Any] = {"security.protocol": protocol.lower()}
    if protocol in ("SSL", "SASL_SSL"):
        for setting, path, prop in (
            ("WORKER_SSL_CAFILE", auth.ssl_cafile, "ssl.ca.location"),
            ("WORKER_SSL_CERTFILE", auth.ssl_certfile, "ssl.certificate.location"),
            ("WORKER_SSL_KEYFILE", auth.ssl_keyfile, "ssl.key.location"),
        ):
            if path is not None:
                check_file(path, setting)
                config[prop] = path
    else:
        refuse_tls_files_without_tls(auth)
    if not protocol.startswith("SASL_"):
        return config
    mechanism = auth.sasl_mechanism
    assert mechanism is not None  # the settings refuse SASL without a mechanism
    config["sasl.mechanism"] = mechanism
    if mechanism == "OAUTHBEARER":
        if (auth.sasl_oauth_token_file is None) == (auth.sasl_oauth_token_command is None):
            raise ConfigError(
                "WORKER_SASL_OAUTH_TOKEN_FILE",
                "WORKER_SASL_OAUTH_TOKEN_FILE: OAUTHBEARER needs exactly one of "
                "WORKER_SASL_OAUTH_TOKEN_FILE and WORKER_SASL_OAUTH_TOKEN_COMMAND",
            )
        config["oauth_cb"] = lambda _config_str: oauth_token(auth)
        return config
    username, password = sasl_credentials(auth, mechanism)
    config["sasl.username"] = username
    config["sasl.password"] = password
    return config


def consumer_config(kafka: KafkaSettings, auth: KafkaAuthSettings) -> dict[str, Any]:
    """The consumer's properties: no auto-commit, read_committed, the group protocol."""
    config: dict[str, Any] = {
        "bootstrap.servers": kafka.bootstrap_servers,
        "group.id": kafka.group_id,
        "client.id": kafka.client_id,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": kafka.auto_offset_reset,
        "isolation.level": "read_committed",
        "max.poll.interval.ms": kafka.max_poll_interval_ms,
        "group.protocol": kafka.group_protocol,
        # Records of paused partitions stay in Kafka, not in a client-side queue: at
        # most 16 MiB prefetched, and no more than two polls' worth per partition
        # (librdkafka's default, 100,000 per partition, grew the RSS by 40 MiB and
        # more while a backlog drained).
        "queued.max.messages.kbytes": 16 * 1024,
        "queued.min.messages": max(1000, 2 * kafka.max_poll_records),
        "fetch.queue.backoff.ms": _FETCH_QUEUE_BACKOFF_MS,
        **security_config(auth),
        # The consumer runs through confluent-kafka's asyncio API (AIOConsumer).
        **rdkafka_log.callbacks(asyncio_api=True),
    }
    if kafka.group_protocol == "classic":
        if kafka.max_poll_interval_ms < kafka.session_timeout_ms:
            raise ConfigError(
                "WORKER_MAX_POLL_INTERVAL_MS",
                "WORKER_MAX_POLL_INTERVAL_MS: librdkafka needs it at least "
                f"WORKER_SESSION_TIMEOUT_MS ({kafka.session_timeout_ms})",
            )
        # Eager, like aiokafka's default: every partition is revoked, then reassigned.
        config["partition.assignment.strategy"] = "roundrobin"
        config["session.timeout.ms"] = kafka.session_timeout_ms
        config["heartbeat.interval.ms"] = max(100, kafka.session_timeout_ms // 5)
    elif kafka.session_timeout_ms != _SESSION_TIMEOUT_DEFAULT_MS:
        raise ConfigError(
            "WORKER_SESSION_TIMEOUT_MS",
            "WORKER_SESSION_TIMEOUT_MS: the consumer group protocol takes the session timeout "
            "from the broker (group.consumer.session.timeout.ms); leave it unset",
        )
    return config


def producer_config(
    kafka: KafkaSettings, auth: KafkaAuthSettings, *, max_request_bytes: int
) -> dict[str, Any]:
    """An idempotent producer's properties (``acks=all``); ``max_request_bytes`` bounds one
    record, headers included."""
    return {
        "bootstrap.servers": kafka.bootstrap_servers,
        "client.id": kafka.client_id,
        "acks": "all",
        "enable.idempotence": True,
        "linger.ms": kafka.linger_ms,
        "message.max.bytes": max_request_bytes,
        "batch.size": min(_MAX_BATCH_BYTES, max_request_bytes),
        "compression.type": kafka.compression_type,
        **security_config(auth),
        **rdkafka_log.callbacks(),
    }
