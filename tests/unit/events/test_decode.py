"""A mapped event to a request and its response to a result event: each mapping form, each
result form, and what a hostile event gets (the field path and what was expected)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2

from worker.errors import DecodeError, InferenceError, InvalidRequest, TooLarge
from worker.events import TopicMapping, decode_event, load_mappings
from worker.events.mapping import ResultForm
from worker.triton.merging import merge
from worker.wire import DecodeLimits, Source, encode_result
from worker.wire.requests import pack_group
from worker.wire.validation import ModelSpec, TensorSpec, check_request

MAPPING = """
[topics.payments]
model = "mlp"
request_id = "/payment_id"
[topics.payments.inputs.INPUT0]
datatype = "FP32"
fields = ["/amount", "/customer/age", "/hour"]
default = -1
[topics.payments.result]
into = "prediction"

[topics.grid]
model = "grid"
[topics.grid.inputs.CELLS]
datatype = "INT8"
from = "$.cells"
shape = [2, -1]
[topics.grid.inputs.NAME]
datatype = "BYTES"
from = "$.name"
shape = [1]
[topics.grid.result.fields]
id = "/id"
score = "PROBS[1]"
probs = "PROBS"
label = { argmax = "PROBS", labels = ["low", "mid", "high"] }
"""

LIMITS = DecodeLimits(max_request_bytes=4 * 1024 * 1024, max_tensor_elements=1000)
SOURCE = Source("payments", 2, 17)
MLP = ModelSpec(
    "mlp", "1", (TensorSpec("INPUT0", "FP32", (3,)),), (TensorSpec("PROBS", "FP32", (2,)),), 8
)


@pytest.fixture(scope="module")
def mappings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TopicMapping]:
    path = tmp_path_factory.mktemp("mapping") / "mapping.toml"
    path.write_text(MAPPING)
    return load_mappings(str(path), ("payments", "grid"))


def decode(mapping: TopicMapping, event: Any, headers: Any = ()) -> Any:
    value = event if isinstance(event, bytes) else orjson.dumps(event)
    return decode_event(mapping, value, headers, SOURCE, LIMITS)


def inputs(request: Any) -> list[tuple[str, list[int], bytes]]:
    infer = request.infer_request
    return [
        (t.name, list(t.shape), raw)
        for t, raw in zip(infer.inputs, infer.raw_input_contents, strict=True)
    ]


def response(**outputs: np.ndarray) -> Any:
    message = service_pb2.ModelInferResponse(model_name="m", model_version="1")
    for name, array in outputs.items():
        out = message.outputs.add(name=name, datatype="FP32")
        out.shape.extend(array.shape)
        message.raw_output_contents.append(array.astype("<f4").tobytes())
    return message


def test_scalar_fields_are_gathered_into_one_vector(mappings: dict[str, TopicMapping]) -> None:
    event = {"payment_id": "p-1", "amount": 12.5, "customer": {"age": 40}, "hour": None}
    request = decode(mappings["payments"], event)
    ((name, shape, raw),) = inputs(request)
    assert (name, shape) == ("INPUT0", [3])
    # hour is null: the default stands in for it
    assert np.frombuffer(raw, "<f4").tolist() == [12.5, 40.0, -1.0]
    assert (request.request_id, request.model_name, request.encoding) == ("p-1", "mlp", "json")
    with pytest.raises(InvalidRequest, match="expects"):  # shaped per event until fitted
        check_request(MLP, request)
    request.event.fit(MLP, request)
    request.event.fit(MLP, request)  # once only
    assert list(request.infer_request.inputs[0].shape) == [1, 3]
    check_request(MLP, request)


def test_the_request_id_falls_back_to_the_header_then_the_record(
    mappings: dict[str, TopicMapping],
) -> None:
    event = {"amount": 1, "customer": {"age": 2}, "hour": 3}
    assert decode(mappings["payments"], event, [("x-request-id", b"h-9")]).request_id == "h-9"
    assert decode(mappings["payments"], event).request_id == "payments-2-17"
    assert decode(mappings["payments"], {**event, "payment_id": 77}).request_id == "77"
    with pytest.raises(InvalidRequest, match=r"\$.payment_id: expected a string or an integer"):
        decode(mappings["payments"], {**event, "payment_id": [1]})


def test_a_nested_array_keeps_its_shape_and_a_string_is_a_bytes_input(
    mappings: dict[str, TopicMapping],
) -> None:
    request = decode(mappings["grid"], {"cells": [[1, 2, 3], [4, 5, 6]], "name": "é"})
    (cells, cells_shape, cells_raw), (name, name_shape, name_raw) = inputs(request)
    assert (cells, cells_shape, np.frombuffer(cells_raw, "i1").tolist()) == (
        "CELLS",
        [2, 3],
        [1, 2, 3, 4, 5, 6],
    )
    assert (name, name_shape, name_raw) == ("NAME", [1], b"\x02\x00\x00\x00\xc3\xa9")
    assert [o.name for o in request.infer_request.outputs] == ["PROBS"]


@pytest.mark.parametrize(
    ("event", "error", "message"),
    [
        (
            {"cells": [[1, 2], [3, "n/a"]], "name": "a"},
            InvalidRequest,
            r'^\$.cells\[1\]\[1\]: expected an integer in -128..127 \(INT8\), got "n/a"$',
        ),
        (
            {"cells": [[1, 2], [3, 300]], "name": "a"},
            InvalidRequest,
            r"^\$.cells\[1\]\[1\]: expected an integer in -128..127 \(INT8\), got 300$",
        ),
        (
            {"cells": [[1, 2], [3, True]], "name": "a"},
            InvalidRequest,
            r"^\$.cells\[1\]\[1\]: expected an integer .* got true$",
        ),
        (
            {"cells": [[1, 2, 3], [4, 5]], "name": "a"},
            InvalidRequest,
            r"^\$.cells\[1\]: 2 elements, expected as many as its siblings, 3 \(dimension 1",
        ),
        (
            {"cells": [[1, 2]], "name": "a"},
            InvalidRequest,
            r"^\$.cells: 1 elements, expected 2 \(dimension 0 of shape \[2, -1\]\)$",
        ),
        (
            {"cells": [[[1]], [[2]]], "name": "a"},
            InvalidRequest,
            r"^\$.cells\[0\]\[0\]: expected an integer .* got \[1\]$",
        ),
        (
            {"cells": 5, "name": "a"},
            InvalidRequest,
            r"^\$.cells: expected a list \(dimension 0 of shape \[2, -1\]\), got 5$",
        ),
        (
            {"name": "a"},
            InvalidRequest,
            r"^\$.cells: missing; expected an integer in -128..127 \(INT8\) for input CELLS of "
            r"model 'grid' \(the mapping of topic 'grid' gives no default\)$",
        ),
        (
            {"cells": [[1], [2]], "name": None},
            InvalidRequest,
            r"^\$.name: null; expected a string for input NAME",
        ),
        (
            {"cells": [[1], [2]], "name": 5},
            InvalidRequest,
            r"^\$.name: expected a string, got 5$",
        ),
        (
            {"cells": [list(range(200))] * 2, "name": "a"},
            InvalidRequest,
            r"^\$.cells\[0\]\[128\]: expected an integer in -128..127 \(INT8\), got 128$",
        ),
        (
            {"cells": [[0] * 600] * 2, "name": "a"},
            TooLarge,
            r"input CELLS.* 1200 elements",
        ),
        ([1, 2], DecodeError, r"^record value: topic 'grid' expects a JSON object .* got list$"),
        (b"null", DecodeError, r"got null$"),
        (b"{", DecodeError, r"^record value is not valid JSON"),
        (b"[" * 5000 + b"]" * 5000, DecodeError, r"^record value is not valid JSON"),
    ],
)
def test_a_hostile_event_is_refused_naming_the_field(
    mappings: dict[str, TopicMapping], event: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        decode(mappings["grid"], event)


def test_a_huge_string_where_a_number_belongs_is_shown_cut(
    mappings: dict[str, TopicMapping],
) -> None:
    event = {"amount": "x" * 1024 * 1024, "customer": {"age": 1}, "hour": 2}
    with pytest.raises(InvalidRequest) as caught:
        decode(mappings["payments"], event)
    assert caught.value.message.startswith('$.amount: expected a number (FP32), got "xxx')
    assert caught.value.message.endswith("... (1048578 characters)")
    assert len(caught.value.message) < 200


def test_the_limits_hold_before_the_event_is_parsed(mappings: dict[str, TopicMapping]) -> None:
    small = DecodeLimits(max_request_bytes=64)
    with pytest.raises(TooLarge, match="over the 64-byte limit"):
        decode_event(mappings["payments"], b'{"amount": 1' + b" " * 64 + b"}", (), SOURCE, small)
    with pytest.raises(DecodeError, match="tombstone"):
        decode_event(mappings["payments"], None, (), SOURCE, LIMITS)


def test_a_byte_order_mark_is_read_past(mappings: dict[str, TopicMapping]) -> None:
    value = b"\xef\xbb\xbf" + orjson.dumps({"amount": 1, "customer": {"age": 2}, "hour": 3})
    assert inputs(decode(mappings["payments"], value))[0][1] == [3]


def test_the_result_is_the_event_enriched(mappings: dict[str, TopicMapping]) -> None:
    event = {"payment_id": "p-1", "amount": 1, "customer": {"age": 2}, "hour": 3, "note": "é"}
    request = decode(mappings["payments"], event)
    request.event.fit(MLP, request)
    value, headers = encode_result(request, response(PROBS=np.array([[0.25, 0.75]])))
    assert orjson.loads(value) == {**event, "prediction": {"PROBS": [0.25, 0.75]}}
    assert headers == [("content-type", b"application/json")]


def test_the_result_is_a_new_event_of_the_chosen_fields(
    mappings: dict[str, TopicMapping],
) -> None:
    request = decode(mappings["grid"], {"id": 5, "cells": [[1], [2]], "name": "a"})
    value, _ = encode_result(request, response(PROBS=np.array([0.125, 0.25, 0.625])))
    assert orjson.loads(value) == {
        "id": 5,
        "score": 0.25,
        "probs": [0.125, 0.25, 0.625],
        "label": "high",
    }
    # a field the event lacks is null in the result
    request = decode(mappings["grid"], {"cells": [[1], [2]], "name": "a"})
    assert orjson.loads(encode_result(request, response(PROBS=np.ones(3)))[0])["id"] is None


@pytest.mark.parametrize(
    ("probs", "label"),
    [
        ([np.nan, 0.25, 0.125], "mid"),
        ([0.5, np.nan, 0.625], "high"),
        ([np.nan, np.nan, np.nan], None),
        ([-np.inf, -np.inf, -np.inf], "low"),
    ],
)
def test_an_argmax_passes_over_nan_and_a_row_of_nan_has_no_label(
    mappings: dict[str, TopicMapping], probs: list[float], label: str | None
) -> None:
    """A NaN is no score: the label is the largest number's; all NaN, it is null."""
    request = decode(mappings["grid"], {"id": 1, "cells": [[1], [2]], "name": "a"})
    value, _ = encode_result(request, response(PROBS=np.array(probs)))
    assert orjson.loads(value)["label"] == label


@pytest.mark.parametrize(
    ("outputs", "message"),
    [
        ({"OTHER": np.ones(3)}, r"reads output 'PROBS', which Triton did not return"),
        ({"PROBS": np.ones(1)}, r"reads PROBS\[1\], but PROBS has 1 elements"),
        ({"PROBS": np.array([0, 0, 0, 1.0])}, r"largest element is at 3, past its 3 labels"),
    ],
)
def test_a_response_the_result_cannot_be_made_of_is_an_inference_error(
    mappings: dict[str, TopicMapping], outputs: dict[str, np.ndarray], message: str
) -> None:
    request = decode(mappings["grid"], {"cells": [[1], [2]], "name": "a"})
    with pytest.raises(InferenceError, match=message):
        encode_result(request, response(**outputs))


def test_numbers_keep_their_datatype_s_shortest_form_and_text_outputs_are_text(
    mappings: dict[str, TopicMapping],
) -> None:
    """FP32 0.1 is written 0.1 (as an inference result has it), not 0.10000000149011612;
    a BYTES output of two dimensions is nested text."""
    request = decode(mappings["grid"], {"id": 1, "cells": [[1], [2]], "name": "a"})
    message = response(PROBS=np.array([0.1, 0.2, 0.7]))
    text = message.outputs.add(name="TEXT", datatype="BYTES")
    text.shape.extend([1, 2])
    message.raw_output_contents.append(b"\x01\x00\x00\x00a\x02\x00\x00\x00\xc3\xa9")
    request.event.mapping = replace(
        request.event.mapping,
        result=ResultForm("out", ()),
    )
    value, _ = encode_result(request, message)
    assert b'"PROBS":[0.1,0.2,0.7]' in value
    assert orjson.loads(value)["out"]["TEXT"] == [["a", "é"]]


def test_events_decoded_for_a_group_build_what_each_would_have_built_merged(
    mappings: dict[str, TopicMapping],
) -> None:
    """Decoded for a group, mapped events keep their tensors pending (their bytes made, no
    request message each); fitted, they get their batch dimension, and packed together
    they equal the events' own requests merged, byte for byte."""
    events = [
        {"payment_id": f"p-{i}", "amount": 1.5 * i, "customer": {"age": 30 + i}, "hour": i}
        for i in range(4)
    ]
    mapping = mappings["payments"]
    raws = [orjson.dumps(event) for event in events]
    deferred = [decode_event(mapping, raw, [], SOURCE, LIMITS, defer=True) for raw in raws]
    assert all(r.pending is not None and r.infer_request is None for r in deferred)
    eager = [decode_event(mapping, raw, [], SOURCE, LIMITS) for raw in raws]
    for request in [*deferred, *eager]:
        request.event.fit(MLP, request)
    assert {r.pending[0].shape for r in deferred if r.pending} == {(1, 3)}
    packed, bad = pack_group(deferred)
    assert bad == []
    merged = merge([r.infer_request for r in eager])
    assert packed.SerializeToString(deterministic=True) == merged.SerializeToString(
        deterministic=True
    )
