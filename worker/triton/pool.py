"""The worker's Triton: one or several endpoints behind one pool of streams.

Behind a Kubernetes Service, long-lived gRPC streams all land on one pod. So the
worker talks to each endpoint itself (worker/triton/endpoints.py: targets, resolution,
health, choice), with a ``ServerPool`` of streams each (worker/triton/server.py),
and sends every request to the up endpoint with the fewest outstanding ones. A
request whose endpoint turns out unreachable (its stream broke, the server died) is
sent again at once to another up endpoint, within the same try (a decoupled one as
worker/triton/failover.py says): only when no endpoint can take it does the caller see
the outage (and the worker-wide breaker count it).

A model's metadata and configuration must agree across endpoints: the spec most
endpoints report is the model's; an endpoint reporting another is logged and not
used for that model.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any

import structlog
from tritonclient.grpc import service_pb2

from worker import errors
from worker.flow.holds import Listing
from worker.observability.metrics import Metrics
from worker.triton.auth import TritonAuth
from worker.triton.cache import MAX_CACHED_MODELS, BoundedCache, KeyedLocks
from worker.triton.decoupled import ResponseStream
from worker.triton.endpoints import Endpoint, EndpointSet, Resolver, Target, parse_targets
from worker.triton.endpoints import sequence_of as _sequence_of
from worker.triton.endpoints import system_resolver as _system_resolver
from worker.triton.failover import FailoverStream
from worker.triton.repository import merged
from worker.triton.server import ServerPool, Trace
from worker.wire.validation import ModelSpec

__all__ = ["TritonPool"]

log = structlog.get_logger(__name__)

_Endpoint = Endpoint[ServerPool]
_Model = tuple[str, str]  # (name, version)


class TritonPool:
    """The Triton endpoints of ``url`` (comma-separated ``host:port``), ``streams`` each."""

    def __init__(
        self,
        url: str,
        streams: int,
        *,
        client_kwargs: Mapping[str, Any] | None = None,
        auth: TritonAuth | None = None,
        shm_min_bytes: int | None = None,
        shm_pool_bytes: int = 0,
        resolve_interval_s: float = 30.0,
        resolver: Resolver | None = None,
        metrics: Metrics | None = None,
        trace_unary: bool = False,
    ) -> None:
        """``shm_min_bytes`` set: inputs that large go through system shared memory
        (regions registered with each endpoint, ``shm_pool_bytes`` each);
        ``trace_unary``: a request given a trace context goes as a unary call carrying it."""
        self.trace_unary = trace_unary
        self.url = url
        self._streams = streams
        self._client_kwargs = dict(client_kwargs or {})
        self._server_kwargs: dict[str, Any] = {
            "client_kwargs": self._client_kwargs,
            "auth": auth,
            "shm_min_bytes": shm_min_bytes,
            "shm_pool_bytes": shm_pool_bytes,
            "on_cache_evict": self._evicted,
        }
        self._resolve_interval_s = resolve_interval_s
        self._metrics = metrics
        self.endpoints: EndpointSet[ServerPool] = EndpointSet(
            parse_targets(url), self._make, resolver or _system_resolver
        )
        # Keyed by names and versions taken from records: bounded (see worker.triton.cache).
        self._specs: BoundedCache[_Model, ModelSpec] = BoundedCache(
            MAX_CACHED_MODELS, on_evict=self._evicted
        )
        self._lookups: KeyedLocks[_Model] = KeyedLocks()
        self._closing = False
        self._started = False
        self._tasks: set[asyncio.Task[None]] = set()

    def _evicted(self) -> None:
        if self._metrics is not None:
            self._metrics.model_cache_evictions_total.inc()

    def _make(self, address: str, target: Target) -> ServerPool:
        extra: tuple[tuple[str, Any], ...] = ()
        if self._client_kwargs.get("ssl") and address != str(target):
            # Dialled by address: the certificate names the host of the target.
            extra = (("grpc.ssl_target_name_override", target.host),)
        return ServerPool(address, self._streams, extra_channel_args=extra, **self._server_kwargs)

    async def start(self) -> None:
        """Resolve the targets and open every endpoint's streams (no server round trip)."""
        await self._apply(*await self.endpoints.refresh())
        self._started = True
        if self.endpoints.resolvable:
            self._spawn(self._resolve_loop(), "triton-resolve")

    def _spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve_loop(self) -> None:
        while not self._closing:
            await asyncio.sleep(self._resolve_interval_s)
            try:
                await self.refresh()
            except Exception as exc:
                # One failed refresh must not end the loop: the set would never follow
                # the name again. The endpoints stay as they were until the next one.
                log.error("triton_refresh_failed", error=f"{type(exc).__name__}: {exc}")

    async def refresh(self) -> None:
        """Resolve the targets again now: new addresses are opened, vanished ones drained."""
        if not self._closing:
            await self._apply(*await self.endpoints.refresh())

    async def _apply(self, added: list[_Endpoint], removed: list[_Endpoint]) -> None:
        for endpoint in added:
            try:
                await endpoint.pool.start()
            except Exception as exc:
                if not self._started:
                    raise  # at start-up: the worker cannot start
                # Out of rotation (a pool without streams cannot take requests); the
                # next refresh finds the address new again and tries once more.
                self.endpoints.discard(endpoint)
                self._spawn(endpoint.pool.close(drain_timeout_s=0.0), "triton-endpoint-close")
                log.error(
                    "triton_endpoint_start_failed", endpoint=endpoint.address, error=repr(exc)
                )
                continue
            self._observe(endpoint)
        for endpoint in removed:
            # Out of rotation already; what it owes is answered before it closes.
            self._spawn(endpoint.pool.close(drain_timeout_s=10.0), "triton-endpoint-close")
            if self._metrics is not None:
                gauges = (self._metrics.triton_endpoint_up, self._metrics.triton_endpoint_in_flight)
                for gauge in gauges:
                    with contextlib.suppress(KeyError):
                        gauge.remove(endpoint.address)

    def _observe(self, endpoint: _Endpoint, outcome: str | None = None) -> None:
        if self._metrics is None:
            return
        label = endpoint.address
        self._metrics.triton_endpoint_up.labels(label).set(1 if endpoint.up else 0)
        self._metrics.triton_endpoint_in_flight.labels(label).set(endpoint.outstanding)
        if outcome is not None:
            self._metrics.triton_endpoint_requests_total.labels(label, outcome).inc()

    def _down(self, endpoint: _Endpoint, error: errors.WorkerError) -> None:
        if endpoint.mark_down(str(error)):
            self._observe(endpoint)

    def wake(self) -> None:
        """Re-open broken streams now (Triton is back), not after their backoff."""
        for endpoint in self.endpoints:
            endpoint.pool.wake()

    @property
    def shm(self) -> Any:
        """The shared-memory regions of the first endpoint (None when not in use)."""
        first = next(iter(self.endpoints), None)
        return first.pool.shm if first is not None else None

    async def infer(
        self, request: service_pb2.ModelInferRequest, timeout_s: float, trace: Trace = ()
    ) -> service_pb2.ModelInferResponse:
        """Send one request to the least-loaded endpoint; its response, or a WorkerError.

        An endpoint found unreachable is marked down and the request goes to the
        next up one within ``timeout_s``; a request of a sequence (``sequence_id``)
        goes to the endpoint holding its sequence while that one is up. ``trace``
        (W3C traceparent and tracestate) is gRPC metadata of a unary call: sent with a
        sequence's request (always unary), and with any request when ``trace_unary``;
        a stream's metadata is set once for all its requests, so a request on a
        stream cannot carry its own.
        """
        if self._closing:
            raise errors.TritonUnavailable("the worker is shutting down")
        model = (request.model_name, request.model_version)
        sticky = _sequence_of(request)
        if not (self.trace_unary or sticky is not None):
            trace = ()
        deadline = time.monotonic() + timeout_s
        tried: list[str] = []
        last: errors.WorkerError | None = None
        while (endpoint := self.endpoints.choose(model, avoid=tried, sticky=sticky)) is not None:
            tried.append(endpoint.address)
            if not await self._agrees(endpoint, model):
                continue
            endpoint.outstanding += 1
            self._observe(endpoint)
            outcome = "error"
            try:
                remaining_s = max(0.001, deadline - time.monotonic())
                response = await endpoint.pool.infer(request, remaining_s, trace)
                outcome = "ok"
                return response
            except errors.TritonUnavailable as exc:
                outcome, last = "unavailable", exc
                self._down(endpoint, exc)
                if self._closing or deadline - time.monotonic() <= 0:
                    raise
            finally:
                endpoint.outstanding -= 1
                self._observe(endpoint, outcome)
        raise last or errors.TritonUnavailable(f"no Triton endpoint can serve model {model[0]!r}")

    def infer_stream(self, request: service_pb2.ModelInferRequest) -> FailoverStream:
        """Send a decoupled model's request to the least-loaded endpoint (see ServerPool); if
        that endpoint is lost, to another (see worker.triton.failover)."""
        if self._closing:
            raise errors.TritonUnavailable("the worker is shutting down")
        return FailoverStream(self, request)

    def submit_stream(
        self, request: service_pb2.ModelInferRequest, avoid: list[str]
    ) -> tuple[ResponseStream, _Endpoint]:
        """See ``StreamEndpoints.submit_stream`` (worker.triton.failover)."""
        model = (request.model_name, request.model_version)
        last: errors.WorkerError | None = None
        while endpoint := self.endpoints.choose(
            model, avoid=avoid, sticky=_sequence_of(request), load=lambda e: e.pool.in_flight()
        ):
            avoid.append(endpoint.address)
            try:
                responses = endpoint.pool.infer_stream(request)
            except errors.TritonUnavailable as exc:
                last = exc
                self._down(endpoint, exc)
                continue
            endpoint.outstanding += 1
            self._observe(endpoint)
            return responses, endpoint
        raise last or errors.TritonUnavailable(f"no Triton endpoint can serve model {model[0]!r}")

    def stream_ended(
        self, endpoint: _Endpoint, model: _Model, outcome: str, error: errors.WorkerError | None
    ) -> bool:
        """See ``StreamEndpoints.stream_ended`` (worker.triton.failover)."""
        endpoint.outstanding -= 1
        if outcome == "unavailable" and error is not None:
            self._down(endpoint, error)
        if self.endpoints.endpoints.get(endpoint.address) is endpoint:  # not removed since
            self._observe(endpoint, outcome)
        return any(e.up and e.serves(model) for e in self.endpoints if e is not endpoint)

    # -- models ---------------------------------------------------------------------

    async def model_spec(self, name: str, version: str) -> ModelSpec:
        """The model's inputs, outputs and batching as the endpoints agree on them; cached.

        Asked of every up endpoint at once: the spec most of them report is the
        model's (ties: the first endpoint's), an endpoint reporting another is not
        used for the model. Endpoints that could not answer are compared before
        their first request of the model.
        """
        key = (name, version)
        if (spec := self._specs.get(key)) is not None:
            return spec
        async with self._lookups.hold(key):
            if (spec := self._specs.get(key)) is not None:
                return spec
            return await self._agree(key)

    async def _agree(self, key: _Model) -> ModelSpec:
        asked = [e for e in self.endpoints if e.up] or list(self.endpoints)
        answers = await asyncio.gather(
            *(e.pool.model_spec(*key) for e in asked), return_exceptions=True
        )
        pairs = zip(asked, answers, strict=True)
        specs = {e.address: a for e, a in pairs if isinstance(a, ModelSpec)}
        if not specs:
            for endpoint, answer in zip(asked, answers, strict=True):
                if isinstance(answer, errors.TritonUnavailable):
                    self._down(endpoint, answer)
            failures = [a for a in answers if isinstance(a, BaseException)]
            raise min(failures, key=lambda a: isinstance(a, errors.TritonUnavailable))
        votes = collections.Counter(specs.values())
        agreed = max(specs.values(), key=lambda s: votes[s])  # first of the most reported
        for endpoint in asked:
            if endpoint.address in specs:
                self._judge(endpoint, key, specs[endpoint.address], agreed)
        self._specs.put(key, agreed)
        return agreed

    def _judge(
        self, endpoint: _Endpoint, key: tuple[str, str], spec: ModelSpec, agreed: ModelSpec
    ) -> bool:
        endpoint.agrees.put(key, spec == agreed)
        if spec != agreed:
            log.error(
                "triton_endpoint_model_mismatch",
                endpoint=endpoint.address,
                model=key[0],
                version=key[1],
                detail="its model metadata or configuration differs from the other endpoints'; "
                "not used for this model",
            )
        return spec == agreed

    async def _agrees(self, endpoint: _Endpoint, key: tuple[str, str]) -> bool:
        """True when ``endpoint`` may serve ``key``: its spec matches the agreed one."""
        agreed = self._specs.get(key)
        if agreed is None or key in endpoint.agrees or len(self.endpoints) == 1:
            return endpoint.serves(key)
        try:
            spec = await endpoint.pool.model_spec(*key)
        except errors.TritonUnavailable as exc:
            self._down(endpoint, exc)
            return False
        except errors.WorkerError:
            return False  # not (yet) served there: try another endpoint
        return self._judge(endpoint, key, spec, agreed)

    def cached_spec(self, name: str, version: str) -> ModelSpec | None:
        """The model's spec if it is cached (ready earlier in this process), else None."""
        return self._specs.get((name, version))

    def has_spec(self, name: str, version: str) -> bool:
        """True when ``name`` at ``version`` was ready earlier in this process (spec cached)."""
        return (name, version) in self._specs

    def forget_model(self, name: str) -> None:
        """Drop what is cached about ``name``: after a reload its configuration may differ."""
        self._specs.discard_where(lambda key: key[0] == name)
        for endpoint in self.endpoints:
            endpoint.pool.forget_model(name)
            endpoint.agrees.discard_where(lambda key: key[0] == name)

    async def model_ready(self, name: str, version: str = "") -> bool:
        """True when some up endpoint says ``name`` (``version``) is ready to serve."""
        return await self._any(lambda p: p.model_ready(name, version))

    async def repository_listing(self, name: str, version: str) -> Listing:
        """What the up endpoints' repository indexes say of ``name`` at ``version``."""
        asked = [e.pool for e in self.endpoints if e.up] or [e.pool for e in self.endpoints]
        return merged(await asyncio.gather(*(p.repository_listing(name, version) for p in asked)))

    async def _any(self, ask: Callable[[ServerPool], Awaitable[bool]]) -> bool:
        asked = [e.pool for e in self.endpoints if e.up] or [e.pool for e in self.endpoints]
        return any(await asyncio.gather(*(ask(p) for p in asked)))

    # -- health ---------------------------------------------------------------------

    async def server_ready(self, timeout_s: float = 2.0) -> bool:
        """True when some endpoint answers ``ServerReady`` within the timeout."""
        if not self._started:
            return False
        pools = [e.pool for e in self.endpoints]
        return any(await asyncio.gather(*(p.server_ready(timeout_s) for p in pools)))

    async def server_live(self, timeout_s: float = 2.0) -> bool:
        """Probe every endpoint (``ServerLive``, see ServerPool); True when one is live. Each
        answer moves its endpoint in or out of rotation (the worker-wide breaker opens only
        when none is live)."""
        if not self._started:
            return False
        endpoints = list(self.endpoints)
        answers = await asyncio.gather(*(e.pool.server_live(timeout_s) for e in endpoints))
        for endpoint, live in zip(endpoints, answers, strict=True):
            if live and endpoint.mark_up():
                endpoint.pool.wake()  # re-open its broken streams now
            elif not live:
                endpoint.mark_down("not live")
            self._observe(endpoint)
        return any(answers)

    def in_flight(self) -> int:
        """Requests still owed a response, over every endpoint."""
        return sum(e.pool.in_flight() for e in self.endpoints)

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        """Drain every endpoint (bounded), end its streams, close its channel. Idempotent."""
        if self._closing:
            return
        self._closing = True
        for task in list(self._tasks):
            if task.get_name() == "triton-resolve":
                task.cancel()
        await asyncio.gather(*(e.pool.close(drain_timeout_s) for e in self.endpoints))
        await asyncio.gather(*self._tasks, return_exceptions=True)
