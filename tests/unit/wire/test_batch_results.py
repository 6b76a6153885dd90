"""A batched response encoded per record: the same bytes as splitting it, then encoding each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from worker.errors import OutputTooLarge
from worker.events import decode_event, load_mappings
from worker.triton.merging import split
from worker.wire import DecodedRequest, DecodeLimits, Source, encode_result
from worker.wire.batch_results import BatchResults
from worker.wire.messages import set_parameters
from worker.wire.tensors import DATATYPES

NUMERIC = [name for name, dt in DATATYPES.items() if dt.dtype is not None]
parameter_values = st.one_of(st.text(max_size=8), st.integers(-(2**40), 2**40), st.booleans())
# At most one key: a protobuf map's order does not survive a copy (the split copies each
# map), so with two keys the split's own results may list them either way.
parameters = st.dictionaries(st.sampled_from(["a", 'ü"q']), parameter_values, max_size=1)


def _request(request_id: str, model: str, encoding: str) -> DecodedRequest:
    return DecodedRequest(
        request_id=request_id,
        model_name=model,
        model_version="3",
        encoding=encoding,  # type: ignore[arg-type]
        infer_request=service_pb2.ModelInferRequest(),
        binary_outputs=encoding == "binary",
        payload_bytes=0,
    )


@st.composite
def batches(draw: st.DrawFn) -> tuple[Any, list[int], list[DecodedRequest]]:
    """A batched response with numeric outputs, the rows of each request, the requests."""
    rows = draw(st.lists(st.integers(1, 3), min_size=2, max_size=5))
    total = sum(rows)
    response = service_pb2.ModelInferResponse(
        model_name=draw(st.sampled_from(["", "mlp"])),
        model_version=draw(st.sampled_from(["", "1"])),
    )
    set_parameters(response.parameters, draw(parameters), "parameters", ())
    for index in range(draw(st.integers(1, 3))):
        datatype = draw(st.sampled_from(NUMERIC))
        rest = draw(st.lists(st.integers(0, 3), max_size=2))
        tensor = response.outputs.add(name=f"OUT{index}", datatype=datatype, shape=[total, *rest])
        set_parameters(tensor.parameters, draw(parameters), "parameters", ())
        size = total * DATATYPES[datatype].size_bytes
        for dim in rest:
            size *= dim
        response.raw_output_contents.append(draw(st.binary(min_size=size, max_size=size)))
    requests = [
        _request(draw(st.text(max_size=6)), "mlp", draw(st.sampled_from(["json", "binary"])))
        for _ in rows
    ]
    return response, rows, requests


@settings(max_examples=300, deadline=None, database=None)
@given(batches())
def test_each_record_gets_the_bytes_its_split_response_encodes_to(
    batch: tuple[Any, list[int], list[DecodedRequest]],
) -> None:
    """Byte for byte, value and headers, JSON and binary, any numeric datatype and shape."""
    response, rows, requests = batch
    parts = split(response, rows, sum(rows))
    expected = [encode_result(r, part) for r, part in zip(requests, parts, strict=True)]
    together = BatchResults.of(response, rows)
    assert together is not None
    got = [
        together.encode(i, n, r, None) for i, (n, r) in enumerate(zip(rows, requests, strict=True))
    ]
    assert got == expected
    assert together.model_version == response.model_version


def _response(datatype: str = "FP32", shape: tuple[int, ...] = (2, 1)) -> Any:
    response = service_pb2.ModelInferResponse(model_name="mlp", model_version="1")
    response.outputs.add(name="OUT", datatype=datatype, shape=list(shape))
    response.raw_output_contents.append(b"\x00" * 8)
    return response


@pytest.mark.parametrize(
    ("response", "why"),
    [
        (_response("BYTES"), "BYTES output"),
        (_response(shape=(3, 1)), "batch dimension is not the batch's rows"),
        (_response(shape=(2, 2)), "raw size does not match the shape"),
        (_response("NOPE"), "unknown datatype"),
        (service_pb2.ModelInferResponse(model_name="mlp"), "no outputs"),
    ],
)
def test_what_it_does_not_cover_is_left_to_the_split(response: Any, why: str) -> None:
    """None: the caller splits the response (which says what is wrong with it)."""
    assert BatchResults.of(response, [1, 1]) is None, why


def test_typed_contents_are_left_to_the_split() -> None:
    response = _response()
    del response.raw_output_contents[:]
    response.outputs[0].contents.fp32_contents.extend([1.0, 2.0])
    assert BatchResults.of(response, [1, 1]) is None


def test_a_result_over_the_limit_is_refused_as_encode_result_refuses_it() -> None:
    """OutputTooLarge with the same message; the other records are not affected."""
    response = _response()
    requests = [_request("a" * 50, "mlp", "json"), _request("b", "mlp", "json")]
    parts = split(response, [1, 1], 2)
    small = len(encode_result(requests[1], parts[1])[0])
    together = BatchResults.of(response, [1, 1])
    assert together is not None
    with pytest.raises(OutputTooLarge) as expected:
        encode_result(requests[0], parts[0], max_result_bytes=small)
    with pytest.raises(OutputTooLarge) as got:
        together.encode(0, 1, requests[0], small)
    assert got.value.message == expected.value.message
    assert together.encode(1, 1, requests[1], small) == encode_result(requests[1], parts[1])


EVENTS = """
[topics.events]
model = "mlp"
request_id = "/id"
[topics.events.inputs.INPUT0]
datatype = "FP32"
from = "$.x"
shape = [2]
[topics.events.result.fields]
id = "/id"
score = "PROBS[1]"
probs = "PROBS"
label = { argmax = "PROBS", labels = ["a", "b", "c"] }
ones = "COUNT"

[topics.enriched]
model = "mlp"
[topics.enriched.inputs.INPUT0]
datatype = "FP32"
from = "$.x"
shape = [2]
[topics.enriched.result]
into = "out"
"""


def test_mapped_events_in_a_batch_get_the_events_their_split_responses_make(
    tmp_path: Path,
) -> None:
    """Events of both result forms, plain and as CloudEvents, beside an inference request:
    each event's result from the batch's rows is the one its own response makes."""
    path = tmp_path / "mapping.toml"
    path.write_text(EVENTS)
    mappings = load_mappings(str(path), ("events", "enriched"))
    limits = DecodeLimits(max_request_bytes=1 << 20)
    binary_ce = [
        ("ce_specversion", b"1.0"),
        ("ce_id", b"c-1"),
        ("ce_source", b"/s"),
        ("ce_type", b"t"),
    ]
    structured = [("content-type", b"application/cloudevents+json")]
    envelope = {"specversion": "1.0", "id": "c-2", "source": "/s", "type": "t"}
    made = [
        ("events", orjson.dumps({"id": "e-1", "x": [1, 2]}), []),
        ("enriched", orjson.dumps({"x": [3, 4], "note": "é"}), binary_ce),
        ("events", orjson.dumps({**envelope, "data": {"id": 7, "x": [5, 6]}}), structured),
    ]
    requests = [
        decode_event(mappings[topic], value, headers, Source(topic, 0, i), limits)
        for i, (topic, value, headers) in enumerate(made)
    ]
    for request in requests:
        request.event.batched = True  # as fit() leaves it for a batching model
    requests.insert(1, _request("oip", "mlp", "json"))
    rows = [1] * len(requests)
    response = service_pb2.ModelInferResponse(model_name="mlp", model_version="1")
    probs = np.random.default_rng(3).random((len(rows), 3)).astype(np.float32)
    for name, datatype, array in (
        ("PROBS", "FP32", probs),
        ("COUNT", "INT64", np.arange(len(rows), dtype=np.int64).reshape(-1, 1)),
    ):
        response.outputs.add(name=name, datatype=datatype, shape=list(array.shape))
        response.raw_output_contents.append(array.tobytes())
    parts = split(response, rows, len(rows))
    expected = [encode_result(r, part) for r, part in zip(requests, parts, strict=True)]
    together = BatchResults.of(response, rows)
    assert together is not None
    got = [together.encode(i, 1, r, None) for i, r in enumerate(requests)]
    assert got == expected
    first = orjson.loads(got[0][0])
    assert first["probs"] == pytest.approx(probs[0].tolist()) and first["ones"] == [0]
    assert orjson.loads(got[3][0])["data"]["label"] == "abc"[int(np.argmax(probs[3]))]
    with pytest.raises(OutputTooLarge):
        together.encode(0, 1, requests[0], 10)
