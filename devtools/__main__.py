"""``python -m devtools``: the project's own tooling, run from a checkout, never shipped.

``dev`` (the local Kafka + Triton stack), ``demo``, ``produce`` (sample traffic),
``bench`` and ``schemas`` (write ``schemas/`` and the docs' generated parts from the code).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from devtools.bench.command import add_bench_parser
from devtools.demo import add_demo_parsers
from devtools.dev import add_dev_parser
from devtools.schemas import add_schemas_parser


def build_parser() -> argparse.ArgumentParser:
    """Every command of ``python -m devtools`` and its flags."""
    parser = argparse.ArgumentParser(
        prog="python -m devtools", description="Development tooling of kafka-triton-worker."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    add_dev_parser(commands)
    add_demo_parsers(commands)
    add_bench_parser(commands)
    add_schemas_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else sys.argv[1:])
    code: int = args.handler(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
