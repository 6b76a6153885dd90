"""Kafka for the commands beside ``run``: the worker's settings, one first contact, one-line errors.

``produce``, ``topics``, ``tail`` and ``replay`` reach Kafka with the ``WORKER_*``
variables and flags ``run`` takes (bootstrap servers, client id, TLS and SASL, and the
client library, ``WORKER_KAFKA_CLIENT``), read by the same settings machinery, and
require nothing they do not use. Every Kafka client they use is the chosen library's,
built by the Kafka edge (``worker.kafka.edge``). Before any work each one contacts a
bootstrap broker through that client's admin: a certificate or a credential the broker
refuses is a configuration error (exit 2); no broker answering is exit 5. Either is one
line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import sys
from collections.abc import AsyncIterator, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from worker.checks import probes
from worker.errors import ExitCode
from worker.kafka.admin import Admin, Refused, Unanswered
from worker.kafka.edge import open_admin
from worker.kafka.types import KafkaError
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
    "contact",
    "describe",
    "quiet_clients",
    "reach",
    "read_connection",
    "run_command",
    "topic_name",
    "topic_problem",
]

#: The settings that say how to reach Kafka: every command that talks to it takes them.
_CONNECTION_FIELDS = (
    "kafka_client",
    "bootstrap_servers",
    "client_id",
    "linger_ms",
    "compression_type",
)
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
    them) and ``optional`` ones (absent when unset); ConfigError naming the setting (as
    ``run``'s: ``WORKER_KAFKA_CLIENT=confluent`` without the confluent extra installed)."""
    environ = os.environ if env is None else env
    given = [name for name in optional if _given(environ, args, name)]
    values = read_settings(environ, args, _specs([*fields, *given]))
    kafka, auth = KafkaSettings(**values["kafka"]), KafkaAuthSettings(**values["kafka_auth"])
    return Connection(kafka, auth, _flatten(values, [*fields, *given]))


def _given(env: Mapping[str, str], args: argparse.Namespace, field: str) -> bool:
    spec = next(spec for spec in SETTINGS_SPEC if spec.field == field)
    return getattr(args, field, None) is not None or bool(env.get(spec.env, ""))


def _flatten(values: dict[str, dict[str, Any]], fields: Iterable[str]) -> dict[str, Any]:
    flat = {field: value for section in values.values() for field, value in section.items()}
    return {field: flat[field] for field in fields if field in flat}


@contextlib.asynccontextmanager
async def contact(kafka: KafkaSettings, auth: KafkaAuthSettings) -> AsyncIterator[Admin]:
    """The chosen client's admin, a bootstrap broker reached as the clients reach it; closed
    on leaving. What it raises, opening or asked in the block, ends as CommandFailed: CONFIG
    when a TLS or SASL handshake is refused, UNAVAILABLE when no bootstrap broker answers
    (within CONTACT_TIMEOUT_S). ConfigError for a security setting the client cannot use."""
    try:
        admin = await open_admin(kafka, auth, CONTACT_TIMEOUT_S)
    except (Refused, Unanswered) as exc:
        raise _failed(kafka, exc) from None
    try:
        yield admin
    except (Refused, Unanswered) as exc:
        raise _failed(kafka, exc) from None
    finally:
        await admin.close()


def _failed(kafka: KafkaSettings, exc: Refused | Unanswered) -> CommandFailed:
    if isinstance(exc, Refused):  # its message names the setting to check
        return CommandFailed(str(exc), ExitCode.CONFIG)
    message = f"Kafka {kafka.bootstrap_servers} unreachable: {exc}"
    return CommandFailed(message, ExitCode.UNAVAILABLE)


async def describe(admin: Admin, topics: Sequence[str]) -> dict[str, Any]:
    """The Metadata answer for ``topics`` (brokers, and each topic's error code, partitions
    and authorized operations); Unanswered when none comes within CONTACT_TIMEOUT_S."""
    try:
        async with asyncio.timeout(CONTACT_TIMEOUT_S):
            return await admin.describe_topics(topics)
    except TimeoutError:
        raise Unanswered(f"no answer in {CONTACT_TIMEOUT_S:g} s") from None


async def reach(connection: Connection, topics: Sequence[str]) -> dict[str, Any]:
    """Contact a bootstrap broker as the clients will; the Metadata answer for ``topics``.

    Raises CommandFailed: CONFIG when TLS or SASL is refused, UNAVAILABLE when no
    bootstrap broker answers within CONTACT_TIMEOUT_S.
    """
    async with contact(connection.kafka, connection.auth) as admin:
        return await describe(admin, topics)


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


def quiet_clients() -> None:
    """Keep the Kafka clients' own log lines off stderr: the line a command prints says what
    failed, and the clients' retries would repeat it."""
    for name in ("aiokafka", "librdkafka"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def run_command(work: Coroutine[Any, Any, int]) -> int:
    """Run a command's coroutine; its failures end in one line on stderr and their exit code."""
    quiet_clients()
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
