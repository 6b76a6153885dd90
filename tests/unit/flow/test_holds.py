"""Which models are held while Triton reloads them, and when the hold ends: the model is
ready again, or the version named is retired while its model serves (MODEL_NOT_FOUND)."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.records.fakes import Clock
from worker import errors
from worker.flow.holds import NOT_LISTED, Listing, ModelGate

pytestmark = pytest.mark.timeout(10)

RETIRED = Listing(listed=True, retired="Triton lists model 'mlp' version 1 as UNAVAILABLE")


class Triton:
    """What the gate asks Triton: what the repository index says, ready now."""

    def __init__(self, listed: set[str], ready: set[str]) -> None:
        self.listed = listed
        self.ready = ready
        self.retired: set[str] = set()  # "name:version"
        self.probed = asyncio.Event()
        self.judged = asyncio.Event()  # the index was asked of a held version
        self.released: list[tuple[str, str]] = []

    async def listing(self, name: str, version: str) -> Listing:
        if version:
            self.judged.set()
        if f"{name}:{version}" in self.retired:
            return RETIRED
        return Listing(listed=True) if name in self.listed else NOT_LISTED

    async def is_ready(self, name: str, version: str) -> bool:
        self.probed.set()
        return name in self.ready

    def gate(
        self, seen: frozenset[str] = frozenset(), grace_s: float = 5.0, clock: Clock | None = None
    ) -> ModelGate:
        return ModelGate(
            seen_ready=lambda name, version: name in seen,
            listed=self.listing,
            ready=self.is_ready,
            released=lambda name, version: self.released.append((name, version)),
            interval_s=0.001,
            retired_grace_s=grace_s,
            clock=clock or Clock(),
        )

    async def next_judgement(self) -> None:
        """Wait until the probe asked the index of a held version once more."""
        self.judged.clear()
        await self.judged.wait()


async def test_a_model_seen_ready_earlier_is_held() -> None:
    """Ready earlier in this process: held even if the index no longer lists it."""
    gate = Triton(listed=set(), ready=set()).gate(seen=frozenset({"mlp"}))
    assert await gate.should_hold("mlp", "")
    assert gate.is_held("mlp", "") and gate.held() == ["mlp"]


async def test_a_model_the_index_lists_is_held_and_an_unknown_one_is_not() -> None:
    """Listed in the repository index: held; unknown everywhere: not held."""
    gate = Triton(listed={"mlp"}, ready=set()).gate()
    assert await gate.should_hold("mlp", "2")
    assert not await gate.should_hold("nope", "")
    assert gate.held() == ["mlp:2"]


async def test_the_probe_releases_waiters_once_the_model_is_ready() -> None:
    """Waiters wake when the probe sees the model ready; the release callback runs once."""
    triton = Triton(listed={"mlp"}, ready=set())
    gate = triton.gate()
    assert await gate.should_hold("mlp", "")
    probing = asyncio.create_task(gate.probe_loop())
    waiter = asyncio.create_task(gate.wait_ready("mlp", ""))
    await triton.probed.wait()
    assert not waiter.done()
    triton.ready.add("mlp")
    waited_s = await waiter
    probing.cancel()
    assert waited_s >= 0 and not gate.is_held("mlp", "")
    assert triton.released == [("mlp", "")]


async def test_waiting_for_a_model_not_held_returns_at_once() -> None:
    """No hold: wait_ready returns 0 without waiting."""
    gate = Triton(listed=set(), ready=set()).gate()
    assert await gate.wait_ready("mlp", "") == 0.0


async def test_a_retired_version_is_held_its_grace_then_not_found() -> None:
    """A version retired while its model serves (even one seen ready): held; once the probe
    has seen it retired for the grace, its waiters and later records get MODEL_NOT_FOUND
    with the index's sentence, without a new hold."""
    clock = Clock()
    triton = Triton(listed={"mlp"}, ready=set())
    triton.retired.add("mlp:1")
    gate = triton.gate(seen=frozenset({"mlp"}), grace_s=5.0, clock=clock)
    assert await gate.should_hold("mlp", "1")
    probing = asyncio.create_task(gate.probe_loop())
    waiter = asyncio.create_task(gate.wait_ready("mlp", "1"))
    await triton.next_judgement()
    clock.now += 4.9
    await triton.next_judgement()
    assert not waiter.done() and gate.held() == ["mlp:1"]
    clock.now += 0.1
    with pytest.raises(errors.ModelNotFound) as ended:
        await waiter
    assert ended.value.message == RETIRED.retired
    assert gate.held() == [] and triton.released == []
    with pytest.raises(errors.ModelNotFound):
        await gate.should_hold("mlp", "1")
    assert gate.held() == []
    probing.cancel()


async def test_a_retired_version_loaded_again_within_its_grace_is_released() -> None:
    """A rollout loads the retired version back before the grace ends: its waiters resume."""
    triton = Triton(listed={"mlp"}, ready=set())
    triton.retired.add("mlp:1")
    gate = triton.gate(grace_s=5.0)
    assert await gate.should_hold("mlp", "1")
    probing = asyncio.create_task(gate.probe_loop())
    waiter = asyncio.create_task(gate.wait_ready("mlp", "1"))
    await triton.next_judgement()
    triton.ready.add("mlp")
    assert await waiter >= 0
    probing.cancel()
    assert triton.released == [("mlp", "1")]


async def test_the_grace_starts_again_when_the_version_is_no_longer_retired() -> None:
    """Retired, then every version unloaded (a rollout: no version serves), then retired
    again: the grace counts from the last time it became retired."""
    clock = Clock()
    triton = Triton(listed={"mlp"}, ready=set())
    triton.retired.add("mlp:1")
    gate = triton.gate(grace_s=5.0, clock=clock)
    assert await gate.should_hold("mlp", "1")
    probing = asyncio.create_task(gate.probe_loop())
    waiter = asyncio.create_task(gate.wait_ready("mlp", "1"))
    await triton.next_judgement()
    triton.retired.clear()
    clock.now += 4
    await triton.next_judgement()
    triton.retired.add("mlp:1")
    await triton.next_judgement()
    clock.now += 4
    await triton.next_judgement()
    assert not waiter.done() and gate.held() == ["mlp:1"]
    clock.now += 1
    with pytest.raises(errors.ModelNotFound):
        await waiter
    probing.cancel()


async def test_a_version_judged_retired_is_held_again_once_listed_otherwise() -> None:
    """Judged retired, later every version unloaded (a rollout): its records wait again."""
    triton = Triton(listed={"mlp"}, ready=set())
    triton.retired.add("mlp:1")
    gate = triton.gate(grace_s=0.0)
    assert await gate.should_hold("mlp", "1")
    probing = asyncio.create_task(gate.probe_loop())
    with pytest.raises(errors.ModelNotFound):
        await gate.wait_ready("mlp", "1")
    probing.cancel()
    triton.retired.clear()
    assert await gate.should_hold("mlp", "1")
    assert gate.held() == ["mlp:1"]
