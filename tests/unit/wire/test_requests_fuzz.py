"""Fuzzing the codec: any value and headers become a decoded request or a WorkerError.

In CI each property runs a few hundred cases; ``FUZZ_CASES=10000`` runs
10,000 per property: ``FUZZ_CASES=10000 .venv/bin/pytest tests/unit/wire/test_requests_fuzz.py``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from devtools.samples import Encoding, encode_request, mlp_inputs
from worker import errors, wire
from worker.wire.validation import ModelSpec, TensorSpec, check_request

pytestmark = pytest.mark.timeout(600)

#: Cases per property: a few hundred in CI, 10,000 in a dedicated fuzzing run.
EXAMPLES = int(os.environ.get("FUZZ_CASES", "300"))
fuzz_settings = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

CONTENT_TYPES = [
    None,
    b"application/json",
    b"application/octet-stream",
    b"application/x-protobuf",
    b"text/plain",
    b"",
]
DATATYPES = ["BOOL", "UINT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "FP8", ""]

SPEC = ModelSpec(
    name="double",
    version="1",
    inputs=(TensorSpec("INPUT0", "FP32", (-1,)),),
    outputs=(TensorSpec("OUTPUT0", "FP32", (-1,)),),
    max_batch_size=64,
)


def _decode(value: bytes | None, headers: list[tuple[str, bytes]]) -> None:
    """The property: a DecodedRequest, or a WorkerError with a code and a message."""
    try:
        request = wire.decode_request(
            value,
            headers,
            source=wire.Source("t", 0, 7),
            default_model="double",
            limits=wire.DecodeLimits(1 << 16, 1 << 14, 1 << 16),
        )
    except errors.WorkerError as error:
        assert error.code in errors.ERROR_CODES
        assert error.message
        return
    assert request.model_name
    try:
        check_request(SPEC, request)
    except errors.WorkerError as error:
        assert error.code in errors.ERROR_CODES


headers_strategy = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "content-type",
                "inference-header-content-length",
                "x-model-name",
                "x-model-version",
                "x-request-id",
                "other",
            ]
        ),
        st.binary(max_size=40),
    ),
    max_size=5,
)


@given(
    value=st.one_of(st.none(), st.binary(max_size=2048)),
    headers=headers_strategy,
    content_type=st.sampled_from(CONTENT_TYPES),
)
def test_fuzz_raw_bytes_never_crash(
    value: bytes | None, headers: list[tuple[str, bytes]], content_type: bytes | None
) -> None:
    """Arbitrary bytes with arbitrary headers: decoded or a coded WorkerError, nothing else."""
    if content_type is not None:
        headers = [("content-type", content_type), *headers]
    _decode(value, headers)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=6) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=30,
)


@st.composite
def oip_documents(draw: st.DrawFn) -> dict[str, Any]:
    """Documents shaped like OIP requests, with wrong types and sizes mixed in."""
    inputs = draw(
        st.lists(
            st.fixed_dictionaries(
                {
                    "name": st.one_of(st.just("INPUT0"), st.text(max_size=6), json_values),
                    "shape": st.one_of(st.lists(st.integers(-3, 9), max_size=4), json_values),
                    "datatype": st.one_of(st.sampled_from(DATATYPES), json_values),
                    "data": json_values,
                }
            ),
            max_size=3,
        )
    )
    doc: dict[str, Any] = {"inputs": inputs}
    if draw(st.booleans()):
        doc["model_name"] = draw(st.one_of(st.just("double"), json_values))
    if draw(st.booleans()):
        doc["id"] = draw(json_values)
    if draw(st.booleans()):
        doc["parameters"] = draw(json_values)
    return doc


@fuzz_settings
@given(doc=oip_documents())
def test_fuzz_oip_like_json_never_crashes(doc: dict[str, Any]) -> None:
    """OIP-shaped JSON with any values: decoded and checked, or a coded WorkerError."""
    _decode(json.dumps(doc, allow_nan=True).encode(), [("content-type", b"application/json")])


@given(
    cut=st.integers(0, 400),
    flip=st.integers(0, 400),
    byte=st.integers(0, 255),
    encoding=st.sampled_from(["json", "binary", "protobuf"]),
)
def test_fuzz_mutated_valid_requests_never_crash(
    cut: int, flip: int, byte: int, encoding: Encoding
) -> None:
    """A valid request truncated and with one byte changed: decoded, or a coded WorkerError."""
    import numpy as np

    value, headers = encode_request("mlp", mlp_inputs(np.random.default_rng(0)), encoding, "f")
    mutated = bytearray(value[: max(0, len(value) - cut)])
    if mutated:
        mutated[flip % len(mutated)] = byte
    _decode(bytes(mutated), headers)
