"""The soak's servers: one broker, two Triton endpoints and a Schema Registry, the faults
applied to them, and a supervisor that restarts a Triton that died by itself.

Triton 2.51 can crash (SIGSEGV in ``TRITONBACKEND_ResponseSend``) while serving decoupled
and ordinary requests under load (README, "Decoupled models"), and needs a supervisor
that restarts it, as a deployment has. The soak is that supervisor: such a death is
noted, the server started again on its ports, and the worker must take it as it takes a
killed endpoint. A broker or a registry that dies by itself fails the soak.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from devtools.devstack.kafka import KafkaCluster
from devtools.devstack.process import tail
from devtools.devstack.registry import SchemaRegistry
from devtools.devstack.triton import TritonServer
from tests.support.soak.outcomes import Tripwire
from tests.support.soak.processes import triton_model_call, triton_model_ready


@dataclass(frozen=True)
class Stack:
    """The servers the soak owns: one broker, two Triton endpoints, a Schema Registry."""

    kafka: KafkaCluster
    tritons: tuple[TritonServer, ...]
    registry: SchemaRegistry


@dataclass(frozen=True)
class Death:
    """A Triton that died by itself: which, how, when, and when it was serving again."""

    address: str
    how: str
    seen_wall_ms: int
    back_wall_ms: int


@dataclass
class Servers:
    """Faults on the servers, one at a time, and the supervisor's restarts between them."""

    stack: Stack
    tripwire: Tripwire
    say: Callable[[str], None]
    deaths: list[Death] = field(default_factory=list)
    #: Held by each fault and by each restart, so that they never overlap.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Endpoints a fault is killing or stopping on purpose right now.
    _victims: set[str] = field(default_factory=set)
    #: When the supervisor first saw each endpoint dead by itself (wall ms): a death during
    #: a fault is seen then, though its restart waits for the fault to end.
    _dead_since: dict[str, int] = field(default_factory=dict)

    async def on_tritons(
        self,
        call: Callable[[TritonServer], object],
        tritons: tuple[TritonServer, ...] | None = None,
    ) -> None:
        """``call`` on each endpoint (all by default) at once, each on a thread of its own."""
        chosen = tritons if tritons is not None else self.stack.tritons
        await asyncio.gather(*(asyncio.to_thread(call, t) for t in chosen))

    async def restart_broker(self, down_s: float) -> None:
        kafka = self.stack.kafka
        async with self.lock:
            await asyncio.to_thread(kafka.stop_node, 1)
            await asyncio.sleep(down_s)  # the outage itself
            await self.tripwire.guard(asyncio.to_thread(kafka.start_node, 1), 120, "broker start")

    async def restart_registry(self, down_s: float) -> None:
        """Stop the Schema Registry (SIGTERM), then start it again with its schemas."""
        registry = self.stack.registry
        async with self.lock:
            await asyncio.to_thread(registry.stop)
            await asyncio.sleep(down_s)  # the outage itself
            starting = asyncio.to_thread(registry.start)
            await self.tripwire.guard(starting, 120, "registry start")

    async def bounce_tritons(
        self, victims: tuple[TritonServer, ...], kill: bool, down_s: float
    ) -> None:
        """Stop (SIGTERM) or kill (SIGKILL) ``victims``, then start them again."""
        stop: Callable[[TritonServer], None] = TritonServer.kill if kill else TritonServer.stop
        async with self.lock:
            self._victims.update(t.grpc_address for t in victims)
            try:
                await self.on_tritons(stop, victims)
                await asyncio.sleep(down_s)  # the outage itself
                starting = self.on_tritons(TritonServer.start, victims)
                await self.tripwire.guard(starting, 120, "Triton")
            finally:
                self._victims.difference_update(t.grpc_address for t in victims)

    async def reload_model(self, model: str, down_s: float) -> None:
        """Unload ``model`` on every endpoint, then load it again. A Triton that dies by
        itself meanwhile (Triton 2.51 crashes now and then amid a load or an unload) is
        left to the supervisor, which starts it again with every model once this ends."""
        async with self.lock:
            serving = await self._model_call(self.stack.tritons, model, "unload")
            await asyncio.sleep(down_s)  # the model's outage itself
            serving = await self._model_call(serving, model, "load")
            for triton in serving:
                assert await asyncio.to_thread(triton_model_ready, triton.http_address, model)

    async def _model_call(
        self, tritons: tuple[TritonServer, ...], model: str, action: str
    ) -> tuple[TritonServer, ...]:
        """``action`` on ``model`` of each of ``tritons``, at once; those that did it."""

        async def call(triton: TritonServer) -> bool:
            try:
                await asyncio.to_thread(triton_model_call, triton.http_address, model, action)
            except OSError:  # the connection closed without an answer: did the server die?
                if not await asyncio.to_thread(_died, triton):
                    raise
                return False
            return True

        done = await asyncio.gather(*(call(t) for t in tritons))
        return tuple(t for t, ok in zip(tritons, done, strict=True) if ok)

    def any_triton_up(self) -> bool:
        return any(t.running() for t in self.stack.tritons)

    async def supervise(self, stop: asyncio.Event, all_down: Callable[[bool], None]) -> None:
        """Restart a Triton that died by itself (``all_down(True)`` while none serves,
        ``all_down(False)`` once one does again); trip the soak if the broker or the
        registry dies."""
        while not stop.is_set():
            self._note_deaths()
            if not self.lock.locked():
                async with self.lock:  # between faults: a stopped server is a dead one
                    for triton in self.stack.tritons:
                        if (death := triton.death_report()) is not None:
                            await self._restart(triton, death, all_down)
                    if not self.stack.kafka.running_nodes():
                        log = self.stack.kafka.node(1).log_path
                        self.tripwire.trip(f"the broker died by itself:\n{tail(log, 40)}")
                    registry = self.stack.registry
                    if not registry.running():
                        log = registry.log_path
                        self.tripwire.trip(f"the registry died by itself:\n{tail(log, 40)}")
            with contextlib.suppress(TimeoutError):
                # Polling other processes' liveness: there is no event to await.
                await asyncio.wait_for(stop.wait(), 0.5)

    async def _restart(
        self, triton: TritonServer, death: str, all_down: Callable[[bool], None]
    ) -> None:
        seen_ms = self._dead_since.pop(triton.grpc_address, int(time.time() * 1000))
        how = death.splitlines()[0]
        self.say(f"supervisor: {how}; starting it again")
        none_up = not self.any_triton_up()
        if none_up:
            all_down(True)
        await self.tripwire.guard(asyncio.to_thread(triton.start), 120, "Triton restart")
        if none_up:
            all_down(False)
        self.deaths.append(Death(triton.grpc_address, how, seen_ms, int(time.time() * 1000)))

    def _note_deaths(self) -> None:
        """When each endpoint not a fault's victim was first seen dead by itself (a fault
        holds the restart back, not the noting: a stream cut short by such a death is
        judged by when it died)."""
        now_ms = int(time.time() * 1000)
        for triton in self.stack.tritons:
            address = triton.grpc_address
            if address in self._victims or triton.death_report() is None:
                self._dead_since.pop(address, None)
            else:
                self._dead_since.setdefault(address, now_ms)


def _died(triton: TritonServer, within_s: float = 10.0) -> bool:
    """True once the server's process has ended, within ``within_s`` of a call it dropped."""
    deadline = time.monotonic() + within_s
    while triton.running():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)  # the process's exit, polled: it has no event to wait on
    return True
