"""Kafka for the commands beside ``run``: the worker's settings, one first contact, one-line errors.

``produce``, ``topics`` and ``tail`` reach Kafka with the ``WORKER_*`` variables and
flags ``run`` takes (bootstrap servers, client id, TLS and SASL), read by the same
settings machinery, and require nothing they do not use. They run on aiokafka
whatever ``WORKER_KAFKA_CLIENT`` says. Before any work each one contacts a bootstrap
broker as the worker's clients would: a certificate or a credential the broker refuses
is a configuration error (exit 2); no broker answering is exit 4. Either is one line.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import ssl
import sys
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.checks import probes
from worker.errors import ExitCode
from worker.kafka.aiokafka import admin as broker
from worker.kafka.options import kafka_client_kwargs
from worker.kafka.types import KafkaError, SaslAuthenticationFailed, UnsupportedSaslMechanismError
from worker.settings import (
    SETTINGS_SPEC,
    ConfigError,
    KafkaAuthSettings,
    KafkaSettings,
    SettingSpec,
    add_setting_arguments,
    read_settings,
)
from worker.shutdown import run_interruptible

__all__ = [
    "CommandFailed",
    "Connection",
    "add_connection_arguments",
    "reach",
    "read_connection",
    "run_command",
    "topic_name",
    "topic_problem",
]

#: The settings that say how to reach Kafka: every command that talks to it takes them.
_CONNECTION_FIELDS = ("bootstrap_servers", "client_id", "linger_ms", "compression_type")
#: How long the first contact with a bootstrap broker may take.
CONTACT_TIMEOUT_S = 10.0


class CommandFailed(Exception):
    """The command cannot do what it was asked; the message is one line, ``code`` the exit."""

    def __init__(self, message: str, code: ExitCode) -> None:
        super().__init__(message)
        self.code = code


def _specs(fields: Iterable[str]) -> list[SettingSpec]:
    wanted = set(fields)
    return [
        spec
        for spec in SETTINGS_SPEC
        if spec.section == "kafka_auth" or spec.field in wanted or spec.field in _CONNECTION_FIELDS
    ]


_TOPIC = next(spec.kind for spec in SETTINGS_SPEC if spec.field == "dlq_topic")


def topic_name(text: str) -> str:
    """An argparse ``type``: a valid Kafka topic name."""
    try:
        return str(_TOPIC.parse(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_connection_arguments(parser: argparse.ArgumentParser, *fields: str) -> None:
    """The flags of the Kafka connection settings, and of ``fields`` (e.g. ``dlq_topic``)."""
    add_setting_arguments(parser, _specs(fields))


@dataclass(frozen=True, slots=True)
class Connection:
    """How to reach Kafka, as the worker would, and the other settings a command asked for."""

    kafka: KafkaSettings
    auth: KafkaAuthSettings
    client_kwargs: dict[str, Any]
    values: dict[str, Any]  # field -> value of the other settings read (unset ones absent)

    @property
    def bootstrap_servers(self) -> str:
        """The bootstrap servers, for a client or a message."""
        return self.kafka.bootstrap_servers


def read_connection(
    args: argparse.Namespace,
    fields: Sequence[str] = (),
    *,
    optional: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Connection:
    """The Kafka settings (env, then flags) plus ``fields`` (required as ``run`` requires
    them) and ``optional`` ones (absent when unset); ConfigError naming the setting."""
    environ = os.environ if env is None else env
    given = [name for name in optional if _given(environ, args, name)]
    values = read_settings(environ, args, _specs([*fields, *given]))
    kafka, auth = KafkaSettings(**values["kafka"]), KafkaAuthSettings(**values["kafka_auth"])
    # Unreadable files and missing credentials, before any connection.
    client_kwargs = kafka_client_kwargs(auth)
    return Connection(kafka, auth, client_kwargs, _flatten(values, [*fields, *given]))


def _given(env: Mapping[str, str], args: argparse.Namespace, field: str) -> bool:
    spec = next(spec for spec in SETTINGS_SPEC if spec.field == field)
    return getattr(args, field, None) is not None or bool(env.get(spec.env, ""))


def _flatten(values: dict[str, dict[str, Any]], fields: Iterable[str]) -> dict[str, Any]:
    flat = {field: value for section in values.values() for field, value in section.items()}
    return {field: flat[field] for field in fields if field in flat}


async def reach(connection: Connection, topics: Sequence[str]) -> dict[str, Any]:
    """Contact a bootstrap broker as the clients will; the Metadata answer for ``topics``.

    Raises CommandFailed: CONFIG when TLS or SASL is refused, UNAVAILABLE when no
    bootstrap broker answers within CONTACT_TIMEOUT_S.
    """
    last = "no bootstrap server"
    for address in connection.kafka.bootstrap_servers.split(","):
        try:
            conn = await asyncio.wait_for(
                broker.connect(
                    address,
                    client_id=connection.kafka.client_id,
                    client_kwargs=connection.client_kwargs,
                    request_timeout_ms=int(CONTACT_TIMEOUT_S * 1000),
                ),
                CONTACT_TIMEOUT_S,
            )
        except (ssl.SSLError, SaslAuthenticationFailed) as exc:
            raise CommandFailed(_refusal(connection, address, exc), ExitCode.CONFIG) from None
        except UnsupportedSaslMechanismError as exc:
            message = f"Kafka {address}: {exc}; check WORKER_SASL_MECHANISM"
            raise CommandFailed(message, ExitCode.CONFIG) from None
        except (OSError, KafkaError, TimeoutError) as exc:
            last = probes.reason(exc) if str(exc) else f"no answer in {CONTACT_TIMEOUT_S:g} s"
            continue
        try:
            return await asyncio.wait_for(
                broker.describe_topics(conn.send, topics), CONTACT_TIMEOUT_S
            )
        except (KafkaError, TimeoutError) as exc:
            last = probes.reason(exc) if str(exc) else f"no answer in {CONTACT_TIMEOUT_S:g} s"
        finally:
            conn.close()
    message = f"Kafka {connection.kafka.bootstrap_servers} unreachable: {last}"
    raise CommandFailed(message, ExitCode.UNAVAILABLE)


def _refusal(connection: Connection, address: str, exc: BaseException) -> str:
    where = f"Kafka {address}"
    if isinstance(exc, ssl.SSLCertVerificationError):
        why = exc.verify_message
        return f"{where}: TLS certificate not trusted ({why}); check WORKER_SSL_CAFILE"
    if isinstance(exc, ssl.SSLError):
        return f"{where}: TLS handshake failed ({exc.reason or exc}); check the WORKER_SSL_* files"
    user = connection.auth.sasl_username
    who = f"user {user!r}" if user else "this client"
    detail = exc.args[0] if exc.args else type(exc).__name__
    return (
        f"{where}: SASL {connection.auth.sasl_mechanism} authentication failed for {who}: {detail}"
    )


def topic_problem(metadata: Mapping[str, Any], topic: str, operation: int) -> str | None:
    """Why ``topic`` cannot be used for ``operation`` (probes.READ or WRITE), or None."""
    found = next((t for t in metadata["topics"] if t["topic"] == topic), None)
    code = int(found["error_code"]) if found is not None else 3
    if code == 3:
        return f"topic {topic!r} does not exist (`kafka-triton-worker topics` creates the worker's)"
    if code == 29:
        return f"topic {topic!r}: not authorized to describe it"
    if code:
        return f"topic {topic!r}: Kafka error code {code}"
    assert found is not None
    if probes.may(int(found["topic_authorized_operations"]), operation) is False:
        verb = "read" if operation == probes.READ else "write"
        return f"topic {topic!r}: no {verb} permission"
    return None


def run_command(work: Coroutine[Any, Any, int]) -> int:
    """Run a command's coroutine; its failures end in one line on stderr and their exit code."""
    # The line printed says what failed; aiokafka's own retries would repeat it.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    try:
        return run_interruptible(work)
    except ConfigError as exc:
        return _fail(str(exc), ExitCode.CONFIG)
    except CommandFailed as exc:
        return _fail(str(exc), exc.code)
    except KafkaError as exc:
        return _fail(f"Kafka: {probes.reason(exc)}", ExitCode.INCOMPLETE)


def _fail(message: str, code: ExitCode) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
