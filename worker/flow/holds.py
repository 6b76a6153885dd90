"""Models Triton is (re)loading: their records wait for the model instead of failing.

A model rollout (unload, then load) is an outage of that model, not bad input.
A record whose model is not ready, or not found, is held when the model was
ready earlier in this process or Triton's repository index still lists it: it
keeps its window slot and its offset, its deadline is paused and no attempt is
spent. A probe asks Triton every ``interval_s`` whether each held model is ready
again; when it is, its records resume. Other models keep flowing meanwhile, until
the held records fill the window and the intake pauses partitions.

A model that the repository does not know at all is not held: those records are
``MODEL_NOT_FOUND`` at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger(__name__)

__all__ = ["ModelGate"]


_Model = tuple[str, str]  # (name, version); version "" is the latest


@dataclass(slots=True)
class _Hold:
    since: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)


class ModelGate:
    """Which models are held, why a model may be held, and the probe that releases them."""

    def __init__(
        self,
        *,
        seen_ready: Callable[[str, str], bool],
        listed: Callable[[str, str], Awaitable[bool]],
        ready: Callable[[str, str], Awaitable[bool]],
        released: Callable[[str, str], None] | None = None,
        interval_s: float = 1.0,
    ) -> None:
        """Each callable takes (model name, version). ``seen_ready``: was it ready earlier;
        ``listed``: does the repository index list it; ``ready``: is it ready now;
        ``released``: called when a hold ends (to drop cached metadata, which a reload
        may change)."""
        self._seen_ready = seen_ready
        self._listed = listed
        self._ready = ready
        self._released = released
        self._interval_s = interval_s
        self._holds: dict[_Model, _Hold] = {}
        self._changed = asyncio.Event()

    def is_held(self, name: str, version: str) -> bool:
        """True while records of the model wait for it."""
        return (name, version) in self._holds

    def held(self) -> list[str]:
        """The models held now, as ``name`` or ``name:version``, sorted."""
        return sorted(f"{name}:{version}" if version else name for name, version in self._holds)

    async def should_hold(self, name: str, version: str) -> bool:
        """Whether a not-ready or not-found model is expected back; holds it if so."""
        key = (name, version)
        if key in self._holds:
            return True
        if not (self._seen_ready(name, version) or await self._listed(name, version)):
            return False
        if key not in self._holds:
            self._holds[key] = _Hold(time.monotonic())
            self._changed.set()
            log.warning("model_not_ready_holding", model=name, version=version or "latest")
        return True

    async def wait_ready(self, name: str, version: str) -> float:
        """Wait until the model is released; return the seconds waited (0 if not held)."""
        hold = self._holds.get((name, version))
        if hold is None:
            return 0.0
        started = time.monotonic()
        await hold.ready.wait()
        return time.monotonic() - started

    async def probe_loop(self) -> None:
        """Every ``interval_s`` while a model is held, ask Triton whether it is ready again."""
        while True:
            if not self._holds:
                self._changed.clear()
                await self._changed.wait()
            await asyncio.sleep(self._interval_s)
            for key, hold in list(self._holds.items()):
                if await self._ready(*key):
                    self._release(key, hold)

    def _release(self, key: _Model, hold: _Hold) -> None:
        if self._holds.get(key) is not hold:
            return
        del self._holds[key]
        if self._released is not None:
            self._released(*key)
        hold.ready.set()
        held_s = round(time.monotonic() - hold.since, 3)
        log.info("model_ready_again", model=key[0], version=key[1] or "latest", held_s=held_s)
