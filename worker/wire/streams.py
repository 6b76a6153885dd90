"""A decoupled model's responses as results: joined into one, or one each with its place.

``WORKER_STREAM_OUTPUT=final`` publishes one result per request: each output is
the concatenation of that output over every response, along the first dimension
(a token stream of ``BYTES [1]`` pieces becomes a ``BYTES [N]`` list of them, in
order), or, with ``WORKER_STREAM_JOIN_BYTES``, one ``BYTES [1]`` string. ``each``
publishes every response as it comes, marked with its place in the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tritonclient.grpc import service_pb2

from worker.errors import InferenceError, WorkerError
from worker.wire.bytes_tensor import deserialize_bytes_tensor, serialize_bytes_tensor
from worker.wire.headers import X_RESPONSE_COUNT, X_RESPONSE_FINAL, X_RESPONSE_INDEX
from worker.wire.results import response_tensors

__all__ = ["concat_responses", "each_headers", "final_headers", "has_outputs"]


def has_outputs(response: Any) -> bool:
    """True when a response carries outputs (Triton's empty final response does not)."""
    return len(response.outputs) > 0


def concat_responses(responses: Sequence[Any], *, join_bytes: bool = False) -> Any:
    """One ModelInferResponse holding every output of ``responses``, concatenated in order.

    Outputs keep the order in which they first appear. Every piece of one output
    must agree on its datatype and on the dimensions after the first (a scalar
    counts as one row); InferenceError names the output if not. ``join_bytes``
    joins the elements of each BYTES output into one element.
    """
    order: dict[str, list[tuple[Any, bytes]]] = {}
    for response in responses:
        for output, raw in response_tensors(response):
            order.setdefault(output.name, []).append((output, raw))
    first = responses[0] if responses else service_pb2.ModelInferResponse()
    merged = service_pb2.ModelInferResponse(
        model_name=first.model_name, model_version=first.model_version, id=first.id
    )
    for name, pieces in order.items():
        datatype, shape, raw = _concat(name, pieces)
        if join_bytes and datatype == "BYTES":
            raw, shape = _join(name, raw), [1]
        merged.outputs.add(name=name, datatype=datatype, shape=shape)
        merged.raw_output_contents.append(raw)
    return merged


def _concat(name: str, pieces: list[tuple[Any, bytes]]) -> tuple[str, list[int], bytes]:
    datatype = pieces[0][0].datatype
    inner = list(pieces[0][0].shape[1:])
    rows = 0
    for index, (output, _) in enumerate(pieces):
        shape = list(output.shape)
        if output.datatype != datatype or shape[1:] != inner:
            raise InferenceError(
                f"responses disagree on output {name!r}: response {index} has {output.datatype} "
                f"{shape}, the first has {datatype} with dimensions {inner} after the first"
            )
        rows += shape[0] if shape else 1
    return datatype, [rows, *inner], b"".join(raw for _, raw in pieces)


def _join(name: str, raw: bytes) -> bytes:
    try:
        pieces = deserialize_bytes_tensor(raw, f"output {name!r}")
    except WorkerError as error:
        raise InferenceError(f"Triton response: {error.message}") from None
    return serialize_bytes_tensor([b"".join(pieces)])


def each_headers(index: int, final: bool, count: int) -> list[tuple[str, bytes]]:
    """``x-response-index``, ``x-response-final`` (and, on the last, ``x-response-count``)."""
    headers = [
        (X_RESPONSE_INDEX, str(index).encode()),
        (X_RESPONSE_FINAL, b"true" if final else b"false"),
    ]
    if final:
        headers.append((X_RESPONSE_COUNT, str(count).encode()))
    return headers


def final_headers(count: int) -> list[tuple[str, bytes]]:
    """``x-response-count`` of a result that joins ``count`` responses."""
    return [(X_RESPONSE_COUNT, str(count).encode())]
