"""System shared memory for large input tensors (``WORKER_TRITON_SHM=system``).

When Triton runs on the same host, a large tensor need not travel through
gRPC: it is copied once into a POSIX shared-memory region that Triton has
mapped, and the request names the region instead of carrying the bytes.

Regions are created on demand (a power of two at least the tensor's size),
registered with Triton once, and reused: a region is leased to one request
and returned to the free list when its response has arrived. A region whose
request timed out or was cancelled may still be read by Triton, so it is
never reused; it is retired and released at ``close``. The regions together
never exceed ``pool_bytes``; a tensor that finds no room goes through gRPC
as usual.

If Triton cannot map a region (it runs on another host), shared memory is
switched off with one warning and every tensor goes through gRPC. If Triton
restarts, its registrations are gone: ``invalidate`` (called when a stream
breaks) makes each region register again before its next use.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
from tritonclient.grpc import InferenceServerException, service_pb2
from tritonclient.grpc.aio import InferenceServerClient
from tritonclient.utils import shared_memory

__all__ = ["Lease", "ShmPool"]

log = structlog.get_logger(__name__)

_MIN_REGION_BYTES = 1 << 20
_ids = itertools.count(1)


@dataclass(eq=False, slots=True)
class _Region:
    name: str
    key: str
    byte_size: int
    handle: Any
    registered: bool = False


@dataclass(eq=False, slots=True)
class Lease:
    """The regions one request holds until its response arrives."""

    regions: list[_Region] = field(default_factory=list)


class ShmPool:
    """A pool of registered system shared-memory regions for input tensors."""

    def __init__(
        self,
        client: InferenceServerClient,
        *,
        min_bytes: int,
        pool_bytes: int,
        headers: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        """Tensors of ``min_bytes`` or more use regions totalling at most ``pool_bytes``."""
        self._client = client
        self._min_bytes = min_bytes
        self._pool_bytes = pool_bytes
        self._headers = headers
        self._free: list[_Region] = []
        self._all: list[_Region] = []
        self._allocated_bytes = 0
        self.enabled = True
        self.tensors_sent = 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes of every region created so far (in use, free or retired)."""
        return self._allocated_bytes

    async def place(
        self, request: service_pb2.ModelInferRequest
    ) -> tuple[service_pb2.ModelInferRequest, Lease | None]:
        """The request to send: large inputs moved into regions, and the lease to release.

        ``request`` itself is left unchanged (a retry may send it again); when
        no input qualifies, it is returned as is with no lease.
        """
        raws = request.raw_input_contents
        if not self.enabled or len(raws) != len(request.inputs):
            return request, None
        large = [i for i, raw in enumerate(raws) if len(raw) >= self._min_bytes]
        if not large:
            return request, None
        lease = Lease()
        placed: dict[int, _Region] = {}
        for index in large:
            region = await self._acquire(len(raws[index]))
            if region is None:
                continue
            shared_memory.set_shared_memory_region(
                region.handle, [np.frombuffer(raws[index], dtype=np.uint8)]
            )
            lease.regions.append(region)
            placed[index] = region
        if not placed:
            return request, None
        sent = service_pb2.ModelInferRequest()
        sent.CopyFrom(request)
        del sent.raw_input_contents[:]
        for index, raw in enumerate(raws):
            region = placed.get(index)
            if region is None:
                sent.raw_input_contents.append(raw)
                continue
            params = sent.inputs[index].parameters
            params["shared_memory_region"].string_param = region.name
            params["shared_memory_byte_size"].int64_param = len(raw)
        self.tensors_sent += len(placed)
        return sent, lease

    def release(self, lease: Lease, *, reusable: bool) -> None:
        """Return the lease's regions; ``reusable`` False when Triton may still read them."""
        if reusable:
            self._free.extend(lease.regions)
        lease.regions.clear()

    def invalidate(self) -> None:
        """Triton may have restarted: register every region again before its next use."""
        for region in self._all:
            region.registered = False

    async def _acquire(self, nbytes: int) -> _Region | None:
        fitting = [r for r in self._free if r.byte_size >= nbytes]
        if fitting:
            region = min(fitting, key=lambda r: r.byte_size)
            self._free.remove(region)
        else:
            size = max(_MIN_REGION_BYTES, 1 << (nbytes - 1).bit_length())
            if self._allocated_bytes + size > self._pool_bytes:
                return None
            region = self._create(size)
        if not region.registered and not await self._register(region):
            return None
        return region

    def _create(self, byte_size: int) -> _Region:
        number = next(_ids)
        name = f"kafka-triton-worker-{os.getpid()}-{number}"
        key = f"/ktw-{os.getpid()}-{number}"
        handle = shared_memory.create_shared_memory_region(name, key, byte_size)
        region = _Region(name, key, byte_size, handle)
        self._all.append(region)
        self._allocated_bytes += byte_size
        return region

    async def _register(self, region: _Region) -> bool:
        headers = dict(self._headers()) or None
        try:
            try:
                await self._client.register_system_shared_memory(
                    region.name, region.key, region.byte_size, headers=headers
                )
            except InferenceServerException as exc:
                if "already" not in (exc.message() or ""):
                    raise
                # Still registered from before a stream broke: register afresh.
                await self._client.unregister_system_shared_memory(region.name, headers=headers)
                await self._client.register_system_shared_memory(
                    region.name, region.key, region.byte_size, headers=headers
                )
        except InferenceServerException as exc:
            log.warning("triton_shm_disabled", error=exc.message())
            self.enabled = False
            return False
        region.registered = True
        return True

    async def close(self) -> None:
        """Unregister every region from Triton and destroy it. Idempotent."""
        regions, self._all, self._free = self._all, [], []
        headers = dict(self._headers()) or None
        for region in regions:
            if region.registered:
                try:
                    await self._client.unregister_system_shared_memory(region.name, headers=headers)
                except InferenceServerException as exc:
                    log.warning("triton_shm_unregister_failed", region=region.name, error=str(exc))
            shared_memory.destroy_shared_memory_region(region.handle)
        self._allocated_bytes = 0
