"""Requests in the three encodings decoded, their model and request id found, bad ones named."""

from __future__ import annotations

import re
import tracemalloc

import pytest
from tritonclient.grpc import service_pb2

from tests.unit.wire.samples import (
    PROTOBUF_HEADERS,
    SAMPLES,
    VALID,
    binary_request,
    decode,
    error_of,
    json_request,
    raw_of,
)
from worker.errors import (
    DecodeError,
    InvalidRequest,
    ModelNotFound,
    TooLarge,
    WorkerError,
)
from worker.wire import Headers, tensors
from worker.wire.messages import DATATYPE_NAMES


@pytest.mark.parametrize("datatype", [d for d in DATATYPE_NAMES if d != "FP16"])
def test_protobuf_typed_contents_become_raw(datatype: str) -> None:
    """Typed `contents` are converted so downstream only sees raw_input_contents."""
    values = SAMPLES[datatype]
    field = tensors.DATATYPES[datatype].contents_field
    assert field is not None
    items = [v.encode() for v in values] if datatype == "BYTES" else values
    message = service_pb2.ModelInferRequest()
    message.inputs.add(name="IN", datatype=datatype, shape=[4]).contents.CopyFrom(
        service_pb2.InferTensorContents(**{field: items})
    )
    request = decode(message.SerializeToString(), PROTOBUF_HEADERS)
    assert list(request.infer_request.raw_input_contents) == [raw_of(datatype, values)]
    assert not request.infer_request.inputs[0].HasField("contents")


def test_nested_and_flat_json_decode_to_the_same_bytes() -> None:
    """Nested row-major data and flat data give identical raw input."""
    nested = decode(
        json_request(
            inputs=[{"name": "X", "shape": [2, 2], "datatype": "INT64", "data": [[1, 2], [3, 4]]}]
        )
    )
    flat = decode(
        json_request(
            inputs=[{"name": "X", "shape": [2, 2], "datatype": "INT64", "data": [1, 2, 3, 4]}]
        )
    )
    assert nested.infer_request.raw_input_contents == flat.infer_request.raw_input_contents


def test_json_request_fields_reach_triton() -> None:
    """Outputs and parameters are forwarded; HTTP framing parameters are not."""
    request = decode(
        json_request(
            parameters={"priority": 2, "tag": "a", "binary_data_output": True, "w": 0.5},
            outputs=[{"name": "OUT", "parameters": {"classification": 3, "binary_data": True}}],
        )
    )
    params = request.infer_request.parameters
    assert set(params) == {"priority", "tag", "w"}
    assert (params["priority"].int64_param, params["tag"].string_param) == (2, "a")
    assert params["w"].double_param == 0.5
    (output,) = request.infer_request.outputs
    assert output.name == "OUT"
    assert dict(output.parameters)["classification"].int64_param == 3
    assert "binary_data" not in output.parameters


# --- Model name and request id.


def test_header_model_wins_over_body_and_default() -> None:
    """x-model-name/x-model-version beat body model_name and the default."""
    request = decode(
        json_request(model_name="body", model_version="1"),
        [("X-Model-Name", b"hdr"), ("X-MODEL-VERSION", b"2")],
    )
    assert (request.model_name, request.model_version) == ("hdr", "2")
    assert request.infer_request.model_name == "hdr"
    assert request.infer_request.model_version == "2"


@pytest.mark.parametrize(("asked", "sent"), [("01", "1"), ("0007", "7"), ("00", "0"), ("", "")])
def test_a_version_has_one_spelling(asked: str, sent: str) -> None:
    """Leading zeros go (Triton reads "01" as 1): one key per version the worker keeps state for."""
    request = decode(json_request(model_name="m"), [("x-model-version", asked.encode())])
    assert request.model_version == request.infer_request.model_version == sent


@pytest.mark.parametrize("version", ["1.0", "1a", "\u0661", "\u00b2", "-1"])
def test_a_version_that_is_not_ascii_digits_is_invalid(version: str) -> None:
    """Only ASCII digits name a version (an Arabic-Indic or superscript digit does not)."""
    error = error_of(json_request(model_name="m"), [("x-model-version", version.encode())])
    assert isinstance(error, InvalidRequest)


def test_body_version_dropped_when_header_names_another_model() -> None:
    """The body's version belongs to the body's model, not to the header's."""
    request = decode(json_request(model_name="body", model_version="1"), [("x-model-name", b"h")])
    assert (request.model_name, request.model_version) == ("h", "")


def test_body_model_then_default_model() -> None:
    """Body model_name beats the default; the default applies when nothing names one."""
    assert decode(json_request(model_name="body")).model_name == "body"
    assert decode(json_request()).model_name == "default-model"


def test_no_model_anywhere_is_model_not_found() -> None:
    """Without header, body or default the record is MODEL_NOT_FOUND with guidance."""
    error = error_of(json_request(), default_model=None)
    assert isinstance(error, ModelNotFound)
    assert error.message == (
        "no model named: set header x-model-name, body model_name, or WORKER_DEFAULT_MODEL"
    )


def test_non_numeric_version_is_invalid() -> None:
    """A model version must be a number (or empty for the latest)."""
    assert isinstance(error_of(json_request(), [("x-model-version", b"v2")]), InvalidRequest)


def test_request_id_precedence() -> None:
    """Body id beats header x-request-id, which beats topic-partition-offset."""
    hdr = [("x-request-id", b"from-header")]
    assert decode(json_request(id="from-body"), hdr).request_id == "from-body"
    assert decode(json_request(), hdr).request_id == "from-header"
    assert decode(json_request()).request_id == "requests-3-42"
    assert decode(json_request()).infer_request.id == ""


def test_content_type_parameters_and_case_are_ignored() -> None:
    """'Application/JSON; charset=utf-8' is JSON."""
    request = decode(json_request(), [("Content-Type", b"Application/JSON; charset=utf-8")])
    assert request.encoding == "json"
    assert request.payload_bytes == len(json_request())


# --- Bad records: each gives the right code and says where.


@pytest.mark.parametrize(
    ("value", "headers", "error_type", "fragment"),
    [
        (None, (), DecodeError, "record value is null"),
        (b"{not json", (), DecodeError, "request body is not valid JSON"),
        (b'{"inputs": "x"}', (), DecodeError, r"Expected `array`, got `str` - at `\$.inputs`"),
        (
            b'{"inputs": [{"name": "X", "shape": [1], "datatype": "FP8", "data": [1]}]}',
            (),
            DecodeError,
            r"\$.inputs\[0\].datatype",
        ),
        (b'{"id": "\xff", "inputs": []}', (), DecodeError, "not valid JSON: Invalid UTF-8"),
        (
            b'{"inputs": [{"name": "X", "shape": [1], "datatype": "FP32"}]}',
            (),
            DecodeError,
            r"inputs\[0\]: no data",
        ),
        (b"{}", [("content-type", b"text/plain")], DecodeError, "'text/plain' is not supported"),
        (VALID, [("x-model-name", b"\xff")], DecodeError, "header x-model-name: value is not"),
        (b"not a protobuf", PROTOBUF_HEADERS, DecodeError, "not a serialized inference"),
        (b"\x08\x01", PROTOBUF_HEADERS, DecodeError, "inputs: none given"),
        (b"", PROTOBUF_HEADERS, DecodeError, "inputs: none given"),
        (b'{"inputs": []}', (), DecodeError, r"Expected `array` of length >= 1"),
    ],
)
def test_undecodable_records(
    value: bytes | None, headers: Headers, error_type: type[WorkerError], fragment: str
) -> None:
    """Records that cannot be decoded, or do not match the schema, are DECODE_ERROR."""
    error = error_of(value, headers)
    assert type(error) is error_type
    assert error.code == "DECODE_ERROR"
    assert not error.retryable
    assert re.search(fragment, error.message), error.message


def test_data_length_mismatch_names_input() -> None:
    """15 values for shape [4, 4] is INVALID_REQUEST naming inputs[1].data."""
    value = json_request(
        inputs=[
            {"name": "A", "shape": [1], "datatype": "FP32", "data": [1.0]},
            {"name": "B", "shape": [4, 4], "datatype": "FP32", "data": [0.0] * 15},
        ]
    )
    error = error_of(value)
    assert (error.code, error.message) == (
        "INVALID_REQUEST",
        "inputs[1].data: 15 elements, shape [4, 4] needs 16",
    )


def test_nested_inconsistent_and_out_of_range_are_invalid() -> None:
    """Ragged nesting and values outside the datatype are INVALID_REQUEST with positions."""
    ragged = json_request(
        inputs=[{"name": "A", "shape": [2, 2], "datatype": "INT8", "data": [[1, 2], [3]]}]
    )
    assert error_of(ragged).message.startswith("inputs[0].data[1]: 1 elements")
    overflow = json_request(
        inputs=[{"name": "A", "shape": [2], "datatype": "UINT8", "data": [1, 300]}]
    )
    error = error_of(overflow)
    assert (error.code, error.message) == (
        "INVALID_REQUEST",
        "inputs[0].data[1]: expected `int` <= 255 for UINT8",
    )


def test_duplicate_input_name_is_invalid() -> None:
    """The same input twice is INVALID_REQUEST."""
    x = {"name": "X", "shape": [1], "datatype": "FP32", "data": [1.0]}
    assert "given more than once" in error_of(json_request(inputs=[x, x])).message


def test_oversized_value_is_too_large_before_parsing() -> None:
    """A value over the limit is TOO_LARGE even when it is not valid JSON."""
    error = error_of(b"{" * 2000, max_request_bytes=1000)
    assert isinstance(error, TooLarge)
    assert error.message == "record value is 2000 bytes, over the 1000-byte limit"


def test_decoded_tensors_over_limit_are_too_large() -> None:
    """JSON that expands past the limit once packed is TOO_LARGE."""
    value = json_request(
        inputs=[{"name": "X", "shape": [200], "datatype": "INT64", "data": [0] * 200}]
    )
    assert len(value) < 1000
    error = error_of(value, max_request_bytes=1000)
    assert isinstance(error, TooLarge)
    assert "decoded tensors are 1600 bytes" in error.message


def test_huge_claimed_shape_is_refused_in_every_encoding_without_allocating() -> None:
    """shape [10**12] with tiny data fails in JSON, binary and protobuf, allocating little."""
    shape = [10**12]
    json_value = json_request(
        inputs=[{"name": "X", "shape": shape, "datatype": "FP32", "data": [1.0]}]
    )
    binary_value, binary_headers = binary_request(
        {
            "inputs": [
                {
                    "name": "X",
                    "shape": shape,
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": 4},
                }
            ]
        },
        [b"\x00" * 4],
    )
    message = service_pb2.ModelInferRequest()
    message.inputs.add(name="X", datatype="FP32", shape=shape)
    message.raw_input_contents.append(b"\x00" * 4)
    typed = service_pb2.ModelInferRequest()
    typed.inputs.add(name="X", datatype="FP32", shape=shape).contents.fp32_contents.append(1.0)
    tracemalloc.start()
    try:
        errors = [
            error_of(json_value),
            error_of(binary_value, binary_headers),
            error_of(message.SerializeToString(), PROTOBUF_HEADERS),
            error_of(typed.SerializeToString(), PROTOBUF_HEADERS),
        ]
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [e.code for e in errors] == ["INVALID_REQUEST"] * 4
    assert all("1000000000000" in e.message or "4000000000000" in e.message for e in errors)
    assert peak < 1_000_000


def test_binary_header_length_past_end() -> None:
    """inference-header-content-length beyond the value is DECODE_ERROR."""
    headers = [
        ("content-type", b"application/octet-stream"),
        ("inference-header-content-length", b"500"),
    ]
    error = error_of(b"{}", headers)
    assert (error.code, error.message) == (
        "DECODE_ERROR",
        "header inference-header-content-length: 500 is past the end of the value (2 bytes)",
    )


@pytest.mark.parametrize("length", [None, b"abc", b"-1"])
def test_binary_header_length_missing_or_not_a_number(length: bytes | None) -> None:
    """Binary records need a numeric inference-header-content-length."""
    headers = [("content-type", b"application/octet-stream")]
    if length is not None:
        headers.append(("inference-header-content-length", length))
    error = error_of(b"{}", headers)
    assert error.code == "DECODE_ERROR"
    assert "inference-header-content-length" in error.message


def test_binary_data_sizes_must_cover_the_remaining_bytes() -> None:
    """binary_data_size totals that differ from the bytes after the header are DECODE_ERROR."""
    header = {
        "inputs": [
            {"name": "X", "shape": [2], "datatype": "FP32", "parameters": {"binary_data_size": 8}}
        ]
    }
    value, headers = binary_request(header, [b"\x00" * 12])
    error = error_of(value, headers)
    assert error.code == "DECODE_ERROR"
    assert "totalling 8 bytes, but 12 bytes follow" in error.message


def test_binary_data_size_not_matching_shape_is_invalid() -> None:
    """A blob whose size does not fit the input's shape is INVALID_REQUEST."""
    header = {
        "inputs": [
            {"name": "X", "shape": [3], "datatype": "FP32", "parameters": {"binary_data_size": 8}}
        ]
    }
    value, headers = binary_request(header, [b"\x00" * 8])
    assert error_of(value, headers).message == (
        "inputs[0]: 8 bytes of data, shape [3] of FP32 needs 12"
    )


def test_binary_data_size_outside_binary_encoding_is_refused() -> None:
    """binary_data_size in a plain JSON record cannot be honoured."""
    value = json_request(
        inputs=[
            {"name": "X", "shape": [1], "datatype": "FP32", "parameters": {"binary_data_size": 4}}
        ]
    )
    assert "needs content-type application/octet-stream" in error_of(value).message


def test_binary_input_with_both_data_and_size_is_refused() -> None:
    """An input cannot carry JSON data and binary data at once."""
    header = {
        "inputs": [
            {
                "name": "X",
                "shape": [1],
                "datatype": "FP32",
                "data": [1.0],
                "parameters": {"binary_data_size": 4},
            }
        ]
    }
    value, headers = binary_request(header, [b"\x00" * 4])
    assert "has both data and binary_data_size" in error_of(value, headers).message


def test_protobuf_raw_count_and_mixing_are_checked() -> None:
    """raw_input_contents must be one per input and not mixed with typed contents."""
    message = service_pb2.ModelInferRequest()
    message.inputs.add(name="A", datatype="FP32", shape=[1])
    message.inputs.add(name="B", datatype="FP32", shape=[1])
    message.raw_input_contents.append(b"\x00" * 4)
    assert (
        "1 entries for 2 inputs" in error_of(message.SerializeToString(), PROTOBUF_HEADERS).message
    )
    message.raw_input_contents.append(b"\x00" * 4)
    message.inputs[1].contents.fp32_contents.append(1.0)
    error = error_of(message.SerializeToString(), PROTOBUF_HEADERS)
    assert (error.code, error.message) == (
        "DECODE_ERROR",
        "inputs[1].contents: mixed with raw_input_contents; use one form",
    )


def test_protobuf_unknown_datatype_is_a_decode_error() -> None:
    """A datatype Triton does not know is DECODE_ERROR in protobuf too."""
    message = service_pb2.ModelInferRequest()
    message.inputs.add(name="A", datatype="FP8", shape=[1])
    message.raw_input_contents.append(b"\x00")
    error = error_of(message.SerializeToString(), PROTOBUF_HEADERS)
    assert error.code == "DECODE_ERROR"
    assert error.message.startswith("inputs[0].datatype: unknown datatype 'FP8'")
