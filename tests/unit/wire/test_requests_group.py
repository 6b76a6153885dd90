"""Plain JSON requests decoded for a group: their tensors pending, then built at once.

What a group builds must be what the per-record decoding builds and merges, byte for
byte, whatever the datatype, the nesting of the data or the number of rows; and a
request whose elements do not fit its datatype is named, for its own decoding to say why.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.triton.merging import merge
from worker.wire import Source
from worker.wire.requests import DecodeLimits, decode_request, pack_group

LIMITS = DecodeLimits(max_request_bytes=1 << 20, max_tensor_elements=1 << 16)
HEADERS = [("content-type", b"application/json")]
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


def _decode(value: bytes, offset: int, *, defer: bool) -> Any:
    return decode_request(value, HEADERS, Source("in", 0, offset, 0), LIMITS, defer=defer)


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
            {"outputs": [{"name": "Y", "parameters": {"binary_data": True}}]}, id="output"
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
