"""What Kafka says about the worker's topics and group, asked through the chosen client.

Shared by the start-up gate of ``run`` and by ``check``: one Metadata request with the
operations the worker's principal may perform on each topic, and the group described
(DescribeGroups with its authorized operations; never joined). With aiokafka the
requests go over a connection of its own; with librdkafka through its admin API, with
the worker's own configuration either way.

Every failure to get an answer ends in one line: a refused handshake (a wrong password,
an untrusted certificate) or a listener speaking another security protocol than
``WORKER_SECURITY_PROTOCOL`` is a configuration error (``CannotRun``, exit 2); a
bootstrap server that does not answer is asked again, with backoff, until ``wait_s``
has passed (``KafkaUnavailable``, exit 5). Messages never carry a secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from worker.checks import probes
from worker.checks.listener import Listener, identify, mismatch
from worker.errors import CannotRun, KafkaUnavailable
from worker.flow.retry import Backoff
from worker.kafka.aiokafka import probes as broker
from worker.kafka.edge import uses_librdkafka
from worker.kafka.options import kafka_client_kwargs, sasl_password
from worker.kafka.types import KafkaError, SaslAuthenticationFailed, UnsupportedSaslMechanismError
from worker.settings import Settings

__all__ = ["Findings", "inspect_kafka", "scrub", "who"]

#: Waits between two tries while no bootstrap server answers (or the group's coordinator
#: is not yet available, as on a fresh cluster).
_RETRY = Backoff(first_s=0.25, max_s=4.0)
#: Bound on identifying what a listener speaks, once a client got no answer.
_IDENTIFY_S = 5.0
#: Bound on waiting for a connection of ours to close.
_CLOSE_S = 2.0


class Findings(NamedTuple):
    """What the broker said: ``where`` answered; topics (Metadata) and the group."""

    where: str
    metadata: dict[str, Any]
    group: dict[str, Any]


class _Refused(Exception):
    """A handshake was refused; the message is the line to print."""


class _Unanswered(Exception):
    """No bootstrap server answered the client; the message says why."""


@dataclass
class _Progress:
    """What the current try is waiting for, for the line printed when time runs out."""

    step: str = "connecting"


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` on one line, every secret in it replaced by ``***``."""
    # Belt and braces: no message of ours carries a secret, even if a library echoed one.
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return " ".join(text.split())


def who(settings: Settings) -> str:
    """The principal the worker runs as, as a message names it."""
    if settings.kafka_auth.sasl_username:
        return f"user {settings.kafka_auth.sasl_username!r}"
    return "the worker's principal"


async def inspect_kafka(
    settings: Settings, wait_s: float, on_wait: Callable[[str], None] | None = None
) -> Findings:
    """The worker's topics, with the operations allowed, and its group, as Kafka reports them.

    Raises CannotRun (one line, no secret) on a refused handshake or a security protocol
    the listener does not speak, and KafkaUnavailable once no bootstrap server answered
    for ``wait_s``; ConfigError when a file the settings name cannot be read.
    ``on_wait`` hears why, the first time Kafka is asked again.
    """
    secrets = [str(sasl_password(settings.kafka_auth) or "")]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    failures = 0
    while True:
        progress = _Progress()
        try:
            async with asyncio.timeout(max(deadline - loop.time(), 0.0)):
                return await _ask(settings, progress, deadline)
        except _Refused as exc:
            refused, reason = str(exc), ""
        except _Unanswered as exc:
            refused, reason = "", str(exc)
        except TimeoutError:
            refused, reason = "", f"no answer while {progress.step}"
        reason = await _diagnose(settings, deadline - loop.time(), refused, reason, secrets)
        failures += 1
        delay_s = _RETRY.delay_s(failures)
        if loop.time() + delay_s >= deadline:
            raise KafkaUnavailable(
                scrub(
                    f"Kafka at {settings.kafka.bootstrap_servers} not reachable within "
                    f"{wait_s:g} s ({reason}): check WORKER_BOOTSTRAP_SERVERS, and that the "
                    "brokers run and can be reached from here",
                    secrets,
                )
            )
        if failures == 1 and on_wait is not None:
            on_wait(scrub(reason, secrets))
        await asyncio.sleep(delay_s)


async def _diagnose(
    settings: Settings, remaining_s: float, refused: str, reason: str, secrets: list[str]
) -> str:
    """Raise CannotRun when the listener speaks another protocol, or for a refusal;
    else return why nothing answered."""
    auth = settings.kafka_auth
    addresses = settings.kafka.bootstrap_servers.split(",")
    listener = await identify(addresses, min(_IDENTIFY_S, max(remaining_s, 1.0)))
    if isinstance(listener, Listener):
        line = mismatch(listener, auth.security_protocol, auth.sasl_mechanism)
        if line is not None:
            raise CannotRun(scrub(line, secrets))
    if refused:
        raise CannotRun(scrub(refused, secrets))
    return reason if isinstance(listener, Listener) else str(listener)


async def _ask(settings: Settings, progress: _Progress, deadline: float) -> Findings:
    if uses_librdkafka(settings):
        return await _ask_rdkafka(settings, progress, deadline)
    return await _ask_aiokafka(settings, progress)


# -- aiokafka: requests over a connection of our own ---------------------------------


async def _ask_aiokafka(settings: Settings, progress: _Progress) -> Findings:
    kwargs = kafka_client_kwargs(settings.kafka_auth)
    conn, address = await _connect(settings, settings.kafka.bootstrap_servers.split(","), kwargs)
    try:
        progress.step = "describing the topics"
        topics = [use.topic for use in probes.topics_to_check(settings)]
        metadata = await broker.describe_topics(conn.send, topics)
        progress.step = f"describing consumer group {settings.kafka.group_id!r}"
        group = await _describe_group(conn, settings, kwargs)
    except (OSError, KafkaError) as exc:
        raise _Unanswered(f"{address}: {probes.reason(exc)}") from None
    finally:
        await _close(conn)
    return Findings(f"Kafka {address}", metadata, group)


async def _close(conn: Any) -> None:
    """Close, and wait (a bounded time) until the socket is: an event loop closed right
    after (``check`` ends) must not find it still open."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(conn.close()), _CLOSE_S)


async def _connect(
    settings: Settings, addresses: list[str], kwargs: dict[str, Any]
) -> tuple[Any, str]:
    """A connection (authenticated) to the first address that takes one."""
    reasons = []
    for address in addresses:
        try:
            conn = await broker.connect(
                address, client_id=settings.kafka.client_id, client_kwargs=kwargs
            )
        except ssl.SSLCertVerificationError as exc:
            raise _Refused(
                f"Kafka {address}: TLS certificate not trusted ({exc.verify_message}); "
                "check WORKER_SSL_CAFILE"
            ) from None
        except ssl.SSLError as exc:
            raise _Refused(
                f"Kafka {address}: TLS handshake failed ({exc.reason or exc}); "
                "check the WORKER_SSL_* files"
            ) from None
        except SaslAuthenticationFailed as exc:
            raise _Refused(
                f"Kafka {address}: SASL {settings.kafka_auth.sasl_mechanism} authentication "
                f"failed for {who(settings)}: {exc.args[0] if exc.args else exc}"
            ) from None
        except UnsupportedSaslMechanismError as exc:
            raise _Refused(f"Kafka {address}: {exc}; check WORKER_SASL_MECHANISM") from None
        except (OSError, KafkaError) as exc:
            reasons.append(f"{address}: {probes.reason(exc)}")
            continue
        return conn, address
    raise _Unanswered("; ".join(reasons))


async def _describe_group(conn: Any, settings: Settings, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The group with its authorized operations, asked of its coordinator; retriable
    errors (a fresh cluster still creating its offsets topic) are asked again."""
    group_id = settings.kafka.group_id
    failures = 0
    while True:
        code, coordinator = await broker.find_coordinator(conn, group_id)
        if not code:
            group = await _on_coordinator(conn, coordinator, settings, kwargs)
            code = int(group["error_code"])
            if not code or not broker.retriable(code):
                return group
        elif not broker.retriable(code):
            return {"error_code": code, "members": []}
        failures += 1
        await asyncio.sleep(_RETRY.delay_s(failures))


async def _on_coordinator(
    conn: Any, address: str, settings: Settings, kwargs: dict[str, Any]
) -> dict[str, Any]:
    if address == f"{conn.host}:{conn.port}":
        return await broker.describe_group_with(conn.send, settings.kafka.group_id)
    coordinator, _ = await _connect(settings, [address], kwargs)
    try:
        return await broker.describe_group_with(coordinator.send, settings.kafka.group_id)
    finally:
        await _close(coordinator)


# -- librdkafka: its admin API ---------------------------------------------------------


async def _ask_rdkafka(settings: Settings, progress: _Progress, deadline: float) -> Findings:
    from worker.kafka.rdkafka.admin import KafkaException, RdAdmin, refusal_message

    where = f"Kafka {settings.kafka.bootstrap_servers}"
    remaining_s = max(deadline - asyncio.get_running_loop().time(), 1.0)
    admin = RdAdmin(settings, remaining_s)
    try:
        progress.step = "describing the topics"
        topics = [use.topic for use in probes.topics_to_check(settings)]
        metadata = await admin.describe_topics(topics)
        progress.step = f"describing consumer group {settings.kafka.group_id!r}"
        group = await admin.describe_group(settings.kafka.group_id)
    except KafkaException as exc:
        if admin.refusal is not None:
            mechanism = settings.kafka_auth.sasl_mechanism
            raise _Refused(
                refusal_message(admin.refusal, where, who(settings), mechanism)
            ) from None
        reported = admin.no_answer or (exc.args[0] if exc.args else exc)
        text = reported.str() if hasattr(reported, "str") else str(reported)
        raise _Unanswered(text.split(" (after ", 1)[0]) from None
    finally:
        await admin.close()
    return Findings(where, metadata, group)
