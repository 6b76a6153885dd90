"""The broker questions of ``check``, the start-up gate and the commands, on aiokafka.

``AioAdmin`` (``worker.kafka.admin.Admin``): a connection of its own to one broker (TLS
and SASL as the worker's clients do them), FindCoordinator for the group, and Metadata
(v8) and DescribeGroups (v3) requests that also return the operations the client may
perform (aiokafka's admin calls do not ask for them); topics are created through
aiokafka's admin client. A refused handshake is ``Refused`` (its line names the setting),
no broker answering ``Unanswered``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiokafka.conn import create_conn
from aiokafka.errors import (
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
    for_code,
)
from aiokafka.protocol.admin import DescribeGroupsResponse_v3
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.coordination import FindCoordinatorRequest
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String

from worker.flow.retry import Backoff
from worker.kafka.admin import Refused, Unanswered, reason, who
from worker.kafka.aiokafka import clients
from worker.kafka.aiokafka._compat import send_to_some_broker
from worker.kafka.options import kafka_client_kwargs
from worker.settings import KafkaAuthSettings, KafkaSettings

__all__ = [
    "AioAdmin",
    "connect",
    "describe_group_with",
    "describe_topics",
    "describe_topics_through",
    "find_coordinator",
    "retriable",
]

#: Waits between two lookups of a group answered with a retriable error (a fresh cluster
#: still creating its offsets topic).
_RETRY = Backoff(first_s=0.25, max_s=4.0)
#: Bound on waiting for a connection of ours to close.
_CLOSE_S = 2.0


async def connect(
    address: str,
    *,
    client_id: str,
    client_kwargs: Mapping[str, Any],
    request_timeout_ms: int | None = None,
) -> Any:
    """A connection (TLS and SASL done) to one broker ``host:port``; its ``send`` sends a
    request, ``close`` closes it. Raises what the handshake raised (ssl errors,
    SaslAuthenticationFailed, UnsupportedSaslMechanismError, KafkaError, OSError)."""
    host, _, port = address.rpartition(":")
    timeout = {} if request_timeout_ms is None else {"request_timeout_ms": request_timeout_ms}
    return await create_conn(
        host.strip("[]"), int(port), client_id=client_id, **timeout, **client_kwargs
    )


async def find_coordinator(conn: Any, group_id: str) -> tuple[int, str]:
    """The error code of the group's FindCoordinator answer, and its coordinator
    (``host:port``) when the code is 0."""
    found = await conn.send(FindCoordinatorRequest(group_id, 0))
    return int(found.error_code), f"{found.host}:{found.port}"


def retriable(code: int) -> bool:
    """True when Kafka's error ``code`` may go away if asked again."""
    return bool(for_code(code).retriable)


# -- requests asking for authorized operations (aiokafka's admin calls do not) ---------


class _MetadataResponseV8(Response):  # type: ignore[misc]  # aiokafka is untyped
    API_KEY = 3
    API_VERSION = 8
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "brokers",
            Array(
                ("node_id", Int32),
                ("host", String("utf-8")),
                ("port", Int32),
                ("rack", String("utf-8")),
            ),
        ),
        ("cluster_id", String("utf-8")),
        ("controller_id", Int32),
        (
            "topics",
            Array(
                ("error_code", Int16),
                ("topic", String("utf-8")),
                ("is_internal", Boolean),
                (
                    "partitions",
                    Array(
                        ("error_code", Int16),
                        ("partition", Int32),
                        ("leader", Int32),
                        ("leader_epoch", Int32),
                        ("replicas", Array(Int32)),
                        ("isr", Array(Int32)),
                        ("offline_replicas", Array(Int32)),
                    ),
                ),
                ("topic_authorized_operations", Int32),
            ),
        ),
        ("cluster_authorized_operations", Int32),
    )


class _MetadataRequestV8(RequestStruct):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 8
    RESPONSE_TYPE = _MetadataResponseV8
    SCHEMA = Schema(
        ("topics", Array(String("utf-8"))),
        ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
    )


class _TopicPermissionsRequest(Request[_MetadataRequestV8]):  # type: ignore[misc]
    API_KEY = 3

    def __init__(self, topics: Sequence[str]) -> None:
        self._topics = list(topics)

    def build(self, request_struct_class: type[_MetadataRequestV8]) -> _MetadataRequestV8:
        return request_struct_class(self._topics, False, False, True)


class _DescribeGroupsRequestV3(RequestStruct):  # type: ignore[misc]
    # aiokafka's own v3 struct parses the answer as v2, which drops the operations.
    API_KEY = 15
    API_VERSION = 3
    RESPONSE_TYPE = DescribeGroupsResponse_v3
    SCHEMA = Schema(("groups", Array(String("utf-8"))), ("include_authorized_operations", Boolean))


class _GroupPermissionsRequest(Request[_DescribeGroupsRequestV3]):  # type: ignore[misc]
    API_KEY = 15

    def __init__(self, group_id: str) -> None:
        self._group_id = group_id

    def build(
        self, request_struct_class: type[_DescribeGroupsRequestV3]
    ) -> _DescribeGroupsRequestV3:
        return request_struct_class([self._group_id], True)


async def describe_topics(
    send: Callable[[Any], Awaitable[Any]], topics: Sequence[str]
) -> dict[str, Any]:
    """The Metadata answer: brokers, cluster id, and each topic with its error code and the
    client's authorized operations.

    ``send`` sends one request to a broker (a connection's, or a client's to some node).
    Topics are never created by asking.
    """
    response = await send(_TopicPermissionsRequest(sorted(set(topics))))
    answer: dict[str, Any] = response.to_object()
    return answer


async def describe_topics_through(client_owner: Any, topics: Sequence[str]) -> dict[str, Any]:
    """``describe_topics`` sent through a started consumer's (or admin's) client."""
    return await describe_topics(lambda request: send_to_some_broker(client_owner, request), topics)


async def describe_group_with(
    send: Callable[[Any], Awaitable[Any]], group_id: str
) -> dict[str, Any]:
    """The DescribeGroups answer for one group, with the client's authorized operations
    (``send`` sends the request to the group's coordinator)."""
    response = await send(_GroupPermissionsRequest(group_id))
    group: dict[str, Any] = response.to_object()["groups"][0]
    return group


class AioAdmin:
    """The broker questions over a connection of their own (``Admin``)."""

    def __init__(
        self,
        kafka: KafkaSettings,
        auth: KafkaAuthSettings,
        conn: Any,
        address: str,
        timeout_s: float,
    ) -> None:
        self._kafka = kafka
        self._auth = auth
        self._kwargs = kafka_client_kwargs(auth)
        self._conn = conn
        self._timeout_s = timeout_s
        self.where = f"Kafka {address}"
        self._address = address

    @classmethod
    async def open(
        cls, kafka: KafkaSettings, auth: KafkaAuthSettings, timeout_s: float
    ) -> AioAdmin:
        """A connection to the first bootstrap server that takes one (ConfigError when a
        file the settings name cannot be read)."""
        kwargs = kafka_client_kwargs(auth)
        conn, address = await _connect(
            kafka, auth, kafka.bootstrap_servers.split(","), kwargs, timeout_s
        )
        return cls(kafka, auth, conn, address, timeout_s)

    async def describe_topics(self, topics: Sequence[str]) -> dict[str, Any]:
        try:
            return await describe_topics(self._conn.send, topics)
        except (OSError, KafkaError) as exc:
            raise Unanswered(f"{self._address}: {reason(exc)}") from None

    async def describe_group(self, group_id: str) -> dict[str, Any]:
        """The group, asked of its coordinator; retriable errors are asked again."""
        failures = 0
        try:
            while True:
                code, coordinator = await find_coordinator(self._conn, group_id)
                if not code:
                    group = await self._on_coordinator(coordinator, group_id)
                    code = int(group["error_code"])
                    if not code or not retriable(code):
                        return group
                elif not retriable(code):
                    return {"error_code": code, "members": []}
                failures += 1
                await asyncio.sleep(_RETRY.delay_s(failures))
        except (OSError, KafkaError) as exc:
            raise Unanswered(f"{self._address}: {reason(exc)}") from None

    async def _on_coordinator(self, address: str, group_id: str) -> dict[str, Any]:
        conn = self._conn
        if address == f"{conn.host}:{conn.port}":
            return await describe_group_with(conn.send, group_id)
        coordinator, _ = await _connect(
            self._kafka, self._auth, [address], self._kwargs, self._timeout_s
        )
        try:
            return await describe_group_with(coordinator.send, group_id)
        finally:
            await _close(coordinator)

    async def create_topics(
        self, names: Sequence[str], *, partitions: int, replication: int
    ) -> list[tuple[str, int, str | None]]:
        admin = clients.admin(self._kafka, self._kwargs, suffix="topics")
        try:
            await admin.start()
            answers = await clients.create_topics(
                admin, names, partitions=partitions, replication=replication
            )
        except (OSError, KafkaError) as exc:
            raise Unanswered(f"{self._address}: {reason(exc)}") from None
        finally:
            await admin.close()
        return [(str(a[0]), int(a[1]), a[2] if len(a) > 2 else None) for a in answers]

    async def close(self) -> None:
        await _close(self._conn)


async def _close(conn: Any) -> None:
    """Close, and wait (a bounded time) until the socket is: an event loop closed right
    after (``check`` ends) must not find it still open."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(conn.close()), _CLOSE_S)


async def _connect(
    kafka: KafkaSettings,
    auth: KafkaAuthSettings,
    addresses: Sequence[str],
    kwargs: Mapping[str, Any],
    timeout_s: float,
) -> tuple[Any, str]:
    """A connection (authenticated) to the first address that takes one: Refused when a
    handshake is refused, Unanswered when none answers."""
    reasons = []
    for address in addresses:
        try:
            conn = await asyncio.wait_for(
                connect(
                    address,
                    client_id=kafka.client_id,
                    client_kwargs=kwargs,
                    request_timeout_ms=int(timeout_s * 1000),
                ),
                timeout_s,
            )
        except ssl.SSLCertVerificationError as exc:
            raise Refused(
                f"Kafka {address}: TLS certificate not trusted ({exc.verify_message}); "
                "check WORKER_SSL_CAFILE"
            ) from None
        except ssl.SSLError as exc:
            raise Refused(
                f"Kafka {address}: TLS handshake failed ({exc.reason or exc}); "
                "check the WORKER_SSL_* files"
            ) from None
        except SaslAuthenticationFailed as exc:
            raise Refused(
                f"Kafka {address}: SASL {auth.sasl_mechanism} authentication "
                f"failed for {who(auth)}: {exc.args[0] if exc.args else exc}"
            ) from None
        except UnsupportedSaslMechanismError as exc:
            raise Refused(f"Kafka {address}: {exc}; check WORKER_SASL_MECHANISM") from None
        except TimeoutError:
            reasons.append(f"{address}: no answer in {timeout_s:g} s")
            continue
        except (OSError, KafkaError) as exc:
            reasons.append(f"{address}: {reason(exc)}")
            continue
        return conn, address
    raise Unanswered("; ".join(reasons) or "no bootstrap server")
