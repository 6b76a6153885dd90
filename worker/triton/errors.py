"""Triton's failures in the worker's taxonomy: gRPC statuses and tritonserver's error texts.

The only place that reads gRPC status codes and Triton error messages; everything
else sees ``worker.errors`` classes and their ``retryable`` flag.
"""

from __future__ import annotations

from typing import Final

import grpc  # type: ignore[import-untyped, unused-ignore]
from tritonclient.grpc import InferenceServerException

from worker.errors import (
    Forbidden,
    InferenceError,
    InvalidRequest,
    ModelNotFound,
    ModelNotReady,
    OutputTooLarge,
    SequenceGone,
    TooLarge,
    TritonOverloaded,
    TritonTimeout,
    TritonUnavailable,
    WorkerError,
)

__all__ = ["from_client_error", "from_grpc", "from_stream_error"]


# Texts produced by tritonserver (core 2.4x-2.5x). Triton reports errors on a
# ModelStreamInfer stream as plain text without a status code, so the text is
# all there is to go by. Matching is on lower-cased substrings; anything not
# recognised is treated as a permanent inference error.
#
# A backend's report of an exception raised by the model itself; checked first
# so that words inside the model's own message cannot make it look transient.
_MODEL_RAISED_TEXTS: Final = ("failed to process the request(s) for model",)
_OVERLOADED_TEXTS: Final = ("exceeds maximum queue size",)
_TIMEOUT_TEXTS: Final = ("request timeout expired",)
_NOT_READY_TEXTS: Final = (
    "is not at ready state",
    "has no available versions",
    "is not ready",
)
_NOT_FOUND_TEXTS: Final = ("request for unknown model",)
_UNAVAILABLE_TEXTS: Final = (
    "server is stopping",
    "server is not ready",
    "server not ready",
    "stream removed",
    "connection reset",
    "socket closed",
)
_INVALID_TEXTS: Final = (
    "unexpected shape for input",
    "unexpected inference input",
    "unexpected inference output",
    "but missing required input",
    "inputs but got",
    "data-type is",
    "input byte size mismatch",
    "batch-size must be <=",
    "unexpected number of string elements",
    "unexpected explicit tensor data",
)
#: A request of a sequence Triton does not hold (never started, dropped when idle, or lost
#: in a restart): the sequence's state is gone, so no retry can fix it.
_SEQUENCE_GONE_TEXTS: Final = ("must specify the start flag",)
_SENT_TOO_LARGE_TEXTS: Final = ("sent message larger than max",)
_RECEIVED_TOO_LARGE_TEXTS: Final = ("received message larger than max",)


def _contains(text: str, needles: tuple[str, ...]) -> bool:
    return any(needle in text for needle in needles)


def from_stream_error(message: str) -> WorkerError:
    """Map the `error_message` of a ModelStreamInferResponse to a WorkerError."""
    text = message.lower()
    detail = f"Triton: {message}"
    if _contains(text, _SEQUENCE_GONE_TEXTS):
        return SequenceGone(detail)
    if _contains(text, _MODEL_RAISED_TEXTS):
        return InferenceError(detail)
    if _contains(text, _OVERLOADED_TEXTS):
        return TritonOverloaded(detail)
    if _contains(text, _TIMEOUT_TEXTS):
        return TritonTimeout(detail)
    # "Request for unknown model: 'm' version 2 is not at ready state" is a
    # model that exists but is (un)loading: retry. Other unknown-model texts
    # ("... is not found", "... version 3 is not found") are permanent.
    if _contains(text, _UNAVAILABLE_TEXTS):
        return TritonUnavailable(detail)
    if _contains(text, _NOT_READY_TEXTS):
        return ModelNotReady(detail)
    if _contains(text, _NOT_FOUND_TEXTS):
        return ModelNotFound(detail)
    if _contains(text, _SENT_TOO_LARGE_TEXTS):
        return TooLarge(detail)
    if _contains(text, _RECEIVED_TOO_LARGE_TEXTS):
        return OutputTooLarge(detail)
    if _contains(text, _INVALID_TEXTS):
        return InvalidRequest(detail)
    return InferenceError(detail)


def from_grpc(status_code: grpc.StatusCode | None, message: str) -> WorkerError:
    """Map a gRPC status (None: the call or stream failed without one)."""
    detail = f"Triton gRPC {status_code.name if status_code else 'error'}: {message}"
    text = message.lower()
    if status_code is None:
        return TritonUnavailable(detail)
    if _contains(text, _SEQUENCE_GONE_TEXTS):
        return SequenceGone(detail)
    if status_code == grpc.StatusCode.UNAVAILABLE:
        # Triton uses UNAVAILABLE for full queues, queue timeouts and models
        # not ready as well as for a server that cannot be reached.
        if _contains(text, _OVERLOADED_TEXTS):
            return TritonOverloaded(detail)
        if _contains(text, _TIMEOUT_TEXTS):
            return TritonTimeout(detail)
        if _contains(text, _NOT_READY_TEXTS):
            return ModelNotReady(detail)
        if _contains(text, _NOT_FOUND_TEXTS):
            return ModelNotFound(detail)
        return TritonUnavailable(detail)
    if status_code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TritonTimeout(detail)
    if status_code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # gRPC also uses RESOURCE_EXHAUSTED for messages over the size limit,
        # which no retry can fix.
        if _contains(text, _SENT_TOO_LARGE_TEXTS):
            return TooLarge(detail)
        if _contains(text, _RECEIVED_TOO_LARGE_TEXTS):
            return OutputTooLarge(detail)
        return TritonOverloaded(detail)
    if status_code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED):
        return TritonUnavailable(detail)
    if status_code == grpc.StatusCode.UNKNOWN and _contains(text, _UNAVAILABLE_TEXTS):
        return TritonUnavailable(detail)
    if status_code == grpc.StatusCode.NOT_FOUND:
        if _contains(text, _NOT_READY_TEXTS):
            return ModelNotReady(detail)
        return ModelNotFound(detail)
    if status_code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE):
        return InvalidRequest(detail)
    if status_code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
        return Forbidden(detail)
    return InferenceError(detail)


def from_client_error(exc: InferenceServerException, what: str) -> WorkerError:
    """Map a tritonclient exception (its status is text like ``StatusCode.NOT_FOUND``)."""
    status = exc.status() or ""
    code = getattr(grpc.StatusCode, status.removeprefix("StatusCode."), None)
    return from_grpc(code, f"{what}: {exc.message()}")
