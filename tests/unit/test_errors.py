"""The error taxonomy: codes, retry flags, and the mapping of gRPC and Triton failures."""

from __future__ import annotations

import grpc  # type: ignore[import-untyped, unused-ignore]
import pytest
from tritonclient.utils import InferenceServerException

from worker import errors
from worker.triton import errors as triton_errors

NON_RETRYABLE = (
    errors.DecodeError,
    errors.InvalidRequest,
    errors.ModelNotFound,
    errors.TooLarge,
    errors.InferenceError,
    errors.RetriesExhausted,
    errors.OutputTooLarge,
    errors.Forbidden,
    errors.BadMagicByte,
    errors.SchemaNotFound,
    errors.SchemaMismatch,
    errors.InternalError,
)
RETRYABLE = (
    errors.TritonUnavailable,
    errors.TritonTimeout,
    errors.TritonOverloaded,
    errors.ModelNotReady,
    errors.RegistryUnavailable,
)


def test_dead_letter_codes_are_the_twelve_non_retryable_ones() -> None:
    """ERROR_CODES lists exactly the codes of the non-retryable errors, in contract order."""
    assert errors.ERROR_CODES == (
        "DECODE_ERROR",
        "INVALID_REQUEST",
        "MODEL_NOT_FOUND",
        "TOO_LARGE",
        "INFERENCE_ERROR",
        "RETRIES_EXHAUSTED",
        "OUTPUT_TOO_LARGE",
        "FORBIDDEN",
        "BAD_MAGIC_BYTE",
        "SCHEMA_NOT_FOUND",
        "SCHEMA_MISMATCH",
        "INTERNAL_ERROR",
    )
    assert tuple(cls.code for cls in NON_RETRYABLE) == errors.ERROR_CODES
    assert not any(cls.retryable for cls in NON_RETRYABLE)


def test_retryable_errors_never_reach_a_dead_letter_code() -> None:
    """Retryable errors are flagged and have codes outside the dead-letter set."""
    assert all(cls.retryable for cls in RETRYABLE)
    assert not {cls.code for cls in RETRYABLE} & set(errors.ERROR_CODES)
    assert errors.TritonUnavailable.code == "TRITON_UNAVAILABLE"


def test_internal_error_names_the_exception_type_and_message() -> None:
    """An unexpected exception becomes INTERNAL_ERROR with its type and message, not retryable."""
    error = errors.InternalError.wrapping(AssertionError("Need at least one: key or value"))
    assert error.code == "INTERNAL_ERROR" and not error.retryable
    assert error.message == "AssertionError: Need at least one: key or value"
    assert errors.InternalError.wrapping(KeyError()).message == "KeyError"


def test_message_is_kept_and_is_the_text() -> None:
    """The message is both an attribute and the exception text."""
    error = errors.InvalidRequest("inputs[1].data: 15 elements, shape [4, 4] needs 16")
    assert error.message == str(error) == "inputs[1].data: 15 elements, shape [4, 4] needs 16"


def test_retries_exhausted_names_the_last_error() -> None:
    """RETRIES_EXHAUSTED says how many attempts and what failed last."""
    error = errors.RetriesExhausted.after(errors.TritonTimeout("deadline of 5000 ms passed"), 3)
    assert error.message == (
        "gave up after 3 attempts; last error TRITON_TIMEOUT: deadline of 5000 ms passed"
    )


#: Triton's text for a step of a sequence it does not hold.
SEQUENCE_GONE = (
    "inference request for sequence 7 to model 'running_sum' must specify the START flag "
    "on the first request of the sequence"
)


@pytest.mark.parametrize(
    ("code", "message", "expected"),
    [
        (None, "connection lost", errors.TritonUnavailable),
        (
            grpc.StatusCode.UNAVAILABLE,
            "failed to connect to all addresses",
            errors.TritonUnavailable,
        ),
        (grpc.StatusCode.UNAVAILABLE, "Exceeds maximum queue size", errors.TritonOverloaded),
        (grpc.StatusCode.UNAVAILABLE, "Request timeout expired", errors.TritonTimeout),
        (
            grpc.StatusCode.UNAVAILABLE,
            "Request for unknown model: 'm' version 1 is not at ready state",
            errors.ModelNotReady,
        ),
        (
            grpc.StatusCode.UNAVAILABLE,
            "Request for unknown model: 'm' is not found",
            errors.ModelNotFound,
        ),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", errors.TritonTimeout),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "too many requests", errors.TritonOverloaded),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "Sent message larger than max (9000000 vs. 4194304)",
            errors.TooLarge,
        ),
        (
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            "Received message larger than max (9000000 vs. 4194304)",
            errors.OutputTooLarge,
        ),
        (grpc.StatusCode.CANCELLED, "Cancelled", errors.TritonUnavailable),
        (grpc.StatusCode.UNKNOWN, "Stream removed", errors.TritonUnavailable),
        (grpc.StatusCode.UNKNOWN, "Exception calling application", errors.InferenceError),
        (
            grpc.StatusCode.NOT_FOUND,
            "Request for unknown model: 'x' is not found",
            errors.ModelNotFound,
        ),
        (
            grpc.StatusCode.NOT_FOUND,
            "Request for unknown model: 'x' has no available versions",
            errors.ModelNotReady,
        ),
        (grpc.StatusCode.INVALID_ARGUMENT, "unexpected shape", errors.InvalidRequest),
        (grpc.StatusCode.PERMISSION_DENIED, "denied", errors.Forbidden),
        (grpc.StatusCode.UNAUTHENTICATED, "no token", errors.Forbidden),
        (grpc.StatusCode.INTERNAL, "model raised", errors.InferenceError),
        (
            grpc.StatusCode.INVALID_ARGUMENT,
            SEQUENCE_GONE,
            errors.SequenceGone,
        ),
        (grpc.StatusCode.UNIMPLEMENTED, "unsupported", errors.InferenceError),
    ],
)
def test_from_grpc(
    code: grpc.StatusCode | None, message: str, expected: type[errors.WorkerError]
) -> None:
    """gRPC statuses map to the error class that decides retrying."""
    error = triton_errors.from_grpc(code, message)
    assert type(error) is expected
    assert message in error.message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Request for unknown model: 'nope' is not found", errors.ModelNotFound),
        ("Request for unknown model: 'm' version 3 is not found", errors.ModelNotFound),
        ("Request for unknown model: 'm' version 1 is not at ready state", errors.ModelNotReady),
        ("Request for unknown model: 'm' has no available versions", errors.ModelNotReady),
        ("model 'm' is not ready", errors.ModelNotReady),
        ("[request id: r-1] Exceeds maximum queue size", errors.TritonOverloaded),
        ("Request timeout expired", errors.TritonTimeout),
        ("Server is stopping", errors.TritonUnavailable),
        (
            "[request id: <id_unknown>] unexpected shape for input 'INPUT0' for model 'simple'. "
            "Expected [-1,16], got [1,15]. ",
            errors.InvalidRequest,
        ),
        (
            "[request id: r] expected 2 inputs but got 1 inputs for model 'simple'. Got input(s) "
            "['INPUT0'], but missing required input(s) ['INPUT1']. Please provide all required "
            "input(s).",
            errors.InvalidRequest,
        ),
        (
            "[request id: r] inference input 'INPUT0' data-type is 'FP32', but model 'simple' "
            "expects 'INT32'",
            errors.InvalidRequest,
        ),
        ("inference request batch-size must be <= 8 for 'simple'", errors.InvalidRequest),
        ("[request id: r] unexpected inference output 'X' for model 'm'", errors.InvalidRequest),
        (
            "Failed to process the request(s) for model 'pyfail_0_0', message: ValueError: boom",
            errors.InferenceError,
        ),
        (
            "Failed to process the request(s) for model 'py_0_0', message: "
            "RuntimeError: cache is not ready",
            errors.InferenceError,
        ),
        ("something nobody has seen before", errors.InferenceError),
        (
            SEQUENCE_GONE,
            errors.SequenceGone,
        ),
    ],
)
def test_from_stream_error(text: str, expected: type[errors.WorkerError]) -> None:
    """Texts Triton puts in a stream response's error_message map conservatively."""
    error = triton_errors.from_stream_error(text)
    assert type(error) is expected
    assert error.message == f"Triton: {text}"


def test_client_errors_map_by_their_status_text() -> None:
    """tritonclient reports statuses as text ("StatusCode.NOT_FOUND"); they map like gRPC's."""
    missing = InferenceServerException("unknown model", status="StatusCode.NOT_FOUND")
    assert type(triton_errors.from_client_error(missing, "model 'm'")) is errors.ModelNotFound
    down = InferenceServerException("failed to connect", status="StatusCode.UNAVAILABLE")
    error = triton_errors.from_client_error(down, "model 'm'")
    assert type(error) is errors.TritonUnavailable and "model 'm'" in error.message
    assert type(triton_errors.from_client_error(InferenceServerException("?"), "x")) is (
        errors.TritonUnavailable
    )
