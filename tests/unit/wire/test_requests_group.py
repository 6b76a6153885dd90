"""Plain requests decoded for a group: their tensors pending, then built at once.

What a group builds must be what the per-record decoding builds and merges, byte for
byte, whatever the datatype, the nesting of the data, the number of rows or the encoding
(JSON elements, or the binary extension's bytes, both in one group); and a request whose
elements do not fit its datatype is named, for its own decoding to say why.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.errors import DecodeError
from worker.triton.merging import merge
from worker.wire import Source
from worker.wire.requests import DecodeLimits, decode_request, pack_group

LIMITS = DecodeLimits(max_request_bytes=1 << 20, max_tensor_elements=1 << 16)
HEADERS: list[tuple[str, bytes | None]] = [("content-type", b"application/json")]
_DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT32": np.int32, "INT8": np.int8}


def _body(rows: int, width: int, datatype: str, nested: bool, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    if datatype.startswith("FP"):
        values = rng.normal(size=(rows, width)).tolist()
    else:
        values = rng.integers(-100, 100, size=(rows, width)).tolist()
    data: Any = values if nested else [v for row in values for v in row]
    document = {
        "model_name": "m",
        "inputs": [{"name": "X", "shape": [rows, width], "datatype": datatype, "data": data}],
        "outputs": [{"name": "Y"}],
    }
    return json.dumps(document).encode()


#: A request as a record carries it: its value and headers.
_Record = tuple[bytes, list[tuple[str, bytes | None]]]


def _binary(rows: int, width: int, datatype: str, seed: int, **extra: Any) -> _Record:
    """The binary extension's form of ``_body``'s request; ``extra``: more of its JSON
    header (``input_parameters``: more of its input's parameters)."""
    rng = np.random.default_rng(seed)
    values: np.ndarray[Any, Any] = (
        rng.normal(size=(rows, width))
        if datatype.startswith("FP")
        else rng.integers(-100, 100, size=(rows, width))
    )
    blob = values.astype(_DTYPES[datatype]).tobytes()
    parameters = {"binary_data_size": len(blob), **extra.pop("input_parameters", {})}
    tensor = {"name": "X", "shape": [rows, width], "datatype": datatype, "parameters": parameters}
    header = json.dumps({"model_name": "m", "inputs": [tensor], **extra}).encode()
    headers: list[tuple[str, bytes | None]] = [
        ("content-type", b"application/octet-stream"),
        ("inference-header-content-length", str(len(header)).encode()),
    ]
    return header + blob, headers


def _decode(value: bytes, offset: int, *, defer: bool, headers: Any = HEADERS) -> Any:
    return decode_request(value, headers, Source("in", 0, offset, 0), LIMITS, defer=defer)


@settings(max_examples=40, deadline=None)
@given(
    datatype=st.sampled_from(sorted(_DTYPES)),
    rows=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    width=st.integers(1, 6),
    nested=st.booleans(),
)
def test_a_group_builds_what_each_request_would_have_built_merged(
    datatype: str, rows: list[int], width: int, nested: bool
) -> None:
    """Pending requests packed together equal the eager requests merged: the same inputs,
    shapes, outputs and raw bytes."""
    values = [_body(n, width, datatype, nested, seed) for seed, n in enumerate(rows)]
    pending = [_decode(v, i, defer=True) for i, v in enumerate(values)]
    assert all(r.pending is not None and r.infer_request is None for r in pending)
    packed, bad = pack_group(pending)
    assert bad == []
    eager = merge([_decode(v, i, defer=False).infer_request for i, v in enumerate(values)])
    assert packed.SerializeToString(deterministic=True) == eager.SerializeToString(
        deterministic=True
    )


def test_a_request_whose_elements_do_not_fit_is_named_and_alone_says_why() -> None:
    """An INT8 element of 300 among good requests: pack_group names that request; decoded
    on its own it is the per-record path's INVALID_REQUEST, element and limit named."""
    good = _body(1, 2, "INT8", False, 1)
    bad = json.dumps(
        {"model_name": "m", "inputs": [{"name": "X", "shape": [1, 2], "datatype": "INT8",
                                        "data": [1, 300]}]}
    ).encode()  # fmt: skip
    requests = [_decode(v, i, defer=True) for i, v in enumerate([good, bad, good])]
    packed, indexes = pack_group(requests)
    assert packed is None and indexes == [1]
    with pytest.raises(Exception, match=r"inputs\[0\]\.data\[1\]: expected `int` <= 127"):
        _decode(bad, 1, defer=False)


@pytest.mark.parametrize(
    "document",
    [
        pytest.param({"parameters": {"p": 1}}, id="request parameters"),
        pytest.param(
            {"outputs": [{"name": "Y", "parameters": {"classification": 2}}]}, id="output"
        ),
        pytest.param({"datatype": "BYTES", "data": ["a", "b"]}, id="bytes"),
        pytest.param({"input_parameters": {"shared_memory_region": "r"}}, id="input"),
    ],
)
def test_requests_other_than_plain_ones_are_decoded_whole(document: dict[str, Any]) -> None:
    """Parameters or BYTES: decoded at once, as ever (nothing pending)."""
    tensor: dict[str, Any] = {"name": "X", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}
    if "datatype" in document:
        tensor |= {"datatype": document["datatype"], "data": document["data"]}
    if "input_parameters" in document:
        tensor["parameters"] = document["input_parameters"]
    body: dict[str, Any] = {"model_name": "m", "inputs": [tensor]}
    body |= {k: v for k, v in document.items() if k in ("parameters", "outputs")}
    request = _decode(json.dumps(body).encode(), 0, defer=True)
    assert request.pending is None and request.infer_request is not None


@settings(max_examples=40, deadline=None)
@given(
    datatype=st.sampled_from(sorted(_DTYPES)),
    rows=st.lists(st.integers(1, 3), min_size=1, max_size=5),
    width=st.integers(1, 6),
    binary=st.lists(st.booleans(), min_size=5, max_size=5),
)
def test_binary_requests_join_a_group_with_their_bytes_as_they_are(
    datatype: str, rows: list[int], width: int, binary: list[bool]
) -> None:
    """Binary-extension requests, alone or among JSON ones, pending with their bytes: packed
    together they equal the eager requests merged, byte for byte."""
    records: list[_Record] = [
        _binary(n, width, datatype, seed)
        if binary[seed]
        else (_body(n, width, datatype, False, seed), HEADERS)
        for seed, n in enumerate(rows)
    ]
    pending = [_decode(v, i, defer=True, headers=h) for i, (v, h) in enumerate(records)]
    assert all(r.pending is not None and r.infer_request is None for r in pending)
    packed, bad = pack_group(pending)
    assert bad == []
    eager = merge(
        [_decode(v, i, defer=False, headers=h).infer_request for i, (v, h) in enumerate(records)]
    )
    assert packed.SerializeToString(deterministic=True) == eager.SerializeToString(
        deterministic=True
    )
    for request, (value, headers) in zip(pending, records, strict=True):
        alone = _decode(value, 0, defer=False, headers=headers).infer_request
        assert request.packed().SerializeToString(deterministic=True) == alone.SerializeToString(
            deterministic=True
        )


def test_a_binary_request_with_the_clients_framing_parameters_is_pending() -> None:
    """tritonclient's own framing (``binary_data`` on the input and the outputs,
    ``binary_data_output`` on the request) is never sent to Triton: still a plain request."""
    value, headers = _binary(
        2,
        3,
        "FP32",
        0,
        input_parameters={"binary_data": True},
        outputs=[{"name": "Y", "parameters": {"binary_data": True}}],
        parameters={"binary_data_output": True},
    )
    request = _decode(value, 0, defer=True, headers=headers)
    assert request.pending is not None and request.binary_outputs
    assert request.output_names == ("Y",)


@pytest.mark.parametrize(
    ("header", "tail", "error"),
    [
        pytest.param({"input_parameters": {"binary_data_size": 4}}, b"", "declare", id="size lies"),
        pytest.param({}, b"\x00", "declare", id="bytes left over"),
        pytest.param({"parameters": {"priority": 1}}, b"", None, id="request parameters"),
    ],
)
def test_a_binary_request_other_than_a_plain_one_is_decoded_whole(
    header: dict[str, Any], tail: bytes, error: str | None
) -> None:
    """A declared size that is not the tensor's, bytes after the tensors, or parameters
    of its own: nothing pending; the whole decoding takes it, and says what is wrong."""
    value, headers = _binary(1, 2, "FP32", 0, **header)
    if error is not None:
        with pytest.raises(DecodeError, match=error):
            _decode(value + tail, 0, defer=True, headers=headers)
        return
    request = _decode(value + tail, 0, defer=True, headers=headers)
    assert request.pending is None and request.infer_request is not None
