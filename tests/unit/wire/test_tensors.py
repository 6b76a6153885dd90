"""Datatypes, BYTES framing, and JSON/raw/numpy tensor conversions."""

from __future__ import annotations

import struct
import tracemalloc
from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2

from worker.errors import DecodeError, InvalidRequest
from worker.wire import tensors
from worker.wire.messages import DATATYPE_NAMES

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


def expected_raw(datatype: str, values: list[Any]) -> bytes:
    """Reference raw encoding built independently of the code under test."""
    if datatype == "BYTES":
        return b"".join(struct.pack("<I", len(v.encode())) + v.encode() for v in values)
    return np.array(values, dtype=tensors.DATATYPES[datatype].dtype).tobytes()


def test_datatype_table_matches_protocol_names() -> None:
    """Every Open Inference Protocol datatype has an entry, and nothing else does."""
    assert tuple(tensors.DATATYPES) == DATATYPE_NAMES
    assert {dt.size_bytes for dt in tensors.DATATYPES.values() if not dt.is_bytes} == {1, 2, 4, 8}
    assert tensors.DATATYPES["BYTES"].size_bytes == 0


def test_bytes_tensor_layout_is_length_prefixed_little_endian() -> None:
    """BYTES elements are a 4-byte little-endian length followed by the bytes."""
    raw = tensors.serialize_bytes_tensor([b"ab", b"", b"\xff"])
    assert raw == b"\x02\x00\x00\x00ab\x00\x00\x00\x00\x01\x00\x00\x00\xff"
    assert tensors.deserialize_bytes_tensor(raw) == [b"ab", b"", b"\xff"]


def test_bytes_tensor_truncated_prefix_is_a_decode_error() -> None:
    """A length prefix cut short names the element and byte position."""
    with pytest.raises(DecodeError, match=r"inputs\[0\]: BYTES element 1 has a truncated"):
        tensors.deserialize_bytes_tensor(b"\x01\x00\x00\x00a\x05\x00", "inputs[0]")


def test_bytes_tensor_length_past_end_is_a_decode_error() -> None:
    """An element claiming more bytes than remain is refused."""
    with pytest.raises(DecodeError, match="claims 9 bytes"):
        tensors.deserialize_bytes_tensor(b"\x09\x00\x00\x00abc")


@pytest.mark.parametrize("datatype", DATATYPE_NAMES)
def test_json_to_raw_every_datatype(datatype: str) -> None:
    """Flat JSON data of each datatype packs to the reference little-endian bytes."""
    values = SAMPLES[datatype]
    raw = tensors.json_to_raw(datatype, [2, 2], values, "inputs[0]")
    assert raw == expected_raw(datatype, values)


@pytest.mark.parametrize("datatype", DATATYPE_NAMES)
def test_raw_to_json_every_datatype(datatype: str) -> None:
    """Raw bytes of each datatype come back as the original flat values."""
    values = SAMPLES[datatype]
    assert tensors.raw_to_json(datatype, [4], expected_raw(datatype, values)) == values


@pytest.mark.parametrize("datatype", DATATYPE_NAMES)
def test_numpy_round_trip_every_datatype(datatype: str) -> None:
    """raw → numpy → raw keeps datatype, shape and bytes."""
    raw = expected_raw(datatype, SAMPLES[datatype])
    array = tensors.raw_to_numpy(datatype, [2, 2], raw)
    assert array.shape == (2, 2)
    assert tensors.numpy_to_raw(array) == (datatype, [2, 2], raw)


def test_numpy_to_raw_encodes_str_arrays_as_bytes() -> None:
    """A numpy str array becomes a UTF-8 BYTES tensor."""
    assert tensors.numpy_to_raw(np.array(["hé"])) == ("BYTES", [1], b"\x03\x00\x00\x00h\xc3\xa9")


def test_nested_and_flat_data_pack_identically() -> None:
    """Row-major nested data equals the same values given flat."""
    nested = [[[1, 2], [3, 4], [5, 6]], [[7, 8], [9, 10], [11, 12]]]
    flat = list(range(1, 13))
    shape = [2, 3, 2]
    assert tensors.json_to_raw("INT32", shape, nested, "x") == tensors.json_to_raw(
        "INT32", shape, flat, "x"
    )


def test_element_count_mismatch_names_input_and_counts() -> None:
    """15 values for shape [4, 4] are refused with both counts in the message."""
    with pytest.raises(InvalidRequest) as caught:
        tensors.json_to_raw("FP32", [4, 4], [0.0] * 15, "inputs[1]")
    assert caught.value.message == "inputs[1].data: 15 elements, shape [4, 4] needs 16"


def test_nested_data_inconsistent_with_shape() -> None:
    """A short inner row is reported at its own position and dimension."""
    with pytest.raises(InvalidRequest) as caught:
        tensors.json_to_raw("INT32", [2, 3], [[1, 2, 3], [4, 5]], "inputs[0]")
    assert caught.value.message.startswith("inputs[0].data[1]: 2 elements")
    assert "at dimension 1" in caught.value.message


def test_nested_data_scalar_where_row_expected() -> None:
    """A scalar in place of a row is refused, naming where."""
    with pytest.raises(InvalidRequest, match=r"inputs\[0\]\.data\[1\]: expected a list"):
        tensors.json_to_raw("INT32", [2, 2], [[1, 2], 3], "inputs[0]")


@pytest.mark.parametrize(
    ("datatype", "data", "fragment"),
    [
        ("UINT8", [1, 300], r"inputs\[0\]\.data\[1\]: expected `int` <= 255 for UINT8"),
        ("INT8", [-129, 0], r"inputs\[0\]\.data\[0\]: expected `int` >= -128 for INT8"),
        ("UINT64", [2**64, 0], r"data\[0\]"),
        ("INT32", [1.5, 2], r"data\[0\]: expected `int`, got `float` for INT32"),
        ("INT32", [True, 2], r"data\[0\]: expected `int`, got `bool`"),
        ("BOOL", [1, 0], r"data\[0\]: expected `bool`, got `int`"),
        ("FP32", ["1.0", 2.0], r"data\[0\]: expected `float`, got `str`"),
        ("FP16", [70000.0, 0.0], r"data\[0\]: expected `float` <= 65504"),
        ("FP32", [1e39, 0.0], r"data\[0\]: expected `float` <= "),
        ("BYTES", [1, "a"], r"data\[0\]: expected `str`, got `int`"),
        ("FP64", [None, 1.0], r"data\[0\]: expected `float`, got `null`"),
    ],
)
def test_wrong_element_types_and_ranges(datatype: str, data: list[Any], fragment: str) -> None:
    """Values of the wrong type or out of the datatype's range are refused by position."""
    with pytest.raises(InvalidRequest, match=fragment):
        tensors.json_to_raw(datatype, [2], data, "inputs[0]")


def test_out_of_range_in_nested_data_gives_nested_position() -> None:
    """The message points at [row][column] for nested data."""
    with pytest.raises(InvalidRequest, match=r"inputs\[2\]\.data\[1\]\[0\]: "):
        tensors.json_to_raw("UINT8", [2, 2], [[1, 2], [256, 3]], "inputs[2]")


def test_unknown_datatype_is_a_decode_error() -> None:
    """A datatype outside the protocol is a decode error naming the field."""
    with pytest.raises(DecodeError, match=r"inputs\[0\]\.datatype: unknown datatype 'FP8'"):
        tensors.json_to_raw("FP8", [1], [1.0], "inputs[0]")


def test_negative_dimension_is_refused() -> None:
    """A negative dim is reported with its index in the shape."""
    with pytest.raises(InvalidRequest, match=r"inputs\[0\]\.shape\[1\]: dimension -3"):
        tensors.json_to_raw("FP32", [1, -3], [1.0], "inputs[0]")


def test_huge_claimed_shape_is_refused_without_allocating() -> None:
    """shape [10**12] with one value fails fast and allocates nothing large."""
    tracemalloc.start()
    try:
        with pytest.raises(InvalidRequest, match="needs 1000000000000"):
            tensors.json_to_raw("FP64", [10**12], [1.0], "inputs[0]")
        with pytest.raises(InvalidRequest, match="needs 8000000000000"):
            tensors.validate_raw("FP64", [10**12], b"\x00" * 8, "inputs[0]")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000


def test_scalar_and_empty_shapes() -> None:
    """Shape [] holds one element; a zero dim holds none."""
    assert tensors.json_to_raw("INT16", [], [7], "x") == b"\x07\x00"
    assert tensors.json_to_raw("INT16", [3, 0], [[], [], []], "x") == b""
    assert tensors.raw_to_json("BYTES", [0], b"") == []


def test_fixed_raw_size_mismatch() -> None:
    """Raw bytes not matching shape times element size are refused with both sizes."""
    with pytest.raises(InvalidRequest, match=r"inputs\[0\]: 7 bytes of data, shape \[2\] of FP32"):
        tensors.validate_raw("FP32", [2], b"\x00" * 7, "inputs[0]")


def test_bytes_raw_element_count_mismatch() -> None:
    """A BYTES blob with fewer elements than the shape needs is refused."""
    raw = tensors.serialize_bytes_tensor([b"a"])
    with pytest.raises(InvalidRequest, match="1 BYTES elements, shape \\[2\\] needs 2"):
        tensors.validate_raw("BYTES", [2], raw, "inputs[0]")


def test_non_utf8_bytes_fall_back_to_base64() -> None:
    """If any BYTES element is not UTF-8, all elements of that tensor are base64."""
    raw = tensors.serialize_bytes_tensor([b"\xff", b"ok"])
    data, base64_used = tensors.raw_to_json_array("BYTES", [2], raw, "outputs[0]")
    assert (data, base64_used) == (["/w==", "b2s="], True)


def test_contents_to_raw_checks_narrow_integer_ranges() -> None:
    """INT8 values carried in int_contents (int32) must fit in INT8."""
    contents = service_pb2.InferTensorContents(int_contents=[1, 200])
    with pytest.raises(InvalidRequest, match=r"int_contents\[1\]: 200 is out of range for INT8"):
        tensors.contents_to_raw("INT8", [2], contents, "inputs[0]")


@pytest.mark.parametrize("datatype", [d for d in DATATYPE_NAMES if d != "FP16"])
def test_contents_to_raw_every_typed_datatype(datatype: str) -> None:
    """Typed protobuf contents convert to the same raw bytes as JSON data."""
    values = SAMPLES[datatype]
    field = tensors.DATATYPES[datatype].contents_field
    assert field is not None
    items = [v.encode() for v in values] if datatype == "BYTES" else values
    contents = service_pb2.InferTensorContents(**{field: items})
    assert tensors.contents_to_raw(datatype, [4], contents, "x") == expected_raw(datatype, values)


def test_fp16_has_no_typed_contents() -> None:
    """FP16 can only travel as raw bytes in protobuf."""
    with pytest.raises(InvalidRequest, match="send it in raw_input_contents"):
        tensors.contents_to_raw("FP16", [1], service_pb2.InferTensorContents(), "inputs[0]")


def _elements(datatype: str) -> st.SearchStrategy[Any]:
    """Valid JSON elements of `datatype`, covering its whole range."""
    dt = tensors.DATATYPES[datatype]
    if datatype == "BOOL":
        return st.booleans()
    if datatype == "BYTES":
        return st.text(max_size=8)
    if datatype.startswith("FP"):
        widths: dict[str, Literal[16, 32, 64]] = {"FP16": 16, "FP32": 32, "FP64": 64}
        width = widths[datatype]
        return st.floats(width=width, allow_nan=False, allow_infinity=False)
    assert dt.dtype is not None
    info = np.iinfo(dt.dtype)
    return st.integers(min_value=int(info.min), max_value=int(info.max))


@st.composite
def tensors_as_json(draw: st.DrawFn) -> tuple[str, list[int], Any, list[Any]]:
    """A datatype, a shape, nested or flat data for it, and the flat values."""
    datatype = draw(st.sampled_from(DATATYPE_NAMES))
    shape = draw(st.lists(st.integers(min_value=0, max_value=4), max_size=3))
    count = int(np.prod(shape)) if shape else 1
    flat = draw(st.lists(_elements(datatype), min_size=count, max_size=count))
    data: Any = flat
    if len(shape) > 1 and count and draw(st.booleans()):
        data = np.array(flat, dtype=object).reshape(shape).tolist()
    return datatype, shape, data, flat


@settings(max_examples=300, deadline=None, database=None)
@given(tensors_as_json())
def test_json_raw_json_round_trip(case: tuple[str, list[int], Any, list[Any]]) -> None:
    """Any valid JSON tensor survives JSON → raw → JSON as the same flat values."""
    datatype, shape, data, flat = case
    raw = tensors.json_to_raw(datatype, shape, data, "inputs[0]")
    assert tensors.raw_to_json(datatype, shape, raw) == flat
