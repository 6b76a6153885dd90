"""The benchmark's outputs: target ratios, a Markdown table, a JSON file and a PNG plot."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

#: Display names, in the order variants are run and shown.
VARIANTS = {
    "sync": "(a) sync baseline",
    "naive": "(b) naive async",
    "quix": "(b2) quixstreams, Triton per message",
    "worker": "(c) worker, defaults",
    "worker_confluent": "(c') worker, defaults, librdkafka",
    "worker_tuned": "(d) worker, tuned",
    "worker_tuned_confluent": "(d') worker, tuned, librdkafka",
    "worker_eos": "(d2) worker, tuned, exactly_once",
    "worker_eos_confluent": "(d2') worker, tuned, exactly_once, librdkafka",
    "worker_key": "(d3) worker, tuned, key ordering",
    "worker_key_confluent": "(d3') worker, tuned, key ordering, librdkafka",
    "worker_audit": "(d4) worker, tuned, audit topic",
    "worker_audit_confluent": "(d4') worker, tuned, audit topic, librdkafka",
    "triton": "(e) ceiling 1: Triton alone",
    "triton_batched": "(e') ceiling 1: Triton alone, batched",
    "kafka": "(f) ceiling 2: Kafka alone",
    "kafka_confluent": "(f') ceiling 2: Kafka alone, librdkafka",
}

#: Each worker variant's Kafka alone: the same client, the same records.
KAFKA_ALONE_OF = {
    "worker": "kafka",
    "worker_tuned": "kafka",
    "worker_confluent": "kafka_confluent",
    "worker_tuned_confluent": "kafka_confluent",
}


@dataclass(frozen=True, slots=True)
class VariantResult:
    """One variant's figures. CPU is per 1,000 records, of the process named in ``cpu_of``."""

    variant: str
    records: int
    records_per_s: float
    latency_ms: dict[str, float]
    cpu_s_per_1k: float
    peak_rss_mib: float
    cpu_of: str
    triton_cpu_s_per_1k: float | None = None
    kafka_cpu_s_per_1k: float | None = None
    settings: dict[str, str] = field(default_factory=dict)
    #: The offered rate the latency was measured at (half the variant's peak).
    latency_at_per_s: float | None = None


@dataclass(frozen=True, slots=True)
class LoadPoint:
    """Latency of the tuned worker (or Triton alone) at one offered rate."""

    offered_per_s: float
    achieved_per_s: float
    latency_ms: dict[str, float]


#: The tuned worker in another mode against the tuned worker on the same client: records/s
#: of the mode / records/s without it, and the least ratio that passes.
MODE_TARGETS = (
    ("worker_eos", "worker_tuned", "exactly_once / at_least_once", 0.8),
    ("worker_eos_confluent", "worker_tuned_confluent", "exactly_once / at_least_once", 0.8),
    ("worker_key", "worker_tuned", "key ordering / unordered", 0.8),
    ("worker_key_confluent", "worker_tuned_confluent", "key ordering / unordered", 0.8),
    ("worker_audit", "worker_tuned", "audit on / off", 0.9),
    ("worker_audit_confluent", "worker_tuned_confluent", "audit on / off", 0.9),
)
#: The tuned worker's records/s against the quixstreams peer's, at least.
PEER_TARGET = 10.0

#: Variants that can be fed at a fixed rate: measured side by side at one common rate.
COMMON_RATE_KEYS = (
    "worker",
    "worker_tuned",
    "worker_tuned_confluent",
    "triton",
    "triton_batched",
    "kafka",
    "kafka_confluent",
)
#: What the tuned worker is held to: the slower of these two (same client path, same rows).
CEILING_KEYS = ("kafka", "triton_batched")


@dataclass(frozen=True, slots=True)
class CommonRate:
    """Every fixed-rate variant fed the same offered rate, and the sum of the parts' p99."""

    offered_per_s: float
    #: How the rate was chosen: given, or half the slowest variant's peak.
    chosen_as: str
    points: dict[str, LoadPoint]
    #: Kafka alone p99 + Triton alone p99 (batched, unbatched), where both were measured.
    sum_of_parts_p99_ms: dict[str, float] = field(default_factory=dict)


def common_rate(
    results: dict[str, VariantResult], requested: float | None
) -> tuple[float, str] | None:
    """The common offered rate: ``requested``, else half the tuned worker's peak.

    Without the tuned worker: half the slowest fixed-rate variant's peak.
    """
    if requested:
        return requested, "given (--common-rate)"
    if "worker_tuned" in results:
        return results[
            "worker_tuned"
        ].records_per_s / 2, f"half the peak of {VARIANTS['worker_tuned']}"
    peaks = {k: results[k].records_per_s for k in COMMON_RATE_KEYS if k in results}
    if not peaks:
        return None
    slowest = min(peaks, key=lambda k: peaks[k])
    return peaks[slowest] / 2, f"half the slowest peak, {VARIANTS[slowest]}"


def at_common_rate(rate: float, chosen_as: str, points: dict[str, LoadPoint]) -> CommonRate:
    """The measurements at the common rate, with the sums of the parts' p99."""
    sums: dict[str, float] = {}
    if "kafka" in points:
        for key in ("triton_batched", "triton"):
            if key in points:
                sums[key] = points["kafka"].latency_ms["p99"] + points[key].latency_ms["p99"]
    return CommonRate(rate, chosen_as, points, sums)


def ceiling(
    results: dict[str, VariantResult], keys: tuple[str, str] = CEILING_KEYS
) -> tuple[str, float] | None:
    """The ceiling of the tuned worker: min(Kafka alone, Triton alone batched), and which binds."""
    parts = {k: results[k].records_per_s for k in keys if k in results}
    if len(parts) < len(keys):
        return None
    binding = min(parts, key=lambda k: parts[k])
    return binding, parts[binding]


@dataclass(frozen=True, slots=True)
class Ratio:
    """One target: the measured value, the bound, and whether it holds."""

    name: str
    value: float
    target: str
    passed: bool


def ratios(results: dict[str, VariantResult], common: CommonRate | None = None) -> list[Ratio]:
    """The targets: each worker against the baselines, its Kafka alone, the ceiling, the parts."""
    out: list[Ratio] = []
    sync, naive = results.get("sync"), results.get("naive")
    for key in ("worker", "worker_tuned", "worker_confluent", "worker_tuned_confluent"):
        worker = results.get(key)
        if worker is None:
            continue
        label = VARIANTS[key].split(" ", 1)[1]
        rate = worker.records_per_s
        if key in ("worker", "worker_tuned") and sync is not None and sync.records_per_s > 0:
            value = rate / sync.records_per_s
            out.append(Ratio(f"{label} / sync", value, ">= 25", value >= 25))
        if key in ("worker", "worker_tuned") and naive is not None and naive.records_per_s > 0:
            value = rate / naive.records_per_s
            out.append(Ratio(f"{label} / naive async", value, ">= 1.5", value >= 1.5))
        kafka = results.get(KAFKA_ALONE_OF[key])
        if kafka is not None and kafka.cpu_s_per_1k > 0:
            value = worker.cpu_s_per_1k / kafka.cpu_s_per_1k
            out.append(
                Ratio(
                    f"{label}: CPU per record / {VARIANTS[kafka.variant].split(': ', 1)[1]}'s",
                    value,
                    "<= 1.5",
                    value <= 1.5,
                )
            )
    for key, keys, ceiling_name in (
        ("worker_tuned", CEILING_KEYS, "Kafka alone"),
        (
            "worker_tuned_confluent",
            ("kafka_confluent", "triton_batched"),
            "Kafka alone on librdkafka",
        ),
    ):
        tuned, bound_by = results.get(key), ceiling(results, keys)
        if tuned is not None and bound_by is not None and bound_by[1] > 0:
            value = tuned.records_per_s / bound_by[1]
            out.append(
                Ratio(
                    f"{VARIANTS[key].split(' ', 1)[1]} / the ceiling, "
                    f"min({ceiling_name}, Triton alone batched)",
                    value,
                    ">= 0.8",
                    value >= 0.8,
                )
            )
    out += _client_ratios(results)
    out += mode_ratios(results)
    out += peer_ratios(results)
    if common is not None:
        out += _latency_ratios(common)
    return out


def _label(key: str) -> str:
    """A variant's display name without its letter: ``worker, tuned, librdkafka``."""
    return VARIANTS[key].split(" ", 1)[1]


def mode_ratios(results: dict[str, VariantResult]) -> list[Ratio]:
    """Each mode of the tuned worker (exactly_once, key ordering, audit) against the tuned
    worker without it, on the same client: records/s."""
    out: list[Ratio] = []
    for key, base_key, what, bound in MODE_TARGETS:
        mode, base = results.get(key), results.get(base_key)
        if mode is None or base is None or base.records_per_s <= 0:
            continue
        value = mode.records_per_s / base.records_per_s
        name = f"{_label(base_key)}: records/s, {what}"
        out.append(Ratio(name, value, f">= {bound}", value >= bound))
    return out


def peer_ratios(results: dict[str, VariantResult]) -> list[Ratio]:
    """Each tuned worker against the quixstreams peer doing the same job: records/s."""
    peer = results.get("quix")
    if peer is None or peer.records_per_s <= 0:
        return []
    out: list[Ratio] = []
    for key in ("worker_tuned", "worker_tuned_confluent"):
        worker = results.get(key)
        if worker is None:
            continue
        value = worker.records_per_s / peer.records_per_s
        name = f"{_label(key)} / quixstreams, Triton per message: records/s"
        out.append(Ratio(name, value, f">= {PEER_TARGET:g}", value >= PEER_TARGET))
    return out


def _latency_ratios(common: CommonRate) -> list[Ratio]:
    """At the common rate: each tuned worker's p99 against its Kafka alone's plus Triton's."""
    out: list[Ratio] = []
    triton = common.points.get("triton_batched")
    for key, alone_key in (
        ("worker_tuned", "kafka"),
        ("worker_tuned_confluent", "kafka_confluent"),
    ):
        worker, alone = common.points.get(key), common.points.get(alone_key)
        if worker is None or alone is None or triton is None:
            continue
        bound = alone.latency_ms["p99"] + triton.latency_ms["p99"] + 10
        value = worker.latency_ms["p99"]
        out.append(
            Ratio(
                f"{VARIANTS[key].split(' ', 1)[1]}: p99 at {common.offered_per_s:,.0f}/s (ms)",
                value,
                f"<= {VARIANTS[alone_key].split(': ', 1)[1]} p99 + Triton alone batched p99 "
                f"+ 10 = {bound:.1f}",
                value <= bound,
            )
        )
    return out


def _client_ratios(results: dict[str, VariantResult]) -> list[Ratio]:
    """librdkafka against aiokafka, the same run: CPU per record and tuned records/s."""
    out: list[Ratio] = []
    for key, other in (("worker", "worker_confluent"), ("worker_tuned", "worker_tuned_confluent")):
        a, c = results.get(key), results.get(other)
        if a is None or c is None or a.cpu_s_per_1k <= 0 or a.records_per_s <= 0:
            continue
        label = VARIANTS[key].split(" ", 1)[1]
        value = c.cpu_s_per_1k / a.cpu_s_per_1k
        out.append(
            Ratio(f"{label}: CPU per record, librdkafka / aiokafka", value, "<= 0.5", value <= 0.5)
        )
        if key == "worker_tuned":
            value = c.records_per_s / a.records_per_s
            out.append(
                Ratio(f"{label}: records/s, librdkafka / aiokafka", value, ">= 1.5", value >= 1.5)
            )
    return out


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown(
    results: dict[str, VariantResult],
    sweep: Sequence[LoadPoint],
    targets: Sequence[Ratio],
    meta: dict[str, Any],
    common: CommonRate | None = None,
) -> str:
    """The results as Markdown: variants, the ceiling, latency against load and at the
    common rate, targets."""
    lines = [
        f"model `{meta['model']}`, {meta['records']:,} records per variant "
        f"({meta['sync_records']:,} for the sync baseline), "
        f"{meta['partitions']} partitions, {meta['machine']}",
        "",
        "Latency: end to end (produce → result on the broker), measured at half the "
        "variant's own peak rate (column 'at /s').",
        "CPU: of the variant's process (the Triton client for ceiling 1), per 1,000 records; "
        "Triton's counts its models' backend stubs.",
        *_key_note(results, meta),
        "",
        "| variant | records/s | at /s | p50 ms | p95 ms | p99 ms | CPU s / 1k records "
        "| peak RSS MiB | Triton CPU s / 1k | Kafka CPU s / 1k |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for key, name in VARIANTS.items():
        r = results.get(key)
        if r is None:
            continue
        lines.append(
            f"| {name} | {r.records_per_s:,.0f} | {_fmt(r.latency_at_per_s, 0)} "
            f"| {_fmt(r.latency_ms['p50'])} "
            f"| {_fmt(r.latency_ms['p95'])} | {_fmt(r.latency_ms['p99'])} "
            f"| {_fmt(r.cpu_s_per_1k, 3)} | {_fmt(r.peak_rss_mib)} "
            f"| {_fmt(r.triton_cpu_s_per_1k, 3)} | {_fmt(r.kafka_cpu_s_per_1k, 3)} |"
        )
    for keys, tuned_key in (
        (CEILING_KEYS, "worker_tuned"),
        (("kafka_confluent", "triton_batched"), "worker_tuned_confluent"),
    ):
        bound_by, tuned = ceiling(results, keys), results.get(tuned_key)
        if bound_by is None:
            continue
        parts = " and ".join(
            f"{VARIANTS[k].split(': ', 1)[1]} {results[k].records_per_s:,.0f}/s" for k in keys
        )
        line = f"The ceiling: min({parts}) = {bound_by[1]:,.0f} rows/s"
        if tuned is not None and bound_by[1] > 0:
            line += (
                f"; {VARIANTS[tuned_key].split(') ', 1)[1].replace('worker', 'the worker')} "
                f"{tuned.records_per_s:,.0f}/s is {tuned.records_per_s / bound_by[1]:.2f} of it"
            )
        lines += ["", line + "."]
    if sweep:
        lines += [
            "",
            "Tuned worker, latency against offered load:",
            "",
            "| offered/s | achieved/s | p50 ms | p95 ms | p99 ms |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for p in sweep:
            lines.append(
                f"| {p.offered_per_s:,.0f} | {p.achieved_per_s:,.0f} | {p.latency_ms['p50']:.1f} "
                f"| {p.latency_ms['p95']:.1f} | {p.latency_ms['p99']:.1f} |"
            )
    if common is not None:
        lines += common_markdown(common)
    lines += ["", "| target | measured | bound | |", "| --- | ---: | --- | --- |"]
    for t in targets:
        lines.append(
            f"| {t.name} | {t.value:,.2f} | {t.target} | {'PASS' if t.passed else 'FAIL'} |"
        )
    return "\n".join(lines) + "\n"


def _key_note(results: dict[str, VariantResult], meta: dict[str, Any]) -> list[str]:
    """How the key-ordering variants' requests were keyed, when they ran."""
    if not {"worker_key", "worker_key_confluent"} & set(results):
        return []
    keys = int(meta.get("ordering_keys", 0))
    if keys <= 0:
        how = (
            "each request keyed by its own id, as in every other variant: every key is "
            "distinct, so key ordering never holds a record back"
        )
    else:
        how = (
            f"the requests keyed over {keys:,} keys (one per request by a hash of its id, so "
            "records of one key follow each other and wait for each other); every other "
            "variant keys each request by its own id"
        )
    return [f"Key ordering ((d3), (d3')): {how}."]


def common_rows(common: CommonRate) -> list[tuple[str, str, str, str, str, str]]:
    """The common-rate table's rows: each variant, then the sums of the parts' p99."""
    rows = []
    for key, name in VARIANTS.items():
        point = common.points.get(key)
        if point is not None:
            q = point.latency_ms
            rows.append(
                (
                    name,
                    f"{point.offered_per_s:,.0f}",
                    f"{point.achieved_per_s:,.0f}",
                    f"{q['p50']:.1f}",
                    f"{q['p95']:.1f}",
                    f"{q['p99']:.1f}",
                )
            )
    for key, total in common.sum_of_parts_p99_ms.items():
        label = f"sum of parts: Kafka alone p99 + {VARIANTS[key].split(': ', 1)[1]} p99"
        rows.append((label, "-", "-", "-", "-", f"{total:.1f}"))
    return rows


def common_markdown(common: CommonRate) -> list[str]:
    """Latency of every fixed-rate variant at the one common offered rate."""
    lines = [
        "",
        f"Latency at one common offered rate, {common.offered_per_s:,.0f}/s "
        f"({common.chosen_as}); end to end for the Kafka variants, per request at the "
        "client for Triton alone:",
        "",
        "| variant | offered/s | achieved/s | p50 ms | p95 ms | p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in common_rows(common)]
    return lines


def print_tables(
    console: Console,
    results: dict[str, VariantResult],
    targets: Sequence[Ratio],
    common: CommonRate | None = None,
) -> None:
    """The results and the targets as rich tables."""
    table = Table(title="benchmark")
    for column in ("variant", "records/s", "p50 ms", "p95 ms", "p99 ms", "CPU s/1k", "RSS MiB"):
        table.add_column(column, justify="left" if column == "variant" else "right")
    for key, name in VARIANTS.items():
        r = results.get(key)
        if r is None:
            continue
        table.add_row(
            name,
            f"{r.records_per_s:,.0f}",
            _fmt(r.latency_ms["p50"]),
            _fmt(r.latency_ms["p95"]),
            _fmt(r.latency_ms["p99"]),
            _fmt(r.cpu_s_per_1k, 3),
            _fmt(r.peak_rss_mib),
        )
    console.print(table)
    if common is not None:
        at = Table(title=f"at a common offered rate, {common.offered_per_s:,.0f}/s")
        for column in ("variant", "offered/s", "achieved/s", "p50 ms", "p95 ms", "p99 ms"):
            at.add_column(column, justify="left" if column == "variant" else "right")
        for row in common_rows(common):
            at.add_row(*row)
        console.print(at)
    verdicts = Table(title="targets")
    for column in ("target", "measured", "bound", "verdict"):
        verdicts.add_column(column)
    for t in targets:
        verdict = "[green]PASS[/green]" if t.passed else "[red]FAIL[/red]"
        verdicts.add_row(t.name, f"{t.value:,.2f}", t.target, verdict)
    console.print(verdicts)


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Everything measured, for later comparison."""
    path.write_text(json.dumps(payload, indent=2, default=_jsonable))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def plot(
    path: Path,
    results: dict[str, VariantResult],
    sweep: Sequence[LoadPoint],
    backlog: Any = None,
    common: CommonRate | None = None,
) -> bool:
    """Throughput per variant, the tuned worker's latency against load, p99 at the common
    rate, RSS draining a backlog."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    with_backlog = backlog is not None and bool(backlog.samples)
    panels = 2 + (common is not None) + with_backlog
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.8))
    bars, lines = axes[0], axes[1]
    keys = [k for k in VARIANTS if k in results]
    bars.barh([VARIANTS[k] for k in keys], [results[k].records_per_s for k in keys])
    bars.invert_yaxis()
    bars.set_xlabel("records/s")
    bars.set_title("throughput per variant")
    if sweep:
        offered = [p.offered_per_s for p in sweep]
        for q in ("p50", "p95", "p99"):
            lines.plot(offered, [p.latency_ms[q] for p in sweep], marker="o", label=q)
        lines.set_yscale("log")
        lines.legend()
    lines.set_xlabel("offered load, records/s")
    lines.set_ylabel("end-to-end latency, ms")
    lines.set_title("tuned worker: latency against offered load")
    if common is not None:
        at = axes[2]
        named = [
            (name, common.points[k].latency_ms["p99"])
            for k, name in VARIANTS.items()
            if k in common.points
        ]
        named += [
            (f"sum: Kafka + {VARIANTS[k].split(': ', 1)[1]}", total)
            for k, total in common.sum_of_parts_p99_ms.items()
        ]
        at.barh([n for n, _ in named], [v for _, v in named])
        at.invert_yaxis()
        at.set_xlabel("p99 latency, ms")
        at.set_title(f"p99, all fed {common.offered_per_s:,.0f}/s")
    if with_backlog:
        memory = axes[-1]
        memory.plot([s[1] for s in backlog.samples], [s[2] for s in backlog.samples], marker=".")
        memory.set_ylim(bottom=0)
        memory.set_xlabel("results published")
        memory.set_ylabel("worker RSS, MiB")
        memory.set_title(f"RSS draining a {backlog.backlog:,}-record backlog")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine() -> str:
    """A one-line description of the machine the benchmark ran on."""
    import os

    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPUs ({model or platform.machine()}), "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}"
    )


#: RSS growth while draining a backlog that still counts as flat.
FLAT_RSS_GROWTH_MIB = 32.0


def _payload_ratios(runs: list[Any] | None) -> list[Ratio]:
    """The payload targets: binary against JSON, 768 floats against 64 (steady CPU)."""
    if not runs:
        return []
    from devtools.bench.extras import payload_of

    cpu = {payload_of(r): r.cpu_s_per_1k_steady for r in runs}
    out = []
    for model in ("mlp", "embedding"):
        if cpu.get((model, "json")):
            value = cpu[(model, "binary")] / cpu[(model, "json")]
            name = f"`{model}`: CPU per record, binary / JSON"
            out.append(Ratio(name, value, "<= 0.5", value <= 0.5))
    if cpu.get(("mlp", "json")) and cpu.get(("mlp", "events")):
        value = cpu[("mlp", "events")] / cpu[("mlp", "json")]
        name = "`mlp`: CPU per record, mapped events / OIP JSON"
        out.append(Ratio(name, value, "<= 1.2", value <= 1.2))
    if cpu.get(("mlp", "events")) and cpu.get(("mlp", "avro")):
        value = cpu[("mlp", "avro")] / cpu[("mlp", "events")]
        name = "`mlp`: CPU per record, Avro events (Schema Registry) / JSON events"
        out.append(Ratio(name, value, "<= 1.0", value <= 1.0))
    for encoding in ("json", "binary"):
        if cpu.get(("mlp", encoding)):
            value = cpu[("embedding", encoding)] / cpu[("mlp", encoding)]
            name = f"{encoding}: CPU per record, `embedding` / `mlp`"
            out.append(Ratio(name, value, "<= 2.0", value <= 2.0))
    return out


def extra_ratios(extras: dict[str, Any]) -> list[Ratio]:
    """Targets of the extra measurements: batching, adaptive window, scale-out, memory."""
    out: list[Ratio] = []
    batching = extras.get("batching")
    if batching and batching[0].records_per_s > 0:
        value = batching[1].records_per_s / batching[0].records_per_s
        out.append(Ratio("batched / unbatched (tuned worker)", value, ">= 2.0", value >= 2.0))
    windows = extras.get("windows")
    if windows:
        fixed = [d for d in windows if d.label.startswith("fixed")]
        adaptive = next(d for d in windows if d.label == "adaptive")
        best = max(fixed, key=lambda d: d.records_per_s)
        value = adaptive.records_per_s / best.records_per_s if best.records_per_s else 0.0
        out.append(Ratio(f"adaptive / best fixed ({best.label})", value, ">= 0.8", value >= 0.8))
        largest = fixed[-1]
        out.append(
            Ratio(
                f"adaptive inference p99 under backlog (ms), vs {largest.label}",
                adaptive.inference_p99_ms,
                f"< {largest.inference_p99_ms:,.1f}",
                adaptive.inference_p99_ms < largest.inference_p99_ms,
            )
        )
    defaults = extras.get("defaults")
    if defaults is not None and defaults.groups:
        from devtools.bench import sweep

        out.append(Ratio(*sweep.target(defaults)))
    shm = extras.get("shm")
    if shm:
        value = shm["gain"]
        out.append(Ratio("system shm / gRPC, 4 MiB tensors", value, "> 1.0", value > 1.0))
    out += _payload_ratios(extras.get("payloads"))
    scale = extras.get("scale_out")
    if scale and scale[0].records_per_s > 0:
        value = scale[1].records_per_s / scale[0].records_per_s
        out.append(Ratio("3 workers / 1 worker (latency-bound)", value, ">= 2.5", value >= 2.5))
    backlog = extras.get("backlog")
    if backlog and backlog.samples:
        growth = rss_growth_mib(backlog)
        out.append(
            Ratio(
                f"RSS growth draining a {backlog.backlog:,} backlog (MiB)",
                growth,
                f"< {FLAT_RSS_GROWTH_MIB:.0f}",
                growth < FLAT_RSS_GROWTH_MIB,
            )
        )
    return out


def rss_growth_mib(backlog: Any) -> float:
    """Highest RSS minus the RSS once a tenth of the drained results were out (warm)."""
    final = backlog.samples[-1][1]
    warm = next(s for s in backlog.samples if s[1] >= final / 10)
    return float(max(s[2] for s in backlog.samples) - warm[2])


def extras_markdown(extras: dict[str, Any]) -> str:
    """The extra measurements as Markdown tables."""
    lines: list[str] = []
    drains = [*(extras.get("batching") or []), *(extras.get("windows") or [])]
    if drains:
        lines += [
            "",
            "One worker draining a backlog (tuned settings but for the column 'settings'):",
            "",
            "| run | settings | records/s | inference p99 ms | peak RSS MiB |",
            "| --- | --- | ---: | ---: | ---: |",
        ]
        for d in drains:
            keys = ("BATCH_MAX_SIZE", "WINDOW_MODE", "MAX_IN_FLIGHT")
            shown = ", ".join(f"{k}={d.settings[k]}" for k in keys if k in d.settings)
            lines.append(
                f"| {d.label} | {shown} | {d.records_per_s:,.0f} "
                f"| {d.inference_p99_ms:,.1f} | {d.peak_rss_mib:,.1f} |"
            )
    if extras.get("defaults") is not None:
        from devtools.bench import sweep

        lines.append(sweep.markdown(extras["defaults"]))
    compression = extras.get("compression")
    if compression:
        ratios = compression["ratios"]
        lines += [
            "",
            "The worker's own batches compressed (`WORKER_COMPRESSION_TYPE`), tuned settings, "
            "one worker draining a backlog; size is of the results, compressed as one batch:",
            "",
            "| codec | records/s | worker CPU s / 1k records | result bytes after compression |",
            "| --- | ---: | ---: | ---: |",
        ]
        for run in compression["runs"]:
            codec = run.settings["COMPRESSION_TYPE"]
            size = "100 %" if codec == "none" else f"{ratios[codec] * 100:.1f} %"
            lines.append(
                f"| {codec} | {run.records_per_s:,.0f} | {run.cpu_s_per_1k:.3f} | {size} |"
            )
    payloads = extras.get("payloads")
    if payloads:
        from devtools.bench.extras import PAYLOAD_FLOATS, payload_of

        lines += [
            "",
            "Payloads (tuned settings, one worker draining a backlog of one model and "
            "encoding; CPU from a tenth of the results on, start-up left out):",
            "",
            "| model, encoding | floats per request | records/s | worker CPU s / 1k records |",
            "| --- | ---: | ---: | ---: |",
        ]
        for run in payloads:
            model, encoding = payload_of(run)
            lines.append(
                f"| `{model}`, {encoding} | {PAYLOAD_FLOATS[model]} | {run.records_per_s:,.0f} "
                f"| {run.cpu_s_per_1k_steady:.3f} |"
            )
    commits = extras.get("commits")
    if commits:
        lines += [
            "",
            "Commit interval (default settings otherwise): one worker draining a backlog is "
            "SIGKILLed after half, a second one finishes:",
            "",
            "| interval ms | records/s | commits/s per worker | a fleet of 100 | "
            "duplicates after the SIGKILL |",
            "| ---: | ---: | ---: | ---: | ---: |",
        ]
        for point in commits:
            lines.append(
                f"| {point.interval_ms} | {point.records_per_s:,.0f} | "
                f"{point.commits_per_s:.1f} | {point.commits_per_s * 100:,.0f} | "
                f"{point.duplicates:,} |"
            )
    shm = extras.get("shm")
    if shm:
        lines += [
            "",
            f"Triton alone, `double`, {shm['tensor_bytes'] / (1 << 20):.0f} MiB FP32 tensors, "
            "4 concurrent:",
            "",
            "| path | requests/s | MB/s |",
            "| --- | ---: | ---: |",
            f"| gRPC bytes | {shm['grpc_requests_per_s']:,.1f} | {shm['grpc_mb_per_s']:,.0f} |",
            f"| system shared memory | {shm['system_shm_requests_per_s']:,.1f} "
            f"| {shm['system_shm_mb_per_s']:,.0f} |",
        ]
    scale = extras.get("scale_out")
    if scale:
        lines += [
            "",
            "Scale-out, `faulty` with DELAY_MS=20, WORKER_MAX_IN_FLIGHT=1 per worker:",
            "",
            "| workers | records | records/s |",
            "| ---: | ---: | ---: |",
        ]
        lines += [f"| {p.workers} | {p.records} | {p.records_per_s:,.1f} |" for p in scale]
    backlog = extras.get("backlog")
    if backlog:
        lines += [
            "",
            f"Backlog of {backlog.backlog:,} records, default settings; RSS while draining:",
            "",
            "| s | results | RSS MiB |",
            "| ---: | ---: | ---: |",
        ]
        step = max(1, len(backlog.samples) // 12)
        for t, n, rss in backlog.samples[::step]:
            lines.append(f"| {t:.0f} | {n:,} | {rss:.1f} |")
    return "\n".join(lines) + "\n" if lines else ""
