"""The defaults sweep: which setting values drain a backlog fastest, one setting at a time.

Around the worker's own defaults, each setting of ``FACTORS`` is set to each of
its values in turn (everything else at its default), and one worker drains the
same backlog (``extras.drain``). Every group of runs of one setting starts with a
run of the defaults, and each value is compared with that run: the machine's load
drifts over minutes, and a ratio to a run made just before is what holds still.
Last, one run combines every setting's best value, followed by one more run of
the defaults to compare it with. The target: the defaults within 10 % of the best
ratio found.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from devtools.bench.extras import Drain, drain
from worker.settings.schema import SETTINGS_SPEC

__all__ = ["FACTORS", "Group", "Sweep", "defaults_of", "markdown", "run_sweep", "target"]

#: The settings swept and the values tried for each (besides the default).
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

#: The label of the run combining every setting's best value.
COMBINED = "every best value combined"


def defaults_of(names: Sequence[str]) -> dict[str, str]:
    """The worker's default of each setting (names without the ``WORKER_`` prefix)."""
    by_env = {spec.env: spec for spec in SETTINGS_SPEC}
    out = {}
    for name in names:
        value = by_env[f"WORKER_{name}"].default_doc()
        # Floats print as "2.0"; the settings parser reads "2" as well.
        out[name] = value.removesuffix(".0")
    return out


@dataclass(slots=True)
class Group:
    """The runs of one setting (or of the combined values): the defaults first, then each."""

    name: str
    default: Drain
    runs: list[tuple[str, Drain]] = field(default_factory=list)  # (value, run)

    def ratios(self) -> list[tuple[str, float]]:
        """(value, records/s over the group's defaults run), in the order run."""
        base = self.default.records_per_s
        return [(value, run.records_per_s / base if base else 0.0) for value, run in self.runs]


@dataclass(slots=True)
class Sweep:
    """Every group of the sweep, and the combined-best run's group last."""

    defaults: dict[str, str]
    groups: list[Group] = field(default_factory=list)

    def best_values(self) -> dict[str, str]:
        """Each setting's value with the highest ratio above 1 (else its default)."""
        out = dict(self.defaults)
        for group in self.groups:
            if group.name not in self.defaults:
                continue
            value, ratio = max(group.ratios(), key=lambda item: item[1], default=("", 0.0))
            if ratio > 1.0:
                out[group.name] = value
        return out

    def best(self) -> tuple[str, float]:
        """The best (setting=value, ratio to its defaults run) of all; 1.0 for the defaults."""
        found = [("the defaults", 1.0)]
        for group in self.groups:
            for value, ratio in group.ratios():
                label = COMBINED if group.name == COMBINED else f"{group.name}={value}"
                found.append((label, ratio))
        return max(found, key=lambda item: item[1])


async def run_sweep(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    model: str,
    records: int,
    factors: Mapping[str, Sequence[str]] = FACTORS,
    on_run: Callable[[str, Drain], None] | None = None,
) -> Sweep:
    """A group per factor (defaults, then each value), then the best values combined."""
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

    for name, values in factors.items():
        group = Group(name, await one(f"defaults-before-{name}", {}))
        for value in values:
            if value != sweep.defaults[name]:
                group.runs.append((value, await one(f"{name}={value}", {name: value})))
        sweep.groups.append(group)
    changed = {k: v for k, v in sweep.best_values().items() if v != sweep.defaults[k]}
    if changed:
        combined = await one("combined", changed)
        label = ", ".join(f"{k}={v}" for k, v in changed.items())
        sweep.groups.append(Group(COMBINED, await one("defaults-after", {}), [(label, combined)]))
    return sweep


def target(sweep: Sweep) -> tuple[str, float, str, bool]:
    """(name, defaults / best, bound, met): the defaults within 10 % of the best run."""
    label, ratio = sweep.best()
    value = 1.0 / ratio if ratio else 0.0
    return (f"defaults / best of the sweep ({label})", value, f">= {1 - WITHIN:.2f}", value >= 0.9)


def markdown(sweep: Sweep | None) -> str:
    """The sweep as a Markdown table: each run against the defaults run of its group."""
    if sweep is None or not sweep.groups:
        return ""
    lines = [
        "",
        "Defaults sweep: one worker draining the same backlog, every setting at its default "
        "but the one named; each group starts with a run of the defaults, and '/ defaults' "
        "compares a run with that one:",
        "",
        "| setting | value | records/s | / defaults | CPU s / 1k | inference p99 ms |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for group in sweep.groups:
        d = group.default
        lines.append(
            f"| {group.name} | (defaults) | {d.records_per_s:,.0f} | 1.00 "
            f"| {d.cpu_s_per_1k:.3f} | {d.inference_p99_ms:,.1f} |"
        )
        for (value, run), (_, ratio) in zip(group.runs, group.ratios(), strict=True):
            lines.append(
                f"| | {value} | {run.records_per_s:,.0f} | {ratio:.2f} "
                f"| {run.cpu_s_per_1k:.3f} | {run.inference_p99_ms:,.1f} |"
            )
    rates = [g.default.records_per_s for g in sweep.groups]
    defaults = ", ".join(f"{k}={v}" for k, v in sweep.defaults.items())
    lines += [
        "",
        f"Defaults: {defaults}. Their {len(rates)} runs spread over "
        f"{min(rates):,.0f} to {max(rates):,.0f} records/s.",
    ]
    return "\n".join(lines) + "\n"
