"""The done offsets beyond a commit point, as commit metadata: compact, bounded, safe to misread."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from worker.delivery.metadata import decode, encode, runs_of

pytestmark = pytest.mark.timeout(60)


@given(
    point=st.integers(min_value=0, max_value=2**40),
    gaps=st.lists(st.integers(min_value=1, max_value=50), max_size=200),
)
def test_what_is_encoded_decodes_to_the_same_offsets(point: int, gaps: list[int]) -> None:
    """Any set of done offsets above the point comes back exactly, or the encoding is refused."""
    offsets, current = [], point
    for gap in gaps:
        current += gap
        offsets.append(current)
    text = encode(point, offsets, max_bytes=100_000)
    assert text is not None
    decoded = decode(point, text)
    assert [o for o in range(point, current + 1) if o in decoded] == offsets
    assert len(decoded) == len(offsets)


def test_consecutive_offsets_are_one_run() -> None:
    """A stuck head record with 10,000 done behind it costs a handful of bytes."""
    text = encode(1000, list(range(1001, 11001)), max_bytes=64)
    assert text == "d1:1+270f"
    assert runs_of([1, 2, 3, 7, 8, 10]) == [(1, 3), (7, 8), (10, 10)]


def test_an_encoding_over_the_bound_is_refused() -> None:
    """Scattered offsets beyond the byte budget: None, so the commit goes without them."""
    scattered = list(range(2, 20_000, 2))
    assert encode(0, scattered, max_bytes=2048) is None
    assert encode(0, [], max_bytes=2048) == ""


@pytest.mark.parametrize(
    "text", ["", "hello", "d1:", "d1:zz+1", "d1:0+1", "d1:5+-1", "d1:1+3,2+0", None]
)
def test_metadata_that_is_not_ours_skips_nothing(text: str | None) -> None:
    """Foreign, empty, malformed or overlapping metadata reads as nothing done beyond the point."""
    decoded = decode(10, text)
    assert decoded.runs == ()
    assert 11 not in decoded
