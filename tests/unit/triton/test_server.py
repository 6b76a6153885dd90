"""Triton health as the worker's probe sees it: live, not strictly ready.

The client is a ``spec_set`` fake: a real Triton cannot be made to answer "live but
not ready" on demand for a unit test (the integration tests unload a real model).
"""

from __future__ import annotations

import asyncio
from typing import Any
from unittest import mock

from tritonclient.grpc import InferenceServerException
from tritonclient.grpc.aio import InferenceServerClient

from worker.triton.server import ServerPool


def _pool(*, live: Any, ready: Any = False) -> ServerPool:
    client = mock.create_autospec(InferenceServerClient, instance=True, spec_set=True)
    client.is_server_live.side_effect = live if callable(live) else (lambda **_: live)
    client.is_server_ready.side_effect = ready if callable(ready) else (lambda **_: ready)
    pool = ServerPool("triton:8001", streams=1)
    pool._client = client  # the pool's channel, replaced without opening streams
    return pool


async def test_live_while_a_model_loads_is_healthy() -> None:
    """Strict readiness says no while one model (un)loads; liveness, the probe's question, yes."""
    pool = _pool(live=True, ready=False)

    assert await pool.server_live() is True
    assert await pool.server_ready() is False


async def test_exiting_server_is_not_live() -> None:
    """A Triton shutting down answers ServerLive with an error: not healthy."""

    def exiting(**_: Any) -> bool:
        raise InferenceServerException("Server exiting", status="StatusCode.UNAVAILABLE")

    assert await _pool(live=exiting).server_live() is False


async def test_starting_server_is_not_live() -> None:
    """A Triton still initialising (loading its models at start) answers live = false."""
    assert await _pool(live=False, ready=False).server_live() is False


async def test_unanswered_liveness_times_out_as_not_live() -> None:
    """A Triton that never answers is not live once the probe's timeout passes."""
    never = asyncio.Event()

    async def hangs(**_: Any) -> bool:
        await never.wait()
        return True

    assert await _pool(live=hangs).server_live(timeout_s=0.05) is False


async def test_pool_not_started_is_not_live() -> None:
    """Before start() there is no channel: not live, and no error."""
    assert await ServerPool("triton:8001", streams=1).server_live() is False
