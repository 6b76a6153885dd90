"""Typed wire structures: the JSON request, the JSON result, the dead-letter headers.

The JSON Schemas in `schemas/` are generated from these types
(the project's schema writer rewrites them), so the decoder and the published
contract cannot drift apart. Decoding is lenient about unknown top-level
fields (ignored) and strict about the types of known ones.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal, get_args

import msgspec

from worker.errors import ERROR_CODES, InvalidRequest
from worker.wire.header_schemas import RequestHeaders, ResultHeaders

__all__ = [
    "BINARY_DATA_SIZE",
    "BYTES_ENCODING",
    "DATATYPE_NAMES",
    "FRAMING_PARAMETERS",
    "Datatype",
    "DeadLetterHeaders",
    "InferRequestJSON",
    "InferResponseJSON",
    "ParameterValue",
    "RequestInput",
    "RequestOutput",
    "ResponseOutput",
    "generate_schemas",
    "parameters_to_json",
    "set_parameters",
]

Datatype = Literal[
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BYTES",
]
DATATYPE_NAMES: Final[tuple[str, ...]] = get_args(Datatype)

ParameterValue = bool | int | float | str
Parameters = Annotated[
    dict[str, ParameterValue],
    msgspec.Meta(description="Open Inference Protocol parameters: name to bool, number or string."),
]
TensorName = Annotated[str, msgspec.Meta(min_length=1, description="Tensor name in the model.")]
Shape = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0)]],
    msgspec.Meta(description="Tensor shape; the element count is the product of the dims."),
]
TensorData = Annotated[
    list[Any],
    msgspec.Meta(
        description=(
            "Tensor elements in row-major order, flat or nested consistently with `shape`. "
            "Numbers for numeric datatypes, true/false for BOOL, UTF-8 strings for BYTES."
        )
    ),
]


#: Parameter names of the binary tensor extension and the JSON framing.
BINARY_DATA_SIZE: Final = "binary_data_size"
BYTES_ENCODING: Final = "bytes_encoding"
#: Parameters that only steer the HTTP/JSON framing; Triton must not see them.
FRAMING_PARAMETERS: Final = frozenset({"binary_data_output", "binary_data", BINARY_DATA_SIZE})


class RequestInput(msgspec.Struct, frozen=True, omit_defaults=True):
    """One input tensor. `data` is required unless the binary extension carries it."""

    name: TensorName
    shape: Shape
    datatype: Datatype
    data: TensorData | None = None
    parameters: (
        Annotated[
            dict[str, ParameterValue],
            msgspec.Meta(
                description=(
                    "Input parameters. With content-type application/octet-stream, "
                    "`binary_data_size` (bytes) says the tensor follows the JSON header "
                    "instead of `data`."
                )
            ),
        ]
        | None
    ) = None


class RequestOutput(msgspec.Struct, frozen=True, omit_defaults=True):
    """One requested output; when `outputs` is absent the model returns all outputs."""

    name: TensorName
    parameters: Parameters | None = None


class InferRequestJSON(msgspec.Struct, frozen=True, omit_defaults=True):
    """Open Inference Protocol (KServe v2) inference request.

    The value of a record with content-type application/json (or none), and the
    JSON header of a record using the binary tensor extension
    (application/octet-stream with header inference-header-content-length).
    The model comes from header x-model-name (and x-model-version), else
    `model_name`/`model_version`, else the worker's default model. The request
    id comes from `id`, else header x-request-id, else topic-partition-offset.
    """

    inputs: Annotated[
        list[RequestInput], msgspec.Meta(min_length=1, description="The input tensors.")
    ]
    id: str | None = None
    model_name: str | None = None
    model_version: str | None = None
    parameters: Parameters | None = None
    outputs: list[RequestOutput] | None = None


class ResponseOutput(msgspec.Struct, frozen=True, omit_defaults=True):
    """One output tensor of a result.

    `data` is flat row-major. BYTES elements are UTF-8 strings; when any element
    of a BYTES output is not valid UTF-8, every element of that output is
    base64-encoded and `parameters.bytes_encoding` is "base64". In binary
    results `data` is absent and `parameters.binary_data_size` gives the length
    of the tensor's raw bytes after the JSON header.
    """

    name: str
    shape: Shape
    datatype: Datatype
    data: TensorData | None = None
    parameters: Parameters | None = None


class InferResponseJSON(msgspec.Struct, frozen=True, omit_defaults=True):
    """Open Inference Protocol (KServe v2) inference result.

    Published for JSON requests (content-type application/json), and as the
    JSON header of binary results (application/octet-stream with header
    inference-header-content-length). `id` is the request id. Result headers:
    the request's headers, plus x-request-id, x-model-name, x-model-version,
    x-source-topic, x-source-partition, x-source-offset and content-type.
    """

    id: str
    model_name: str
    model_version: str
    outputs: list[ResponseOutput]
    parameters: Parameters | None = None


def set_parameters(
    target: Any,
    parameters: Mapping[str, ParameterValue] | None,
    where: str,
    skip: Collection[str] = (),
) -> None:
    """Copy JSON parameters into a protobuf map of `InferParameter` (except `skip`)."""
    if not parameters:
        return
    for key, value in parameters.items():
        if key in skip:
            continue
        param = target[key]
        if isinstance(value, bool):
            param.bool_param = value
        elif isinstance(value, int):
            if -(2**63) <= value < 2**63:
                param.int64_param = value
            elif 0 <= value < 2**64:
                param.uint64_param = value
            else:
                raise InvalidRequest(f"{where}.{key}: {value} does not fit in 64 bits")
        elif isinstance(value, float):
            param.double_param = value
        else:
            param.string_param = value


def parameters_to_json(parameters: Any, skip: Collection[str] = ()) -> dict[str, ParameterValue]:
    """JSON values of a protobuf map of `InferParameter` (except `skip`)."""
    result: dict[str, ParameterValue] = {}
    for key, param in parameters.items():
        if key not in skip:
            choice = param.WhichOneof("parameter_choice")
            result[key] = getattr(param, choice) if choice else ""
    return result


_Digits = Annotated[str, msgspec.Meta(pattern=r"^-?[0-9]+$")]
if TYPE_CHECKING:
    _ErrorCode = str
else:
    # The codes come from the error classes; the schema lists them as an enum.
    _ErrorCode = Literal[ERROR_CODES]
_True = Literal["true"]
_Sha256 = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class DeadLetterHeaders(msgspec.Struct, frozen=True):
    """Headers of a dead-letter record, each value a UTF-8 string.

    The record's value and key are the original request's bytes, unchanged.
    The original headers come first, then these (a header of the same name in
    the original is replaced, not duplicated).
    """

    error_code: Annotated[_ErrorCode, msgspec.Meta(description="Why the record failed.")] = (
        msgspec.field(name="x-error-code")
    )
    error_message: Annotated[
        str,
        msgspec.Meta(
            max_length=1024,
            description="What is wrong and where; at most 1 KiB of UTF-8, truncated with '...'.",
        ),
    ] = msgspec.field(name="x-error-message")
    error_retryable: Annotated[
        Literal["true", "false"],
        msgspec.Meta(
            description=(
                "true when the cause was transient (RETRIES_EXHAUSTED): replaying the record "
                "later may succeed; false when the record itself or the model is at fault."
            )
        ),
    ] = msgspec.field(name="x-error-retryable")
    attempts: Annotated[
        _Digits, msgspec.Meta(description="How many times inference was tried (0: never).")
    ] = msgspec.field(name="x-attempts")
    source_topic: Annotated[str, msgspec.Meta(description="Topic of the original record.")] = (
        msgspec.field(name="x-source-topic")
    )
    source_partition: Annotated[
        _Digits, msgspec.Meta(description="Partition of the original record.")
    ] = msgspec.field(name="x-source-partition")
    source_offset: Annotated[
        _Digits, msgspec.Meta(description="Offset of the original record.")
    ] = msgspec.field(name="x-source-offset")
    source_timestamp: Annotated[
        _Digits, msgspec.Meta(description="Timestamp of the original record, ms since epoch.")
    ] = msgspec.field(name="x-source-timestamp")
    consumer_group: Annotated[
        str, msgspec.Meta(description="Consumer group of the worker that gave up.")
    ] = msgspec.field(name="x-consumer-group")
    failed_at: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$",
            description="When the record was dead-lettered, RFC 3339 UTC.",
        ),
    ] = msgspec.field(name="x-failed-at")
    value_omitted: Annotated[
        _True | msgspec.UnsetType,
        msgspec.Meta(
            description=(
                "Present when the dead-letter topic refused the record for its size: the "
                "value is empty; the original stays at x-source-topic/partition/offset."
            )
        ),
    ] = msgspec.field(default=msgspec.UNSET, name="x-value-omitted")
    original_value_bytes: Annotated[
        _Digits | msgspec.UnsetType,
        msgspec.Meta(description="With x-value-omitted: size of the original value."),
    ] = msgspec.field(default=msgspec.UNSET, name="x-original-value-bytes")
    original_value_sha256: Annotated[
        _Sha256 | msgspec.UnsetType,
        msgspec.Meta(description="With x-value-omitted: SHA-256 of the original value, hex."),
    ] = msgspec.field(default=msgspec.UNSET, name="x-original-value-sha256")
    key_omitted: Annotated[
        _True | msgspec.UnsetType,
        msgspec.Meta(description="Present when the key had to be left out too (the key is null)."),
    ] = msgspec.field(default=msgspec.UNSET, name="x-key-omitted")
    original_key_bytes: Annotated[
        _Digits | msgspec.UnsetType,
        msgspec.Meta(description="With x-key-omitted: size of the original key."),
    ] = msgspec.field(default=msgspec.UNSET, name="x-original-key-bytes")
    original_key_sha256: Annotated[
        _Sha256 | msgspec.UnsetType,
        msgspec.Meta(description="With x-key-omitted: SHA-256 of the original key, hex."),
    ] = msgspec.field(default=msgspec.UNSET, name="x-original-key-sha256")
    responses_received: Annotated[
        _Digits | msgspec.UnsetType,
        msgspec.Meta(
            description="A decoupled model's stream that failed: responses received before."
        ),
    ] = msgspec.field(default=msgspec.UNSET, name="x-responses-received")
    responses_published: Annotated[
        _Digits | msgspec.UnsetType,
        msgspec.Meta(
            description=(
                "WORKER_STREAM_OUTPUT=each under at_least_once: results of the stream already "
                "published (x-response-index 0 to this - 1); the request was not retried."
            )
        ),
    ] = msgspec.field(default=msgspec.UNSET, name="x-responses-published")


_SCHEMA_DIALECT: Final = "https://json-schema.org/draft/2020-12/schema"


def _schema(type_: Any, title: str, description: str) -> dict[str, Any]:
    schema: dict[str, Any] = msgspec.json.schema(type_)
    return {"$schema": _SCHEMA_DIALECT, "title": title, "description": description, **schema}


def generate_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schemas of the wire contract, keyed by file name under `schemas/`."""
    return {
        "request.schema.json": _schema(
            InferRequestJSON,
            "Inference request",
            "JSON inference request consumed from the input topics (Open Inference Protocol).",
        ),
        "result.schema.json": _schema(
            InferResponseJSON,
            "Inference result",
            "JSON inference result published to the output topic (Open Inference Protocol).",
        ),
        "request-headers.schema.json": _schema(
            RequestHeaders,
            "Request headers",
            "Headers of a request record that the worker reads, as a JSON object of header "
            "name to UTF-8 value. Other headers are passed through to the result.",
        ),
        "result-headers.schema.json": _schema(
            ResultHeaders,
            "Result headers",
            "Headers of a result record, as a JSON object of header name to UTF-8 value.",
        ),
        "dead-letter.schema.json": _schema(
            DeadLetterHeaders,
            "Dead-letter headers",
            "Headers of a dead-letter record, as a JSON object of header name to UTF-8 value. "
            "The record value is the original request, byte for byte.",
        ),
    }
