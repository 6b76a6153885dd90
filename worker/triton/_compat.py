"""The few private parts of tritonclient the worker relies on, each in one function.

tritonclient's ``stream_infer`` takes dicts of ``InferInput`` (a numpy copy per tensor);
the worker feeds ``ModelInferRequest`` messages straight to the gRPC stub instead, and
uses the client's own message-size limit. Should tritonclient rename these, this is
the only file to change.
"""

from __future__ import annotations

from typing import Any

from tritonclient.grpc import KeepAliveOptions
from tritonclient.grpc._client import MAX_GRPC_MESSAGE_SIZE
from tritonclient.grpc.aio import InferenceServerClient

__all__ = ["channel_args", "grpc_stub"]


def grpc_stub(client: InferenceServerClient) -> Any:
    """The client's ``GRPCInferenceService`` stub (ModelStreamInfer, ModelInfer)."""
    return client._client_stub


def channel_args() -> list[tuple[str, Any]]:
    """tritonclient's own channel options, plus a short reconnect backoff.

    gRPC's default reconnect backoff grows to two minutes: after a long Triton
    outage the channel would wait that long before trying again, keeping the
    worker (and its health probe) down well after Triton is ready. One second
    at most keeps resumption within seconds.
    """
    keepalive = KeepAliveOptions()
    return [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.keepalive_time_ms", keepalive.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", keepalive.keepalive_timeout_ms),
        ("grpc.keepalive_permit_without_calls", keepalive.keepalive_permit_without_calls),
        ("grpc.http2.max_pings_without_data", keepalive.http2_max_pings_without_data),
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
