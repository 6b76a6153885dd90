"""Joining compatible requests along the batch dimension, and cutting the response back.

Raw tensors are row-major with the batch dimension first, so joining is byte
concatenation, for BYTES too (each element carries its own length prefix). Used
by the micro-batcher and by the batch path (``worker.records.batch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from math import prod
from typing import Any

from tritonclient.grpc import service_pb2

from worker import errors
from worker.wire.bytes_tensor import LENGTH_PREFIX

__all__ = ["SplitError", "merge", "split"]


class SplitError(errors.InferenceError):
    """The batched response cannot be split per request (treated as a batch failure)."""


def merge(requests: Sequence[Any]) -> Any:
    """One request holding every request's rows, in order (all share a batch key)."""
    first = requests[0]
    merged = service_pb2.ModelInferRequest(
        model_name=first.model_name, model_version=first.model_version
    )
    for name, value in first.parameters.items():
        merged.parameters[name].CopyFrom(value)
    total_rows = sum(int(r.inputs[0].shape[0]) for r in requests)
    for index, tensor in enumerate(first.inputs):
        merged.inputs.add(
            name=tensor.name, datatype=tensor.datatype, shape=[total_rows, *tensor.shape[1:]]
        )
        merged.raw_input_contents.append(b"".join(r.raw_input_contents[index] for r in requests))
    merged.outputs.extend(first.outputs)
    return merged


def split(response: Any, rows: Sequence[int], total_rows: int) -> list[Any]:
    """Cut a batched response into one response per request, by each one's rows."""
    outputs = response.outputs
    raws = response.raw_output_contents
    if len(raws) != len(outputs):
        raise SplitError("batched response has no raw output contents to split")
    parts = []
    for _ in rows:
        part = service_pb2.ModelInferResponse(
            model_name=response.model_name, model_version=response.model_version
        )
        for name, value in response.parameters.items():
            part.parameters[name].CopyFrom(value)
        parts.append(part)
    for tensor, raw in zip(outputs, raws, strict=True):
        shape = list(tensor.shape)
        if not shape or shape[0] != total_rows:
            raise SplitError(
                f"output {tensor.name!r} has shape {shape}, expected {total_rows} batch rows"
            )
        row_elements = prod(shape[1:])
        pieces = (
            _split_bytes(raw, rows, row_elements)
            if tensor.datatype == "BYTES"
            else _split_fixed(raw, rows, total_rows)
        )
        for part, count, piece in zip(parts, rows, pieces, strict=True):
            out = part.outputs.add(name=tensor.name, datatype=tensor.datatype)
            out.shape.extend([count, *shape[1:]])
            for name, value in tensor.parameters.items():
                out.parameters[name].CopyFrom(value)
            part.raw_output_contents.append(piece)
    return parts


def _split_fixed(raw: bytes, rows: Sequence[int], total_rows: int) -> list[bytes]:
    row_bytes, remainder = divmod(len(raw), total_rows)
    if remainder:
        raise SplitError(f"output of {len(raw)} bytes does not divide into {total_rows} rows")
    view = memoryview(raw)
    pieces, start = [], 0
    for count in rows:
        end = start + count * row_bytes
        pieces.append(bytes(view[start:end]))
        start = end
    return pieces


def _split_bytes(raw: bytes, rows: Sequence[int], row_elements: int) -> list[bytes]:
    """Split length-prefixed BYTES elements: each request gets rows x row_elements of them."""
    view = memoryview(raw)
    pieces, start = [], 0
    for count in rows:
        end = start
        for _ in range(count * row_elements):
            if end + 4 > len(raw):
                raise SplitError("BYTES output ends inside an element")
            (length,) = LENGTH_PREFIX.unpack_from(raw, end)
            end += 4 + length
        if end > len(raw):
            raise SplitError("BYTES output ends inside an element")
        pieces.append(bytes(view[start:end]))
        start = end
    if start != len(raw):
        raise SplitError("BYTES output has more elements than the batch rows")
    return pieces
