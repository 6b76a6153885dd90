"""The committed JSON Schemas: generated from the code, and true to what the codec does."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2

from devtools.schemas import default_schema_dir, render_schema, write_schemas
from worker import wire
from worker.errors import DecodeError, InvalidRequest, WorkerError
from worker.wire import tensors
from worker.wire.messages import DATATYPE_NAMES, generate_schemas

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"


def validator(name: str) -> jsonschema.Draft202012Validator:
    """A validator for the committed schema file `name`."""
    schema = json.loads((SCHEMA_DIR / name).read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def decode(value: bytes, headers: wire.Headers = ()) -> wire.DecodedRequest:
    """Decode with a default model and a generous limit."""
    return wire.decode_request(
        value,
        headers,
        source=wire.Source("t", 0, 1),
        default_model="m",
        limits=wire.DecodeLimits(1 << 20),
    )


GOOD_REQUESTS: list[dict[str, Any]] = [
    {"inputs": [{"name": "X", "shape": [2], "datatype": "FP32", "data": [1.0, 2]}]},
    {
        "id": "r-1",
        "model_name": "simple",
        "model_version": "1",
        "parameters": {"priority": 1, "tag": "x", "flag": True, "w": 0.5},
        "inputs": [
            {"name": "A", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]},
            {"name": "B", "shape": [1], "datatype": "BYTES", "data": ["héllo"]},
        ],
        "outputs": [{"name": "OUT", "parameters": {"classification": 2}}],
        "unknown_top_level_field": {"ignored": True},
    },
]
BAD_REQUESTS: list[dict[str, Any]] = [
    {},
    {"inputs": "x"},
    {"inputs": [{"name": "X", "shape": [1], "datatype": "FP8", "data": [1]}]},
    {"inputs": [{"name": "X", "shape": [-1], "datatype": "FP32", "data": [1]}]},
    {"inputs": [{"name": "", "shape": [1], "datatype": "FP32", "data": [1]}]},
    {"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": 1}]},
    {"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]},
    {"inputs": []},
    {"id": 5, "inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]},
    {
        "inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}],
        "parameters": {"nested": {"a": 1}},
    },
]


def test_committed_schemas_equal_generated() -> None:
    """schemas/*.json are exactly what `python -m devtools schemas` writes."""
    generated = generate_schemas()
    assert sorted(p.name for p in SCHEMA_DIR.glob("*.json")) == sorted(generated)
    for name, schema in generated.items():
        assert (SCHEMA_DIR / name).read_text(encoding="utf-8") == render_schema(schema), name
    assert default_schema_dir() == SCHEMA_DIR


def test_write_schemas_writes_canonical_files(tmp_path: Path) -> None:
    """The regeneration entry point writes pretty, sorted, newline-terminated files."""
    written = write_schemas(tmp_path)
    assert sorted(p.name for p in written) == sorted(generate_schemas())
    for path in written:
        text = path.read_text(encoding="utf-8")
        assert text.endswith("}\n")
        assert (
            text
            == json.dumps(json.loads(text), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        )


@pytest.mark.parametrize("body", GOOD_REQUESTS)
def test_good_requests_pass_schema_and_decoder(body: dict[str, Any]) -> None:
    """Valid requests validate against the schema and decode."""
    validator("request.schema.json").validate(body)
    assert decode(orjson.dumps(body)).request_id in ("t-0-1", "r-1")


@pytest.mark.parametrize("body", BAD_REQUESTS)
def test_bad_requests_fail_schema_and_decoder(body: dict[str, Any]) -> None:
    """Requests the schema rejects are also DECODE_ERROR for the decoder."""
    assert list(validator("request.schema.json").iter_errors(body))
    with pytest.raises(DecodeError):
        decode(orjson.dumps(body))


def test_schema_allows_what_only_the_decoder_can_check() -> None:
    """Counts against shape are beyond JSON Schema: schema-valid, yet INVALID_REQUEST."""
    body = {"inputs": [{"name": "X", "shape": [4], "datatype": "FP32", "data": [1.0]}]}
    validator("request.schema.json").validate(body)
    with pytest.raises(InvalidRequest):
        decode(orjson.dumps(body))


def response_for(datatype: str, raw: bytes, count: int) -> Any:
    """A one-output ModelInferResponse."""
    response = service_pb2.ModelInferResponse(model_name="m", model_version="1")
    response.outputs.add(name="OUT", datatype=datatype, shape=[count])
    response.raw_output_contents.append(raw)
    return response


@pytest.mark.parametrize("datatype", DATATYPE_NAMES)
def test_json_results_match_result_schema(datatype: str) -> None:
    """Encoded JSON results of every datatype validate against result.schema.json."""
    if datatype == "BYTES":
        raw = tensors.serialize_bytes_tensor([b"ok", b"\xff"])
    else:
        dtype = tensors.DATATYPES[datatype].dtype
        assert dtype is not None
        raw = np.ones(2, dtype=dtype).tobytes()
    request = decode(b'{"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [1]}]}')
    value, _ = wire.encode_result(request, response_for(datatype, raw, 2))
    validator("result.schema.json").validate(orjson.loads(value))


def test_binary_result_header_matches_result_schema() -> None:
    """The JSON header of a binary result validates against result.schema.json."""
    binary_input: dict[str, object] = {"name": "X", "shape": [1], "datatype": "FP32"}
    binary_input["parameters"] = {"binary_data_size": 4}
    head = orjson.dumps({"inputs": [binary_input]})
    headers = [
        ("content-type", b"application/octet-stream"),
        ("inference-header-content-length", str(len(head)).encode()),
    ]
    request = decode(head + b"\x00\x00\x80?", headers)
    value, result_headers = wire.encode_result(request, response_for("FP32", b"\x00\x00\x80?", 1))
    length = int(dict(result_headers)["inference-header-content-length"])
    validator("result.schema.json").validate(orjson.loads(value[:length]))


@pytest.mark.parametrize("error", [InvalidRequest("x" * 5000), DecodeError("bad")])
def test_dead_letter_headers_match_schema(error: WorkerError) -> None:
    """Dead-letter headers, read as UTF-8 strings, validate against dead-letter.schema.json."""
    built = wire.dead_letter_headers(
        [("trace", b"1")],
        error,
        attempts=0,
        source=wire.Source("t", 2, 9, 1714557600000),
        group_id="g",
        failed_at=datetime(2024, 5, 1, tzinfo=UTC),
    )
    as_json: dict[str, str] = {}
    for name, value in built:
        assert value is not None, name
        as_json[name] = value.decode()
    validator("dead-letter.schema.json").validate(as_json)
    as_json["x-error-code"] = "TRITON_UNAVAILABLE"
    assert list(validator("dead-letter.schema.json").iter_errors(as_json))
