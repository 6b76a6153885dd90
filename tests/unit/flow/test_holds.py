"""Which models are held while Triton reloads them, and when the hold ends."""

from __future__ import annotations

import asyncio

import pytest

from worker.flow.holds import ModelGate

pytestmark = pytest.mark.timeout(10)


class Triton:
    """What the gate asks Triton: listed in the repository index, ready now."""

    def __init__(self, listed: set[str], ready: set[str]) -> None:
        self.listed = listed
        self.ready = ready
        self.probed = asyncio.Event()
        self.released: list[tuple[str, str]] = []

    async def is_listed(self, name: str, version: str) -> bool:
        return name in self.listed

    async def is_ready(self, name: str, version: str) -> bool:
        self.probed.set()
        return name in self.ready

    def gate(self, seen: set[str] = frozenset()) -> ModelGate:  # type: ignore[assignment]
        return ModelGate(
            seen_ready=lambda name, version: name in seen,
            listed=self.is_listed,
            ready=self.is_ready,
            released=lambda name, version: self.released.append((name, version)),
            interval_s=0.001,
        )


async def test_a_model_seen_ready_earlier_is_held() -> None:
    """Ready earlier in this process: held even if the index no longer lists it."""
    gate = Triton(listed=set(), ready=set()).gate(seen={"mlp"})
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
