"""Models Triton is (re)loading: their records wait for the model instead of failing.

A model rollout (unload, then load) is an outage of that model, not bad input.
A record whose model is not ready, or not found, is held when the model was
ready earlier in this process or Triton's repository index still lists it: it
keeps its window slot and its offset, its deadline is paused and no attempt is
spent. A probe asks Triton every ``interval_s`` whether each held model is ready
again; when it is, its records resume. Other models keep flowing meanwhile, until
the held records fill the window and the intake pauses partitions.

A model that the repository does not know at all is not held: those records are
``MODEL_NOT_FOUND`` at once. Nor, for long, is a version the index lists as unloaded
or unloading (``UNAVAILABLE``, ``UNLOADING``) while another version of its model is
``READY``: that is no rollout in progress, but a version the model's version policy
retired, or one that failed to load while the others loaded. Its records are held
``retired_grace_s`` (a rollout that loads it again meanwhile is waited for), then they,
and those that name it later, are ``MODEL_NOT_FOUND``, the message naming the version,
its state and Triton's reason.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from worker import errors

log = structlog.get_logger(__name__)

__all__ = ["NOT_LISTED", "RETIRED_GRACE_S", "Listing", "ModelGate"]


_Model = tuple[str, str]  # (name, version); version "" is the latest

#: How long records of a retired version (see ``Listing``) are held before they are
#: MODEL_NOT_FOUND: a rollout that loads the version again within it is waited for.
RETIRED_GRACE_S = 5.0
#: Versions judged retired, remembered so that their later records are not held again
#: (named by records, so bounded; the oldest is forgotten first).
_MAX_RETIRED = 256


@dataclass(frozen=True, slots=True)
class Listing:
    """What Triton's repository index says of a model version."""

    #: Listed in a state Triton serves from or passes through in a rollout (ready,
    #: loading, unloading, unloaded or failed to load): it may be served (again).
    listed: bool
    #: Why the version is not served while another version of its model is (the version
    #: policy retired it, or it failed to load); "" when that is not so.
    retired: str = ""


#: Not in the repository index, or never loaded.
NOT_LISTED = Listing(listed=False)


@dataclass(slots=True)
class _Hold:
    since: float
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    #: Since when the probe has seen the version retired, without a break.
    retired_since: float | None = None
    #: Why the hold ended without the version coming back (its records: MODEL_NOT_FOUND).
    verdict: str | None = None


class ModelGate:
    """Which models are held, why a model may be held, and the probe that releases them."""

    def __init__(
        self,
        *,
        seen_ready: Callable[[str, str], bool],
        listed: Callable[[str, str], Awaitable[Listing]],
        ready: Callable[[str, str], Awaitable[bool]],
        released: Callable[[str, str], None] | None = None,
        interval_s: float = 1.0,
        retired_grace_s: float = RETIRED_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Each callable takes (model name, version). ``seen_ready``: was it ready earlier;
        ``listed``: what the repository index says of it; ``ready``: is it ready now;
        ``released``: called when a hold ends (to drop cached metadata, which a reload
        may change). ``retired_grace_s``: how long a retired version is held, by ``clock``."""
        self._seen_ready = seen_ready
        self._listed = listed
        self._ready = ready
        self._released = released
        self._interval_s = interval_s
        self._retired_grace_s = retired_grace_s
        self._clock = clock
        self._holds: dict[_Model, _Hold] = {}
        self._retired: dict[_Model, None] = {}  # in the order judged
        self._changed = asyncio.Event()

    def is_held(self, name: str, version: str) -> bool:
        """True while records of the model wait for it."""
        return (name, version) in self._holds

    def held(self) -> list[str]:
        """The models held now, as ``name`` or ``name:version``, sorted."""
        return sorted(f"{name}:{version}" if version else name for name, version in self._holds)

    async def should_hold(self, name: str, version: str) -> bool:
        """Whether a not-ready or not-found model is expected back; holds it if so.

        Raises ModelNotFound for a version that is retired (see ``Listing``) and was held
        its grace already.
        """
        key = (name, version)
        if key in self._holds:
            return True
        listing = await self._listed(name, version)
        if listing.retired:
            if key in self._retired:
                raise errors.ModelNotFound(listing.retired)
        else:
            self._retired.pop(key, None)
            if not (self._seen_ready(name, version) or listing.listed):
                return False
        if key not in self._holds:
            retired_since = self._clock() if listing.retired else None
            self._holds[key] = _Hold(time.monotonic(), retired_since=retired_since)
            self._changed.set()
            log.warning("model_not_ready_holding", model=name, version=version or "latest")
        return True

    async def wait_ready(self, name: str, version: str) -> float:
        """Wait until the model is released; return the seconds waited (0 if not held).

        Raises ModelNotFound when the hold ended because the version is retired.
        """
        hold = self._holds.get((name, version))
        if hold is None:
            return 0.0
        started = time.monotonic()
        await hold.ready.wait()
        if hold.verdict is not None:
            raise errors.ModelNotFound(hold.verdict)
        return time.monotonic() - started

    async def probe_loop(self) -> None:
        """Every ``interval_s`` while a model is held, ask Triton whether it is ready again
        (and, of a version named, whether it is retired)."""
        while True:
            if not self._holds:
                self._changed.clear()
                await self._changed.wait()
            await asyncio.sleep(self._interval_s)
            for key, hold in list(self._holds.items()):
                if await self._ready(*key):
                    self._release(key, hold)
                elif key[1]:
                    await self._judge(key, hold)

    async def _judge(self, key: _Model, hold: _Hold) -> None:
        """End the hold of a version retired for ``retired_grace_s`` without a break."""
        listing = await self._listed(*key)
        now = self._clock()
        if not listing.retired:
            hold.retired_since = None
            return
        if hold.retired_since is None:
            hold.retired_since = now
        if now - hold.retired_since < self._retired_grace_s or self._holds.get(key) is not hold:
            return
        del self._holds[key]
        self._retired[key] = None
        if len(self._retired) > _MAX_RETIRED:
            del self._retired[next(iter(self._retired))]
        hold.verdict = listing.retired
        hold.ready.set()
        log.warning(
            "model_version_retired",
            model=key[0],
            version=key[1],
            held_s=round(time.monotonic() - hold.since, 3),
            error=listing.retired,
        )

    def _release(self, key: _Model, hold: _Hold) -> None:
        if self._holds.get(key) is not hold:
            return
        del self._holds[key]
        if self._released is not None:
            self._released(*key)
        hold.ready.set()
        held_s = round(time.monotonic() - hold.since, 3)
        log.info("model_ready_again", model=key[0], version=key[1] or "latest", held_s=held_s)
