"""The defaults sweep's bookkeeping: ratios to each group's defaults run, the target, the table."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from devtools.bench import report, sweep
from devtools.bench.extras import Drain


def _drain(label: str, per_s: float) -> Drain:
    return Drain(label, {}, 1000, per_s, 10.0, cpu_s_per_1k=0.1)


def _group(name: str, default: float, runs: dict[str, float]) -> sweep.Group:
    return sweep.Group(name, _drain("d", default), [(v, _drain(v, r)) for v, r in runs.items()])


def _sweep(*groups: sweep.Group) -> sweep.Sweep:
    return sweep.Sweep({"MAX_IN_FLIGHT": "256", "LINGER_MS": "5"}, list(groups))


def test_defaults_are_read_from_the_settings_declarations() -> None:
    """The worker's own defaults, floats without their '.0' (as the parser reads them)."""
    got = sweep.defaults_of(["MAX_IN_FLIGHT", "BATCH_DELAY_MS", "COMPRESSION_TYPE"])
    assert got == {"MAX_IN_FLIGHT": "256", "BATCH_DELAY_MS": "2", "COMPRESSION_TYPE": "none"}


def test_each_value_is_compared_with_its_own_groups_defaults_run() -> None:
    """1,200/s beside a 1,000/s defaults run beats 1,300/s beside a 1,400/s one."""
    s = _sweep(
        _group("MAX_IN_FLIGHT", 1000.0, {"512": 1200.0, "64": 600.0}),
        _group("LINGER_MS", 1400.0, {"0": 1300.0}),
    )
    assert s.best_values() == {"MAX_IN_FLIGHT": "512", "LINGER_MS": "5"}
    label, ratio = s.best()
    assert label == "MAX_IN_FLIGHT=512"
    assert ratio == pytest.approx(1.2)


def test_target_fails_when_the_best_run_is_more_than_a_tenth_faster() -> None:
    """A best ratio of 1.2 gives 0.83: missed; 1.05 gives 0.95: held; nothing better: 1.0."""
    missed = sweep.target(_sweep(_group("MAX_IN_FLIGHT", 1000.0, {"512": 1200.0})))
    assert missed[1] == pytest.approx(1000 / 1200)
    assert not missed[3]
    assert sweep.target(_sweep(_group("MAX_IN_FLIGHT", 1000.0, {"512": 1050.0})))[3]
    alone = report.extra_ratios({"defaults": _sweep(_group("LINGER_MS", 1000.0, {"0": 900.0}))})
    assert [(r.name, r.value, r.passed) for r in alone] == [
        ("defaults / best of the sweep (the defaults)", 1.0, True)
    ]


def test_markdown_lists_every_run_against_its_groups_defaults() -> None:
    """One row per defaults run and per value, with the ratio; the combined run by its label."""
    s = _sweep(
        _group("MAX_IN_FLIGHT", 1000.0, {"512": 1500.0}),
        _group(sweep.COMBINED, 900.0, {"MAX_IN_FLIGHT=512": 1800.0}),
    )
    table = sweep.markdown(s)
    assert "| MAX_IN_FLIGHT | (defaults) | 1,000 | 1.00 |" in table
    assert "| | 512 | 1,500 | 1.50 |" in table
    assert "| | MAX_IN_FLIGHT=512 | 1,800 | 2.00 |" in table
    assert "Their 2 runs spread over 900 to 1,000 records/s" in table
    assert sweep.target(s)[0] == f"defaults / best of the sweep ({sweep.COMBINED})"


def test_run_sweep_runs_the_defaults_before_each_group_and_combines_the_winners(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Defaults, then each value, per setting; the winners combined, then the defaults again."""
    seen: list[dict[str, str]] = []

    async def fake_drain(*_: Any, settings: dict[str, str], label: str, **__: Any) -> Drain:
        seen.append(dict(settings))
        rate = {"512": 1300.0, "8": 1100.0}.get(next(iter(settings.values()), ""), 1000.0)
        return _drain(label, 2000.0 if len(settings) > 1 else rate)

    monkeypatch.setattr(sweep, "drain", fake_drain)
    factors = {"MAX_IN_FLIGHT": ("64", "512"), "TRITON_STREAMS": ("8", "1")}
    s = asyncio.run(sweep.run_sweep("b", "t", tmp_path, model="mlp", records=10, factors=factors))
    assert [i for i, run in enumerate(seen) if not run] == [0, 3, 7]
    assert seen[6] == {"MAX_IN_FLIGHT": "512", "TRITON_STREAMS": "8"}
    assert [g.name for g in s.groups] == ["MAX_IN_FLIGHT", "TRITON_STREAMS", sweep.COMBINED]
    assert s.best() == (sweep.COMBINED, 2.0)
