"""The replay command's flags and settings, refused before Kafka; its summary from a plan."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rich.table import Table

from tests.support.worker import env_without_settings
from worker.replay import DeadLetter, Entry, Outcome, ReplayPlan, render


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = env_without_settings()
    return subprocess.run(
        [sys.executable, "-m", "worker", "replay", *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


_DLQ = {"WORKER_DLQ_TOPIC": "dead-letters", "WORKER_BOOTSTRAP_SERVERS": "127.0.0.1:1"}


@pytest.mark.parametrize(
    ("env", "args", "named"),
    [
        ({}, (), "WORKER_DLQ_TOPIC"),
        ({**_DLQ, "WORKER_MAX_INFLIGHT": "8"}, (), "WORKER_MAX_INFLIGHT"),
        ({**_DLQ, "WORKER_SECURITY_PROTOCOL": "SASL_SSL"}, (), "WORKER_SASL_MECHANISM"),
        (_DLQ, ("--dlq-topic", "no spaces"), "--dlq-topic"),
        (_DLQ, ("--linger-ms", "-1"), "--linger-ms"),
        (_DLQ, ("--to", "dead-letters"), "--to"),
        (_DLQ, ("--failed-after", "1h", "--failed-before", "2h"), "--failed-before"),
    ],
)
def test_invalid_settings_exit_2_with_one_line(
    env: dict[str, str], args: tuple[str, ...], named: str
) -> None:
    """The worker's settings rules hold for replay: exit 2, one line naming the setting."""
    done = _run(env, *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: ") and named in lines[0]
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--code", "NOPE"), "--code"),
        (("--failed-after", "yesterday"), "--failed-after"),
        (("--max-replays", "-1"), "--max-replays"),
        (("--to", "a b"), "--to"),
        (("--input-topics", "x"), "--input-topics"),
        (("--dry",), "--dry"),
    ],
)
def test_invalid_flags_exit_2(args: tuple[str, ...], named: str) -> None:
    """replay's own flags are checked by argparse (usage, then the error naming the flag);
    a flag of ``run`` that replay does not take, or an abbreviation, is refused."""
    done = _run(_DLQ, *args)
    assert done.returncode == 2
    assert named in done.stderr.strip().splitlines()[-1]


def _entry(offset: int, outcome: Outcome, *, code: str = "FORBIDDEN", detail: str = "") -> Entry:
    letter = DeadLetter(
        at=f"dlq/0/{offset}",
        partition=0,
        offset=offset,
        code=code,
        model="double",
        request_id=f"r-{offset}",
        source_topic="requests",
        source=f"requests/0/{100 + offset}",
        failed_at=None,
        replay_count=0,
        replayed_from="",
        value_omitted=outcome is Outcome.VALUE_OMITTED,
        size=10,
    )
    return Entry(letter, "requests", outcome, detail)


def test_summary_counts_by_code_and_model_and_lists_what_was_not_sent() -> None:
    """One column per outcome seen; omitted values name their source; reasons are grouped."""
    limit = "replayed 3 times already (--max-replays 3)"
    plan = ReplayPlan("dlq", max_replays=3, dry_run=False, records=9)
    plan.entries = [
        _entry(0, Outcome.SENT),
        _entry(1, Outcome.SENT),
        _entry(2, Outcome.FAILED, code="DECODE_ERROR", detail="MessageSizeTooLargeError"),
        _entry(3, Outcome.OVER_LIMIT, detail=limit),
        _entry(4, Outcome.OVER_LIMIT, detail=limit),
        _entry(5, Outcome.VALUE_OMITTED, code="DECODE_ERROR", detail="original at requests/0/105"),
        _entry(6, Outcome.REPLAYED_SINCE, detail="failed again as dlq/0/7"),
    ]

    summary, *lines = render(plan)

    assert isinstance(summary, Table)
    headers = [column.header for column in summary.columns]
    assert headers == [
        "code",
        "model",
        "sent",
        "failed",
        "replayed since",
        "over the limit",
        "value omitted",
    ]
    cells = [list(column.cells) for column in summary.columns]
    assert [list(row) for row in zip(*cells, strict=True)] == [
        ["DECODE_ERROR", "double", "0", "1", "0", "0", "1"],
        ["FORBIDDEN", "double", "2", "0", "1", "2", "0"],
    ]
    assert "  requests/0/105 (dead letter dlq/0/5)" in lines
    assert f"not sent 2: {limit}: dlq/0/3, dlq/0/4" in lines
    assert "not sent 1: MessageSizeTooLargeError: dlq/0/2" in lines
    assert lines[-1] == "sent 2 of 7 selected to requests"
    assert not plan.complete
