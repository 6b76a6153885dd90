"""What Kafka says about the worker's topics and group, asked through the chosen client.

Shared by the start-up gate of ``run`` and by ``check``: one Metadata request with the
operations the worker's principal may perform on each topic, and the group described
(DescribeGroups with its authorized operations; never joined), asked through the chosen
client's admin (``worker.kafka.edge.open_admin``) with the worker's own configuration.

Every failure to get an answer ends in one line: a refused handshake (a wrong password,
an untrusted certificate) or a listener speaking another security protocol than
``WORKER_SECURITY_PROTOCOL`` is a configuration error (``CannotRun``, exit 2); a
bootstrap server that does not answer is asked again, with backoff, until ``wait_s``
has passed (``KafkaUnavailable``, exit 5). Messages never carry a secret.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from worker.checks import probes
from worker.checks.listener import Listener, identify, mismatch
from worker.errors import CannotRun, KafkaUnavailable
from worker.flow.retry import Backoff
from worker.kafka import admin
from worker.kafka.admin import Refused, Unanswered
from worker.kafka.edge import open_admin
from worker.kafka.options import sasl_password
from worker.settings import Settings

__all__ = ["Findings", "inspect_kafka", "scrub", "who"]

#: Waits between two tries while no bootstrap server answers (or the group's coordinator
#: is not yet available, as on a fresh cluster).
_RETRY = Backoff(first_s=0.25, max_s=4.0)
#: Bound on identifying what a listener speaks, once a client got no answer.
_IDENTIFY_S = 5.0


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
    return admin.who(settings.kafka_auth)


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
    remaining_s = max(deadline - asyncio.get_running_loop().time(), 1.0)
    try:
        admin = await open_admin(settings.kafka, settings.kafka_auth, remaining_s)
    except Refused as exc:
        raise _Refused(str(exc)) from None
    except Unanswered as exc:
        raise _Unanswered(str(exc)) from None
    try:
        progress.step = "describing the topics"
        topics = [use.topic for use in probes.topics_to_check(settings)]
        metadata = await admin.describe_topics(topics)
        progress.step = f"describing consumer group {settings.kafka.group_id!r}"
        group = await admin.describe_group(settings.kafka.group_id)
    except Refused as exc:
        raise _Refused(str(exc)) from None
    except Unanswered as exc:
        raise _Unanswered(str(exc)) from None
    finally:
        await admin.close()
    return Findings(admin.where, metadata, group)
