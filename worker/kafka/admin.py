"""The broker questions of ``check``, the start-up gate and the commands, on either client.

An ``Admin`` is opened by the Kafka edge (``edge.open_admin``) with the worker's Kafka
settings, TLS and SASL; its answers have one shape on both clients: the Metadata answer
(brokers, cluster id, each topic with its error code, partitions and the operations this
principal may perform as a bit field), the group (error code, state, members,
operations), and the topics created. Opening it either reaches a broker or ends in one
of two errors whose message is the line to print.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from worker.settings import KafkaAuthSettings

__all__ = ["Admin", "Refused", "Unanswered", "reason", "who"]


class Refused(Exception):
    """A broker refused the handshake (TLS, SASL): a setting to fix; the message is the
    line to print, naming it (never a secret)."""


class Unanswered(Exception):
    """No bootstrap broker answered; the message says why."""


class Admin(Protocol):
    """One admin client of the chosen library, a broker reached; ``close`` when done.

    Every call raises ``Refused`` or ``Unanswered`` when the brokers stop answering.
    """

    #: The broker that answered (``Kafka host:port``), or the bootstrap servers.
    where: str

    async def describe_topics(self, topics: Sequence[str]) -> dict[str, Any]:
        """Brokers, cluster id, and each topic's error code, partitions (with their
        leader) and authorized operations; topics are never created by asking."""
        ...

    async def describe_group(self, group_id: str) -> dict[str, Any]:
        """The group's error code, protocol type, state, members and authorized
        operations (retriable errors asked again: the caller bounds the time)."""
        ...

    async def create_topics(
        self, names: Sequence[str], *, partitions: int, replication: int
    ) -> list[tuple[str, int, str | None]]:
        """Create the topics; per topic (name, Kafka error code, message), code 0 when
        created."""
        ...

    async def close(self) -> None:
        """Close the client; its connections are closed when this returns (bounded)."""
        ...


def reason(exc: BaseException) -> str:
    """The first line of an error, named by its type unless the message already is."""
    name = type(exc).__name__
    lines = str(exc).strip().splitlines()
    if not lines:
        return name
    return lines[0] if lines[0].startswith(name) else f"{name}: {lines[0]}"


def who(auth: KafkaAuthSettings) -> str:
    """The principal the worker runs as, as a message names it."""
    if auth.sasl_username:
        return f"user {auth.sasl_username!r}"
    return "the worker's principal"
