"""Which dead letters a replay selects, and what it decides for each: filters, times, limits."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta, timezone

import pytest

from worker import wire
from worker.errors import Forbidden, InferenceError, WorkerError
from worker.replay import DeadLetter, Filters, Outcome, Planner, parse_time
from worker.wire import Headers, replay_headers
from worker.wire.headers import omitted_value_headers

_T0 = datetime(2024, 5, 1, 12, 0, tzinfo=UTC)


@dataclass
class _Record:
    """A consumed dead letter: the fields replay reads."""

    topic: str
    partition: int
    offset: int
    value: bytes | None
    key: bytes | None
    headers: Headers = field(default_factory=list)


def _letter(
    offset: int,
    *,
    error: WorkerError | None = None,
    model: str = "double",
    request_id: str | None = None,
    source: wire.Source | None = None,
    failed_at: datetime = _T0,
    original: Headers = (),
    partition: int = 0,
) -> DeadLetter:
    """A dead letter as the worker writes it (its own header builder), read back."""
    value = f'{{"model_name": "{model}", "inputs": []}}'.encode()
    headers = list(original)
    if request_id is not None:
        headers.append(("x-request-id", request_id.encode()))
    built = wire.dead_letter_headers(
        headers,
        error or Forbidden("not allowed"),
        source or wire.Source("requests", 0, offset, 0),
        attempts=1,
        group_id="workers",
        failed_at=failed_at,
    )
    return DeadLetter.of(_Record("dlq", partition, offset, value, b"k", built))


def test_a_dead_letter_read_off_its_headers() -> None:
    """Coordinates, code, model (body), request id (header), source, time and count."""
    letter = _letter(
        5,
        error=InferenceError("boom"),
        model="faulty",
        request_id="r-5",
        source=wire.Source("requests", 2, 40, 0),
        failed_at=datetime(2024, 5, 1, 14, 0, 0, 250000, tzinfo=timezone(timedelta(hours=2))),
        partition=1,
    )
    assert (letter.at, letter.partition, letter.offset) == ("dlq/1/5", 1, 5)
    assert (letter.code, letter.model, letter.request_id) == ("INFERENCE_ERROR", "faulty", "r-5")
    assert (letter.source_topic, letter.source) == ("requests", "requests/2/40")
    assert letter.failed_at == datetime(2024, 5, 1, 12, 0, 0, 250000, tzinfo=UTC)
    assert (letter.replay_count, letter.replayed_from, letter.value_omitted) == (0, "", False)
    assert letter.size == len(b'{"model_name": "faulty", "inputs": []}') + 1


def test_request_id_falls_back_to_the_source_coordinates() -> None:
    """No id in body or headers: the worker's own fallback, topic-partition-offset."""
    letter = _letter(3, source=wire.Source("requests", 1, 17, 0))
    assert letter.request_id == "requests-1-17"


def test_no_filter_selects_everything() -> None:
    """Filters() matches any dead letter, even one without x-failed-at."""
    bare = DeadLetter.of(_Record("dlq", 0, 0, b"", None, []))
    assert Filters().match(bare)
    assert Filters().match(_letter(1))


@pytest.mark.parametrize(
    ("filters", "selected"),
    [
        (Filters(codes=frozenset({"FORBIDDEN"})), [0, 2]),
        (Filters(models=frozenset({"mlp"})), [1]),
        (Filters(source_topics=frozenset({"other"})), [2]),
        (Filters(request_ids=frozenset({"r-1", "r-2"})), [1, 2]),
        (Filters(failed_after=_T0 + timedelta(minutes=1)), [1, 2]),
        (Filters(failed_before=_T0 + timedelta(minutes=2)), [0, 1]),
        (
            Filters(
                failed_after=_T0 + timedelta(minutes=1), failed_before=_T0 + timedelta(minutes=2)
            ),
            [1],
        ),
        (Filters(codes=frozenset({"FORBIDDEN"}), models=frozenset({"mlp"})), []),
        (
            Filters(
                codes=frozenset({"FORBIDDEN", "INFERENCE_ERROR"}),
                source_topics=frozenset({"requests"}),
            ),
            [0, 1],
        ),
    ],
)
def test_filters_combine_with_and_values_with_or(filters: Filters, selected: list[int]) -> None:
    """Each filter given must match; several values of one filter match any of them."""
    letters = [
        _letter(0, request_id="r-0", failed_at=_T0),
        _letter(
            1,
            error=InferenceError("x"),
            model="mlp",
            request_id="r-1",
            failed_at=_T0 + timedelta(minutes=1),
        ),
        _letter(
            2,
            request_id="r-2",
            source=wire.Source("other", 0, 2, 0),
            failed_at=_T0 + timedelta(minutes=2),
        ),
    ]
    assert [letter.offset for letter in letters if filters.match(letter)] == selected


def test_a_time_filter_excludes_dead_letters_without_a_time() -> None:
    """No readable x-failed-at: not inside any range."""
    bare = DeadLetter.of(_Record("dlq", 0, 0, b"", None, [("x-failed-at", b"yesterday")]))
    assert bare.failed_at is None
    assert not Filters(failed_before=_T0).match(bare)


@pytest.mark.parametrize(
    ("text", "moment"),
    [
        ("2024-05-01T12:00:00Z", _T0),
        ("2024-05-01T12:00:00.000Z", _T0),
        ("2024-05-01T14:00:00+02:00", _T0),
        ("2024-05-01T12:00", _T0),
        ("2024-05-01", _T0 - timedelta(hours=12)),
        ("90s", _T0 - timedelta(seconds=90)),
        ("15m", _T0 - timedelta(minutes=15)),
        ("2h", _T0 - timedelta(hours=2)),
        (" 7d ", _T0 - timedelta(days=7)),
    ],
)
def test_parse_time(text: str, moment: datetime) -> None:
    """RFC 3339 with any offset, a naive time or date as UTC, or a duration before now."""
    assert parse_time(text, now=_T0) == moment


@pytest.mark.parametrize("text", ["", "yesterday", "2h30m", "-2h", "2024-13-01", "5w"])
def test_parse_time_refuses_anything_else(text: str) -> None:
    """Neither a time nor a duration: ValueError naming the text."""
    with pytest.raises(ValueError, match="neither a time"):
        parse_time(text, now=_T0)


def _plan(*letters: DeadLetter, to: str | None = None, max_replays: int = 3) -> dict[str, Outcome]:
    planner = Planner(Filters(), dlq_topic="dlq", to_topic=to, max_replays=max_replays)
    planner.add_all(letters)
    plan = planner.plan()
    assert plan.records == len(letters)
    return {entry.letter.at: entry.outcome for entry in plan.entries}


def _replayed(letter: DeadLetter, offset: int, count: int) -> DeadLetter:
    """The dead letter of ``letter``'s replay number ``count``, failed again."""
    headers = replay_headers(
        wire.dead_letter_headers(
            [],
            Forbidden("x"),
            wire.Source("requests", 0, 0, 0),
            attempts=1,
            group_id="g",
            failed_at=_T0,
        ),
        letter.at,
        count,
    )
    again = wire.dead_letter_headers(
        headers,
        Forbidden("again"),
        wire.Source("requests", 0, 100 + offset, 0),
        attempts=1,
        group_id="g",
        failed_at=_T0,
    )
    return DeadLetter.of(_Record("dlq", 0, offset, b"{}", None, again))


def test_plan_sends_to_the_source_topic_or_to() -> None:
    """A selected dead letter goes back to x-source-topic, or to --to for all."""
    letter = _letter(0, source=wire.Source("requests", 0, 9, 0))
    planner = Planner(Filters(), dlq_topic="dlq")
    planner.add(letter)
    assert [(e.destination, e.outcome) for e in planner.plan().entries] == [
        ("requests", Outcome.SEND)
    ]
    planner = Planner(Filters(), dlq_topic="dlq", to_topic="fixed")
    planner.add(letter)
    assert [e.destination for e in planner.plan().entries] == ["fixed"]


def test_a_dead_letter_replayed_since_is_skipped_for_its_latest() -> None:
    """Replayed twice and failed each time: only the newest copy is sent, with count 3."""
    first = _letter(0)
    second = _replayed(first, 1, 1)
    third = _replayed(second, 2, 2)
    assert (third.replay_count, third.replayed_from) == (2, "dlq/0/1")

    outcomes = _plan(first, second, third)

    assert outcomes == {
        "dlq/0/0": Outcome.REPLAYED_SINCE,
        "dlq/0/1": Outcome.REPLAYED_SINCE,
        "dlq/0/2": Outcome.SEND,
    }


def test_the_replay_limit_counts_replays_already_made() -> None:
    """--max-replays 3: a request replayed 3 times is refused, one replayed twice is sent."""
    twice = _replayed(_letter(0), 1, 2)
    thrice = _replayed(_letter(10), 2, 3)
    outcomes = _plan(twice, thrice)
    assert outcomes == {"dlq/0/1": Outcome.SEND, "dlq/0/2": Outcome.OVER_LIMIT}
    assert _plan(twice, max_replays=0) == {"dlq/0/1": Outcome.OVER_LIMIT}


def test_a_dead_letter_without_its_value_is_reported_not_sent() -> None:
    """x-value-omitted: true keeps only headers; the entry points at the source record."""
    letter = _letter(0, source=wire.Source("requests", 3, 77, 0))
    record = _Record("dlq", 0, 4, b"", b"k", [])
    built = wire.dead_letter_headers(
        [],
        Forbidden("x"),
        wire.Source("requests", 3, 77, 0),
        attempts=1,
        group_id="g",
        failed_at=_T0,
    )
    record.headers = omitted_value_headers(built, b"{...}", b"k", drop_key=False)
    omitted = DeadLetter.of(record)
    assert omitted.value_omitted

    planner = Planner(Filters(), dlq_topic="dlq")
    planner.add_all([letter, omitted])
    plan = planner.plan()

    by_at = {entry.letter.at: entry for entry in plan.entries}
    assert by_at["dlq/0/4"].outcome is Outcome.VALUE_OMITTED
    assert by_at["dlq/0/4"].detail == "original at requests/3/77"
    assert by_at["dlq/0/0"].outcome is Outcome.SEND
    assert not plan.complete


def test_no_source_topic_and_no_to_has_no_destination() -> None:
    """A record without x-source-topic (not written by the worker) needs --to."""
    bare = DeadLetter.of(_Record("dlq", 0, 0, b"{}", None, [("x-error-code", b"DECODE_ERROR")]))
    assert _plan(bare) == {"dlq/0/0": Outcome.NO_DESTINATION}
    assert _plan(bare, to="fixed") == {"dlq/0/0": Outcome.SEND}


def test_only_selected_dead_letters_are_kept_but_all_are_counted() -> None:
    """The filters keep what is judged; every dead letter of the snapshot is counted."""
    planner = Planner(Filters(codes=frozenset({"INFERENCE_ERROR"})), dlq_topic="dlq")
    planner.add_all([_letter(0), _letter(1, error=InferenceError("x"), model="faulty")])
    plan = planner.plan()
    assert plan.records == 2
    assert [entry.letter.offset for entry in plan.entries] == [1]
    assert plan.counts() == {("INFERENCE_ERROR", "faulty"): {Outcome.SEND: 1}}


def test_a_plan_is_complete_unless_something_selected_is_left_unsent() -> None:
    """Sent and replayed-since are fine; failed, refused, omitted or undeliverable are not."""
    planner = Planner(Filters(), dlq_topic="dlq")
    planner.add_all([_letter(0), _letter(1)])
    plan = planner.plan()
    for entry in plan.entries:
        entry.outcome = Outcome.SENT
    assert plan.complete
    plan.entries[1] = replace(plan.entries[1], outcome=Outcome.FAILED)
    assert not plan.complete


@pytest.mark.parametrize("style", ["connect", "both"])
def test_a_connect_style_dead_letter_is_read_as_the_worker_s(style: str) -> None:
    """Kafka Connect's headers name the source and (by its exception class) the code."""
    built = wire.dead_letter_headers(
        [("x-request-id", b"r-1")],
        InferenceError("boom"),
        wire.Source("requests", 2, 40, 0),
        attempts=1,
        group_id="workers",
        failed_at=_T0,
        style=style,
    )
    letter = DeadLetter.of(_Record("dlq", 0, 9, b"{}", b"k", built))
    assert (letter.code, letter.source_topic, letter.source) == (
        "INFERENCE_ERROR",
        "requests",
        "requests/2/40",
    )
    assert letter.failed_at == (_T0 if style == "both" else None)


def test_a_connect_dead_letter_of_another_tool_has_no_code_of_ours() -> None:
    headers = [
        ("__connect.errors.topic", b"orders"),
        ("__connect.errors.partition", b"0"),
        ("__connect.errors.offset", b"5"),
        ("__connect.errors.exception.class.name", b"org.apache.kafka.connect.errors.DataException"),
    ]
    letter = DeadLetter.of(_Record("dlq", 0, 1, b"{}", None, headers))
    assert (letter.code, letter.source) == ("", "orders/0/5")
