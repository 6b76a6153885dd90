"""Tensor datatypes and the conversions between JSON data, raw bytes and numpy.

Raw bytes follow Triton's conventions: little-endian, row-major, and BYTES
tensors as a sequence of elements each prefixed by its length as a 4-byte
little-endian unsigned integer.

Validation never allocates from a claimed shape: element counts are computed
with Python integers and compared with the data actually present before any
buffer is built, so `shape: [1000000000000]` with a handful of values is
refused cheaply.
"""

from __future__ import annotations

import base64
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod
from typing import Annotated, Any, Final

import msgspec
import numpy as np
import numpy.typing as npt

from worker.errors import DecodeError, InvalidRequest, TooLarge
from worker.wire.bytes_tensor import (
    count_bytes_elements,
    deserialize_bytes_tensor,
    serialize_bytes_tensor,
)

__all__ = [
    "DATATYPES",
    "DataType",
    "TensorLimits",
    "check_raw_size",
    "contents_to_raw",
    "count_bytes_elements",
    "deserialize_bytes_tensor",
    "element_count",
    "flat_json",
    "json_to_raw",
    "json_to_raw_many",
    "lookup_datatype",
    "numpy_to_raw",
    "raw_to_json",
    "raw_to_json_array",
    "raw_to_numpy",
    "serialize_bytes_tensor",
    "validate_raw",
]

_FP16_MAX: Final = 65504.0
_FP32_MAX: Final = float(np.finfo(np.float32).max)


def _int_range(bits: int, signed: bool) -> Any:
    low = -(2 ** (bits - 1)) if signed else 0
    high = 2 ** (bits - 1) - 1 if signed else 2**bits - 1
    if high >= 2**63:
        # msgspec bounds must fit in int64; numpy refuses larger values instead.
        return Annotated[int, msgspec.Meta(ge=low)]
    return Annotated[int, msgspec.Meta(ge=low, le=high)]


@dataclass(frozen=True, slots=True)
class DataType:
    """One Open Inference Protocol datatype and its numpy/protobuf counterparts."""

    name: str
    dtype: np.dtype[Any] | None  # None for BYTES
    size_bytes: int  # 0 for BYTES (variable length)
    contents_field: str | None  # InferTensorContents field; None: raw only (FP16)
    json_element: Any  # msgspec type each JSON element must satisfy
    contents_dtype: np.dtype[Any] | None  # dtype of the typed contents field, wider for small ints

    @property
    def is_bytes(self) -> bool:
        """True for the variable-length BYTES datatype."""
        return self.dtype is None


def _fixed(
    name: str, dtype: str, field: str | None, element: Any, contents_dtype: str | None = None
) -> DataType:
    np_dtype = np.dtype(dtype)
    return DataType(
        name=name,
        dtype=np_dtype,
        size_bytes=np_dtype.itemsize,
        contents_field=field,
        json_element=element,
        contents_dtype=np.dtype(contents_dtype or dtype),
    )


DATATYPES: Final[Mapping[str, DataType]] = {
    dt.name: dt
    for dt in (
        _fixed("BOOL", "?", "bool_contents", bool),
        _fixed("UINT8", "<u1", "uint_contents", _int_range(8, False), "<u4"),
        _fixed("UINT16", "<u2", "uint_contents", _int_range(16, False), "<u4"),
        _fixed("UINT32", "<u4", "uint_contents", _int_range(32, False)),
        _fixed("UINT64", "<u8", "uint64_contents", _int_range(64, False)),
        _fixed("INT8", "<i1", "int_contents", _int_range(8, True), "<i4"),
        _fixed("INT16", "<i2", "int_contents", _int_range(16, True), "<i4"),
        _fixed("INT32", "<i4", "int_contents", _int_range(32, True)),
        _fixed("INT64", "<i8", "int64_contents", _int_range(64, True)),
        _fixed("FP16", "<f2", None, Annotated[float, msgspec.Meta(ge=-_FP16_MAX, le=_FP16_MAX)]),
        _fixed(
            "FP32",
            "<f4",
            "fp32_contents",
            Annotated[float, msgspec.Meta(ge=-_FP32_MAX, le=_FP32_MAX)],
        ),
        _fixed("FP64", "<f8", "fp64_contents", float),
        DataType("BYTES", None, 0, "bytes_contents", str, None),
    )
}
"""All supported datatypes by their Open Inference Protocol name."""

_JSON_LIST_TYPES: Final[Mapping[str, Any]] = {
    name: types.GenericAlias(list, (dt.json_element,)) for name, dt in DATATYPES.items()
}


def lookup_datatype(name: str, where: str) -> DataType:
    """Return the datatype named `name`, or raise DecodeError naming `where`."""
    dt = DATATYPES.get(name)
    if dt is None:
        known = ", ".join(DATATYPES)
        raise DecodeError(f"{where}: unknown datatype {name!r}; expected one of {known}")
    return dt


def element_count(shape: Sequence[int], where: str) -> int:
    """Number of elements of `shape` (Python int, no overflow); dims must be >= 0."""
    for i, dim in enumerate(shape):
        if dim < 0:
            raise InvalidRequest(f"{where}[{i}]: dimension {dim} is negative")
    return prod(shape)


@dataclass(frozen=True, slots=True)
class TensorLimits:
    """Bounds on one input tensor; None disables a bound.

    Checked from the claimed shape and the bytes actually present, before any
    buffer is built from them, so neither a huge shape with little data nor a
    small shape with huge data costs memory.
    """

    max_elements: int | None = None
    max_bytes: int | None = None

    def check(
        self, datatype: str, shape: Sequence[int], where: str, data_bytes: int | None = None
    ) -> None:
        """Raise TooLarge when the tensor claims or carries more than allowed."""
        dt = lookup_datatype(datatype, f"{where}.datatype")
        count = element_count(shape, f"{where}.shape")
        if self.max_elements is not None and count > self.max_elements:
            raise TooLarge(
                f"{where}: shape {list(shape)} has {count} elements, over the "
                f"{self.max_elements}-element limit per tensor"
            )
        if self.max_bytes is None:
            return
        claimed = count * dt.size_bytes
        for size, what in ((claimed, "shape needs"), (data_bytes, "data is")):
            if size is not None and size > self.max_bytes:
                raise TooLarge(
                    f"{where}: {dt.name} {what} {size} bytes, over the "
                    f"{self.max_bytes}-byte limit per tensor"
                )


def check_raw_size(dt: DataType, shape: Sequence[int], raw_size: int, where: str) -> int:
    """Check that `raw_size` bytes hold exactly `shape`; return the element count.

    For BYTES only the byte count is known here; use `count_bytes_elements`.
    """
    count = element_count(shape, f"{where}.shape")
    if not dt.is_bytes and raw_size != count * dt.size_bytes:
        raise InvalidRequest(
            f"{where}: {raw_size} bytes of data, shape {list(shape)} of {dt.name} "
            f"needs {count * dt.size_bytes}"
        )
    return count


def _check_bytes_count(
    raw: bytes | memoryview, shape: Sequence[int], count: int, where: str
) -> None:
    found = count_bytes_elements(raw, where)
    if found != count:
        raise InvalidRequest(f"{where}: {found} BYTES elements, shape {list(shape)} needs {count}")


def _flatten(data: Any, shape: Sequence[int], count: int, where: str) -> list[Any]:
    if not isinstance(data, list):
        raise InvalidRequest(f"{where}: expected a list, got {type(data).__name__}")
    if len(shape) <= 1 or not data or not isinstance(data[0], list):
        if len(data) != count:
            raise InvalidRequest(
                f"{where}: {len(data)} elements, shape {list(shape)} needs {count}"
            )
        return data
    flat: list[Any] = []
    last = len(shape) - 1

    def walk(node: Any, depth: int, path: str) -> None:
        if not isinstance(node, list):
            raise InvalidRequest(
                f"{where}{path}: expected a list of {shape[depth]} at dimension {depth} "
                f"of shape {list(shape)}, got {type(node).__name__}"
            )
        if len(node) != shape[depth]:
            raise InvalidRequest(
                f"{where}{path}: {len(node)} elements, shape {list(shape)} needs "
                f"{shape[depth]} at dimension {depth}"
            )
        if depth == last:
            flat.extend(node)
            return
        for i, child in enumerate(node):
            walk(child, depth + 1, f"{path}[{i}]")

    walk(data, 0, "")
    return flat


def _position(index: int, shape: Sequence[int], nested: bool) -> str:
    """Index text of flat element `index`: "[7]", or "[1][3]" in nested data."""
    if nested and len(shape) > 1:
        return "".join(f"[{int(i)}]" for i in np.unravel_index(index, tuple(shape)))
    return f"[{index}]"


def _element_error(
    error: msgspec.ValidationError, dt: DataType, shape: Sequence[int], nested: bool, where: str
) -> InvalidRequest:
    # msgspec says e.g. "Expected `int` <= 255 - at `$[7]`": turn `$[7]` into
    # the element's own index in the caller's (possibly nested) data.
    text = str(error)
    reason, _, at = text.partition(" - at `$[")
    index_text = at.split("]", 1)[0]
    if index_text.isdigit():
        index = int(index_text)
        return InvalidRequest(
            f"{where}{_position(index, shape, nested)}: {reason.lower()} for {dt.name}"
        )
    return InvalidRequest(f"{where}: {text} for {dt.name}")


def flat_json(datatype: str, shape: Sequence[int], data: Any, where: str) -> tuple[list[Any], bool]:
    """JSON ``data`` checked against ``shape`` and flattened (row-major), its elements not
    converted yet; and whether it came nested (for the index of an element in a message)."""
    lookup_datatype(datatype, f"{where}.datatype")
    count = element_count(shape, f"{where}.shape")
    flat = _flatten(data, shape, count, f"{where}.data")
    return flat, flat is not data


def json_to_raw_many(datatype: str, flats: Sequence[list[Any]]) -> bytes | None:
    """The raw bytes of several numeric tensors' flat JSON elements, joined in order (a
    group's rows); None when an element does not convert (each tensor's own ``json_to_raw``
    then says which, and why)."""
    dt = DATATYPES[datatype]
    if dt.dtype is None:
        return None
    joined: list[Any] = []
    for flat in flats:
        joined += flat
    try:
        values = msgspec.convert(joined, _JSON_LIST_TYPES[dt.name])
        return np.asarray(values, dtype=dt.dtype).tobytes()
    except (msgspec.ValidationError, OverflowError):
        return None


def json_to_raw(datatype: str, shape: Sequence[int], data: Any, where: str) -> bytes:
    """Validate JSON `data` (flat or nested row-major) and return its raw bytes.

    `where` names the input for messages, e.g. "inputs[1]".
    """
    dt = lookup_datatype(datatype, f"{where}.datatype")
    count = element_count(shape, f"{where}.shape")
    data_where = f"{where}.data"
    flat = _flatten(data, shape, count, data_where)
    nested = flat is not data
    try:
        values = msgspec.convert(flat, _JSON_LIST_TYPES[dt.name])
    except msgspec.ValidationError as error:
        raise _element_error(error, dt, shape, nested, data_where) from None
    if dt.dtype is None:
        try:
            return serialize_bytes_tensor([value.encode() for value in values])
        except UnicodeEncodeError as error:
            raise InvalidRequest(
                f"{data_where}: string is not valid UTF-8 ({error.reason})"
            ) from None
    try:
        return np.asarray(values, dtype=dt.dtype).tobytes()
    except OverflowError:
        limit = int(np.iinfo(dt.dtype).max)
        index = next(i for i, value in enumerate(values) if value > limit)
        raise InvalidRequest(
            f"{data_where}{_position(index, shape, nested)}: "
            f"expected `int` <= {limit} for {dt.name}"
        ) from None


def raw_to_numpy(datatype: str, shape: Sequence[int], raw: bytes) -> npt.NDArray[Any]:
    """View raw tensor bytes as a numpy array of `shape` (BYTES: object array of bytes)."""
    dt = lookup_datatype(datatype, "tensor.datatype")
    count = check_raw_size(dt, shape, len(raw), "tensor")
    if dt.dtype is None:
        items = deserialize_bytes_tensor(raw)
        if len(items) != count:
            raise InvalidRequest(
                f"tensor: {len(items)} BYTES elements, shape {list(shape)} needs {count}"
            )
        array = np.empty(count, dtype=object)
        array[:] = items
        return array.reshape(tuple(shape))
    return np.frombuffer(raw, dtype=dt.dtype).reshape(tuple(shape))


def raw_to_json_array(
    datatype: str, shape: Sequence[int], raw: bytes, where: str
) -> tuple[npt.NDArray[Any] | list[str], bool]:
    """Flat JSON-ready data for a raw tensor, and whether BYTES fell back to base64.

    Numeric tensors come back as 1-D numpy arrays (orjson serialises them
    without a Python list); BYTES as UTF-8 strings, or, when any element is
    not valid UTF-8, every element base64-encoded.
    """
    dt = lookup_datatype(datatype, f"{where}.datatype")
    count = check_raw_size(dt, shape, len(raw), where)
    if dt.dtype is not None:
        return np.frombuffer(raw, dtype=dt.dtype), False
    items = deserialize_bytes_tensor(raw, where)
    if len(items) != count:
        raise InvalidRequest(
            f"{where}: {len(items)} BYTES elements, shape {list(shape)} needs {count}"
        )
    try:
        return [item.decode() for item in items], False
    except UnicodeDecodeError:
        return [base64.b64encode(item).decode("ascii") for item in items], True


def raw_to_json(datatype: str, shape: Sequence[int], raw: bytes) -> list[Any]:
    """Flat row-major Python list for a raw tensor (BYTES as str, base64 if not UTF-8)."""
    data, _ = raw_to_json_array(datatype, shape, raw, "tensor")
    if isinstance(data, list):
        return data
    result: list[Any] = data.tolist()
    return result


def numpy_to_raw(array: npt.NDArray[Any]) -> tuple[str, list[int], bytes]:
    """Return (datatype, shape, raw little-endian bytes) for a numpy array.

    Object, bytes and str arrays become BYTES (str encoded as UTF-8).
    """
    shape = [int(dim) for dim in array.shape]
    kind = array.dtype.kind
    if kind in ("O", "S", "U"):
        items = [item.encode() if isinstance(item, str) else bytes(item) for item in array.flat]
        return "BYTES", shape, serialize_bytes_tensor(items)
    for dt in DATATYPES.values():
        if (
            dt.dtype is not None
            and dt.dtype.kind == kind
            and dt.dtype.itemsize == array.dtype.itemsize
        ):
            contiguous = np.ascontiguousarray(array, dtype=dt.dtype)
            return dt.name, shape, contiguous.tobytes()
    raise InvalidRequest(f"numpy dtype {array.dtype} has no inference datatype")


def contents_to_raw(datatype: str, shape: Sequence[int], contents: Any, where: str) -> bytes:
    """Convert typed protobuf `InferTensorContents` to raw bytes, checking ranges."""
    dt = lookup_datatype(datatype, f"{where}.datatype")
    count = element_count(shape, f"{where}.shape")
    if dt.contents_field is None:
        raise InvalidRequest(
            f"{where}.contents: {dt.name} has no typed contents field; "
            "send it in raw_input_contents"
        )
    values = getattr(contents, dt.contents_field)
    if len(values) != count:
        raise InvalidRequest(
            f"{where}.contents.{dt.contents_field}: {len(values)} elements, "
            f"shape {list(shape)} needs {count}"
        )
    if dt.dtype is None:
        return serialize_bytes_tensor(values)
    assert dt.contents_dtype is not None
    wide = np.fromiter(values, dtype=dt.contents_dtype, count=count)
    if dt.contents_dtype != dt.dtype and count:
        info = np.iinfo(dt.dtype)
        bad = np.flatnonzero((wide < info.min) | (wide > info.max))
        if bad.size:
            index = int(bad[0])
            raise InvalidRequest(
                f"{where}.contents.{dt.contents_field}[{index}]: {int(wide[index])} is out of "
                f"range for {dt.name} ({info.min}..{info.max})"
            )
    return wide.astype(dt.dtype, copy=False).tobytes()


def validate_raw(
    datatype: str, shape: Sequence[int], raw: bytes | memoryview, where: str
) -> DataType:
    """Check that raw tensor bytes match `shape` (BYTES: element framing and count)."""
    dt = lookup_datatype(datatype, f"{where}.datatype")
    count = check_raw_size(dt, shape, len(raw), where)
    if dt.is_bytes:
        _check_bytes_count(raw, shape, count, where)
    return dt
