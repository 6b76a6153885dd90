"""The defaults sweep's bookkeeping: best values, the combined run, the target and its table."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from devtools.bench import report, sweep
from devtools.bench.extras import Drain


def _drain(label: str, per_s: float) -> Drain:
    return Drain(label, {}, 1000, per_s, 10.0, cpu_s_per_1k=0.1)


def _sweep(rates: dict[tuple[str, str], float], defaults: tuple[float, ...]) -> sweep.Sweep:
    out = sweep.Sweep({"MAX_IN_FLIGHT": "256", "LINGER_MS": "5"})
    out.default_runs = [_drain(f"d{i}", r) for i, r in enumerate(defaults)]
    out.runs = [(name, value, _drain(f"{name}={value}", r)) for (name, value), r in rates.items()]
    return out


def test_defaults_are_read_from_the_settings_declarations() -> None:
    """The worker's own defaults, floats without their '.0' (as the parser reads them)."""
    got = sweep.defaults_of(["MAX_IN_FLIGHT", "BATCH_DELAY_MS", "COMPRESSION_TYPE"])
    assert got == {"MAX_IN_FLIGHT": "256", "BATCH_DELAY_MS": "2", "COMPRESSION_TYPE": "none"}


def test_best_values_keep_a_default_that_nothing_beat() -> None:
    """A value beating the defaults' median is best; a setting whose values all lose keeps its."""
    s = _sweep(
        {("MAX_IN_FLIGHT", "512"): 1200.0, ("MAX_IN_FLIGHT", "64"): 600.0, ("LINGER_MS", "0"): 900},
        (1000.0, 950.0, 1050.0),
    )
    assert s.default_rate() == 1000.0
    assert s.best_values() == {"MAX_IN_FLIGHT": "512", "LINGER_MS": "5"}
    assert s.best()[0] == "MAX_IN_FLIGHT=512"


def test_target_fails_when_the_best_run_is_more_than_a_tenth_faster() -> None:
    """1,000/s defaults against a best of 1,200/s is 0.83: missed; against 1,050/s it holds."""
    missed = sweep.target(_sweep({("MAX_IN_FLIGHT", "512"): 1200.0}, (1000.0,)))
    assert missed[1] == pytest.approx(1000 / 1200)
    assert not missed[3]
    held = sweep.target(_sweep({("MAX_IN_FLIGHT", "512"): 1050.0}, (1000.0,)))
    assert held[3]
    alone = report.extra_ratios({"defaults": _sweep({}, (1000.0,))})
    assert [(r.name, r.value, r.passed) for r in alone] == [
        ("defaults / best of the sweep (the defaults)", 1.0, True)
    ]


def test_markdown_lists_every_run_against_the_defaults_median(tmp_path: Path) -> None:
    """One row per defaults run and per swept value, with the ratio to the median."""
    s = _sweep({("MAX_IN_FLIGHT", "512"): 1500.0}, (1000.0, 900.0, 1100.0))
    s.combined = _drain("combined", 1600.0)
    table = sweep.markdown(s)
    assert "| MAX_IN_FLIGHT | 512 | 1,500 | 1.50 |" in table
    assert "| every best value combined | MAX_IN_FLIGHT=512, LINGER_MS=5 | 1,600 | 1.60 |" in table
    assert "spread over 900 to 1,100 records/s" in table
    assert sweep.target(s)[0] == "defaults / best of the sweep (every best value combined)"


def test_run_sweep_measures_defaults_three_times_and_combines_the_winners(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Defaults first, in the middle and last; one run per value; a combined run of winners."""
    seen: list[dict[str, str]] = []

    async def fake_drain(*_: Any, settings: dict[str, str], label: str, **__: Any) -> Drain:
        seen.append(dict(settings))
        rate = {"512": 1300.0, "8": 1100.0}.get(next(iter(settings.values()), ""), 1000.0)
        return _drain(label, 2000.0 if len(settings) > 1 else rate)

    monkeypatch.setattr(sweep, "drain", fake_drain)
    factors = {"MAX_IN_FLIGHT": ("64", "512"), "TRITON_STREAMS": ("8", "1")}
    s = asyncio.run(sweep.run_sweep("b", "t", tmp_path, model="mlp", records=10, factors=factors))
    assert [i for i, run in enumerate(seen) if not run] == [0, 3, 6]
    assert seen[-1] == {"MAX_IN_FLIGHT": "512", "TRITON_STREAMS": "8"}
    assert s.combined is not None and s.best()[0] == "every best value combined"
