"""What the wire tests share: sample values of every datatype, records, responses.

The raw encodings are built independently of the code under test.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2

from worker import wire
from worker.errors import WorkerError
from worker.wire import DecodedRequest, Headers, decode_request, tensors

SAMPLES: dict[str, list[Any]] = {
    "BOOL": [True, False, True, True],
    "UINT8": [0, 255, 7, 1],
    "UINT16": [0, 65535, 7, 1],
    "UINT32": [0, 2**32 - 1, 7, 1],
    "UINT64": [0, 2**64 - 1, 7, 1],
    "INT8": [-128, 127, 0, 1],
    "INT16": [-(2**15), 2**15 - 1, 0, 1],
    "INT32": [-(2**31), 2**31 - 1, 0, 1],
    "INT64": [-(2**63), 2**63 - 1, 0, 1],
    "FP16": [0.5, -2.0, 65504.0, 0.0],
    "FP32": [0.5, -1.25, 1024.0, 0.0],
    "FP64": [0.1, -1e300, 2.5, 0.0],
    "BYTES": ["a", "héllo", "", "xyz"],
}
JSON_HEADERS: Headers = [("content-type", b"application/json")]
PROTOBUF_HEADERS: Headers = [("content-type", b"application/x-protobuf")]
VALID = b'{"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}]}'


def raw_of(datatype: str, values: list[Any]) -> bytes:
    """Reference raw encoding built independently of the code under test."""
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)
    return np.array(values, dtype=tensors.DATATYPES[datatype].dtype).tobytes()


def decode(value: bytes | None, headers: Headers = (), **overrides: Any) -> DecodedRequest:
    """decode_request with test defaults for the record coordinates and limits."""
    limits = wire.DecodeLimits(overrides.pop("max_request_bytes", 1 << 20))
    options: dict[str, Any] = {"default_model": "default-model", **overrides}
    return decode_request(value, headers, wire.Source("requests", 3, 42), limits, **options)


def json_request(**fields: Any) -> bytes:
    """A JSON request with one FP32 input of shape [2] unless `inputs` is given."""
    body = {"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1.0, 2.0]}]}
    body.update(fields)
    return orjson.dumps(body)


def binary_request(header: dict[str, Any], blobs: list[bytes]) -> tuple[bytes, Headers]:
    """A binary-extension record: JSON header, then the blobs, and its headers."""
    head = orjson.dumps(header)
    headers = [
        ("content-type", b"application/octet-stream"),
        ("inference-header-content-length", str(len(head)).encode()),
    ]
    return head + b"".join(blobs), headers


def response_with(outputs: list[tuple[str, str, list[int], bytes]]) -> Any:
    """A ModelInferResponse as Triton sends it on a stream."""
    response = service_pb2.ModelInferResponse(model_name="m", model_version="3", id="corr-1")
    for name, datatype, shape, raw in outputs:
        tensor = response.outputs.add(name=name, datatype=datatype)
        tensor.shape.extend(shape)
        response.raw_output_contents.append(raw)
    response.parameters["triton_final_response"].bool_param = True
    return response


def error_of(value: bytes | None, headers: Headers = (), **overrides: Any) -> WorkerError:
    """The WorkerError decoding raises."""
    with pytest.raises(WorkerError) as caught:
        decode(value, headers, **overrides)
    return caught.value
