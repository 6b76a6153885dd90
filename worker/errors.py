"""The error taxonomy: every failure the worker handles has a code and a retry flag.

This module is the only place that decides whether a failure is retryable and
which dead-letter code it carries. Callers raise or receive a `WorkerError`
subclass and look at `retryable`; they never inspect gRPC codes or Triton
error texts themselves.

Non-retryable errors end in a dead letter with their own `code`. Retryable
errors are retried within the record's deadline; when the budget is spent the
record is dead-lettered as `RetriesExhausted`, which names the last error.
"""

from __future__ import annotations

import asyncio
import enum
from typing import ClassVar, Final

import grpc  # type: ignore[import-untyped, unused-ignore]

__all__ = [
    "ERROR_CODES",
    "DecodeError",
    "ExitCode",
    "Fatal",
    "Forbidden",
    "InferenceError",
    "InternalError",
    "InvalidRequest",
    "ModelNotFound",
    "ModelNotReady",
    "OutputTooLarge",
    "PartitionRevoked",
    "RetriesExhausted",
    "TooLarge",
    "TooManyInternalErrors",
    "TritonOverloaded",
    "TritonTimeout",
    "TritonUnavailable",
    "WorkerError",
    "WriteFailed",
    "from_exception",
    "from_grpc",
    "from_stream_error",
]


class WorkerError(Exception):
    """Base of every handled failure; `message` says what is wrong and where."""

    code: ClassVar[str] = "INTERNAL"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


# --- Non-retryable: the record itself is at fault, or Triton refused it for good.


class DecodeError(WorkerError):
    """The value is not decodable, or does not match the request schema."""

    code = "DECODE_ERROR"


class InvalidRequest(WorkerError):
    """The request decodes but is inconsistent, or does not match the model."""

    code = "INVALID_REQUEST"


class ModelNotFound(WorkerError):
    """No model is named, or Triton does not know the named model."""

    code = "MODEL_NOT_FOUND"


class TooLarge(WorkerError):
    """The request is larger than the configured limit."""

    code = "TOO_LARGE"


class InferenceError(WorkerError):
    """Triton or the model rejected the request in a way a retry will not fix."""

    code = "INFERENCE_ERROR"


class RetriesExhausted(WorkerError):
    """A retryable failure persisted until the record's retry budget was spent."""

    code = "RETRIES_EXHAUSTED"

    @classmethod
    def after(cls, last_error: WorkerError, attempts: int) -> RetriesExhausted:
        """Build the error that closes a record after `attempts` failed tries."""
        return cls(f"gave up after {attempts} attempts; last error {last_error.code}: {last_error}")


class OutputTooLarge(WorkerError):
    """The inference result is larger than what can be published."""

    code = "OUTPUT_TOO_LARGE"


class Forbidden(WorkerError):
    """Triton refused the worker's credentials for this request."""

    code = "FORBIDDEN"


class InternalError(WorkerError):
    """A bug met while handling one record: that record is dead-lettered, the worker goes on."""

    code = "INTERNAL_ERROR"

    @classmethod
    def wrapping(cls, exc: BaseException) -> InternalError:
        """The dead letter's error for an unexpected exception: its type and message."""
        text = str(exc)
        return cls(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


# --- Retryable: the record is fine, Triton is not (yet) able to serve it.


class TritonUnavailable(WorkerError):
    """Triton cannot be reached, or the stream carrying the request broke."""

    code = "TRITON_UNAVAILABLE"
    retryable = True


class TritonTimeout(WorkerError):
    """The request did not complete within its deadline."""

    code = "TRITON_TIMEOUT"
    retryable = True


class TritonOverloaded(WorkerError):
    """Triton shed the request because its queues are full."""

    code = "TRITON_OVERLOADED"
    retryable = True


class ModelNotReady(WorkerError):
    """The model exists but is loading, unloading or has no ready version."""

    code = "MODEL_NOT_READY"
    retryable = True


ERROR_CODES: Final[tuple[str, ...]] = (
    DecodeError.code,
    InvalidRequest.code,
    ModelNotFound.code,
    TooLarge.code,
    InferenceError.code,
    RetriesExhausted.code,
    OutputTooLarge.code,
    Forbidden.code,
    InternalError.code,
)
"""The codes a dead letter can carry (retryable errors end as RETRIES_EXHAUSTED)."""


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
_SENT_TOO_LARGE_TEXTS: Final = ("sent message larger than max",)
_RECEIVED_TOO_LARGE_TEXTS: Final = ("received message larger than max",)


def _contains(text: str, needles: tuple[str, ...]) -> bool:
    return any(needle in text for needle in needles)


def from_stream_error(message: str) -> WorkerError:
    """Map the `error_message` of a ModelStreamInferResponse to a WorkerError."""
    text = message.lower()
    detail = f"Triton: {message}"
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


def _status_code_named(name: str | None) -> grpc.StatusCode | None:
    # tritonclient reports statuses as text such as "StatusCode.UNAVAILABLE".
    if not name:
        return None
    member = name.rsplit(".", 1)[-1]
    code: grpc.StatusCode | None = getattr(grpc.StatusCode, member, None)
    return code


def from_exception(exc: BaseException) -> WorkerError:
    """Map an exception raised by the gRPC or tritonclient stack to a WorkerError."""
    if isinstance(exc, WorkerError):
        return exc
    if isinstance(exc, grpc.RpcError):
        code_fn = getattr(exc, "code", None)
        details_fn = getattr(exc, "details", None)
        status_code = code_fn() if callable(code_fn) else None
        details = details_fn() if callable(details_fn) else None
        return from_grpc(status_code, str(details or exc))
    status_fn = getattr(exc, "status", None)
    message_fn = getattr(exc, "message", None)
    if callable(status_fn) and callable(message_fn):
        # tritonclient.utils.InferenceServerException
        return from_grpc(_status_code_named(status_fn()), str(message_fn() or exc))
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return TritonTimeout(f"timed out: {exc}" if str(exc) else "timed out")
    if isinstance(exc, (ConnectionError, OSError, EOFError)):
        return TritonUnavailable(f"{type(exc).__name__}: {exc}")
    return InferenceError(f"{type(exc).__name__}: {exc}")


class ExitCode(enum.IntEnum):
    """The worker's process exit codes."""

    OK = 0
    #: A second signal abandoned in-flight records (they stay uncommitted).
    FORCED = 1
    #: Invalid settings, or a credential, certificate or ACL problem found at start-up.
    CONFIG = 2
    #: An outcome can never be written, or too many records in a row met a bug.
    FATAL = 3


class Fatal(RuntimeError):
    """The worker must stop (exit 3): going on would lose records or dead-letter a topic.

    Not a WorkerError: no dead letter can fix it. The offsets of the records
    concerned are never committed, so nothing is lost.
    """


class WriteFailed(Fatal):
    """An outcome (result, dead letter, audit record) could not be written after every retry."""


class PartitionRevoked(Exception):
    """The partition moved away before the record's outcome was committed; its next owner
    processes the record again. Control flow, not a failure of the record."""


class TooManyInternalErrors(Fatal):
    """So many records in a row met a bug that the worker stops rather than dead-letter them all."""
