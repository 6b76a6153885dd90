"""An input datatype's values as events write them: what is expected, a default's check.

A dead letter says what an event should have given (``an integer in -128..127 (INT8)``); a
mapping's default is checked as an event's value is read, so a default that loads never
refuses an event.
"""

from __future__ import annotations

from typing import Any, Final

import msgspec
import numpy as np

from worker.wire.tensors import DATATYPES

__all__ = ["default_problem", "expected"]

_EXPECTED: Final = {"BOOL": "true or false", "BYTES": "a string"}


def expected(datatype: str) -> str:
    """``a number (FP32)``, ``an integer in -128..127 (INT8)``: what an event must give."""
    if datatype in _EXPECTED:
        return _EXPECTED[datatype]
    if datatype.startswith("FP"):
        return f"a number ({datatype})"
    info = np.iinfo(DATATYPES[datatype].dtype)
    return f"an integer in {int(info.min)}..{int(info.max)} ({datatype})"


def default_problem(datatype: str, value: Any) -> str | None:
    """Why ``value`` cannot stand in for a missing field of a ``datatype`` input (None: it
    can). It is checked as an event's value is, so a default that loads never refuses an
    event."""
    if not _scalar_fits(datatype, value):
        return f"{value!r} is not a {datatype} value"
    dtype = DATATYPES[datatype].dtype
    if dtype is None or dtype.kind == "b":
        return None
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        low, high = int(info.min), int(info.max)
        fits = low <= value <= high
        shown = f"{low}..{high}"
    else:
        # As an event's number is read: FP16 and FP32 take finite values in their range.
        try:
            msgspec.convert(value, DATATYPES[datatype].json_element)
            fits = True
        except msgspec.ValidationError:
            fits = False
        largest = float(np.finfo(dtype).max)
        shown = f"{-largest:.8g}..{largest:.8g}"
    if fits:
        return None
    return f"{value!r} is outside the range of {datatype} ({shown}); give a value it can hold"


def _scalar_fits(datatype: str, value: Any) -> bool:
    if datatype == "BYTES":
        return isinstance(value, str)
    if datatype == "BOOL":
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return datatype.startswith("FP") or isinstance(value, int)
