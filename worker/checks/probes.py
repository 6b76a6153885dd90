"""The probes behind both the start-up gate and the ``check`` command: one way to ask.

Kafka: which topics the worker uses and what it needs on each, and how to read the
operations the broker reports the client may perform (asked through the chosen client's
admin, ``worker.kafka.admin``). Triton: the client built from the settings.
"""

from __future__ import annotations

from typing import NamedTuple

from tritonclient.grpc.aio import InferenceServerClient

from worker.kafka.admin import reason
from worker.settings import Settings
from worker.triton.auth import triton_client_kwargs
from worker.triton.endpoints import EndpointSet, Target, parse_targets

__all__ = [
    "READ",
    "WRITE",
    "Target",
    "TopicUse",
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


def may(operations: int, operation: int) -> bool | None:
    """Whether the bit field allows ``operation``; None when the broker did not say."""
    if operations == _NOT_REPORTED:
        return None
    return bool(operations & (1 << operation))


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
