"""``dev up|down|status|fetch``: the local Kafka + Triton (+ Schema Registry) stack from the
command line."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from devtools.devstack import stack


def add_dev_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dev = commands.add_parser("dev", help="run a local Kafka + Triton stack (no Docker needed)")
    actions = dev.add_subparsers(dest="dev_command", required=True)
    start = actions.add_parser(
        "up", help="start Kafka, Triton and a Schema Registry; they keep running"
    )
    start.add_argument("--kafka-nodes", type=int, default=1, help="Kafka nodes (default 1)")
    start.add_argument(
        "--models", default=None, help="comma-separated models to load (default: all)"
    )
    actions.add_parser("down", help="stop the stack and delete its data")
    actions.add_parser("status", help="show what runs")
    actions.add_parser(
        "fetch",
        help="download the Kafka jars and the Triton wheel, build the Schema Registry (cached)",
    )
    dev.set_defaults(handler=run_dev)


def _up(args: argparse.Namespace, console: Console) -> int:
    """``dev up``: 0 once the stack runs with its topics; one line (and 0) if one already ran."""
    models = [m for m in args.models.split(",") if m] if args.models else None
    try:
        with console.status("starting Kafka, Triton and the Schema Registry..."):
            running = stack.up(kafka_nodes=args.kafka_nodes, models=models, log=console.print)
    except stack.StackRunning as already:
        where = already.stack.describe()
        print(
            f"a local stack is already running (kafka {where['kafka bootstrap']}, "
            f"triton {where['triton grpc']}); `python -m devtools dev down` stops it"
        )
        return 0
    table = Table(title="local stack is up", show_header=False)
    for name, address in running.describe().items():
        table.add_row(name, address)
    table.add_row("topics", ", ".join(stack.DEFAULT_TOPICS.values()))
    for part, seconds in running.timings_s.items():
        table.add_row(f"ready in ({part})", f"{seconds:.1f} s")
    console.print(table)
    console.print("stop it with: [bold]python -m devtools dev down[/bold]")
    console.print("a worker's settings for it, ready to paste:")
    # Plain print: rich would wrap or colour what the shell must read verbatim.
    for name, value in running.worker_env().items():
        print(f"export {name}={value}")
    return 0


def run_dev(args: argparse.Namespace) -> int:
    console = Console(stderr=False)
    log = console.print
    if args.dev_command == "fetch":
        stack.fetch(log=log)
        log("[green]Kafka jars, Triton and the Schema Registry are in the cache[/green]")
        return 0
    if args.dev_command == "up":
        return _up(args, console)
    if args.dev_command == "status":
        current = stack.LocalStack.load()
        if current is None:
            log("no local stack recorded (start one with `python -m devtools dev up`)")
            return 1
        table = Table(title="local stack")
        table.add_column("process")
        table.add_column("pid")
        table.add_column("state")
        for name, pid, alive in current.processes():
            table.add_row(name, str(pid), "[green]running[/green]" if alive else "[red]down[/red]")
        console.print(table)
        for name, address in current.describe().items():
            log(f"{name}: {address}")
        return 0 if all(alive for _, _, alive in current.processes()) else 1
    stopped = stack.down()
    log("local stack stopped" if stopped else "no local stack was running")
    return 0
