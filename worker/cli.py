"""Command line: `run`, `check`, `topics`, `produce`, `tail`, `replay`. Imported by nothing."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from worker import __version__
from worker.checks.report import add_check_parser
from worker.commands import add_produce_parser, add_tail_parser, add_topics_parser
from worker.errors import ExitCode
from worker.replay import add_replay_parser

if TYPE_CHECKING:
    from worker.settings import Settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kafka-triton-worker",
        description="Kafka stream-processing inference worker for NVIDIA Triton.",
    )
    parser.add_argument("--version", action="version", version=__version__)
    commands = parser.add_subparsers(dest="command", required=True)
    # `run` flags are parsed by the settings loader itself (see `main`), so that env
    # and flags share one set of checks and one error format.
    run = commands.add_parser(
        "run",
        help="consume requests, infer on Triton, publish results and dead letters",
        add_help=False,
    )
    run.set_defaults(handler=run_worker)
    add_check_parser(commands)
    add_topics_parser(commands)
    add_produce_parser(commands)
    add_tail_parser(commands)
    add_replay_parser(commands)
    return parser


def run_worker(args: argparse.Namespace) -> int:
    """``run``: load settings (exit 2 with one line if invalid), then serve until signalled."""
    from worker.settings import ConfigError, add_run_arguments, load_settings

    if "-h" in args.settings or "--help" in args.settings:
        helper = argparse.ArgumentParser(
            prog="kafka-triton-worker run",
            description="Every flag can also be set by its WORKER_* environment variable.",
        )
        add_run_arguments(helper)
        helper.print_help()
        return 0
    try:
        settings = load_settings(os.environ, args.settings, isatty=sys.stderr.isatty())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG

    from worker.allocator import pin_mmap_threshold
    from worker.observability import configure_logging
    from worker.shutdown import end_process

    configure_logging(settings.ops.log_format, settings.ops.log_level)
    pin_mmap_threshold()  # before any client allocates: large buffers freed stay freed
    # Every way out ends the same: the worker has closed its clients (librdkafka's threads
    # joined), then the process ends without the interpreter's teardown (see end_process).
    end_process(_serve(settings))


def _serve(settings: Settings) -> int:
    """Serve until stopped; the exit code, after one line on stderr when the worker refused
    to run or could not go on."""
    from worker.app import run_async, serve
    from worker.errors import CannotRun, Fatal, WriteFailed
    from worker.settings import ConfigError

    try:
        return run_async(serve(settings))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    except CannotRun as exc:
        # A credential, certificate, ACL or topic problem found at start-up (no retry fixes
        # it), or Kafka unavailable (the orchestrator's restart is the retry).
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except BaseExceptionGroup as group:
        refused, _ = group.split(CannotRun)
        if refused is not None:  # e.g. the group refused to the worker while it runs
            cause = _first_leaf(refused)
            print(f"error: {cause}", file=sys.stderr)
            return cause.exit_code if isinstance(cause, CannotRun) else ExitCode.CONFIG
        matched, _ = group.split(Fatal)
        if matched is None:
            raise
        first = _first_leaf(matched)
        # Crash loudly rather than lose a record: its offset was never committed.
        suffix = "; its offset was not committed" if isinstance(first, WriteFailed) else ""
        print(f"fatal: {first}{suffix}", file=sys.stderr)
        return ExitCode.FATAL


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m worker`` and the ``kafka-triton-worker`` script."""
    words = list(argv) if argv is not None else sys.argv[1:]
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(words)
        if args.command == "run":
            args.settings = extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        code: int = args.handler(args)
    except KeyboardInterrupt:
        # Ctrl-C outside `run`'s own signal handling (while loading, or in another
        # command): no traceback. `run` had taken nothing yet: a clean stop.
        return ExitCode.OK if words[:1] == ["run"] else ExitCode.INTERRUPTED
    return code
