"""The broker questions of ``check``, the start-up gate and the commands, on aiokafka.

A connection of their own to one broker (TLS and SASL as the worker's clients do them),
FindCoordinator for the group, and Metadata (v8) and DescribeGroups (v3) requests that
also return the operations the client may perform (aiokafka's admin calls do not ask for
them), sent over such a connection or through a started client. The errors the callers
tell apart when a connection fails come from ``worker.kafka.types``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from aiokafka.conn import create_conn
from aiokafka.errors import for_code
from aiokafka.protocol.admin import DescribeGroupsResponse_v3
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.coordination import FindCoordinatorRequest
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String

from worker.kafka.aiokafka._compat import send_to_some_broker

__all__ = [
    "connect",
    "describe_group_with",
    "describe_topics",
    "describe_topics_through",
    "find_coordinator",
    "retriable",
]


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
