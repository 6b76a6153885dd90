"""The results of one batched response, encoded per record without splitting it first.

``encode_result`` encodes one record's response; a micro-batch's response would
first be cut into one ``ModelInferResponse`` per record (``worker.triton.merging.split``),
and each record's result built from a document of its own. Here the response is
read once: each numeric output becomes one array, a record's rows are a view of
it, and the parts every record's result shares (model name and version, each
output's name, shape, datatype and parameters) are serialized once, so a
record's result is its id and its rows between bytes made beforehand. The bytes
are those ``encode_result`` makes of the split response, for JSON and binary
results alike; ``BatchResults.of`` declines (None) what it does not cover (a
protobuf result, a BYTES output, typed contents, a response that does not split
into the batch's rows), which the caller encodes the other way. A mapped event's
result is made by its event of its rows' arrays (views of the batch's), as it makes it of
its own response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from math import prod
from typing import Any, Final

import numpy as np
import orjson

from worker.wire.headers import CONTENT_TYPE, INFERENCE_HEADER_CONTENT_LENGTH
from worker.wire.messages import BINARY_DATA_SIZE, ParameterValue, parameters_to_json
from worker.wire.requests import DecodedRequest
from worker.wire.results import RESULT_CONTENT_TYPES, STREAM_PARAMETERS, check_result_size
from worker.wire.tensors import DATATYPES

__all__ = ["BatchResults"]

_NUMPY: Final = orjson.OPT_SERIALIZE_NUMPY


@dataclass(frozen=True, slots=True)
class _Output:
    """One output of the batched response, as every record's result shows it."""

    name: str
    datatype: str
    rest: tuple[int, ...]  # the shape past the batch dimension
    parameters: dict[str, ParameterValue]
    values: np.ndarray[Any, Any]  # every row's elements, flat
    raw: memoryview
    row_elements: int
    row_bytes: int


class BatchResults:
    """Each record's result cut from one batched response (see the module docstring)."""

    def __init__(self, response: Any, outputs: list[_Output], offsets: list[int]) -> None:
        self._model_name: str = response.model_name
        self._model_version: str = response.model_version
        params = parameters_to_json(response.parameters, STREAM_PARAMETERS)
        self._tail = b"]" + (b',"parameters":' + orjson.dumps(params) if params else b"") + b"}"
        self._outputs = outputs
        self._offsets = offsets  # each record's first row
        self._names: dict[tuple[str, str], bytes] = {}
        self._entries: dict[tuple[bool, int], list[tuple[bytes, bytes]]] = {}

    @classmethod
    def of(cls, response: Any, rows: Sequence[int]) -> BatchResults | None:
        """The batched ``response`` to requests of these ``rows``; None when it cannot be
        encoded this way (the caller splits it, which says what is wrong with it)."""
        total = sum(rows)
        raws = response.raw_output_contents
        if not total or not len(response.outputs) or len(raws) != len(response.outputs):
            return None
        outputs = []
        for tensor, raw in zip(response.outputs, raws, strict=True):
            dt = DATATYPES.get(tensor.datatype)
            shape = tuple(tensor.shape)
            if dt is None or dt.dtype is None or not shape or shape[0] != total:
                return None
            row_elements = prod(shape[1:])
            row_bytes = row_elements * dt.size_bytes
            if any(dim < 0 for dim in shape) or len(raw) != total * row_bytes:
                return None
            outputs.append(
                _Output(
                    name=tensor.name,
                    datatype=tensor.datatype,
                    rest=shape[1:],
                    parameters=parameters_to_json(tensor.parameters, STREAM_PARAMETERS),
                    values=np.frombuffer(raw, dtype=dt.dtype),
                    raw=memoryview(raw),
                    row_elements=row_elements,
                    row_bytes=row_bytes,
                )
            )
        offsets, start = [], 0
        for count in rows:
            offsets.append(start)
            start += count
        return cls(response, outputs, offsets)

    @property
    def model_version(self) -> str:
        """The version Triton says it served."""
        return self._model_version

    def encode(
        self, index: int, rows: int, request: DecodedRequest, max_result_bytes: int | None
    ) -> tuple[bytes, list[tuple[str, bytes]]]:
        """The result of the ``index``-th record (``rows`` rows), as ``encode_result``
        makes it of that record's part of the response; OutputTooLarge over the limit."""
        start = self._offsets[index]
        if request.event is not None:
            value, headers = request.event.encode_outputs(self._arrays(start, rows))
            check_result_size(request, value, max_result_bytes)
            return value, headers
        binary = request.binary_outputs
        head = b'{"id":' + orjson.dumps(request.request_id) + self._names_of(request)
        parts = [head]
        pieces = []
        entries = self._entries_of(binary, rows)
        for (before, after), output in zip(entries, self._outputs, strict=True):
            parts.append(before)
            if binary:
                begin = start * output.row_bytes
                pieces.append(output.raw[begin : begin + rows * output.row_bytes])
            else:
                first = start * output.row_elements
                rows_values = output.values[first : first + rows * output.row_elements]
                parts.append(orjson.dumps(rows_values, option=_NUMPY))
            parts.append(after)
        parts.append(self._tail)
        document = b"".join(parts)
        encoding = "binary" if binary else request.encoding
        headers = [(CONTENT_TYPE, RESULT_CONTENT_TYPES[encoding])]
        if binary:
            headers.append((INFERENCE_HEADER_CONTENT_LENGTH, str(len(document)).encode()))
            value = b"".join([document, *pieces])
        else:
            value = document
        check_result_size(request, value, max_result_bytes)
        return value, headers

    def _arrays(self, start: int, rows: int) -> dict[str, np.ndarray[Any, Any]]:
        """Each output's ``rows`` rows from row ``start``, shaped with their batch dimension."""
        return {
            output.name: output.values[
                start * output.row_elements : (start + rows) * output.row_elements
            ].reshape((rows, *output.rest))
            for output in self._outputs
        }

    def _names_of(self, request: DecodedRequest) -> bytes:
        """``,"model_name":...,"model_version":...,"outputs":[`` for the request's model."""
        key = (request.model_name, request.model_version)
        names = self._names.get(key)
        if names is None:
            name = self._model_name or request.model_name
            version = self._model_version or request.model_version
            names = (
                b',"model_name":'
                + orjson.dumps(name)
                + b',"model_version":'
                + orjson.dumps(version)
                + b',"outputs":['
            )
            self._names[key] = names
        return names

    def _entries_of(self, binary: bool, rows: int) -> list[tuple[bytes, bytes]]:
        """Each output's entry around its data (JSON) or whole (binary), for ``rows`` rows."""
        key = (binary, rows)
        entries = self._entries.get(key)
        if entries is None:
            entries = [_entry(output, binary, rows, i) for i, output in enumerate(self._outputs)]
            self._entries[key] = entries
        return entries


def _entry(output: _Output, binary: bool, rows: int, index: int) -> tuple[bytes, bytes]:
    """The ``index``-th output's entry for ``rows`` rows: the bytes before and after its data
    (JSON), or the whole entry and nothing (binary: the data follows the document)."""
    start = (
        (b"," if index else b"")
        + b'{"name":'
        + orjson.dumps(output.name)
        + b',"shape":'
        + orjson.dumps([rows, *output.rest])
        + b',"datatype":'
        + orjson.dumps(output.datatype)
    )
    if binary:
        parameters = dict(output.parameters)
        parameters[BINARY_DATA_SIZE] = rows * output.row_bytes
        return start + b',"parameters":' + orjson.dumps(parameters) + b"}", b""
    after = (
        b',"parameters":' + orjson.dumps(output.parameters) if output.parameters else b""
    ) + b"}"
    return start + b',"data":', after
