"""Request bytes and headers to a Triton ``ModelInferRequest``: the three encodings decoded.

Every request, whatever its encoding, becomes a ``ModelInferRequest`` with one
little-endian blob per input in ``raw_input_contents``, so everything downstream
handles a single form:

- JSON (content-type absent or application/json): typed decoding with msgspec,
  then each input's data is validated and packed with numpy;
- binary extension (application/octet-stream + inference-header-content-length):
  the JSON header as above, the tensors sliced straight out of the value;
- protobuf (application/x-protobuf): parsed as is; typed ``contents`` are
  converted to raw.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from math import prod
from typing import Any, Final, Literal

import msgspec
from google.protobuf.message import (  # type: ignore[import-untyped, unused-ignore]
    DecodeError as ProtobufDecodeError,
)
from tritonclient.grpc import service_pb2

from worker.errors import DecodeError, InvalidRequest, ModelNotFound, TooLarge, WorkerError
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
    Headers,
    Source,
    header_text,
)
from worker.wire.messages import (
    BINARY_DATA_SIZE,
    FRAMING_PARAMETERS,
    InferRequestJSON,
    RequestInput,
    set_parameters,
)

__all__ = [
    "DecodeLimits",
    "DecodedRequest",
    "Encoding",
    "PendingInput",
    "decode_request",
    "pack_group",
    "request_names",
]

Encoding = Literal["json", "binary", "protobuf"]

_CONTENT_TYPES: Final[dict[str, Encoding]] = {
    CONTENT_TYPE_JSON: "json",
    CONTENT_TYPE_BINARY: "binary",
    CONTENT_TYPE_PROTOBUF: "protobuf",
    "application/protobuf": "protobuf",
}
_request_decoder: Final = msgspec.json.Decoder(InferRequestJSON)


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """How large a request and its tensors may be (None: unbounded)."""

    max_request_bytes: int
    max_tensor_elements: int | None = None
    max_tensor_bytes: int | None = None
    #: The two tensor bounds as ``tensors`` checks them (made once, not per record).
    tensor: tensors.TensorLimits = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        limits = tensors.TensorLimits(self.max_tensor_elements, self.max_tensor_bytes)
        object.__setattr__(self, "tensor", limits)


@dataclass(frozen=True, slots=True)
class PendingInput:
    """An input of a request whose tensor is not built yet: its elements as parsed, one flat
    row-major list (checked against its shape, not converted); or its bytes, checked
    against its shape (the binary extension's, a view of the record's value; a mapped
    event's, made from the event)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    flat: list[Any] | bytes | memoryview


@dataclass(slots=True)
class DecodedRequest:
    """A request ready for Triton, and what is needed to shape its result.

    `payload_bytes` is the size of the record value. A JSON request decoded for a group
    (``defer``) may have its tensors ``pending``: ``infer_request`` is then None until
    ``packed()`` builds it, and the group builds one request of all its rows at once
    (``pack_group``).
    """

    request_id: str
    model_name: str
    model_version: str
    encoding: Encoding
    infer_request: Any  # service_pb2.ModelInferRequest
    binary_outputs: bool
    payload_bytes: int
    #: A mapped topic's event (``worker.events.MappedEvent``): it shapes the request for the
    #: model and makes the result event. None for an inference request.
    event: Any = None
    #: The inputs whose tensors are built later (see above), and the outputs asked for.
    pending: tuple[PendingInput, ...] | None = None
    output_names: tuple[str, ...] = ()

    def packed(self) -> Any:
        """The ``ModelInferRequest``, built now if its tensors were pending (InvalidRequest
        when an element does not fit its datatype)."""
        if self.infer_request is None:
            assert self.pending is not None
            request = _new_request(self.model_name, self.model_version, self.output_names)
            for i, tensor in enumerate(self.pending):
                flat = tensor.flat
                raw = (
                    bytes(flat)  # the same object when it is bytes already
                    if isinstance(flat, _RAW)
                    else tensors.json_to_raw(tensor.datatype, tensor.shape, flat, f"inputs[{i}]")
                )
                request.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
                request.raw_input_contents.append(raw)
            self.infer_request = request
        return self.infer_request


def _new_request(model_name: str, model_version: str, outputs: tuple[str, ...]) -> Any:
    request = service_pb2.ModelInferRequest(model_name=model_name, model_version=model_version)
    for name in outputs:
        request.outputs.add(name=name)
    return request


def pack_group(requests: list[DecodedRequest]) -> tuple[Any, list[int]]:
    """One ``ModelInferRequest`` of the pending requests' rows, in order (all share a batch
    key); or None and the indexes of the requests whose elements do not convert (each one's
    own decoding says why), when there are some."""
    first = requests[0]
    assert first.pending is not None
    merged = _new_request(first.model_name, first.model_version, first.output_names)
    total_rows = 0
    for request in requests:
        assert request.pending is not None
        total_rows += request.pending[0].shape[0]
    for i, tensor in enumerate(first.pending):
        flats = [request.pending[i].flat for request in requests]  # type: ignore[index]
        raw = _joined(tensor.datatype, flats)
        if raw is None:
            bad = [j for j, flat in enumerate(flats) if _joined(tensor.datatype, [flat]) is None]
            return None, bad
        merged.inputs.add(
            name=tensor.name, datatype=tensor.datatype, shape=[total_rows, *tensor.shape[1:]]
        )
        merged.raw_input_contents.append(raw)
    return merged, []


#: A pending tensor given as its bytes (see ``PendingInput``), not as JSON elements.
_RAW: Final = (bytes, memoryview)


def _joined(datatype: str, flats: list[list[Any] | bytes | memoryview]) -> bytes | None:
    """The raw bytes of several pending tensors of one input, joined in order; None when a
    JSON element does not convert. Tensors given as bytes are copied in as they are."""
    if not any(isinstance(flat, _RAW) for flat in flats):
        return tensors.json_to_raw_many(datatype, flats)  # type: ignore[arg-type]
    parts = []  # JSON elements among them (JSON and binary requests): each converted alone
    for flat in flats:
        raw = flat if isinstance(flat, _RAW) else tensors.json_to_raw_many(datatype, [flat])
        if raw is None:
            return None
        parts.append(raw)
    return b"".join(parts)


def _encoding_of(headers: Headers) -> Encoding:
    content_type = header_text(headers, CONTENT_TYPE)
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
            tensor.parameters, spec.parameters, f"{where}.parameters", FRAMING_PARAMETERS
        )
        request.raw_input_contents.append(raw)
        total_bytes += len(raw)
    for i, output in enumerate(body.outputs or ()):
        requested = request.outputs.add()
        requested.name = output.name
        set_parameters(
            requested.parameters, output.parameters, f"outputs[{i}].parameters", FRAMING_PARAMETERS
        )
    set_parameters(request.parameters, body.parameters, "parameters", FRAMING_PARAMETERS)
    return request, total_bytes


def _binary_header_length(headers: Headers, value: bytes) -> int:
    text = header_text(headers, INFERENCE_HEADER_CONTENT_LENGTH)
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
    header_name = header_text(headers, X_MODEL_NAME) or ""
    header_version = header_text(headers, X_MODEL_VERSION) or ""
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
    if version and not (version.isascii() and version.isdigit()):
        raise InvalidRequest(f"model version {version!r} of {name!r} is not a version number")
    # Triton reads "01" as 1: one spelling per version, so that what the worker keeps per
    # model version is bounded by the versions Triton serves, not by a producer's spellings.
    return name, version.lstrip("0") or ("0" if version else "")


def decode_request(
    value: bytes | None,
    headers: Headers,
    source: Source,
    limits: DecodeLimits,
    default_model: str | None = None,
    *,
    defer: bool = False,
) -> DecodedRequest:
    """Decode a record into a Triton request; raise a WorkerError saying what is wrong.

    The size limit is checked before any parsing, and again on the decoded
    tensors (JSON numbers can expand several times in binary form). Each input
    tensor is held to ``limits.max_tensor_elements`` and ``limits.max_tensor_bytes``
    (TooLarge) from its claimed shape and its data, before its buffer is built.
    ``defer``: a plain JSON request (numeric inputs with their data, no parameters) keeps
    its tensors pending, for its group to build them together.
    """
    max_request_bytes, tensor_limits = limits.max_request_bytes, limits.tensor
    if value is None:
        raise DecodeError("record value is null (a tombstone); expected an inference request")
    value = bytes(value)
    if len(value) > max_request_bytes:
        raise TooLarge(
            f"record value is {len(value)} bytes, over the {max_request_bytes}-byte limit"
        )
    encoding = _encoding_of(headers)
    pending: tuple[PendingInput, ...] | None = None
    outputs: tuple[str, ...] = ()
    if encoding == "protobuf":
        request, tensor_bytes = _from_protobuf(value, tensor_limits)
        body_id, body_name, body_version = request.id, request.model_name, request.model_version
    else:
        (request, tensor_bytes, pending, outputs), (body_id, body_name, body_version) = (
            _from_json_value(value, headers, encoding, tensor_limits, defer=defer)
        )
    if tensor_bytes > max_request_bytes:
        raise TooLarge(
            f"decoded tensors are {tensor_bytes} bytes, over the {max_request_bytes}-byte limit"
        )
    model_name, model_version = _choose_model(headers, body_name, body_version, default_model)
    if request is not None:
        request.model_name, request.model_version, request.id = model_name, model_version, ""
    request_id = (
        body_id
        or header_text(headers, X_REQUEST_ID)
        or f"{source.topic}-{source.partition}-{source.offset}"
    )
    return DecodedRequest(
        request_id=request_id,
        model_name=model_name,
        model_version=model_version,
        encoding=encoding,
        infer_request=request,
        binary_outputs=encoding == "binary",
        payload_bytes=len(value),
        pending=pending,
        output_names=outputs,
    )


#: A JSON or binary-extension request: its message (None while its tensors are pending),
#: its tensors' bytes, its pending inputs and the outputs it asks for.
_Decoded = tuple[Any, int, "tuple[PendingInput, ...] | None", tuple[str, ...]]


def _from_json_value(
    value: bytes,
    headers: Headers,
    encoding: Encoding,
    tensor_limits: tensors.TensorLimits,
    *,
    defer: bool,
) -> tuple[_Decoded, tuple[str, str, str]]:
    """A JSON or binary-extension value decoded (see ``decode_request``'s ``defer``), and
    the body's request id, model name and model version ("" when not given)."""
    body, header_end = _json_body(value, headers, encoding)
    names = (body.id or "", body.model_name or "", body.model_version or "")
    deferred = _deferred(body, tensor_limits, value, header_end) if defer else None
    if deferred is not None:
        pending, tensor_bytes = deferred
        return (None, tensor_bytes, pending, tuple(o.name for o in body.outputs or ())), names
    request, tensor_bytes = _from_json(body, value, header_end, tensor_limits)
    return (request, tensor_bytes, None, ()), names


def _json_body(
    value: bytes, headers: Headers, encoding: str
) -> tuple[InferRequestJSON, int | None]:
    """A JSON or binary-extension value's JSON, and where its binary tensors start."""
    header_end: int | None = None
    json_part: bytes | memoryview = value
    if encoding == "json" and value.startswith(codecs.BOM_UTF8):
        # RFC 8259 lets a parser ignore a byte order mark; some Windows tools write one.
        json_part = memoryview(value)[len(codecs.BOM_UTF8) :]
    if encoding == "binary":
        header_end = _binary_header_length(headers, value)
        json_part = memoryview(value)[:header_end]
    body = _decode_json(json_part, "JSON header" if header_end is not None else "request body")
    return body, header_end


def _deferred(
    body: InferRequestJSON, limits: tensors.TensorLimits, value: bytes, binary_start: int | None
) -> tuple[tuple[PendingInput, ...], int] | None:
    """A plain request's inputs, pending (checked against their shapes and the limits, their
    elements not converted), and their tensors' bytes; None for any other request, and for
    one these checks refuse (it is decoded whole, which says why).

    Plain: no parameters but the binary extension's framing ones (never sent to Triton);
    with the binary extension (``binary_start``: where its tensors start in ``value``),
    each input's ``binary_data_size`` is the whole of its tensor's bytes, every byte after
    the JSON header taken; numeric datatypes only.
    """
    if not _framing_only(body.parameters):
        return None
    for output in body.outputs or ():
        if not _framing_only(output.parameters):
            return None
    pending: list[PendingInput] = []
    names: set[str] = set()
    total_bytes = 0
    position = binary_start
    for spec in body.inputs:
        if spec.name in names:
            return None
        names.add(spec.name)
        taken = _pending_input(spec, limits, value, position)
        if taken is None:
            return None
        tensor, size = taken
        if position is not None:
            position += size
        pending.append(tensor)
        total_bytes += size
    if position is not None and position != len(value):
        return None
    return tuple(pending), total_bytes


def _framing_only(parameters: dict[str, Any] | None) -> bool:
    return not parameters or parameters.keys() <= FRAMING_PARAMETERS


def _pending_input(
    spec: RequestInput, limits: tensors.TensorLimits, value: bytes, position: int | None
) -> tuple[PendingInput, int] | None:
    """One input of a plain request (see ``_deferred``), pending, and its tensor's bytes;
    they start at ``position`` of ``value`` with the binary extension (None: its elements
    are JSON)."""
    dt = tensors.DATATYPES.get(spec.datatype)
    shape, data, parameters = spec.shape, spec.data, spec.parameters or {}
    if dt is None or dt.dtype is None or not shape or min(shape) < 0:
        return None
    if not _framing_only(parameters):
        return None
    count = prod(shape)
    size = count * dt.size_bytes
    max_elements, max_bytes = limits.max_elements, limits.max_bytes
    if (max_elements is not None and count > max_elements) or (
        max_bytes is not None and size > max_bytes
    ):
        return None
    flat: list[Any] | bytes | memoryview
    if position is not None:
        declared = parameters.get(BINARY_DATA_SIZE)
        if data is not None or type(declared) is not int or declared != size:
            return None
        if position + size > len(value):
            return None
        flat = memoryview(value)[position : position + size]
    elif data is None or BINARY_DATA_SIZE in parameters:
        return None
    elif len(shape) == 1 or not data or not isinstance(data[0], list):
        if len(data) != count:
            return None
        flat = data
    else:
        try:
            flat, _ = tensors.flat_json(spec.datatype, shape, data, "")
        except WorkerError:
            return None
    return PendingInput(spec.name, spec.datatype, tuple(shape), flat), size


class _Names(msgspec.Struct):
    """The two fields of a request body that name it; every other field is skipped."""

    id: str | None = None
    model_name: str | None = None


_names_decoder: Final = msgspec.json.Decoder(_Names)


def request_names(value: bytes | None, headers: Headers) -> tuple[str, str]:
    """The model and the request id a record names, ``""`` for what it does not name.

    Chosen as `decode_request` chooses them (model: header ``x-model-name``, else
    the body's ``model_name``; id: the body's ``id``, else header ``x-request-id``),
    but never raising: for reports on records that may not decode at all.
    """
    body = _Names()
    try:
        encoding = _encoding_of(headers)
        raw = bytes(value or b"")
        if encoding == "protobuf" and raw:
            request = service_pb2.ModelInferRequest()
            request.ParseFromString(raw)
            body = _Names(request.id or None, request.model_name or None)
        elif raw:
            end = _binary_header_length(headers, raw) if encoding == "binary" else len(raw)
            start = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
            body = _names_decoder.decode(memoryview(raw)[start:end])
    except Exception:
        pass  # an unreadable body names nothing; the headers still may
    model = _header(headers, X_MODEL_NAME) or body.model_name or ""
    return model, body.id or _header(headers, X_REQUEST_ID)


def _header(headers: Headers, name: str) -> str:
    try:
        return header_text(headers, name) or ""
    except DecodeError:
        return ""
