"""``bench``: the worker side by side with what a user would otherwise run, and the ceilings.

Every variant gets fresh topics, the same payloads (JSON requests for one
model) and runs as its own process, measured in turn:

1. the variant starts and is warmed up (a few requests answered end to end);
2. the records are produced as fast as the producer goes, while the variant
   consumes them; throughput is counted between the first and last result;
3. its CPU and peak memory are read from ``/proc`` (the benchmark's own
   producer and collector are not counted), as are Triton's and Kafka's.

The tuned worker is then fed at fixed rates to draw latency against offered
load. Both workers and Kafka alone run on each Kafka client (aiokafka, and
librdkafka through confluent-kafka) in the same run, and so does the tuned worker
in each of its other modes (exactly_once, key ordering, audit records to a topic),
measured as the tuned worker is. The quixstreams peer does the worker's job one
Triton call per message, in a virtualenv of its own (``devtools.bench.quix``).
"Triton alone, batched" drives Triton through the worker's own client path
(stream pool and micro-batcher) with the tuned settings; with Kafka alone it
makes the ceiling the tuned worker is compared with. Last, every variant that
can be fed at a fixed rate (the workers, Triton alone both ways, Kafka alone)
is fed one common rate, half the tuned worker's peak, each on fresh topics,
for latencies side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress

    from devtools.bench.report import CommonRate, LoadPoint, VariantResult
    from devtools.bench.runner import Runner, Servers
    from devtools.devstack.stack import LocalStack

_T = TypeVar("_T")

#: The variants, in the order they run (names in devtools.bench.report.VARIANTS).
VARIANT_KEYS = (
    "sync",
    "naive",
    "quix",
    "worker",
    "worker_confluent",
    "worker_tuned",
    "worker_tuned_confluent",
    "worker_eos",
    "worker_eos_confluent",
    "worker_key",
    "worker_key_confluent",
    "worker_audit",
    "worker_audit_confluent",
    "triton",
    "triton_batched",
    "kafka",
    "kafka_confluent",
)
#: The variants of ``--smoke`` (CI) unless ``--variants`` says otherwise: the table's but
#: the quixstreams peer (its virtualenv is a download of its own) and the tuned worker's
#: other modes (each mode's own tests run it through the real worker).
SMOKE_KEYS = (
    "sync",
    "naive",
    "worker",
    "worker_confluent",
    "worker_tuned",
    "worker_tuned_confluent",
    "triton",
    "triton_batched",
    "kafka",
    "kafka_confluent",
)
#: Measurements beyond the table (devtools.bench.extras, devtools.bench.scaleout, ...).
EXTRA_KEYS = (
    "batching",
    "windows",
    "defaults",
    "compression",
    "payloads",
    "commits",
    "shm",
    "scale_out",
    "decoupled",
    "profile",
)
MODELS = ("double", "mlp", "echo_bytes", "embedding")

#: Settings of the tuned worker, beyond the defaults.
TUNED_SETTINGS = {
    "BATCH_MAX_SIZE": "32",
    "BATCH_DELAY_MS": "2",
    "TRITON_STREAMS": "4",
    "MAX_IN_FLIGHT": "512",
    "MAX_IN_FLIGHT_PER_PARTITION": "256",
    "MAX_POLL_RECORDS": "1000",
    "LINGER_MS": "5",
}


def add_bench_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench`` and its options."""
    bench = commands.add_parser(
        "bench", help="benchmark the worker against baselines and ceilings (local stack)"
    )
    bench.add_argument("--records", type=int, default=20_000, help="records per variant")
    bench.add_argument(
        "--drain-records",
        type=int,
        default=60_000,
        help="backlog of each drain (batching, windows, the defaults sweep, compression): "
        "long enough that a worker's start-up does not weigh on its rate",
    )
    bench.add_argument(
        "--sync-records", type=int, default=2_000, help="records for the slow sync baseline"
    )
    bench.add_argument("--model", default="mlp", choices=MODELS)
    bench.add_argument("--partitions", type=int, default=4, help="input topic partitions")
    bench.add_argument("--out", type=Path, default=Path(".devstack/bench"), help="output folder")
    bench.add_argument("--sweep-s", type=float, default=4.0, help="seconds per offered load")
    bench.add_argument(
        "--common-rate",
        type=float,
        default=0.0,
        metavar="PER_S",
        help="the common offered rate for the side-by-side latencies "
        "(default: half the slowest peak of the fixed-rate variants)",
    )
    bench.add_argument(
        "--variants",
        help="comma-separated subset of: "
        + ", ".join(VARIANT_KEYS + EXTRA_KEYS)
        + " (default: all; with --smoke, the table's but quix and the tuned worker's modes)",
    )
    bench.add_argument(
        "--keys",
        type=int,
        default=1000,
        metavar="N",
        help="distinct record keys of the key-ordering variants (worker_key, "
        "worker_key_confluent); 0: each request keyed by its own id, as elsewhere",
    )
    bench.add_argument(
        "--backlog",
        type=int,
        default=0,
        metavar="N",
        help="also produce N records and sample the worker's RSS while it drains them",
    )
    bench.add_argument(
        "--backlog-drain",
        type=int,
        default=300_000,
        metavar="N",
        help="stop sampling after this many results of the backlog",
    )
    bench.add_argument(
        "--tuned",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a setting of the tuned worker, e.g. --tuned BATCH_MAX_SIZE=64 (repeatable)",
    )
    bench.add_argument("--bootstrap-servers", help="use this Kafka instead of a local stack")
    bench.add_argument("--triton-url", help="use this Triton instead of a local stack")
    bench.add_argument(
        "--smoke", action="store_true", help="a tiny run (a few hundred records) for CI"
    )
    bench.set_defaults(handler=run_bench)


def chosen(variants: str | None, smoke: bool = False) -> tuple[list[str], list[str]]:
    """The variants and extras ``--variants`` asks for (by default all, or with ``--smoke``
    ``SMOKE_KEYS``), and the names in it that are neither."""
    if variants is None:
        return list(SMOKE_KEYS if smoke else VARIANT_KEYS + EXTRA_KEYS), []
    wanted = [v for v in variants.split(",") if v]
    known = set(VARIANT_KEYS + EXTRA_KEYS)
    return [v for v in wanted if v in known], sorted({v for v in wanted if v not in known})


def run_bench(args: argparse.Namespace) -> int:
    """Start (or use) the servers, measure every variant, write the outputs."""
    from rich.console import Console

    from devtools.bench.runner import Servers
    from worker.app import run_async

    console = Console()
    if args.smoke:
        args.records, args.sync_records, args.sweep_s = 300, 100, 1.0
        args.drain_records = 300
    wanted, unknown = chosen(args.variants, args.smoke)
    if unknown:
        console.print(f"[red]unknown variants: {', '.join(unknown)}[/red]")
        return 2
    args.variants = ",".join(wanted)
    args.out.mkdir(parents=True, exist_ok=True)
    stack = None
    if args.bootstrap_servers and args.triton_url:
        servers = Servers(args.bootstrap_servers, args.triton_url)
    else:
        from devtools.devstack.paths import run_dir
        from devtools.devstack.stack import LocalStack

        workdir = run_dir() / "bench"
        # A fresh stack each run: old data would carry another cluster id.
        shutil.rmtree(workdir, ignore_errors=True)
        with console.status("starting a local Kafka broker and Triton server..."):
            # double: the shared-memory measurement; faulty: the scale-out one;
            # tokens: the decoupled one; mlp and embedding: the payloads.
            models = sorted({args.model, "double", "faulty", "tokens", "mlp", "embedding"})
            # A Schema Registry for the payloads' Avro events.
            registry = "payloads" in args.variants.split(",")
            stack = LocalStack.create(workdir, models=models, registry=registry, log=console.print)
            stack.start()
        kafka_pids = tuple(n["pid"] for n in stack.kafka.to_state()["nodes"] if n["pid"])
        servers = Servers(
            stack.kafka.bootstrap_servers,
            stack.triton.grpc_address,
            stack.triton.pid,
            kafka_pids,
            stack.registry.url if stack.registry is not None else None,
        )
    try:
        return run_async(_bench(args, servers, console, stack))
    finally:
        if stack is not None:
            stack.stop()


async def _bench(
    args: argparse.Namespace, servers: Servers, console: Console, stack: LocalStack | None = None
) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from devtools.bench import decoupled, report, stages
    from devtools.bench.runner import Runner

    wanted = [v for v in args.variants.split(",") if v]
    tuned = dict(TUNED_SETTINGS)
    for item in args.tuned:
        name, _, value = item.partition("=")
        tuned[name.removeprefix("WORKER_")] = value
    if "quix" in wanted:
        from devtools.bench import quix

        with console.status("the quixstreams peer's virtualenv..."):
            await asyncio.to_thread(quix.ensure_quix, console.print)
    results: dict[str, VariantResult] = {}
    sweep: list[LoadPoint] = []
    runner = Runner(args, servers, args.out)
    progress = Progress(
        TextColumn("{task.description:<30}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    )
    with progress:
        for key in report.VARIANTS:
            if key not in wanted:
                continue
            name = report.VARIANTS[key]
            if key in ("triton", "triton_batched"):
                client = tuned if key == "triton_batched" else None

                async def ceiling(name: str = name, client: Any = client) -> VariantResult:
                    return await runner.triton(name, progress, client)

                results[key] = await again_if_triton_died(key, ceiling, servers, stack, console)
                continue
            count = args.sync_records if key == "sync" else args.records
            command, env, settings = runner.command(key, tuned)
            sweep_into = sweep if key == "worker_tuned" else None

            async def variant(
                key: str = key,
                name: str = name,
                count: int = count,
                command: Any = command,
                env: Any = env,
                settings: Any = settings,
                sweep_into: Any = sweep_into,
            ) -> VariantResult:
                if sweep_into is not None:
                    sweep_into.clear()  # a measurement made again starts its sweep again
                return await runner.kafka_variant(
                    key, name, command, env, count, progress, settings, sweep_into
                )

            results[key] = await again_if_triton_died(key, variant, servers, stack, console)
        common = await _common_rate(args, runner, results, tuned, progress)
    extras = await _extras(args, servers, wanted, tuned, console, stack)
    targets = report.ratios(results, common) + report.extra_ratios(extras)
    meta = {
        "model": args.model,
        "records": args.records,
        "sync_records": args.sync_records,
        "drain_records": args.drain_records,
        "partitions": args.partitions,
        "ordering_keys": args.keys,
        "machine": report.machine(),
        "command": "python -m devtools bench " + " ".join(sys.argv[2:]),
        "tuned_settings": {f"WORKER_{k}": v for k, v in tuned.items()},
    }
    report.print_tables(console, results, targets, common)
    table = report.markdown(results, sweep, targets, meta, common)
    table += report.extras_markdown(extras)
    table += decoupled.markdown(extras.get("decoupled"))  # type: ignore[arg-type]
    table += stages.markdown(extras.get("profile"))  # type: ignore[arg-type]
    (args.out / "bench.md").write_text(table)
    report.write_json(
        args.out / "bench.json",
        {
            "meta": meta,
            "variants": results,
            "worker_tuned_latency_vs_load": sweep,
            "ceiling": report.ceiling(results),
            "at_common_rate": common,
            "targets": targets,
            "extras": extras,
        },
    )
    plotted = report.plot(args.out / "bench.png", results, sweep, extras.get("backlog"), common)
    console.print(
        f"written: {args.out / 'bench.json'}, {args.out / 'bench.md'}"
        + (f", {args.out / 'bench.png'}" if plotted else " (no matplotlib: no plot)")
    )
    return 0


async def _common_rate(
    args: argparse.Namespace,
    runner: Runner,
    results: dict[str, VariantResult],
    tuned: dict[str, str],
    progress: Progress,
) -> CommonRate | None:
    """Every fixed-rate variant measured fed the same rate, in the table's order."""
    from devtools.bench import report

    chosen = report.common_rate(results, args.common_rate)
    if chosen is None:
        return None
    rate, how = chosen
    points: dict[str, LoadPoint] = {}
    for key in report.COMMON_RATE_KEYS:
        if key not in results:
            continue
        if key in ("triton", "triton_batched"):
            client = tuned if key == "triton_batched" else None
            points[key] = await runner.triton_at(rate, progress, client)
        else:
            command, env, _ = runner.command(key, tuned)
            points[key] = await runner.kafka_at(key, command, env, rate, progress)
    return report.at_common_rate(rate, how, points)


#: Deaths of the local Triton a measurement is made again after.
TRITON_DEATHS_TOLERATED = 3


async def again_if_triton_died(
    label: str,
    measure: Callable[[], Awaitable[_T]],
    servers: Servers,
    stack: LocalStack | None,
    console: Console,
) -> _T:
    """``measure()``; when it failed because the local Triton died under it, Triton is
    restarted and the measurement made again, up to ``TRITON_DEATHS_TOLERATED`` times
    (Triton 2.51 has crashed mid-run here, in ``TRITONSERVER_InferenceRequestDelete``,
    while a worker stopped or started, and twice in a row in one run of 2026-12-07)."""
    for _ in range(TRITON_DEATHS_TOLERATED):
        try:
            return await measure()
        except Exception:
            if stack is None or stack.triton.running():
                raise
        console.print(
            f"[yellow]{label}: Triton died during the measurement (its log: "
            f"{stack.triton.log_path}); restarted, measuring again[/yellow]"
        )
        await asyncio.to_thread(stack.triton.restart)
        servers.triton_pid = stack.triton.pid
    return await measure()


async def _extras(
    args: argparse.Namespace,
    servers: Servers,
    wanted: list[str],
    tuned: dict[str, str],
    console: Console,
    stack: LocalStack | None = None,
) -> dict[str, object]:
    """Scale-out, adaptive window, shared memory, decoupled and backlog memory, as asked for."""
    from devtools.bench import decoupled, extras, scaleout

    async def guarded(label: str, measure: Callable[[], Awaitable[Any]]) -> Any:
        return await again_if_triton_died(label, measure, servers, stack, console)

    out: dict[str, object] = {}
    if "batching" in wanted:
        with console.status("batching: the tuned worker with and without micro-batching..."):

            async def batching() -> list[Any]:
                return [
                    await extras.drain(
                        servers.bootstrap,
                        servers.triton,
                        args.out,
                        label=label,
                        model=args.model,
                        backlog=args.drain_records,
                        settings={**tuned, "BATCH_MAX_SIZE": size},
                        sample_s=0.5,
                    )
                    for label, size in (("unbatched", "1"), ("batched", tuned["BATCH_MAX_SIZE"]))
                ]

            out["batching"] = await guarded("batching", batching)
    if "windows" in wanted:
        with console.status("window sweep: fixed windows and the adaptive one..."):
            out["windows"] = await guarded(
                "windows",
                lambda: extras.window_sweep(
                    servers.bootstrap,
                    servers.triton,
                    args.out,
                    model=args.model,
                    records=args.drain_records,
                    base={k: v for k, v in tuned.items() if not k.startswith("MAX_IN_FLIGHT")},
                ),
            )
    if "defaults" in wanted:
        from devtools.bench import sweep

        total = len(sweep.FACTORS) + sum(len(v) for v in sweep.FACTORS.values()) + 2
        with console.status("defaults sweep: one setting at a time around the defaults...") as s:
            done: list[str] = []

            def on_run(label: str, run: Any) -> None:
                done.append(label)
                s.update(
                    f"defaults sweep [{len(done)}/~{total}]: {label} "
                    f"{run.records_per_s:,.0f} records/s"
                )

            out["defaults"] = await guarded(
                "defaults",
                lambda: sweep.run_sweep(
                    servers.bootstrap,
                    servers.triton,
                    args.out,
                    model=args.model,
                    records=args.drain_records,
                    on_run=on_run,
                ),
            )
    if "compression" in wanted:
        with console.status("compression: the worker's own batches none, lz4, zstd..."):
            out["compression"] = await guarded(
                "compression",
                lambda: extras.compression(
                    servers.bootstrap,
                    servers.triton,
                    args.out,
                    model=args.model,
                    records=args.drain_records,
                    base=tuned,
                ),
            )
    if "payloads" in wanted:
        with console.status("payloads: 64 and 768 floats, as JSON and binary..."):
            out["payloads"] = await guarded(
                "payloads",
                lambda: extras.payloads(
                    servers.bootstrap,
                    servers.triton,
                    args.out,
                    records=args.drain_records,
                    base=tuned,
                    registry_url=servers.registry_url,
                ),
            )
    if "commits" in wanted:
        from devtools.bench import commits

        with console.status("commit intervals: SIGKILL mid-drain, duplicates and commits/s..."):
            out["commits"] = await guarded(
                "commits",
                lambda: commits.commit_intervals(
                    servers.bootstrap, servers.triton, args.out, records=args.records, settings={}
                ),
            )
    if "shm" in wanted:
        with console.status("shared memory: 4 MiB tensors with and without..."):
            out["shm"] = await guarded(
                "shm",
                lambda: extras.shm_gain(
                    servers.triton,
                    tensor_bytes=4 << 20,
                    requests=max(20, min(400, args.records // 50)),
                ),
            )
    if "scale_out" in wanted:
        with console.status("scale-out: one worker, then three in one group..."):

            async def scale_out() -> list[Any]:
                return [
                    await scaleout.measure_workers(
                        servers.bootstrap, servers.triton, args.out, workers=n, records=600
                    )
                    for n in (1, 3)
                ]

            out["scale_out"] = await guarded("scale_out", scale_out)
    if "decoupled" in wanted:
        with console.status("decoupled: token streams, Triton alone, then the worker..."):
            out["decoupled"] = await guarded(
                "decoupled",
                lambda: decoupled.measure(
                    servers.bootstrap, servers.triton, args.out, requests=args.records
                ),
            )
    if "profile" in wanted:
        from devtools.bench import stages

        with console.status("profile: py-spy on the per-record path, then the fast path..."):
            out["profile"] = await guarded(
                "profile",
                lambda: stages.profile(
                    servers.bootstrap,
                    servers.triton,
                    args.out,
                    model=args.model,
                    records=max(100_000, args.records),
                    base=tuned,
                ),
            )
    if args.backlog:
        with console.status(f"backlog: producing {args.backlog:,} records, then draining..."):
            out["backlog"] = await guarded(
                "backlog",
                lambda: extras.drain(
                    servers.bootstrap,
                    servers.triton,
                    args.out,
                    label="backlog",
                    model=args.model,
                    backlog=args.backlog,
                    settings={},
                    until_results=min(args.backlog, args.backlog_drain),
                    sample_s=2.0,
                    timeout_s=900,
                ),
            )
    return out
