"""Results: what each encoding decodes comes back in the request's encoding, with its headers."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2

from tests.unit.wire.samples import (
    JSON_HEADERS,
    PROTOBUF_HEADERS,
    SAMPLES,
    binary_request,
    decode,
    json_request,
    raw_of,
    response_with,
)
from worker import wire
from worker.errors import (
    InferenceError,
    OutputTooLarge,
)
from worker.wire import encode_result, tensors
from worker.wire.messages import DATATYPE_NAMES


@pytest.mark.parametrize("datatype", DATATYPE_NAMES)
def test_json_round_trip_every_datatype(datatype: str) -> None:
    """JSON request → raw bytes; raw response → JSON result with the same values."""
    values = SAMPLES[datatype]
    value = json_request(
        inputs=[{"name": "IN", "shape": [2, 2], "datatype": datatype, "data": values}]
    )
    request = decode(value, JSON_HEADERS)
    assert request.encoding == "json"
    assert list(request.infer_request.raw_input_contents) == [raw_of(datatype, values)]
    assert list(request.infer_request.inputs[0].shape) == [2, 2]

    result, headers = encode_result(
        request, response_with([("OUT", datatype, [2, 2], raw_of(datatype, values))])
    )
    assert headers == [("content-type", b"application/json")]
    document = orjson.loads(result)
    assert document["id"] == "requests-3-42"
    assert (document["model_name"], document["model_version"]) == ("m", "3")
    assert "parameters" not in document
    assert document["outputs"] == [
        {"name": "OUT", "shape": [2, 2], "datatype": datatype, "data": values}
    ]


@pytest.mark.parametrize("datatype", DATATYPE_NAMES)
def test_binary_round_trip_every_datatype(datatype: str) -> None:
    """Binary-extension request and result carry the raw bytes unchanged."""
    raw = raw_of(datatype, SAMPLES[datatype])
    header: dict[str, Any] = {
        "inputs": [
            {"name": "IN", "shape": [4], "datatype": datatype},
            {"name": "J", "shape": [1], "datatype": "INT32", "data": [5]},
        ]
    }
    header["inputs"][0]["parameters"] = {"binary_data_size": len(raw)}
    value, headers = binary_request(header, [raw])
    request = decode(value, headers)
    assert (request.encoding, request.binary_outputs) == ("binary", True)
    assert list(request.infer_request.raw_input_contents) == [raw, b"\x05\x00\x00\x00"]
    assert dict(request.infer_request.inputs[0].parameters) == {}

    result, result_headers = encode_result(request, response_with([("OUT", datatype, [4], raw)]))
    length = int(dict(result_headers)["inference-header-content-length"])
    assert dict(result_headers)["content-type"] == b"application/octet-stream"
    document = orjson.loads(result[:length])
    assert document["outputs"] == [
        {
            "name": "OUT",
            "shape": [4],
            "datatype": datatype,
            "parameters": {"binary_data_size": len(raw)},
        }
    ]
    assert result[length:] == raw


@pytest.mark.parametrize("datatype", DATATYPE_NAMES)
def test_protobuf_round_trip_every_datatype(datatype: str) -> None:
    """Serialized ModelInferRequest in, serialized ModelInferResponse out."""
    raw = raw_of(datatype, SAMPLES[datatype])
    message = service_pb2.ModelInferRequest(model_name="body-model", id="req-7")
    message.inputs.add(name="IN", datatype=datatype, shape=[4])
    message.raw_input_contents.append(raw)
    request = decode(message.SerializeToString(), PROTOBUF_HEADERS)
    assert (request.encoding, request.request_id, request.model_name) == (
        "protobuf",
        "req-7",
        "body-model",
    )
    assert request.infer_request.id == ""
    assert list(request.infer_request.raw_input_contents) == [raw]

    result, headers = encode_result(request, response_with([("OUT", datatype, [4], raw)]))
    assert headers == [("content-type", b"application/x-protobuf")]
    parsed = service_pb2.ModelInferResponse.FromString(result)
    assert parsed.id == "req-7"
    assert "triton_final_response" not in parsed.parameters
    assert list(parsed.raw_output_contents) == [raw]


def test_fp32_result_prints_shortest_float32_text() -> None:
    """FP32 outputs print as 0.1, not as the float64 widening 0.10000000149011612."""
    request = decode(json_request())
    raw = np.array([0.1], dtype="<f4").tobytes()
    result, _ = encode_result(request, response_with([("OUT", "FP32", [1], raw)]))
    assert b'"data":[0.1]' in result


def test_non_utf8_bytes_output_is_base64_with_parameter() -> None:
    """A BYTES output that is not UTF-8 is base64 with parameters.bytes_encoding."""
    request = decode(json_request())
    raw = tensors.serialize_bytes_tensor([b"\xff\xfe", b"ok"])
    result, _ = encode_result(request, response_with([("OUT", "BYTES", [2], raw)]))
    (output,) = orjson.loads(result)["outputs"]
    assert output["data"] == ["//4=", "b2s="]
    assert output["parameters"] == {"bytes_encoding": "base64"}


def test_malformed_response_is_an_inference_error() -> None:
    """Output bytes that do not fit the output's shape are Triton's fault."""
    request = decode(json_request())
    with pytest.raises(InferenceError, match=r"outputs\[0\]: 3 bytes of data"):
        encode_result(request, response_with([("OUT", "FP32", [1], b"abc")]))


def test_result_over_limit_is_output_too_large() -> None:
    """A result bigger than max_result_bytes is refused with OUTPUT_TOO_LARGE."""
    request = decode(json_request())
    raw = np.zeros(1000, dtype="<f4").tobytes()
    with pytest.raises(OutputTooLarge, match="over the 100-byte limit"):
        encode_result(request, response_with([("OUT", "FP32", [1000], raw)]), max_result_bytes=100)


def test_result_headers_pass_through_and_replace() -> None:
    """Request headers pass through; content-type and x- headers are replaced, not duplicated."""
    value, headers = binary_request(
        {
            "inputs": [
                {
                    "name": "X",
                    "shape": [1],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 4},
                }
            ]
        },
        [b"\x00" * 4],
    )
    original = [
        *headers,
        ("traceparent", b"00-abc"),
        ("X-Request-Id", b"old"),
        ("x-model-name", b"old"),
    ]
    request = decode(value, original)
    built = wire.result_headers(
        original,
        request,
        [("content-type", b"application/json")],
        source=wire.Source("requests", 3, 42),
        served_model_version="7",
    )
    assert built == [
        ("traceparent", b"00-abc"),
        ("x-request-id", b"old"),
        ("x-model-name", b"old"),
        ("x-model-version", b"7"),
        ("x-source-topic", b"requests"),
        ("x-source-partition", b"3"),
        ("x-source-offset", b"42"),
        ("content-type", b"application/json"),
    ]
    names = [name.lower() for name, _ in built]
    assert len(names) == len(set(names))
