"""The defaults sweep: which setting values drain a backlog fastest, one setting at a time.

Around the worker's own defaults, each setting of ``FACTORS`` is set to each of
its values in turn (everything else at its default), and one worker drains the
same backlog (``extras.drain``). Then one more run combines every setting's best
value. The defaults themselves are measured three times, first, in the middle and
last, so the spread the shared machine adds is in the table beside the
differences the settings make; the target compares the median of those three
with the best run found.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from devtools.bench.extras import Drain, drain
from worker.settings.schema import SETTINGS_SPEC

__all__ = ["FACTORS", "Sweep", "defaults_of", "markdown", "run_sweep", "target"]

#: The settings swept and the values tried for each (the default is added if missing).
FACTORS: dict[str, tuple[str, ...]] = {
    "MAX_IN_FLIGHT": ("64", "128", "512", "1024"),
    "MAX_IN_FLIGHT_PER_PARTITION": ("32", "128", "256"),
    "TRITON_STREAMS": ("1", "4", "8"),
    "BATCH_MAX_SIZE": ("8", "16", "64"),
    "BATCH_DELAY_MS": ("0", "1", "5"),
    "MAX_POLL_RECORDS": ("100", "1000"),
    "LINGER_MS": ("0", "20"),
    "COMPRESSION_TYPE": ("lz4", "zstd"),
}

#: The defaults are within this fraction of the best run found (the target).
WITHIN = 0.10


def defaults_of(names: Sequence[str]) -> dict[str, str]:
    """The worker's default of each setting (names without the ``WORKER_`` prefix)."""
    by_env = {spec.env: spec for spec in SETTINGS_SPEC}
    out = {}
    for name in names:
        spec = by_env[f"WORKER_{name}"]
        value = spec.default_doc()
        # Defaults print as "2.0" for floats; the settings parser reads either.
        out[name] = value.removesuffix(".0") if value.endswith(".0") else value
    return out


@dataclass(slots=True)
class Sweep:
    """Every run of the sweep, the defaults' repeats, and the combined-best run."""

    defaults: dict[str, str]
    default_runs: list[Drain] = field(default_factory=list)
    runs: list[tuple[str, str, Drain]] = field(default_factory=list)  # (setting, value, run)
    combined: Drain | None = None

    def default_rate(self) -> float:
        """The median records/s of the defaults' runs."""
        return statistics.median(d.records_per_s for d in self.default_runs)

    def best(self) -> tuple[str, Drain]:
        """The fastest run of all (label, run); the defaults' median counts as one."""
        median = sorted(self.default_runs, key=lambda d: d.records_per_s)[
            (len(self.default_runs) - 1) // 2
        ]
        candidates = [("the defaults", median)]
        candidates += [(f"{name}={value}", run) for name, value, run in self.runs]
        if self.combined is not None:
            candidates.append(("every best value combined", self.combined))
        return max(candidates, key=lambda item: item[1].records_per_s)

    def best_values(self) -> dict[str, str]:
        """Each setting's value with the most records/s (its default when nothing beat it)."""
        default = self.default_rate()
        out = {}
        for name in self.defaults:
            tried = [(value, run.records_per_s) for n, value, run in self.runs if n == name]
            value, rate = max(tried, key=lambda item: item[1], default=("", 0.0))
            out[name] = value if rate > default else self.defaults[name]
        return out


async def run_sweep(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    model: str,
    records: int,
    factors: Mapping[str, Sequence[str]] = FACTORS,
    on_run: Any = None,
) -> Sweep:
    """Drain ``records`` with the defaults, each factor's values, and the best combined."""
    sweep = Sweep(defaults_of(list(factors)))

    async def one(label: str, settings: Mapping[str, str]) -> Drain:
        run = await drain(
            bootstrap,
            triton_url,
            out_dir,
            label=f"sweep-{label}",
            model=model,
            backlog=records,
            settings=settings,
            sample_s=0.5,
        )
        if on_run is not None:
            on_run(label, run)
        return run

    sweep.default_runs.append(await one("defaults-1", {}))
    items = [
        (name, value)
        for name, values in factors.items()
        for value in values
        if value != sweep.defaults[name]
    ]
    for i, (name, value) in enumerate(items):
        if i == len(items) // 2:
            sweep.default_runs.append(await one("defaults-2", {}))
        sweep.runs.append((name, value, await one(f"{name}={value}", {name: value})))
    sweep.default_runs.append(await one("defaults-3", {}))
    changed = {k: v for k, v in sweep.best_values().items() if v != sweep.defaults[k]}
    if changed:
        sweep.combined = await one("combined", changed)
    return sweep


def target(sweep: Sweep) -> tuple[str, float, str, bool]:
    """(name, defaults' median / best, bound, met): the defaults within 10 % of the best."""
    label, best = sweep.best()
    value = sweep.default_rate() / best.records_per_s if best.records_per_s else 0.0
    met = value >= 1 - WITHIN
    return (f"defaults / best of the sweep ({label})", value, f">= {1 - WITHIN:.2f}", met)


def markdown(sweep: Sweep | None) -> str:
    """The sweep as a Markdown table: each run against the defaults' median."""
    if sweep is None or not sweep.default_runs:
        return ""
    default = sweep.default_rate()
    spread = [d.records_per_s for d in sweep.default_runs]
    lines = [
        "",
        "Defaults sweep (one worker draining the same backlog; every setting at its default "
        "but the one named):",
        "",
        "| setting | value | records/s | / defaults | CPU s / 1k | inference p99 ms |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for i, run in enumerate(sweep.default_runs, 1):
        lines.append(
            f"| (defaults, run {i}) | - | {run.records_per_s:,.0f} "
            f"| {run.records_per_s / default:.2f} | {run.cpu_s_per_1k:.3f} "
            f"| {run.inference_p99_ms:,.1f} |"
        )
    rows = [(name, value, run) for name, value, run in sweep.runs]
    if sweep.combined is not None:
        combined = ", ".join(f"{k}={v}" for k, v in sweep.best_values().items())
        rows.append(("every best value combined", combined, sweep.combined))
    for name, value, run in rows:
        lines.append(
            f"| {name} | {value} | {run.records_per_s:,.0f} | {run.records_per_s / default:.2f} "
            f"| {run.cpu_s_per_1k:.3f} | {run.inference_p99_ms:,.1f} |"
        )
    defaults = ", ".join(f"{k}={v}" for k, v in sweep.defaults.items())
    lines += [
        "",
        f"Defaults: {defaults}. Their three runs spread over "
        f"{min(spread):,.0f} to {max(spread):,.0f} records/s.",
    ]
    return "\n".join(lines) + "\n"
