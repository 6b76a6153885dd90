"""What a ``replay`` would do: each dead letter read off its headers, filtered and judged.

Pure: no Kafka here. A dead letter is selected by the filters (error code, model,
source topic, request id, ``x-failed-at`` range), then judged:

- replayed since: a later dead letter of the same snapshot came from it (its
  ``x-replayed-from`` names this one), so its request is replayed through that one
  and not twice;
- value omitted: the dead-letter topic refused the record for its size and keeps only
  its headers; the original is at its source coordinates;
- over the limit: its request has been replayed ``max_replays`` times already;
- otherwise it is sent to ``--to`` or to its source topic.
"""

from __future__ import annotations

import enum
import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from worker.errors import WorkerError
from worker.wire import header_value, replay_count, request_names
from worker.wire.headers import (
    CONNECT_CLASS_MODULE,
    CONNECT_EXCEPTION_CLASS,
    CONNECT_OFFSET,
    CONNECT_PARTITION,
    CONNECT_TOPIC,
    X_ERROR_CODE,
    X_FAILED_AT,
    X_REPLAYED_FROM,
    X_SOURCE_OFFSET,
    X_SOURCE_PARTITION,
    X_SOURCE_TOPIC,
    X_VALUE_OMITTED,
)

__all__ = [
    "DeadLetter",
    "Entry",
    "Filters",
    "Outcome",
    "Planner",
    "ReplayPlan",
    "parse_time",
]

_DURATION = re.compile(r"(\d+)\s*([smhd])")
_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days"}


def parse_time(text: str, now: datetime) -> datetime:
    """A moment: RFC 3339 / ISO 8601 (a date, or a time without zone, is UTC), or a
    duration before ``now`` (``90s``, ``15m``, ``2h``, ``7d``). ValueError if neither."""
    text = text.strip()
    duration = _DURATION.fullmatch(text)
    if duration is not None:
        return now - timedelta(**{_UNITS[duration[2]]: int(duration[1])})
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a time (2024-05-01T12:00:00Z) nor a duration ago (2h)"
        ) from None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


def _text(headers: Any, name: str) -> str:
    raw = header_value(headers, name)
    return bytes(raw).decode("utf-8", errors="replace").strip() if raw is not None else ""


def _moment(text: str) -> datetime | None:
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        return None
    return moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment


#: Error codes by the class names Connect-style dead letters carry.
def _error_classes(base: type[WorkerError]) -> list[type[WorkerError]]:
    return [c for sub in base.__subclasses__() for c in (sub, *_error_classes(sub))]


_CODES: Final = {f"{CONNECT_CLASS_MODULE}{c.__name__}": c.code for c in _error_classes(WorkerError)}


def _connect_code(headers: Any) -> str:
    """The error code of a Connect-style dead letter, from its exception's class name."""
    return _CODES.get(_text(headers, CONNECT_EXCEPTION_CLASS), "")


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """What a dead letter says about itself: where it is, why it failed, what it asked."""

    at: str  # dlq-topic/partition/offset: what x-replayed-from of its replay says
    partition: int
    offset: int
    code: str
    model: str  # "" when the request names none
    request_id: str
    source_topic: str
    source: str  # topic/partition/offset of the request the worker failed
    failed_at: datetime | None
    replay_count: int
    replayed_from: str  # "" unless this dead letter is a replay that failed again
    value_omitted: bool
    size: int  # bytes of value and key

    @classmethod
    def of(cls, record: Any) -> DeadLetter:
        """Read a consumed dead letter (anything with topic, partition, offset, key,
        value, headers)."""
        headers = record.headers
        # The worker's headers, else Kafka Connect's (WORKER_DLQ_HEADER_STYLE connect).
        source_topic = _text(headers, X_SOURCE_TOPIC) or _text(headers, CONNECT_TOPIC)
        partition = _text(headers, X_SOURCE_PARTITION) or _text(headers, CONNECT_PARTITION)
        offset = _text(headers, X_SOURCE_OFFSET) or _text(headers, CONNECT_OFFSET)
        model, request_id = request_names(record.value, headers)
        return cls(
            at=f"{record.topic}/{record.partition}/{record.offset}",
            partition=record.partition,
            offset=record.offset,
            code=_text(headers, X_ERROR_CODE) or _connect_code(headers),
            model=model,
            # The worker's own fallback, rebuilt from the coordinates it recorded.
            request_id=request_id or f"{source_topic}-{partition}-{offset}",
            source_topic=source_topic,
            source=f"{source_topic}/{partition}/{offset}",
            failed_at=_moment(_text(headers, X_FAILED_AT)),
            replay_count=replay_count(headers),
            replayed_from=_text(headers, X_REPLAYED_FROM),
            value_omitted=_text(headers, X_VALUE_OMITTED).lower() == "true",
            size=len(record.value or b"") + len(record.key or b""),
        )


@dataclass(frozen=True, slots=True)
class Filters:
    """Which dead letters to replay; every filter given must match (one of its values)."""

    codes: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()
    source_topics: frozenset[str] = frozenset()
    request_ids: frozenset[str] = frozenset()
    failed_after: datetime | None = None  # inclusive
    failed_before: datetime | None = None  # exclusive

    def match(self, letter: DeadLetter) -> bool:
        """True when ``letter`` passes every filter (no filter: every dead letter)."""
        if self.failed_after is not None or self.failed_before is not None:
            moment = letter.failed_at
            if moment is None:
                return False
            if self.failed_after is not None and moment < self.failed_after:
                return False
            if self.failed_before is not None and moment >= self.failed_before:
                return False
        wanted = (
            (self.codes, letter.code),
            (self.models, letter.model),
            (self.source_topics, letter.source_topic),
            (self.request_ids, letter.request_id),
        )
        return all(not values or value in values for values, value in wanted)


class Outcome(enum.Enum):
    """Where a selected dead letter ends; the value is the summary's column."""

    SEND = "to send"  # judged sendable; a dry run stops here
    SENT = "sent"
    FAILED = "failed"
    REPLAYED_SINCE = "replayed since"
    OVER_LIMIT = "over the limit"
    VALUE_OMITTED = "value omitted"
    NO_DESTINATION = "no destination"


#: Outcomes that leave a selected dead letter unsent for a reason the operator must see.
NOT_SENT = frozenset(
    {Outcome.FAILED, Outcome.OVER_LIMIT, Outcome.VALUE_OMITTED, Outcome.NO_DESTINATION}
)


@dataclass(slots=True)
class Entry:
    """A selected dead letter, where it goes, and what became of it."""

    letter: DeadLetter
    destination: str
    outcome: Outcome
    detail: str = ""


@dataclass(slots=True)
class ReplayPlan:
    """Every selected dead letter of one snapshot with its outcome (filled in as it goes)."""

    dlq_topic: str
    max_replays: int
    dry_run: bool
    records: int = 0  # dead letters in the snapshot
    entries: list[Entry] = field(default_factory=list)

    def having(self, *outcomes: Outcome) -> list[Entry]:
        return [entry for entry in self.entries if entry.outcome in outcomes]

    @property
    def complete(self) -> bool:
        """True unless a selected dead letter was (or would be) left unsent."""
        return not self.having(*NOT_SENT)

    def counts(self) -> dict[tuple[str, str], Counter[Outcome]]:
        """Outcomes by (error code, model), in that order."""
        out: dict[tuple[str, str], Counter[Outcome]] = {}
        for entry in self.entries:
            key = (entry.letter.code, entry.letter.model)
            out.setdefault(key, Counter())[entry.outcome] += 1
        return dict(sorted(out.items()))


class Planner:
    """Reads a snapshot's dead letters one at a time, keeping only the selected ones."""

    def __init__(
        self,
        filters: Filters,
        *,
        dlq_topic: str,
        to_topic: str | None = None,
        max_replays: int = 3,
        dry_run: bool = False,
    ) -> None:
        self._filters = filters
        self._to_topic = to_topic
        self._selected: list[DeadLetter] = []
        # x-replayed-from -> the later dead letter saying it came from there.
        self._replayed: dict[str, str] = {}
        self._plan = ReplayPlan(dlq_topic, max_replays, dry_run)

    @property
    def dlq_topic(self) -> str:
        return self._plan.dlq_topic

    def add(self, letter: DeadLetter) -> None:
        self._plan.records += 1
        if letter.replayed_from:
            self._replayed[letter.replayed_from] = letter.at
        if self._filters.match(letter):
            self._selected.append(letter)

    def add_all(self, letters: Iterable[DeadLetter]) -> None:
        for letter in letters:
            self.add(letter)

    def plan(self) -> ReplayPlan:
        """Judge every selected dead letter, now that the whole snapshot has been seen."""
        self._plan.entries = [self._judge(letter) for letter in self._selected]
        return self._plan

    def _judge(self, letter: DeadLetter) -> Entry:
        destination = self._to_topic or letter.source_topic
        limit = self._plan.max_replays
        later = self._replayed.get(letter.at)
        if later is not None:
            return Entry(letter, destination, Outcome.REPLAYED_SINCE, f"failed again as {later}")
        if letter.value_omitted:
            return Entry(letter, destination, Outcome.VALUE_OMITTED, f"original at {letter.source}")
        if letter.replay_count >= limit:
            why = f"replayed {letter.replay_count} times already (--max-replays {limit})"
            return Entry(letter, destination, Outcome.OVER_LIMIT, why)
        if not destination:
            return Entry(letter, destination, Outcome.NO_DESTINATION, "no x-source-topic; use --to")
        return Entry(letter, destination, Outcome.SEND)
