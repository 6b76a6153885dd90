"""The probes behind both the start-up gate and the ``check`` command: one way to ask.

Kafka: which topics the worker uses and what it needs on each, and Metadata (v8) and
DescribeGroups (v3) requests that also return the operations the client may perform
(aiokafka's admin calls do not ask for them). Triton: the client built from the settings.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple

from aiokafka.protocol.admin import DescribeGroupsResponse_v3
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String
from tritonclient.grpc.aio import InferenceServerClient

from worker.settings import Settings
from worker.triton.auth import triton_client_kwargs
from worker.triton.endpoints import EndpointSet, Target, parse_targets

__all__ = [
    "READ",
    "WRITE",
    "Target",
    "TopicUse",
    "describe_group_with",
    "describe_topics",
    "may",
    "reason",
    "topics_to_check",
    "triton_addresses",
    "triton_client",
]

#: Kafka's AclOperation codes, as bit positions of an "authorized operations" field.
READ, WRITE = 3, 4
#: The field's value when the broker did not report the operations.
_NOT_REPORTED = -(2**31)


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


def may(operations: int, operation: int) -> bool | None:
    """Whether the bit field allows ``operation``; None when the broker did not say."""
    if operations == _NOT_REPORTED:
        return None
    return bool(operations & (1 << operation))


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


class TopicUse(NamedTuple):
    """A topic the worker uses: its row in reports, the operation it needs, its setting."""

    row: str
    topic: str
    operation: int
    setting: str


def topics_to_check(settings: Settings) -> list[TopicUse]:
    """Every topic the worker uses, with what it needs on it."""
    topics, ops = settings.topics, settings.ops
    rows = [
        TopicUse(f"input topic {t}", t, READ, "WORKER_INPUT_TOPICS") for t in topics.input_topics
    ]
    rows.append(
        TopicUse(
            f"output topic {topics.output_topic}", topics.output_topic, WRITE, "WORKER_OUTPUT_TOPIC"
        )
    )
    rows.append(
        TopicUse(
            f"dead-letter topic {topics.dlq_topic}", topics.dlq_topic, WRITE, "WORKER_DLQ_TOPIC"
        )
    )
    if ops.audit in ("topic", "both") and ops.audit_topic is not None:
        rows.append(
            TopicUse(f"audit topic {ops.audit_topic}", ops.audit_topic, WRITE, "WORKER_AUDIT_TOPIC")
        )
    return rows


async def describe_group_with(
    send: Callable[[Any], Awaitable[Any]], group_id: str
) -> dict[str, Any]:
    """The DescribeGroups answer for one group, with the client's authorized operations
    (``send`` sends the request to the group's coordinator)."""
    response = await send(_GroupPermissionsRequest(group_id))
    group: dict[str, Any] = response.to_object()["groups"][0]
    return group


def reason(exc: BaseException) -> str:
    """The first line of an error, named by its type unless the message already is."""
    name = type(exc).__name__
    lines = str(exc).strip().splitlines()
    if not lines:
        return name
    return lines[0] if lines[0].startswith(name) else f"{name}: {lines[0]}"


async def triton_addresses(settings: Settings) -> list[tuple[str, Target]]:
    """Every Triton endpoint the worker would use now (resolved as the worker resolves)."""
    endpoints: EndpointSet[None] = EndpointSet(
        parse_targets(settings.triton.triton_url), lambda _a, _t: None
    )
    return list((await endpoints.addresses()).items())


def triton_client(settings: Settings, address: str, target: Target) -> InferenceServerClient:
    """A client of one Triton endpoint with the worker's TLS settings (the caller closes it)."""
    kwargs = triton_client_kwargs(settings.triton)
    if kwargs.get("ssl") and address != str(target):
        # Dialled by address: the certificate names the host of the target.
        kwargs["channel_args"] = [("grpc.ssl_target_name_override", target.host)]
    return InferenceServerClient(address, **kwargs)
