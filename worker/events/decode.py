"""A mapped topic's event to an inference request, and the response back to an event.

``decode_event`` reads the fields the mapping names into one tensor per model input;
a field that is missing, null without a default, of the wrong type, out of range or of
the wrong length is refused with its path (``$.features[3]: expected a number, got
"n/a"``). The request carries a ``MappedEvent``, which ``fit`` shapes for the model (a
batching model gets a batch dimension of 1) and which encodes the result event.
"""

from __future__ import annotations

import codecs
from dataclasses import replace
from typing import Any, Final

import msgspec
import numpy as np
import orjson

from worker.errors import DecodeError, InferenceError, InvalidRequest, TooLarge
from worker.events.cloudevents import CloudEvent, cloud_event_of, is_structured
from worker.events.mapping import Argmax, InputMap, OutputRef, TopicMapping
from worker.events.paths import MISSING, EventPath
from worker.events.values import expected
from worker.registry import Registry
from worker.registry.results import ResultWriter
from worker.wire import tensors
from worker.wire.bytes_tensor import serialize_bytes_tensor
from worker.wire.headers import CONTENT_TYPE, X_REQUEST_ID, Headers, Source, header_text
from worker.wire.requests import DecodedRequest, DecodeLimits, PendingInput
from worker.wire.validation import ModelSpec

__all__ = ["MappedEvent", "decode_event"]

#: How much of a wrong value a message shows.
_SHOWN: Final = 40


def _show(value: Any) -> str:
    text = orjson.dumps(value).decode() if value is not MISSING else "nothing"
    return text if len(text) <= _SHOWN else f"{text[:_SHOWN]}... ({len(text)} characters)"


class MappedEvent:
    """The event a request was made of, and how to make its result event."""

    __slots__ = ("batched", "cloud", "event", "mapping", "source", "writer")

    def __init__(
        self,
        mapping: TopicMapping,
        event: dict[str, Any],
        source: Source,
        cloud: CloudEvent | None = None,
        writer: ResultWriter | None = None,
    ) -> None:
        self.mapping = mapping
        self.event = event
        self.source = source
        #: The request came as a CloudEvent: the result goes out as one, in its mode.
        self.cloud = cloud
        #: A registry-format topic's: how the result event is written (its schema and id).
        self.writer = writer
        #: The inputs were given a batch dimension (the model batches).
        self.batched = False

    def fit(self, spec: ModelSpec, request: DecodedRequest) -> None:
        """Shape the request for ``spec``: a batching model's inputs get a batch of 1."""
        if spec.max_batch_size > 0 and not self.batched:
            self.batched = True
            if request.pending is not None:
                request.pending = tuple(
                    replace(tensor, shape=(1, *tensor.shape)) for tensor in request.pending
                )
            if request.infer_request is not None:
                for tensor in request.infer_request.inputs:
                    tensor.shape.insert(0, 1)

    def encode(self, pairs: list[tuple[Any, bytes]]) -> tuple[bytes, list[tuple[str, bytes]]]:
        """The result event of the response's (output, raw bytes) pairs, and its headers
        (a CloudEvent's in the request's mode)."""
        outputs: dict[str, Any] = {}
        for i, (out, raw) in enumerate(pairs):
            try:
                outputs[out.name] = tensors.raw_to_numpy(out.datatype, out.shape, raw)
            except Exception as exc:
                raise InferenceError(f"Triton response outputs[{i}]: {exc}") from None
        return self.encode_outputs(outputs)

    def encode_outputs(self, outputs: dict[str, Any]) -> tuple[bytes, list[tuple[str, bytes]]]:
        """The result event of the response's outputs as arrays (with the batch dimension
        the request was given, if any: a batched response's rows of this event serve as
        well as its own response), and its headers."""
        if self.batched:
            outputs = {
                name: array[0] if array.ndim and array.shape[0] == 1 else array
                for name, array in outputs.items()
            }
        result, writer = self.mapping.result, self.writer
        # A registry format's library writes plain Python values; orjson writes numpy's.
        value_of = _json if writer is None else _python
        if result.into is not None:
            document = dict(self.event)
            if writer is not None:  # an Avro event's arrays of numbers, as lists
                for key, value in document.items():
                    if isinstance(value, np.ndarray):
                        document[key] = value_of(value)
            document[result.into] = {name: value_of(array) for name, array in outputs.items()}
        else:
            document = {
                name: self._field(name, source, outputs, value_of) for name, source in result.fields
            }
        if writer is not None:
            data, content_type = writer.encode(document), writer.content_type
        else:
            data = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
            content_type = b"application/json"
        if self.cloud is not None:
            return self.cloud.result(data, self.mapping.cloudevents, self.source, content_type)
        return data, [(CONTENT_TYPE, content_type)]

    def _field(self, name: str, source: Any, outputs: dict[str, Any], value_of: Any = None) -> Any:
        value_of = value_of or _json
        if isinstance(source, EventPath):
            value = source.find(self.event)
            if isinstance(value, np.ndarray):  # an Avro event's array of numbers
                return value_of(value)
            return None if value is MISSING else value
        array = outputs.get(source.output)
        if array is None:
            raise InferenceError(
                f"result field {name!r} reads output {source.output!r}, which Triton did not "
                f"return (it returned {', '.join(outputs) or 'none'})"
            )
        flat = array.reshape(-1)
        if isinstance(source, OutputRef):
            if source.index is None:
                return value_of(array)
            if source.index >= flat.size:
                raise InferenceError(
                    f"result field {name!r} reads {source}, but {source.output} has "
                    f"{flat.size} elements"
                )
            return value_of(flat[source.index])
        assert isinstance(source, Argmax)
        if not flat.size or flat.dtype == object:
            raise InferenceError(
                f"result field {name!r}: argmax of {source.output}, which has no numbers"
            )
        nan = np.isnan(flat) if flat.dtype.kind == "f" else None
        if nan is not None and nan.any():
            # numpy's argmax picks the first NaN; a NaN is no score, so it is passed over,
            # and a row of NaNs has no label (null) rather than the first one's.
            if nan.all():
                return None
            best = int(np.nanargmax(flat))
        else:
            best = int(np.argmax(flat))
        if best >= len(source.labels):
            raise InferenceError(
                f"result field {name!r}: {source.output}'s largest element is at {best}, "
                f"past its {len(source.labels)} labels"
            )
        return source.labels[best]


def _json(value: Any) -> Any:
    """A numpy array or scalar as orjson writes it (numbers as their datatype's shortest
    form, as results of inference requests have them; BYTES as UTF-8 text)."""
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return _texts(value.tolist())
        return value[()] if value.ndim == 0 else np.ascontiguousarray(value)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value


def _python(value: Any) -> Any:
    """A numpy array or scalar as plain Python values (lists, floats, ints, text), for a
    registry format's writer (a NaN stays a NaN: Avro's floats hold it)."""
    if isinstance(value, np.ndarray):
        return _texts(value.tolist())
    if isinstance(value, np.generic):
        return _texts(value.item())
    return _texts(value)


def _texts(items: Any) -> Any:
    if isinstance(items, list):
        return [_texts(item) for item in items]
    return items.decode("utf-8", "replace") if isinstance(items, bytes) else items


def decode_event(
    mapping: TopicMapping,
    value: bytes | None,
    headers: Headers,
    source: Source,
    limits: DecodeLimits,
    registry: Registry | None = None,
    *,
    defer: bool = False,
) -> DecodedRequest:
    """The event's request for the mapping's model; a WorkerError naming what is wrong.

    ``registry``: where a registry-format topic's records find their schemas (they
    raise ``SchemaPending`` while theirs is not fetched yet). ``defer``: the tensors are
    left pending (their bytes made, no request message), for a group to build at once."""
    if value is None:
        raise DecodeError(
            f"record value is null (a tombstone); topic {mapping.topic!r} expects an event"
        )
    value = bytes(value)
    if len(value) > limits.max_request_bytes:
        raise TooLarge(
            f"record value is {len(value)} bytes, over the {limits.max_request_bytes}-byte limit"
        )
    if mapping.registry_format:
        assert registry is not None, "a registry-format topic without its registry"
        event, cloud = _registry_event_of(mapping, value, headers, registry)
    else:
        event, cloud = _event_of(mapping, value, headers)
    inputs = _inputs(mapping, event, limits)
    decoded = DecodedRequest(
        request_id=_request_id(mapping, event, headers, source, cloud),
        model_name=mapping.model,
        model_version=mapping.version,
        encoding="json",
        infer_request=None,
        binary_outputs=False,
        payload_bytes=len(value),
        event=MappedEvent(
            mapping,
            event,
            source,
            cloud,
            registry.result(mapping.topic) if registry and mapping.registry_format else None,
        ),
        pending=inputs,
        output_names=tuple(mapping.outputs()),
    )
    if not defer:
        decoded.packed()
    return decoded


def _event_of(
    mapping: TopicMapping, value: bytes, headers: Headers
) -> tuple[dict[str, Any], CloudEvent | None]:
    """The event a record holds (a structured CloudEvent's data), and its CloudEvent."""
    try:
        event = orjson.loads(value[3:] if value.startswith(codecs.BOM_UTF8) else value)
    except orjson.JSONDecodeError as exc:
        raise DecodeError(f"record value is not valid JSON: {exc}") from None
    structured = is_structured(headers)
    cloud = cloud_event_of(headers, event if structured else None)
    if structured:
        event = event.get("data")
        if not isinstance(event, dict):
            raise DecodeError(
                f"structured CloudEvent: data is {_show(event)}; expected a JSON object (the event)"
            )
    if not isinstance(event, dict):
        raise DecodeError(
            f"record value: topic {mapping.topic!r} expects a JSON object (an event), "
            f"got {type(event).__name__ if event is not None else 'null'}"
        )
    return event, cloud


def _registry_event_of(
    mapping: TopicMapping, value: bytes, headers: Headers, registry: Registry
) -> tuple[dict[str, Any], CloudEvent | None]:
    """The record of a registry-format topic, read with its writer's schema; a binary
    CloudEvent's attributes from its headers (a structured one is JSON, not framed)."""
    event = registry.read(mapping.topic, value)
    if not isinstance(event, dict):
        raise DecodeError(
            f"record value: topic {mapping.topic!r} expects a record (an event), got "
            f"{type(event).__name__ if event is not None else 'null'}"
        )
    return event, cloud_event_of(headers, None, json_data=False)


def _request_id(
    mapping: TopicMapping,
    event: dict[str, Any],
    headers: Headers,
    source: Source,
    cloud: CloudEvent | None,
) -> str:
    if mapping.request_id is not None:
        found = mapping.request_id.find(event)
        if isinstance(found, str) and found:
            return found
        if isinstance(found, int) and not isinstance(found, bool):
            return str(found)
        if found is not MISSING and found is not None:
            raise InvalidRequest(
                f"{mapping.request_id}: expected a string or an integer (the request id), "
                f"got {_show(found)}"
            )
    if cloud is not None:
        return cloud.id
    return (
        header_text(headers, X_REQUEST_ID) or f"{source.topic}-{source.partition}-{source.offset}"
    )


def _inputs(
    mapping: TopicMapping, event: dict[str, Any], limits: DecodeLimits
) -> tuple[PendingInput, ...]:
    """The request's inputs read from the event, within the limits (their bytes made)."""
    pending: list[PendingInput] = []
    total = 0
    for spec in mapping.inputs:
        shape, raw = _tensor(spec, event, mapping)
        limits.tensor.check(spec.datatype, shape, f"input {spec.name}", len(raw))
        pending.append(PendingInput(spec.name, spec.datatype, tuple(shape), raw))
        total += len(raw)
    if total > limits.max_request_bytes:
        raise TooLarge(
            f"decoded tensors are {total} bytes, over the {limits.max_request_bytes}-byte limit"
        )
    return tuple(pending)


def _tensor(
    spec: InputMap, event: dict[str, Any], mapping: TopicMapping
) -> tuple[list[int], bytes]:
    """One input's shape and raw bytes, read from the event."""
    if spec.fields:
        values, places = [], []
        for path in spec.fields:
            found = path.find(event)
            if found is MISSING or found is None:
                found = _default(spec, path, found, mapping)
            values.append(found)
            places.append(str(path))
        return [len(values)], _raw(spec.datatype, values, places.__getitem__)
    assert spec.source is not None
    path = spec.source
    found = path.find(event)
    if found is MISSING or found is None:
        default = _default(spec, path, found, mapping)
        if -1 in spec.shape:
            raise InvalidRequest(
                f"{path}: missing; a default cannot fill shape "
                f"{list(spec.shape)} (its size is the event's)"
            )
        count = int(np.prod(spec.shape)) if spec.shape else 1
        return list(spec.shape), _raw(spec.datatype, [default] * count, lambda _: str(path))
    if isinstance(found, np.ndarray):  # an Avro array of numbers, read as one
        numbers = _numbers(spec, found)
        if numbers is not None:
            return numbers
        found = found.tolist()  # checked element by element, as a JSON event's
    if not isinstance(found, list) and spec.shape in ((), (1,)):
        return list(spec.shape), _raw(spec.datatype, [found], lambda _: str(path))
    shape, flat = _flatten(found, spec.shape, path)
    return shape, _raw(spec.datatype, flat, lambda i: _place(path, i, shape))


def _numbers(spec: InputMap, found: np.ndarray[Any, Any]) -> tuple[list[int], bytes] | None:
    """A floating-point input of one dimension from an array of numbers, converted at once
    when every value fits (None: the element-wise path says what does not)."""
    dtype = tensors.DATATYPES[spec.datatype].dtype
    if dtype is None or dtype.kind != "f" or len(spec.shape) != 1:
        return None
    if spec.shape[0] not in (-1, found.size):
        return None
    converted = found.astype(dtype, copy=False)
    if not np.isfinite(converted).all():
        return None
    return [found.size], converted.tobytes()


def _default(spec: InputMap, path: EventPath, found: Any, mapping: TopicMapping) -> Any:
    if spec.default is not None:
        return spec.default
    what = "null" if found is None else "missing"
    raise InvalidRequest(
        f"{path}: {what}; expected {expected(spec.datatype)} for input {spec.name} of model "
        f"{mapping.model!r} (the mapping of topic {mapping.topic!r} gives no default)"
    )


def _flatten(value: Any, shape: tuple[int, ...], path: EventPath) -> tuple[list[int], list[Any]]:
    """The nested lists' actual shape and elements, row-major; InvalidRequest where the
    nesting does not match ``shape`` (-1: any size, the same for every sibling)."""
    actual = list(shape)
    flat: list[Any] = []
    last = len(shape) - 1

    def walk(node: Any, depth: int, where: str) -> None:
        if not isinstance(node, list):
            raise InvalidRequest(
                f"{where}: expected a list (dimension {depth} of shape "
                f"{list(shape)}), got {_show(node)}"
            )
        if actual[depth] == -1:
            actual[depth] = len(node)
        if len(node) != actual[depth]:
            wanted = "as many as its siblings, " if shape[depth] == -1 else ""
            raise InvalidRequest(
                f"{where}: {len(node)} elements, expected {wanted}"
                f"{actual[depth]} (dimension {depth} of shape {list(shape)})"
            )
        if depth == last:
            flat.extend(node)
            return
        for i, child in enumerate(node):
            walk(child, depth + 1, f"{where}[{i}]")

    if not shape:
        raise InvalidRequest(f"{path}: expected one value (shape []), got a list")
    walk(value, 0, str(path))
    return actual, flat


def _place(path: EventPath, index: int, shape: list[int]) -> str:
    if len(shape) <= 1:
        return path.at(index)
    return str(path) + "".join(f"[{int(i)}]" for i in np.unravel_index(index, tuple(shape)))


def _raw(datatype: str, values: list[Any], place: Any) -> bytes:
    """The values as the datatype's raw bytes; InvalidRequest naming the first wrong one."""
    dt = tensors.DATATYPES[datatype]
    try:
        checked = msgspec.convert(values, list[dt.json_element])  # type: ignore[name-defined]
    except msgspec.ValidationError as error:
        index = _failed_index(str(error))
        shown = _show(values[index]) if index is not None else ""
        where = place(index) if index is not None else "value"
        raise InvalidRequest(f"{where}: expected {expected(datatype)}, got {shown}") from None
    if dt.dtype is None:
        try:
            return serialize_bytes_tensor([text.encode() for text in checked])
        except UnicodeEncodeError as error:
            raise InvalidRequest(f"value: string is not valid UTF-8 ({error.reason})") from None
    try:
        return np.asarray(checked, dtype=dt.dtype).tobytes()
    except OverflowError:
        limit = int(np.iinfo(dt.dtype).max)
        index = next(i for i, v in enumerate(checked) if v > limit)
        raise InvalidRequest(
            f"{place(index)}: expected {expected(datatype)}, got {_show(checked[index])}"
        ) from None


def _failed_index(text: str) -> int | None:
    """The element index in msgspec's "... - at `$[7]`"."""
    _, _, at = text.partition(" - at `$[")
    index = at.split("]", 1)[0]
    return int(index) if index.isdigit() else None
