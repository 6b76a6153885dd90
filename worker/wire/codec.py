"""Record bytes and headers to a Triton request, and a Triton response to result bytes.

Every request, whatever its encoding, becomes a Triton
`ModelInferRequest` with one little-endian blob per input in
`raw_input_contents`, so everything downstream handles a single form:

- JSON (content-type absent or application/json): typed decoding with msgspec,
  then each input's data is validated and packed with numpy;
- binary extension (application/octet-stream + inference-header-content-length):
  the JSON header as above, the tensors sliced straight out of the value;
- protobuf (application/x-protobuf): parsed as is; typed `contents` are
  converted to raw.

Results use the request's encoding family. Header builders for results and
dead letters live here too, so all wire names are in one place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final, Literal

import msgspec
import orjson
from google.protobuf.message import (  # type: ignore[import-untyped, unused-ignore]
    DecodeError as ProtobufDecodeError,
)
from tritonclient.grpc import service_pb2

from worker.errors import (
    DecodeError,
    InferenceError,
    InvalidRequest,
    ModelNotFound,
    OutputTooLarge,
    RetriesExhausted,
    TooLarge,
    WorkerError,
)
from worker.wire import tensors
from worker.wire.messages import (
    InferRequestJSON,
    RequestInput,
    parameters_to_json,
    set_parameters,
)

__all__ = [
    "CONTENT_TYPE",
    "CONTENT_TYPE_BINARY",
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_PROTOBUF",
    "INFERENCE_HEADER_CONTENT_LENGTH",
    "DecodedRequest",
    "Encoding",
    "Headers",
    "dead_letter_headers",
    "decode_request",
    "encode_result",
    "header_value",
    "result_headers",
]

#: Kafka record headers; a header's value may be null.
Headers = Sequence[tuple[str, bytes | None]]
Encoding = Literal["json", "binary", "protobuf"]

CONTENT_TYPE: Final = "content-type"
INFERENCE_HEADER_CONTENT_LENGTH: Final = "inference-header-content-length"
X_MODEL_NAME: Final = "x-model-name"
X_MODEL_VERSION: Final = "x-model-version"
X_REQUEST_ID: Final = "x-request-id"
X_SOURCE_TOPIC: Final = "x-source-topic"
X_SOURCE_PARTITION: Final = "x-source-partition"
X_SOURCE_OFFSET: Final = "x-source-offset"
X_SOURCE_TIMESTAMP: Final = "x-source-timestamp"
X_ERROR_CODE: Final = "x-error-code"
X_ERROR_MESSAGE: Final = "x-error-message"
X_ERROR_RETRYABLE: Final = "x-error-retryable"
X_ATTEMPTS: Final = "x-attempts"
X_CONSUMER_GROUP: Final = "x-consumer-group"
X_FAILED_AT: Final = "x-failed-at"

CONTENT_TYPE_JSON: Final = "application/json"
CONTENT_TYPE_BINARY: Final = "application/octet-stream"
CONTENT_TYPE_PROTOBUF: Final = "application/x-protobuf"
_CONTENT_TYPES: Final[dict[str, Encoding]] = {
    CONTENT_TYPE_JSON: "json",
    CONTENT_TYPE_BINARY: "binary",
    CONTENT_TYPE_PROTOBUF: "protobuf",
    "application/protobuf": "protobuf",
}
_RESULT_CONTENT_TYPES: Final[dict[Encoding, bytes]] = {
    "json": CONTENT_TYPE_JSON.encode(),
    "binary": CONTENT_TYPE_BINARY.encode(),
    "protobuf": CONTENT_TYPE_PROTOBUF.encode(),
}

MAX_ERROR_MESSAGE_BYTES: Final = 1024
BINARY_DATA_SIZE: Final = "binary_data_size"
BYTES_ENCODING: Final = "bytes_encoding"
# Parameters that only steer the HTTP/JSON framing; Triton must not see them.
_FRAMING_PARAMETERS: Final = frozenset({"binary_data_output", "binary_data", BINARY_DATA_SIZE})
# Triton marks the last response of a stream with this; it is not part of a result.
_STREAM_PARAMETERS: Final = frozenset({"triton_final_response"})

_request_decoder: Final = msgspec.json.Decoder(InferRequestJSON)
_UTF8_BOM: Final = b"\xef\xbb\xbf"


@dataclass(slots=True)
class DecodedRequest:
    """A request ready for Triton, and what is needed to shape its result.

    `payload_bytes` is the size of the record value.
    """

    request_id: str
    model_name: str
    model_version: str
    encoding: Encoding
    infer_request: Any  # service_pb2.ModelInferRequest
    binary_outputs: bool
    payload_bytes: int


def header_value(headers: Headers, name: str) -> bytes | None:
    """Value of the last header called `name` (case-insensitive), or None."""
    wanted = name.lower()
    found: bytes | None = None
    for key, value in headers:
        if key.lower() == wanted:
            found = value
    return found


def _header_text(headers: Headers, name: str) -> str | None:
    raw = header_value(headers, name)
    if raw is None:
        return None
    try:
        return bytes(raw).decode().strip()
    except UnicodeDecodeError:
        raise DecodeError(f"header {name}: value is not valid UTF-8") from None


def _encoding_of(headers: Headers) -> Encoding:
    content_type = _header_text(headers, CONTENT_TYPE)
    if not content_type:
        return "json"
    media_type = content_type.split(";", 1)[0].strip().lower()
    encoding = _CONTENT_TYPES.get(media_type)
    if encoding is None:
        raise DecodeError(
            f"header content-type: {content_type!r} is not supported; use {CONTENT_TYPE_JSON}, "
            f"{CONTENT_TYPE_BINARY} with {INFERENCE_HEADER_CONTENT_LENGTH}, "
            f"or {CONTENT_TYPE_PROTOBUF}"
        )
    return encoding


def _decode_json(value: bytes | memoryview, what: str) -> InferRequestJSON:
    try:
        return _request_decoder.decode(value)
    except msgspec.ValidationError as error:
        raise DecodeError(f"{what} does not match the request schema: {error}") from None
    except msgspec.DecodeError as error:
        raise DecodeError(f"{what} is not valid JSON: {error}") from None


def _binary_data_size(spec: RequestInput, where: str) -> int | None:
    if not spec.parameters or BINARY_DATA_SIZE not in spec.parameters:
        return None
    size = spec.parameters[BINARY_DATA_SIZE]
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise DecodeError(
            f"{where}.parameters.{BINARY_DATA_SIZE}: expected a byte count, got {size!r}"
        )
    return size


def _from_json(
    body: InferRequestJSON, value: bytes, binary_start: int | None, limits: tensors.TensorLimits
) -> tuple[Any, int]:
    """Build the ModelInferRequest; return it and the total raw tensor bytes."""
    request = service_pb2.ModelInferRequest()
    sizes: list[int | None] = []
    for i, spec in enumerate(body.inputs):
        size = _binary_data_size(spec, f"inputs[{i}]")
        if size is not None and binary_start is None:
            raise DecodeError(
                f"inputs[{i}].parameters.{BINARY_DATA_SIZE}: binary data needs content-type "
                f"{CONTENT_TYPE_BINARY} and header {INFERENCE_HEADER_CONTENT_LENGTH}"
            )
        sizes.append(size)
    if binary_start is not None:
        declared = sum(size for size in sizes if size is not None)
        remaining = len(value) - binary_start
        if declared != remaining:
            raise DecodeError(
                f"binary tensors: inputs declare {BINARY_DATA_SIZE} totalling {declared} bytes, "
                f"but {remaining} bytes follow the {binary_start}-byte JSON header"
            )
    position = binary_start or 0
    seen: set[str] = set()
    total_bytes = 0
    for i, (spec, size) in enumerate(zip(body.inputs, sizes, strict=True)):
        where = f"inputs[{i}]"
        if spec.name in seen:
            raise InvalidRequest(f"{where}.name: input {spec.name!r} is given more than once")
        seen.add(spec.name)
        # Limits first: the claimed shape and the bytes present, before any copy.
        limits.check(spec.datatype, spec.shape, where, size)
        if size is not None:
            if spec.data is not None:
                raise DecodeError(f"{where}: has both data and {BINARY_DATA_SIZE}")
            raw = value[position : position + size]
            position += size
            tensors.validate_raw(spec.datatype, spec.shape, raw, where)
        elif spec.data is None:
            raise DecodeError(f"{where}: no data (and no {BINARY_DATA_SIZE})")
        else:
            raw = tensors.json_to_raw(spec.datatype, spec.shape, spec.data, where)
            limits.check(spec.datatype, spec.shape, where, len(raw))
        tensor = request.inputs.add()
        tensor.name = spec.name
        tensor.datatype = spec.datatype
        tensor.shape.extend(spec.shape)
        set_parameters(
            tensor.parameters, spec.parameters, f"{where}.parameters", _FRAMING_PARAMETERS
        )
        request.raw_input_contents.append(raw)
        total_bytes += len(raw)
    for i, output in enumerate(body.outputs or ()):
        requested = request.outputs.add()
        requested.name = output.name
        set_parameters(
            requested.parameters, output.parameters, f"outputs[{i}].parameters", _FRAMING_PARAMETERS
        )
    set_parameters(request.parameters, body.parameters, "parameters", _FRAMING_PARAMETERS)
    return request, total_bytes


def _binary_header_length(headers: Headers, value: bytes) -> int:
    text = _header_text(headers, INFERENCE_HEADER_CONTENT_LENGTH)
    if text is None:
        raise DecodeError(
            f"content-type {CONTENT_TYPE_BINARY} needs header {INFERENCE_HEADER_CONTENT_LENGTH} "
            "(the length of the JSON header in bytes)"
        )
    if not text.isdigit():
        raise DecodeError(f"header {INFERENCE_HEADER_CONTENT_LENGTH}: {text!r} is not a byte count")
    length = int(text)
    if length > len(value):
        raise DecodeError(
            f"header {INFERENCE_HEADER_CONTENT_LENGTH}: {length} is past the end of the "
            f"value ({len(value)} bytes)"
        )
    return length


def _from_protobuf(value: bytes, limits: tensors.TensorLimits) -> tuple[Any, int]:
    request = service_pb2.ModelInferRequest()
    try:
        request.ParseFromString(value)
    except (ProtobufDecodeError, RuntimeWarning) as error:
        raise DecodeError(
            f"value is not a serialized inference.ModelInferRequest: {error}"
        ) from None
    if not request.inputs:
        # Garbage can parse as an empty message; no request has zero inputs.
        raise DecodeError("inputs: none given; a request needs at least one input")
    raw_count = len(request.raw_input_contents)
    if raw_count and raw_count != len(request.inputs):
        raise DecodeError(
            f"raw_input_contents: {raw_count} entries for {len(request.inputs)} inputs; "
            "give one per input, or use typed contents for all"
        )
    seen: set[str] = set()
    converted: list[bytes] = []
    for i, tensor in enumerate(request.inputs):
        where = f"inputs[{i}]"
        if not tensor.name:
            raise DecodeError(f"{where}.name: empty")
        if tensor.name in seen:
            raise InvalidRequest(f"{where}.name: input {tensor.name!r} is given more than once")
        seen.add(tensor.name)
        limits.check(
            tensor.datatype,
            tensor.shape,
            where,
            len(request.raw_input_contents[i]) if raw_count else None,
        )
        if raw_count:
            if tensor.HasField("contents"):
                raise DecodeError(f"{where}.contents: mixed with raw_input_contents; use one form")
            tensors.validate_raw(
                tensor.datatype, tensor.shape, request.raw_input_contents[i], where
            )
        else:
            converted.append(
                tensors.contents_to_raw(tensor.datatype, tensor.shape, tensor.contents, where)
            )
            tensor.ClearField("contents")
    if converted:
        request.raw_input_contents.extend(converted)
    total_bytes = sum(len(raw) for raw in request.raw_input_contents)
    return request, total_bytes


def _choose_model(
    headers: Headers, body_name: str, body_version: str, default_model: str | None
) -> tuple[str, str]:
    header_name = _header_text(headers, X_MODEL_NAME) or ""
    header_version = _header_text(headers, X_MODEL_VERSION) or ""
    if header_name:
        name = header_name
        # The body's version belongs to the body's model: drop it when the
        # header names another one.
        version = header_version or (body_version if body_name in ("", header_name) else "")
    elif body_name:
        name, version = body_name, header_version or body_version
    elif default_model:
        name, version = default_model, header_version or body_version
    else:
        raise ModelNotFound(
            "no model named: set header x-model-name, body model_name, or WORKER_DEFAULT_MODEL"
        )
    if version and not version.isdigit():
        raise InvalidRequest(f"model version {version!r} of {name!r} is not a version number")
    return name, version


def decode_request(
    value: bytes | None,
    headers: Headers,
    *,
    topic: str,
    partition: int,
    offset: int,
    default_model: str | None,
    max_request_bytes: int,
    max_tensor_elements: int | None = None,
    max_tensor_bytes: int | None = None,
) -> DecodedRequest:
    """Decode a record into a Triton request; raise a WorkerError saying what is wrong.

    The size limit is checked before any parsing, and again on the decoded
    tensors (JSON numbers can expand several times in binary form). Each input
    tensor is held to ``max_tensor_elements`` and ``max_tensor_bytes`` (TooLarge)
    from its claimed shape and its data, before its buffer is built.
    """
    limits = tensors.TensorLimits(max_tensor_elements, max_tensor_bytes)
    if value is None:
        raise DecodeError("record value is null (a tombstone); expected an inference request")
    value = bytes(value)
    if len(value) > max_request_bytes:
        raise TooLarge(
            f"record value is {len(value)} bytes, over the {max_request_bytes}-byte limit"
        )
    encoding = _encoding_of(headers)
    body_id = body_name = body_version = ""
    if encoding == "protobuf":
        request, tensor_bytes = _from_protobuf(value, limits)
        body_id, body_name, body_version = request.id, request.model_name, request.model_version
    else:
        header_end: int | None = None
        json_part: bytes | memoryview = value
        if encoding == "json" and value.startswith(_UTF8_BOM):
            # RFC 8259 lets a parser ignore a byte order mark; some Windows tools write one.
            json_part = memoryview(value)[len(_UTF8_BOM) :]
        if encoding == "binary":
            header_end = _binary_header_length(headers, value)
            json_part = memoryview(value)[:header_end]
        body = _decode_json(json_part, "JSON header" if header_end is not None else "request body")
        request, tensor_bytes = _from_json(body, value, header_end, limits)
        body_id = body.id or ""
        body_name, body_version = body.model_name or "", body.model_version or ""
    if tensor_bytes > max_request_bytes:
        raise TooLarge(
            f"decoded tensors are {tensor_bytes} bytes, over the {max_request_bytes}-byte limit"
        )
    model_name, model_version = _choose_model(headers, body_name, body_version, default_model)
    request.model_name = model_name
    request.model_version = model_version
    request.id = ""
    request_id = body_id or _header_text(headers, X_REQUEST_ID) or f"{topic}-{partition}-{offset}"
    return DecodedRequest(
        request_id=request_id,
        model_name=model_name,
        model_version=model_version,
        encoding=encoding,
        infer_request=request,
        binary_outputs=encoding == "binary",
        payload_bytes=len(value),
    )


def _response_tensors(response: Any) -> list[tuple[Any, bytes]]:
    outputs = response.outputs
    raws = response.raw_output_contents
    if len(raws) == len(outputs):
        return list(zip(outputs, raws, strict=True))
    if not raws:
        return [
            (out, tensors.contents_to_raw(out.datatype, out.shape, out.contents, f"outputs[{i}]"))
            for i, out in enumerate(outputs)
        ]
    raise InferenceError(
        f"Triton response has {len(outputs)} outputs but {len(raws)} raw_output_contents"
    )


def _encode_json(request: DecodedRequest, response: Any, pairs: list[tuple[Any, bytes]]) -> bytes:
    outputs = []
    for i, (out, raw) in enumerate(pairs):
        data, base64_used = tensors.raw_to_json_array(out.datatype, out.shape, raw, f"outputs[{i}]")
        entry: dict[str, Any] = {
            "name": out.name,
            "shape": list(out.shape),
            "datatype": out.datatype,
            "data": data,
        }
        params = parameters_to_json(out.parameters, _STREAM_PARAMETERS)
        if base64_used:
            params[BYTES_ENCODING] = "base64"
        if params:
            entry["parameters"] = params
        outputs.append(entry)
    document = _result_document(request, response, outputs)
    return orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)


def _result_document(
    request: DecodedRequest, response: Any, outputs: list[dict[str, Any]]
) -> dict[str, Any]:
    document: dict[str, Any] = {
        "id": request.request_id,
        "model_name": response.model_name or request.model_name,
        "model_version": response.model_version or request.model_version,
        "outputs": outputs,
    }
    params = parameters_to_json(response.parameters, _STREAM_PARAMETERS)
    if params:
        document["parameters"] = params
    return document


def _encode_binary(
    request: DecodedRequest, response: Any, pairs: list[tuple[Any, bytes]]
) -> tuple[bytes, int]:
    outputs = []
    for i, (out, raw) in enumerate(pairs):
        tensors.validate_raw(out.datatype, out.shape, raw, f"outputs[{i}]")
        params = parameters_to_json(out.parameters, _STREAM_PARAMETERS)
        params[BINARY_DATA_SIZE] = len(raw)
        outputs.append(
            {
                "name": out.name,
                "shape": list(out.shape),
                "datatype": out.datatype,
                "parameters": params,
            }
        )
    header = orjson.dumps(_result_document(request, response, outputs))
    return b"".join([header, *(raw for _, raw in pairs)]), len(header)


def encode_result(
    request: DecodedRequest, response: Any, *, max_result_bytes: int | None = None
) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Encode a ModelInferResponse in the request's encoding family.

    Returns the value and the encoding's headers (content-type, and
    inference-header-content-length for binary results). For protobuf the
    response is updated in place (`id` set to the request id). Raises
    InferenceError if the response is malformed, OutputTooLarge over
    `max_result_bytes`.
    """
    encoding_headers: list[tuple[str, bytes]] = [
        (CONTENT_TYPE, _RESULT_CONTENT_TYPES[request.encoding])
    ]
    try:
        if request.encoding == "protobuf":
            response.id = request.request_id
            for key in _STREAM_PARAMETERS:
                if key in response.parameters:
                    del response.parameters[key]
            value: bytes = response.SerializeToString()
        else:
            pairs = _response_tensors(response)
            if request.binary_outputs:
                value, header_length = _encode_binary(request, response, pairs)
                encoding_headers.append(
                    (INFERENCE_HEADER_CONTENT_LENGTH, str(header_length).encode())
                )
            else:
                value = _encode_json(request, response, pairs)
    except (InferenceError, OutputTooLarge):
        raise
    except WorkerError as error:
        raise InferenceError(f"Triton response {error.message}") from None
    if max_result_bytes is not None and len(value) > max_result_bytes:
        raise OutputTooLarge(
            f"result of model {request.model_name!r} is {len(value)} bytes, "
            f"over the {max_result_bytes}-byte limit"
        )
    return value, encoding_headers


def _merge_headers(
    original: Headers, added: list[tuple[str, bytes]], also_drop: frozenset[str] = frozenset()
) -> list[tuple[str, bytes | None]]:
    # The worker's value wins: originals of the same name are dropped, not duplicated.
    # Null values and repeated names among the others pass through as they came.
    replaced = {name for name, _ in added} | also_drop
    kept: list[tuple[str, bytes | None]] = [
        (name, None if value is None else bytes(value))
        for name, value in original
        if name.lower() not in replaced
    ]
    return [*kept, *added]


def result_headers(
    request_headers: Headers,
    request: DecodedRequest,
    encoding_headers: Sequence[tuple[str, bytes]],
    *,
    topic: str,
    partition: int,
    offset: int,
    served_model_version: str = "",
) -> list[tuple[str, bytes | None]]:
    """Headers of a result: the request's, then the worker's (which replace same names).

    `served_model_version` is the version Triton reports having used, when known.
    """
    added = [
        (X_REQUEST_ID, request.request_id.encode()),
        (X_MODEL_NAME, request.model_name.encode()),
        (X_MODEL_VERSION, (served_model_version or request.model_version).encode()),
        (X_SOURCE_TOPIC, topic.encode()),
        (X_SOURCE_PARTITION, str(partition).encode()),
        (X_SOURCE_OFFSET, str(offset).encode()),
        *((name.lower(), bytes(value)) for name, value in encoding_headers),
    ]
    # A request's binary header length never describes the result.
    return _merge_headers(request_headers, added, frozenset({INFERENCE_HEADER_CONTENT_LENGTH}))


def truncate_utf8(text: str, max_bytes: int = MAX_ERROR_MESSAGE_BYTES) -> bytes:
    """UTF-8 of `text`, cut to at most `max_bytes` on a character boundary, marked '...'."""
    encoded = text.encode("utf-8", errors="replace")
    if len(encoded) <= max_bytes:
        return encoded
    marker = b"..."
    head = encoded[: max_bytes - len(marker)].decode("utf-8", errors="ignore")
    return head.encode() + marker


def rfc3339_utc(moment: datetime) -> str:
    """`moment` as RFC 3339 UTC with milliseconds, e.g. 2024-05-01T12:00:00.000Z."""
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def dead_letter_headers(
    original_headers: Headers,
    error: WorkerError,
    *,
    attempts: int,
    topic: str,
    partition: int,
    offset: int,
    timestamp_ms: int,
    group_id: str,
    failed_at: datetime,
) -> list[tuple[str, bytes | None]]:
    """Headers of a dead letter: the original ones first, then the explanation.

    A retryable error is reported as RETRIES_EXHAUSTED naming it, so that
    x-error-code is always one of the dead-letter codes. x-error-retryable
    tells whether the cause was transient, i.e. whether replaying the record
    later may succeed: true exactly for RETRIES_EXHAUSTED.
    """
    if error.retryable:
        error = RetriesExhausted.after(error, attempts)
    transient = isinstance(error, RetriesExhausted)
    added = [
        (X_ERROR_CODE, error.code.encode()),
        (X_ERROR_MESSAGE, truncate_utf8(error.message)),
        (X_ERROR_RETRYABLE, b"true" if transient else b"false"),
        (X_ATTEMPTS, str(attempts).encode()),
        (X_SOURCE_TOPIC, topic.encode()),
        (X_SOURCE_PARTITION, str(partition).encode()),
        (X_SOURCE_OFFSET, str(offset).encode()),
        (X_SOURCE_TIMESTAMP, str(timestamp_ms).encode()),
        (X_CONSUMER_GROUP, group_id.encode()),
        (X_FAILED_AT, rfc3339_utc(failed_at).encode()),
    ]
    return _merge_headers(original_headers, added)
