"""The set of Triton endpoints: targets resolved to addresses, health, least-outstanding choice.

``WORKER_TRITON_URL`` lists targets (``host:port``, comma-separated). A target whose
host resolves to several addresses (a Kubernetes headless Service) stands for one
endpoint per address, and the set follows the name: it is resolved again every
``WORKER_TRITON_RESOLVE_INTERVAL_S``. A target that is an address, or a name that
resolves to a single address (or not at all, for now), is one endpoint under its own
name: gRPC resolves it as it always did, and a TLS certificate naming it still matches.

Each endpoint carries its own health: it is up after a good probe, down after a
failed one or as soon as a request on it finds Triton unreachable (a breaker of
threshold one, closed by its next good probe). Requests go to the up endpoint with
the fewest outstanding requests; only when none is up are the down ones tried, so one
endpoint does not make an outage while another serves.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import zlib
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import structlog
from tritonclient.grpc import service_pb2

from worker.triton.cache import MAX_CACHED_MODELS, BoundedCache

__all__ = [
    "Endpoint",
    "EndpointSet",
    "Resolver",
    "Target",
    "parse_targets",
    "sequence_of",
    "system_resolver",
]

log = structlog.get_logger(__name__)

#: ``resolver(host, port)``: the addresses ``host`` stands for (raises OSError when unknown).
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

_P = TypeVar("_P")


@dataclass(frozen=True, slots=True)
class Target:
    """One entry of ``WORKER_TRITON_URL``."""

    host: str
    port: int

    @property
    def is_address(self) -> bool:
        """True when the host is an IP address (nothing to resolve)."""
        try:
            ipaddress.ip_address(self.host.strip("[]"))
        except ValueError:
            return False
        return True

    def __str__(self) -> str:
        return join(self.host, self.port)


def join(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    bare = host.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def parse_targets(url: str) -> tuple[Target, ...]:
    """The targets of a comma-separated ``host:port`` list (validated by the settings)."""
    targets = []
    for part in filter(None, (p.strip() for p in url.split(","))):
        host, _, port = part.rpartition(":")
        targets.append(Target(host, int(port)))
    return tuple(dict.fromkeys(targets))


def sequence_of(request: service_pb2.ModelInferRequest) -> bytes | None:
    """The sequence id of a request of a sequence (its state lives in one server)."""
    if len(request.parameters) and "sequence_id" in request.parameters:
        return bytes(request.parameters["sequence_id"].SerializeToString())
    return None


async def system_resolver(host: str, port: int) -> Sequence[str]:
    """Every address ``host`` resolves to (TCP), in a stable order, without duplicates."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(eq=False, slots=True)
class Endpoint(Generic[_P]):
    """One Triton server the worker talks to, with its own health and load."""

    address: str  # host:port the channel dials; the metrics label
    target: Target  # the entry of WORKER_TRITON_URL it came from
    pool: _P
    up: bool = True  # optimistic until the first probe: start-up already checked Triton
    outstanding: int = 0  # requests sent and not yet answered
    #: (model, version) whose metadata was compared with the agreed one: True agrees.
    agrees: BoundedCache[tuple[str, str], bool] = field(
        default_factory=lambda: BoundedCache(MAX_CACHED_MODELS)
    )

    def mark_down(self, reason: str) -> bool:
        """Take the endpoint out of rotation until a probe finds it live; True if it was up."""
        if not self.up:
            return False
        self.up = False
        log.warning("triton_endpoint_down", endpoint=self.address, reason=reason)
        return True

    def mark_up(self) -> bool:
        """Back in rotation; True if it was down."""
        if self.up:
            return False
        self.up = True
        log.info("triton_endpoint_up", endpoint=self.address)
        return True

    def serves(self, model: tuple[str, str]) -> bool:
        """False once its metadata for ``model`` was found to disagree with the others'."""
        return self.agrees.get(model) is not False


class EndpointSet(Generic[_P]):
    """The endpoints of the targets, kept in step with what the names resolve to."""

    def __init__(
        self,
        targets: Sequence[Target],
        make: Callable[[str, Target], _P],
        resolver: Resolver = system_resolver,
    ) -> None:
        """``make(address, target)`` builds the per-endpoint pool (not started)."""
        self.targets = tuple(targets)
        self._make = make
        self._resolver = resolver
        self.endpoints: dict[str, Endpoint[_P]] = {}
        self._turn = 0

    @property
    def resolvable(self) -> bool:
        """True when some target is a name whose addresses may change."""
        return any(not t.is_address for t in self.targets)

    async def addresses(self) -> dict[str, Target]:
        """The address of every endpoint the targets stand for right now.

        A name that fails to resolve keeps the endpoints it had (a DNS hiccup is
        no reason to drop a server), or stands for itself when it had none.
        """
        wanted: dict[str, Target] = {}
        for target in self.targets:
            for address in await self._addresses_of(target):
                wanted.setdefault(address, target)
        return wanted

    async def _addresses_of(self, target: Target) -> list[str]:
        if target.is_address:
            return [str(target)]
        try:
            found = list(await self._resolver(target.host, target.port))
        except OSError as exc:
            kept = [a for a, e in self.endpoints.items() if e.target == target]
            log.warning("triton_resolve_failed", target=str(target), error=str(exc), kept=kept)
            return kept or [str(target)]
        if len(found) <= 1:
            return [str(target)]
        return [join(address, target.port) for address in found]

    async def refresh(self) -> tuple[list[Endpoint[_P]], list[Endpoint[_P]]]:
        """Resolve the targets again; the endpoints (added, removed), the set updated."""
        wanted = await self.addresses()
        added = [
            Endpoint(address, target, self._make(address, target))
            for address, target in wanted.items()
            if address not in self.endpoints
        ]
        removed = [e for address, e in self.endpoints.items() if address not in wanted]
        for endpoint in removed:
            del self.endpoints[endpoint.address]
        for endpoint in added:
            self.endpoints[endpoint.address] = endpoint
        if added or removed:
            log.info(
                "triton_endpoints_changed",
                added=[e.address for e in added],
                removed=[e.address for e in removed],
                endpoints=list(self.endpoints),
            )
        return added, removed

    def discard(self, endpoint: Endpoint[_P]) -> None:
        """Take ``endpoint`` out of the set (a refresh that finds its address adds it again)."""
        if self.endpoints.get(endpoint.address) is endpoint:
            del self.endpoints[endpoint.address]

    def __iter__(self) -> Any:
        return iter(list(self.endpoints.values()))

    def __len__(self) -> int:
        return len(self.endpoints)

    def choose(
        self,
        model: tuple[str, str],
        *,
        avoid: Iterable[str] = (),
        sticky: bytes | None = None,
        load: Callable[[Endpoint[_P]], int] | None = None,
    ) -> Endpoint[_P] | None:
        """The endpoint for the next request of ``model``, or None when none can take it.

        Up endpoints first, the one with the fewest outstanding requests (``load``,
        by default ``outstanding``), ties taken in turn. When none is up, a first
        try (nothing to ``avoid``) goes to a down one anyway: it fails as an outage
        and the worker-wide breaker counts it. ``sticky`` (a sequence id) always
        picks the same up endpoint while the set is unchanged, and moves as few
        sequences as possible when it changes (rendezvous hashing): a sequence's
        state lives in one server.
        """
        skip = set(avoid)
        usable = [e for e in self.endpoints.values() if e.address not in skip and e.serves(model)]
        live = [e for e in usable if e.up]
        candidates = live or ([] if skip else usable)
        if not candidates:
            return None
        if sticky is not None:
            return max(candidates, key=lambda e: zlib.crc32(sticky + e.address.encode()))
        weigh = load or (lambda e: e.outstanding)
        self._turn += 1
        count = len(candidates)
        ranked = ((weigh(e), (i - self._turn) % count, e) for i, e in enumerate(candidates))
        return min(ranked, key=lambda item: item[:2])[2]
