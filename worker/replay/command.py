"""``replay``: the command's flags, its summary tables and its exit code.

It takes the worker's own Kafka settings (``WORKER_*`` variables and the same flags:
the client library, bootstrap servers, client id, linger, compression, TLS and SASL) and
its dead-letter topic, and nothing else the worker needs: no input or output topic, no
group.
"""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from typing import Any

from rich.console import Console
from rich.table import Table

from worker.commands.produce import progress_bar
from worker.commands.session import (
    CommandFailed,
    add_connection_arguments,
    quiet_clients,
    read_connection,
    topic_name,
)
from worker.errors import ERROR_CODES, ExitCode
from worker.replay.plan import Filters, Outcome, Planner, ReplayPlan, parse_time
from worker.replay.transfer import ReplayError, replay
from worker.settings import ConfigError
from worker.shutdown import run_interruptible

__all__ = ["add_replay_parser", "render", "run_replay"]

#: Samples shown per error code and model in a dry run.
_SAMPLES = 2
#: Dead letters named per reason they were not sent.
_LISTED = 10


def render(plan: ReplayPlan) -> list[Any]:
    """The summary: outcomes by code and model, samples in a dry run, then what was not sent."""
    out: list[Any] = [_summary_table(plan)]
    if plan.dry_run and plan.having(Outcome.SEND):
        out.append(_samples_table(plan))
    replayed = plan.having(Outcome.REPLAYED_SINCE)
    if replayed:
        out.append(
            f"skipped {len(replayed)}: replayed since and failed again; their later dead "
            "letters stand for them"
        )
    omitted = plan.having(Outcome.VALUE_OMITTED)
    if omitted:
        out.append(
            f"without their value {len(omitted)}: the dead-letter topic refused them for "
            "their size; fetch the originals from these source coordinates:"
        )
        out += [f"  {entry.letter.source} (dead letter {entry.letter.at})" for entry in omitted]
    verb = "would not send" if plan.dry_run else "not sent"
    reasons = (Outcome.OVER_LIMIT, Outcome.NO_DESTINATION, Outcome.FAILED)
    grouped: dict[str, list[str]] = {}
    for entry in plan.having(*reasons):
        grouped.setdefault(entry.detail, []).append(entry.letter.at)
    for detail, where in grouped.items():
        listed = ", ".join(where[:_LISTED]) + (", ..." if len(where) > _LISTED else "")
        out.append(f"{verb} {len(where)}: {detail}: {listed}")
    sent = plan.having(Outcome.SENT)
    if plan.dry_run:
        out.append("dry run: nothing sent")
    elif sent:
        topics = ", ".join(sorted({entry.destination for entry in sent}))
        out.append(f"sent {len(sent)} of {len(plan.entries)} selected to {topics}")
    return out


def _label(plan: ReplayPlan, outcome: Outcome) -> str:
    return "would send" if plan.dry_run and outcome is Outcome.SEND else outcome.value


def _summary_table(plan: ReplayPlan) -> Table:
    counts = plan.counts()
    present = [o for o in Outcome if any(c[o] for c in counts.values())]
    what = "replay plan (dry run)" if plan.dry_run else "replay"
    table = Table(
        title=f"{what}: {len(plan.entries)} of {plan.records} dead letters in {plan.dlq_topic}"
    )
    table.add_column("code")
    table.add_column("model")
    for outcome in present:
        table.add_column(_label(plan, outcome), justify="right")
    for (code, model), counted in counts.items():
        table.add_row(code or "-", model or "-", *(str(counted[o]) for o in present))
    return table


def _samples_table(plan: ReplayPlan) -> Table:
    """The first few dead letters of each code and model that would be sent."""
    sending = plan.having(Outcome.SEND)
    destinations = sorted({entry.destination for entry in sending})
    one = len(destinations) == 1
    table = Table(title=f"samples, to {destinations[0]}" if one else "samples")
    columns = ["dead letter", "request id", "code", "model", "failed at (UTC)", "replay"]
    for column in columns if one else [*columns, "to"]:
        fixed = column in ("dead letter", "failed at (UTC)", "replay")
        table.add_column(column, no_wrap=fixed, overflow="fold")
    shown: dict[tuple[str, str], int] = {}
    for entry in sending:
        letter = entry.letter
        group = (letter.code, letter.model)
        shown[group] = shown.get(group, 0) + 1
        if shown[group] > _SAMPLES:
            continue
        moment = letter.failed_at
        row = [
            letter.at,
            letter.request_id,
            letter.code,
            letter.model or "-",
            f"{moment.astimezone(UTC):%Y-%m-%d %H:%M:%S}" if moment else "-",
            f"{letter.replay_count + 1}/{plan.max_replays}",
        ]
        table.add_row(*row) if one else table.add_row(*row, entry.destination)
    return table


def _codes(text: str) -> list[str]:
    codes = [code.strip().upper() for code in text.split(",") if code.strip()]
    unknown = [code for code in codes if code not in ERROR_CODES]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r} is not one of {', '.join(ERROR_CODES)}")
    return codes


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _moment(text: str) -> datetime:
    try:
        return parse_time(text, datetime.now(UTC))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return int(text)


def add_replay_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``replay``; it takes the worker's WORKER_* Kafka settings and flags."""
    parser = commands.add_parser(
        "replay",
        help="re-produce dead letters to their source topic (or --to), headers restored",
        description="Re-produce dead letters, as they were before they failed, to their "
        "source topic or --to. Filters combine (all must match); a filter given several "
        "values (repeated, or comma-separated) matches any of them.",
        allow_abbrev=False,  # it sends records: --dry is not taken for --dry-run
    )
    add = parser.add_argument
    add("--to", metavar="TOPIC", type=topic_name, help="send all here, not to their source topic")
    add("--code", action="extend", type=_codes, default=[], help="x-error-code, e.g. FORBIDDEN")
    add(
        "--model",
        action="extend",
        type=_names,
        default=[],
        help="the model the request names (x-model-name, else model_name)",
    )
    add(
        "--source-topic",
        action="extend",
        type=_names,
        default=[],
        metavar="TOPIC",
        help="x-source-topic: the topic the request failed on",
    )
    add(
        "--request-id",
        action="append",
        default=[],
        metavar="ID",
        help="the request's id (body id, else x-request-id, else topic-partition-offset)",
    )
    add(
        "--failed-after",
        metavar="TIME",
        type=_moment,
        help="x-failed-at at or after TIME (RFC 3339, e.g. 2024-05-01T12:00:00Z, or a "
        "duration ago: 90s, 15m, 2h, 7d)",
    )
    add("--failed-before", metavar="TIME", type=_moment, help="x-failed-at before TIME")
    add(
        "--max-replays",
        metavar="N",
        type=_count,
        default=3,
        help="refuse a dead letter whose request was replayed N times already "
        "(x-replay-count) [default: 3]",
    )
    add("--dry-run", action="store_true", help="print what would be sent; send nothing")
    # Where the dead letters are, and how to reach Kafka (the producer uses the worker's
    # linger and compression).
    add_connection_arguments(parser, "dlq_topic")
    parser.set_defaults(handler=run_replay)


def _refused(args: argparse.Namespace, dlq_topic: str) -> str:
    if args.to == dlq_topic:
        return f"--to: must not be the dead-letter topic {dlq_topic!r}"
    after, before = args.failed_after, args.failed_before
    if after is not None and before is not None and after >= before:
        return "--failed-before: must be later than --failed-after"
    return ""


def run_replay(args: argparse.Namespace) -> int:
    """``replay``: 0 when every selected dead letter was sent (or in a dry run), 4 when
    some were not, 2 for invalid settings or a refused credential, 5 when Kafka is
    unreachable."""
    try:
        connection = read_connection(args, ["dlq_topic"])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    dlq_topic: str = connection.values["dlq_topic"]
    problem = _refused(args, dlq_topic)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return ExitCode.CONFIG
    filters = Filters(
        codes=frozenset(args.code),
        models=frozenset(args.model),
        source_topics=frozenset(args.source_topic),
        request_ids=frozenset(args.request_id),
        failed_after=args.failed_after,
        failed_before=args.failed_before,
    )
    planner = Planner(
        filters,
        dlq_topic=dlq_topic,
        to_topic=args.to,
        max_replays=args.max_replays,
        dry_run=args.dry_run,
    )
    # The summary reports what failed; the clients' own retries would repeat it on stderr.
    quiet_clients()
    console, errors = Console(), Console(stderr=True)
    try:
        # Off a terminal the bar would only repeat the summary's counts.
        with progress_bar(errors, disable=not errors.is_terminal) as progress:
            plan = run_interruptible(replay(planner, connection.kafka, connection.auth, progress))
    except ConfigError as exc:  # e.g. an OAUTHBEARER token command failing on connect
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    except CommandFailed as exc:  # a refused credential, no broker answering
        print(f"error: {exc}", file=sys.stderr)
        return exc.code
    except ReplayError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.INCOMPLETE
    for part in render(plan):
        console.print(part)
    return ExitCode.OK if plan.dry_run or plan.complete else ExitCode.INCOMPLETE
