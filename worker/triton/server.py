"""The streams to one Triton server: ``ModelStreamInfer`` calls, id correlation, deadlines.

Each stream is the bidirectional gRPC call that
``tritonclient.grpc.aio.InferenceServerClient.stream_infer`` opens. The worker
feeds it ready-made ``ModelInferRequest`` messages (the codec builds them
straight from the Kafka value) instead of dicts of ``InferInput``, which would
force a numpy copy of every tensor.

``TritonPool`` (worker/triton/pool.py) spreads the worker's requests over one
``ServerPool`` per Triton endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
import zlib
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]
import structlog
from tritonclient.grpc import InferenceServerException, service_pb2
from tritonclient.grpc.aio import InferenceServerClient

from worker import errors
from worker.flow.holds import Listing
from worker.flow.retry import Backoff
from worker.triton import errors as triton_errors
from worker.triton import repository
from worker.triton._compat import channel_args, grpc_stub
from worker.triton.auth import TritonAuth
from worker.triton.cache import MAX_CACHED_MODELS, BoundedCache, KeyedLocks
from worker.triton.decoupled import ENABLE_EMPTY_FINAL, ResponseStream
from worker.triton.shm import ShmPool
from worker.triton.stream import Stream
from worker.wire.validation import ModelSpec

__all__ = ["ServerPool", "answers_true"]

log = structlog.get_logger(__name__)

#: Waits before re-opening a broken stream, so a down server is not hammered.
_REOPEN = Backoff(first_s=0.1, max_s=5.0)
#: How long a negative model lookup (unknown model) is remembered.
_NEGATIVE_CACHE_S = 5.0
#: A stream whose oldest request waits longer than this is avoided for new requests.
_STUCK_AFTER_S = 0.25
#: How long one read of the repository index answers for (a burst of failures asks once).
_INDEX_CACHE_S = 1.0
#: W3C trace context (traceparent, tracestate) as gRPC metadata of a unary call.
Trace = tuple[tuple[str, str], ...]
_Model = tuple[str, str]  # (name, version)


class ServerPool:
    """``streams`` concurrent inference streams to one Triton server, re-opened when they break."""

    def __init__(
        self,
        url: str,
        streams: int,
        *,
        client_kwargs: Mapping[str, Any] | None = None,
        auth: TritonAuth | None = None,
        shm_min_bytes: int | None = None,
        shm_pool_bytes: int = 0,
        extra_channel_args: tuple[tuple[str, Any], ...] = (),
        on_cache_evict: Callable[[], None] | None = None,
    ) -> None:
        """``shm_min_bytes`` set: inputs that large go through system shared memory.

        ``extra_channel_args`` are added to the channel's options (a TLS name override
        when ``url`` is an address the server's certificate does not name).
        ``on_cache_evict`` is told of each model lookup dropped to keep the caches bounded.
        """
        self.url = url
        self._extra_channel_args = extra_channel_args
        self._client_kwargs = dict(client_kwargs or {})
        self._auth = auth
        self._size = streams
        self._client: InferenceServerClient | None = None
        self._streams: list[Stream] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._ids = itertools.count(1)
        # Keyed by names and versions taken from records: bounded (see worker.triton.cache).
        self._specs: BoundedCache[_Model, ModelSpec] = BoundedCache(
            MAX_CACHED_MODELS, on_evict=on_cache_evict
        )
        #: Models Triton does not know (or refused for good): the error's class and text.
        self._refused: BoundedCache[_Model, tuple[type[errors.WorkerError], str]] = BoundedCache(
            MAX_CACHED_MODELS, ttl_s=_NEGATIVE_CACHE_S, on_evict=on_cache_evict
        )
        self._lookups: KeyedLocks[_Model] = KeyedLocks()
        self._closing = False
        self._reopen_failures = 0
        self._wake = asyncio.Event()
        self._shm_min_bytes = shm_min_bytes
        self._shm_pool_bytes = shm_pool_bytes
        self.shm: ShmPool | None = None
        self._index: tuple[float, repository.Index] | None = None
        self._index_lock = asyncio.Lock()

    async def start(self) -> None:
        """Create the channel and open the streams (no server round trip needed)."""
        self._client = InferenceServerClient(
            self.url,
            channel_args=[*channel_args(), *self._extra_channel_args],
            **self._client_kwargs,
        )
        if self._shm_min_bytes is not None:
            self.shm = ShmPool(
                self._client,
                min_bytes=self._shm_min_bytes,
                pool_bytes=self._shm_pool_bytes,
                headers=self._headers,
            )
        for index in range(self._size):
            self._open(index)

    def _open(self, index: int) -> None:
        assert self._client is not None
        stream = Stream(grpc_stub(self._client), index, self._headers())
        task = asyncio.get_running_loop().create_task(
            self._supervise(stream), name=f"triton-stream-{index}"
        )
        if index < len(self._streams):
            self._streams[index], self._tasks[index] = stream, task
        else:
            self._streams.append(stream)
            self._tasks.append(task)

    async def _supervise(self, stream: Stream) -> None:
        await stream.run()
        if self._closing:
            return
        log.warning("triton_stream_broken", stream=stream.index, error=str(stream.broken))
        if self.shm is not None:
            self.shm.invalidate()  # a restarted Triton has forgotten the regions
        # Back off before re-opening, so a down server is not hammered; the other
        # streams keep serving meanwhile.
        with contextlib.suppress(TimeoutError):
            self._reopen_failures += 1
            await asyncio.wait_for(self._wake.wait(), _REOPEN.delay_s(self._reopen_failures))
        if not self._closing:
            self._open(stream.index)

    def wake(self) -> None:
        """Re-open broken streams now (Triton is back), not after their backoff."""
        self._reopen_failures = 0
        self._wake.set()
        self._wake = asyncio.Event()

    def _headers(self) -> dict[str, str]:
        """Per-call gRPC metadata (authentication), read afresh for each call or stream."""
        return dict(self._auth.headers()) if self._auth is not None else {}

    def _pick(self, request: service_pb2.ModelInferRequest, decoupled: bool = False) -> Stream:
        """The least-loaded live stream of its group, avoiding streams stuck behind a slow
        request.

        Triton answers a stream in request order, so a request queued behind a
        slow one waits for it; streams whose oldest request is older than
        ``_STUCK_AFTER_S`` are used only when every stream is. Decoupled requests
        have streams of their own (see ``infer_stream``); one of a sequence
        (``sequence_id``) goes on the stream its id names while that one is live,
        so one sequence's requests all travel on one stream.
        """
        group = self._streams[self._size :] if decoupled else self._streams[: self._size]
        if decoupled and "sequence_id" in request.parameters:
            named = request.parameters["sequence_id"].SerializeToString()
            pinned = group[zlib.crc32(named) % len(group)]
            if pinned.broken is None:
                return pinned
        live = [s for s in group if s.broken is None] or group
        now = time.monotonic()
        return min(live, key=lambda s: (s.oldest_age_s(now) > _STUCK_AFTER_S, s.load()))

    async def infer(
        self, request: service_pb2.ModelInferRequest, timeout_s: float, trace: Trace = ()
    ) -> service_pb2.ModelInferResponse:
        """Send one request on the least-loaded stream; its response, or a WorkerError.

        The request's ``id`` is replaced by a correlation id unique to this pool. A
        request of a sequence (``sequence_id``) goes as a unary call instead: Triton
        answers a stream's requests to ordinary models in order, and one waiting for a
        free sequence slot would hold back every response behind it, including those
        of the sequences that would free the slot.
        """
        if self._closing:
            raise errors.TritonUnavailable("the worker is shutting down")
        if trace or (len(request.parameters) and "sequence_id" in request.parameters):
            return await self._infer_unary(request, timeout_s, trace)  # trace: gRPC metadata
        stream = self._pick(request)
        if stream.broken is not None:
            raise stream.broken
        correlation = str(next(self._ids))
        request.id = correlation
        lease = None
        if self.shm is not None:
            request, lease = await self.shm.place(request)
        future = stream.submit(request)
        answered = False
        try:
            response = await asyncio.wait_for(future, timeout_s)
            answered = True
        except TimeoutError:
            stream.forget(correlation)
            raise errors.TritonTimeout(
                f"no response from Triton within {timeout_s * 1000:.0f} ms"
            ) from None
        except asyncio.CancelledError:
            stream.forget(correlation)
            raise
        except errors.WorkerError:
            answered = stream.broken is None  # an error response: Triton is done with it
            raise
        finally:
            if lease is not None:
                assert self.shm is not None
                self.shm.release(lease, reusable=answered)
        self._reopen_failures = 0
        return response

    async def _infer_unary(
        self, request: service_pb2.ModelInferRequest, timeout_s: float, trace: Trace = ()
    ) -> service_pb2.ModelInferResponse:
        assert self._client is not None
        call = grpc_stub(self._client).ModelInfer
        metadata = (*self._headers().items(), *trace)
        try:
            response: service_pb2.ModelInferResponse = await call(
                request, timeout=timeout_s, metadata=metadata or None
            )
        except grpc.aio.AioRpcError as exc:
            raise triton_errors.from_grpc(exc.code(), exc.details() or "") from None
        self._reopen_failures = 0
        return response

    def infer_stream(self, request: service_pb2.ModelInferRequest) -> ResponseStream:
        """Send a decoupled model's request; read its responses from the returned
        ResponseStream (and close it when done with them).

        Decoupled requests travel on streams of their own, as many as the ordinary
        ones, opened with the first of them: tritonserver 2.51 aborts (a gRPC
        assertion, ``!byte_buffer->Valid()``) when one stream carries decoupled and
        ordinary requests under load, while streams of either kind alone held.
        The ``id`` is replaced by a correlation id, and the request asks Triton to
        mark its last response (``triton_enable_empty_final_response``). Tensors go
        as gRPC bytes, never through shared memory: a region would be held for the
        whole stream.
        """
        if self._closing:
            raise errors.TritonUnavailable("the worker is shutting down")
        if len(self._streams) == self._size:
            for index in range(self._size, 2 * self._size):
                self._open(index)
        stream = self._pick(request, decoupled=True)
        if stream.broken is not None:
            raise stream.broken
        request.id = str(next(self._ids))
        request.parameters[ENABLE_EMPTY_FINAL].bool_param = True
        return stream.submit_stream(request)

    async def model_spec(self, name: str, version: str) -> ModelSpec:
        """The model's inputs, outputs and batching, fetched once and cached (an unknown
        model's refusal for a few seconds); lookups of one model take turns."""
        key = (name, version)
        if (spec := self._cached(key)) is not None:
            return spec
        async with self._lookups.hold(key):
            if (spec := self._cached(key)) is not None:
                return spec  # looked up by the task before this one
            return await self._lookup(key)

    def _cached(self, key: _Model) -> ModelSpec | None:
        """The cached spec; raises the cached refusal; None when nothing is cached."""
        spec = self._specs.get(key)
        if spec is None and (refused := self._refused.get(key)) is not None:
            raise refused[0](refused[1])  # a fresh error: see _lookup
        return spec

    async def _lookup(self, key: _Model) -> ModelSpec:
        try:
            spec = await self._fetch_spec(*key)
        except errors.WorkerError as exc:
            if not exc.retryable:
                # Its class and text only: the error itself holds the frames that raised it.
                self._refused.put(key, (type(exc), exc.message))
            raise
        self._specs.put(key, spec)
        return spec

    def has_spec(self, name: str, version: str) -> bool:
        """True when ``name`` at ``version`` was ready earlier in this process (spec cached)."""
        return (name, version) in self._specs

    def forget_model(self, name: str) -> None:
        """Drop what is cached about ``name``: after a reload its configuration may differ."""
        self._specs.discard_where(lambda key: key[0] == name)
        self._refused.discard_where(lambda key: key[0] == name)

    async def model_ready(self, name: str, version: str = "") -> bool:
        """True when Triton says ``name`` (``version``) is ready to serve."""
        if self._client is None:
            return False
        return await answers_true(
            self._client.is_model_ready(name, version, headers=self._headers()), 2.0
        )

    async def repository_listing(self, name: str, version: str) -> Listing:
        """What Triton's repository index says of ``name`` at ``version`` ("": any; see
        ``worker.triton.repository``). Read at most once a second; unreadable, it lists
        nothing."""
        async with self._index_lock:
            now = time.monotonic()
            if self._index is None or now - self._index[0] > _INDEX_CACHE_S:
                self._index = (now, await self._read_index())
            index = self._index[1]
        return repository.listing(index, name, version)

    async def _read_index(self) -> repository.Index:
        """Every model version the index lists in a servable state, with its state."""
        if self._client is None:
            return {}
        try:
            index = await asyncio.wait_for(
                self._client.get_model_repository_index(headers=self._headers()), 2.0
            )
        except (TimeoutError, InferenceServerException, grpc.aio.AioRpcError):
            return {}
        return repository.read_index(index.models)

    async def _fetch_spec(self, name: str, version: str) -> ModelSpec:
        assert self._client is not None
        try:
            headers = self._headers()
            metadata = await self._client.get_model_metadata(name, version, headers=headers)
            config = await self._client.get_model_config(name, version, headers=headers)
        except InferenceServerException as exc:
            raise triton_errors.from_client_error(exc, f"model {name!r}") from None
        return ModelSpec.from_triton(metadata, config)

    async def server_ready(self, timeout_s: float = 2.0) -> bool:
        """True when Triton answers ``ServerReady`` within the timeout.

        With strict readiness (Triton's default) that means every model is ready too.
        """
        if self._client is None:
            return False
        return await answers_true(self._client.is_server_ready(headers=self._headers()), timeout_s)

    async def server_live(self, timeout_s: float = 2.0) -> bool:
        """True when Triton answers ``ServerLive`` within the timeout: up, started, not exiting.

        This, not ``server_ready``, tells whether Triton can serve: with strict readiness
        Triton is not ready while any one model is loading, unloading or failed to load,
        and one model's rollout must not count as an outage of all of them (its own
        records are held by the ModelGate meanwhile).
        """
        if self._client is None:
            return False
        return await answers_true(self._client.is_server_live(headers=self._headers()), timeout_s)

    def in_flight(self) -> int:
        """Requests still owed a response on this server's streams."""
        return sum(s.load() for s in self._streams)

    async def close(self, drain_timeout_s: float = 10.0) -> None:
        """Drain every stream (bounded), end them, close the channel. Idempotent."""
        if self._closing:
            return
        self._closing = True
        await asyncio.gather(*(s.close(drain_timeout_s) for s in self._streams))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*self._tasks, return_exceptions=True), drain_timeout_s
            )
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.shm is not None:
            await self.shm.close()
        if self._client is not None:
            await self._client.close()


async def answers_true(call: Awaitable[Any], timeout_s: float) -> bool:
    """True when the health call answers true in time; False on any error or timeout."""
    try:
        return bool(await asyncio.wait_for(call, timeout_s))
    except (TimeoutError, InferenceServerException, grpc.aio.AioRpcError):
        return False
