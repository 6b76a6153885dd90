"""A Triton response to result bytes, in the request's encoding family, and the result's headers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

import orjson

from worker.errors import InferenceError, OutputTooLarge, WorkerError
from worker.wire import tensors
from worker.wire.headers import (
    CONTENT_TYPE,
    CONTENT_TYPE_BINARY,
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_PROTOBUF,
    INFERENCE_HEADER_CONTENT_LENGTH,
    X_MODEL_NAME,
    X_MODEL_VERSION,
    X_REQUEST_ID,
    X_SOURCE_OFFSET,
    X_SOURCE_PARTITION,
    X_SOURCE_TOPIC,
    Headers,
    Source,
)
from worker.wire.messages import BINARY_DATA_SIZE, BYTES_ENCODING, parameters_to_json
from worker.wire.requests import DecodedRequest, Encoding

__all__ = [
    "ResultHeaders",
    "check_result_size",
    "encode_result",
    "response_tensors",
    "result_headers",
]

RESULT_CONTENT_TYPES: Final[dict[Encoding, bytes]] = {
    "json": CONTENT_TYPE_JSON.encode(),
    "binary": CONTENT_TYPE_BINARY.encode(),
    "protobuf": CONTENT_TYPE_PROTOBUF.encode(),
}

# Triton marks the last response of a stream with this; it is not part of a result.
STREAM_PARAMETERS: Final = frozenset({"triton_final_response"})


def response_tensors(response: Any) -> list[tuple[Any, bytes]]:
    """(output, raw bytes) of each output of a ModelInferResponse; InferenceError if malformed."""
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
        params = parameters_to_json(out.parameters, STREAM_PARAMETERS)
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
    params = parameters_to_json(response.parameters, STREAM_PARAMETERS)
    if params:
        document["parameters"] = params
    return document


def _encode_binary(
    request: DecodedRequest, response: Any, pairs: list[tuple[Any, bytes]]
) -> tuple[bytes, int]:
    outputs = []
    for i, (out, raw) in enumerate(pairs):
        tensors.validate_raw(out.datatype, out.shape, raw, f"outputs[{i}]")
        params = parameters_to_json(out.parameters, STREAM_PARAMETERS)
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
        (CONTENT_TYPE, RESULT_CONTENT_TYPES[request.encoding])
    ]
    value: bytes
    try:
        if request.event is not None:
            value, encoding_headers = request.event.encode(response_tensors(response))
        elif request.encoding == "protobuf":
            response.id = request.request_id
            for key in STREAM_PARAMETERS:
                if key in response.parameters:
                    del response.parameters[key]
            value = response.SerializeToString()
        else:
            pairs = response_tensors(response)
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
    check_result_size(request, value, max_result_bytes)
    return value, encoding_headers


def check_result_size(request: DecodedRequest, value: bytes, max_result_bytes: int | None) -> None:
    """OutputTooLarge when the result ``value`` is over ``max_result_bytes`` (None: no limit)."""
    if max_result_bytes is not None and len(value) > max_result_bytes:
        raise OutputTooLarge(
            f"result of model {request.model_name!r} is {len(value)} bytes, "
            f"over the {max_result_bytes}-byte limit"
        )


def result_headers(
    request_headers: Headers,
    request: DecodedRequest,
    encoding_headers: Sequence[tuple[str, bytes]],
    source: Source,
    *,
    served_model_version: str = "",
    extra: Sequence[tuple[str, bytes]] = (),
) -> list[tuple[str, bytes | None]]:
    """Headers of a result: the request's, then the worker's (which replace same names).

    `served_model_version` is the version Triton reports having used, when known;
    `extra` are further headers of the worker's (a stream's x-response-*).
    """
    version = served_model_version or request.model_version
    return ResultHeaders(request.model_name, version).of(
        request_headers, request, encoding_headers, source, extra=extra
    )


class ResultHeaders:
    """Result headers of one model version's results (a micro-batch's): what they share
    (model, version, topic, partition) encoded once."""

    __slots__ = ("_model", "_partitions", "_topics", "_version")

    def __init__(self, model_name: str, served_version: str) -> None:
        self._model = (X_MODEL_NAME, model_name.encode())
        self._version = (X_MODEL_VERSION, served_version.encode())
        self._topics: dict[str, tuple[str, bytes]] = {}
        self._partitions: dict[int, tuple[str, bytes]] = {}

    def of(
        self,
        request_headers: Headers,
        request: DecodedRequest,
        encoding_headers: Sequence[tuple[str, bytes]],
        source: Source,
        *,
        extra: Sequence[tuple[str, bytes]] = (),
    ) -> list[tuple[str, bytes | None]]:
        """``result_headers`` of one result of the model version."""
        if request.event is not None:
            # A CloudEvent's attributes describe the request; the result's are its own, and
            # a plain event's result is no CloudEvent: a ce_* header it came with
            # (ce_subject, say) would make it look like one.
            request_headers = [
                (n, v) for n, v in request_headers if not n.lower().startswith("ce_")
            ]
        topic = self._topics.get(source.topic)
        if topic is None:
            topic = self._topics[source.topic] = (X_SOURCE_TOPIC, source.topic.encode())
        partition = self._partitions.get(source.partition)
        if partition is None:
            partition = (X_SOURCE_PARTITION, str(source.partition).encode())
            self._partitions[source.partition] = partition
        added: list[tuple[str, bytes]] = [
            (X_REQUEST_ID, request.request_id.encode()),
            self._model,
            self._version,
            topic,
            partition,
            (X_SOURCE_OFFSET, str(source.offset).encode()),
        ]
        # The common case (the encoding gives the content type, nothing else is added)
        # replaces the names of _REPLACED: that set is not made again.
        common = not extra and bool(encoding_headers) and encoding_headers[0][0] == CONTENT_TYPE
        for name, value in encoding_headers:
            name = name.lower()
            added.append((name, bytes(value)))
            common = common and name in _REPLACED
        added += extra
        if not request_headers:
            return list(added)
        replaced = (
            _REPLACED
            if common
            else frozenset(name for name, _ in added) | {INFERENCE_HEADER_CONTENT_LENGTH}
        )
        # The worker's value wins: originals of the same name are dropped, not duplicated.
        # Null values and repeated names among the others pass through as they came. A
        # request's binary header length never describes the result.
        kept: list[tuple[str, bytes | None]] = [
            (name, None if value is None else bytes(value))
            for name, value in request_headers
            if name.lower() not in replaced
        ]
        return [*kept, *added]


#: The names a result's headers replace of its request's when its encoding gives its
#: content type (and a binary header length, never the request's): the common case, whose
#: set is made once.
_REPLACED: Final = frozenset(
    {
        X_REQUEST_ID,
        X_MODEL_NAME,
        X_MODEL_VERSION,
        X_SOURCE_TOPIC,
        X_SOURCE_PARTITION,
        X_SOURCE_OFFSET,
        CONTENT_TYPE,
        INFERENCE_HEADER_CONTENT_LENGTH,
    }
)
