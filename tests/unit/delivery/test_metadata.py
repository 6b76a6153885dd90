"""The done offsets beyond a commit point, as commit metadata: compact, bounded, safe to misread."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.delivery.fakes import ours
from worker.delivery.metadata import ForeignMetadata, decode, encode, runs_of

pytestmark = pytest.mark.timeout(60)

#: The bounds the worker decodes with by default (WORKER_MAX_UNCOMMITTED_PER_PARTITION).
AHEAD, BYTES = 10_000, 2048


@given(
    point=st.integers(min_value=0, max_value=2**40),
    gaps=st.lists(st.integers(min_value=1, max_value=50), max_size=200),
)
def test_what_is_encoded_decodes_to_the_same_offsets(point: int, gaps: list[int]) -> None:
    """Any set of done offsets within the bound comes back exactly."""
    offsets, current = [], point
    for gap in gaps:
        current += gap
        offsets.append(current)
    text = encode(point, offsets, max_bytes=100_000)
    assert text is not None
    decoded = decode(point, text, max_ahead=current - point + 1, max_bytes=100_000)
    assert [o for o in range(point, current + 1) if o in decoded] == offsets
    assert decoded.records == len(offsets)


def test_consecutive_offsets_are_one_run() -> None:
    """A stuck head record with 10,000 done behind it costs a handful of bytes."""
    text = encode(1000, list(range(1001, 11001)), max_bytes=64)
    assert text == ours(1000, "1+270f") and len(text) == 3 + 6 + 1 + 8
    assert runs_of([1, 2, 3, 7, 8, 10]) == [(1, 3), (7, 8), (10, 10)]


def test_an_encoding_over_the_bound_is_refused() -> None:
    """Scattered offsets beyond the byte budget: None, so the commit goes without them."""
    scattered = list(range(2, 20_000, 2))
    assert encode(0, scattered, max_bytes=2048) is None
    assert encode(0, [], max_bytes=2048) == ""


@pytest.mark.parametrize("text", ["", None])
def test_no_metadata_is_nothing_done_beyond_the_point(text: str | None) -> None:
    """A commit without metadata lists nothing."""
    decoded = decode(10, text, max_ahead=AHEAD, max_bytes=BYTES)
    assert decoded.runs == () and 11 not in decoded and decoded.records == 0


@pytest.mark.parametrize(
    "text",
    [
        "hello",
        "d1:",
        "d1:zz+1",
        "d1:0+1",
        "d1:5+-1",
        "d1:1+3,2+0",  # overlapping
        "d1:5+0,1+0",  # out of order
        "d1:0x1+1",
        "d1: 1+1",
        "d1:A+1",  # the worker writes lowercase
        "d1:1+1,",
        ours(10, "1+1") + "0",  # a byte after the check
        ours(10, "1+1")[:-1],  # cut short
        ours(10, "1+1") + "\x00",
        ours(11, "1+1"),  # the check of another commit point
        ours(10, "1+1").replace("1+1", "1+2"),
        ours(10, "1+1").upper(),
        ours(10, ""),
        ours(10, "zz+1"),
        ours(10, "0+1"),
        ours(10, "1+3,2+0"),  # overlapping
        ours(10, "5+0,1+0"),  # out of order
        ours(10, "1+1,"),
        " " + ours(10, "1+1"),
    ],
)
def test_metadata_that_is_not_ours_is_refused(text: str) -> None:
    """Foreign, malformed, overlapping, unordered or unchecked metadata is ForeignMetadata,
    and so is the worker's own with anything before or after it."""
    with pytest.raises(ForeignMetadata):
        decode(10, text, max_ahead=AHEAD, max_bytes=BYTES)


def test_a_run_longer_than_any_count_is_refused() -> None:
    """A run past sys.maxsize, as a hostile group member can commit, is not ours (no overflow)."""
    with pytest.raises(ForeignMetadata, match="WORKER_MAX_UNCOMMITTED_PER_PARTITION"):
        decode(0, ours(0, "1+7fffffffffffffff"), max_ahead=AHEAD, max_bytes=BYTES)
    with pytest.raises(ForeignMetadata):
        decode(0, ours(0, "1+" + "f" * 40), max_ahead=sys.maxsize, max_bytes=BYTES)


def test_a_run_may_reach_as_far_as_the_uncommitted_bound_and_no_further() -> None:
    """With a bound of 100 the last offset a worker could have done is point + 99."""
    assert decode(7, ours(7, "1+62"), max_ahead=100, max_bytes=BYTES).last == 7 + 99
    with pytest.raises(ForeignMetadata):
        decode(7, ours(7, "1+63"), max_ahead=100, max_bytes=BYTES)
    with pytest.raises(ForeignMetadata):
        decode(7, ours(7, "64+0"), max_ahead=100, max_bytes=BYTES)


def test_metadata_longer_than_the_worker_writes_is_refused() -> None:
    """The worker never writes more than its byte budget; a longer string is not its own."""
    text = ours(0, ",".join(f"{2 * i + 1:x}+0" for i in range(600)))
    assert len(text) > BYTES
    with pytest.raises(ForeignMetadata):
        decode(0, text, max_ahead=AHEAD, max_bytes=BYTES)


@given(
    point=st.integers(min_value=0, max_value=2**62),
    body=st.text(alphabet="0123456789abcdef+,", max_size=80),
    ahead=st.integers(min_value=1, max_value=2**63),
)
def test_whatever_is_accepted_stays_within_the_bound(point: int, body: str, ahead: int) -> None:
    """Any metadata is refused, or lists sorted disjoint runs within ``ahead`` of the point."""
    try:
        decoded = decode(point, ours(point, body), max_ahead=ahead, max_bytes=BYTES)
    except ForeignMetadata:
        return
    assert decoded.records < ahead
    previous_end = point
    for start, end in decoded.runs:
        assert previous_end < start <= end < point + ahead
        previous_end = end


def test_the_first_format_is_not_trusted_any_more() -> None:
    """d1 has no end of its own: "d1:2+0" read with one stray byte is "d1:2+01", a run
    twice as long; no d1 text is trusted, whatever it says."""
    for text in ("d1:2+0", "d1:2+01"):
        with pytest.raises(ForeignMetadata, match="first format"):
            decode(10, text, max_ahead=AHEAD, max_bytes=BYTES)


@given(
    point=st.integers(min_value=0, max_value=2**40),
    done=st.lists(st.integers(min_value=1, max_value=500), min_size=1, max_size=50, unique=True),
    stray=st.text(min_size=1, max_size=3),
)
def test_nothing_after_the_workers_own_metadata_is_accepted(
    point: int, done: list[int], stray: str
) -> None:
    """Whatever follows the worker's metadata (what librdkafka reads past a commit written
    without a terminator), the whole is refused: nothing is skipped on its word."""
    text = encode(point, sorted(point + d for d in done), max_bytes=BYTES)
    assert text is not None
    assert decode(point, text, max_ahead=AHEAD, max_bytes=BYTES).records == len(done)
    with pytest.raises(ForeignMetadata):
        decode(point, text + stray, max_ahead=AHEAD, max_bytes=BYTES)
