"""``/metrics``, ``/healthz``, ``/readyz`` and ``/debug/inflight`` over HTTP/1.1, asyncio alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import orjson
import prometheus_client
import structlog
from prometheus_client import CollectorRegistry

#: Answers whether the worker is ready, and what is (not) ready, e.g. {"triton": "down"}.
ReadinessCheck = Callable[[], tuple[bool, Mapping[str, object]]]
#: The records in flight as plain data, the ``limit`` oldest listed (InFlightRegistry.snapshot).
InFlightSnapshot = Callable[[int], Mapping[str, object]]

#: Records listed by ``/debug/inflight`` without a ``limit`` query parameter.
DEFAULT_INFLIGHT_LIMIT = 20

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class HealthServer:
    """``GET /metrics``, ``/healthz`` and ``/readyz`` over HTTP/1.1, one request per connection.

    ``/debug/inflight`` too when given a snapshot (JSON; ``?limit=N`` oldest records).

    Each connection gets ``read_timeout_s`` and ``max_request_bytes`` for its request
    head, so a slow or hostile client costs one small task and is then dropped.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        readiness: ReadinessCheck,
        *,
        host: str = "0.0.0.0",
        port: int,
        read_timeout_s: float = 5.0,
        max_request_bytes: int = 8192,
        inflight: InFlightSnapshot | None = None,
    ) -> None:
        """``inflight``: serves ``/debug/inflight`` when given (404 otherwise)."""
        self._registry = registry
        self._readiness = readiness
        self._inflight = inflight
        self._host = host
        self._requested_port = port
        self._read_timeout_s = read_timeout_s
        self._max_request_bytes = max_request_bytes
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._log = structlog.get_logger(__name__)

    @property
    def port(self) -> int:
        """The port listened on (the ephemeral one chosen when started with port 0)."""
        if self._server is None:
            raise RuntimeError("HealthServer is not started")
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Listen; returns once the socket is bound."""
        if self._server is not None:
            return
        self._server = await asyncio.start_server(
            self._serve, self._host, self._requested_port, limit=self._max_request_bytes
        )

    async def stop(self) -> None:
        """Stop listening and drop open connections; safe to call more than once."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        # Aborting a transport ends its handler's read with EOF. Cancelling the handler
        # task instead would make asyncio report it as an unhandled error.
        for writer in self._connections.values():
            writer.transport.abort()
        await asyncio.gather(*self._connections, return_exceptions=True)
        await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._server is None or task is None:  # accepted just before stop()
            writer.transport.abort()
            return
        self._connections[task] = writer
        try:
            status, content_type, body, head_only = await self._respond(reader)
            head = (
                f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode("latin-1")
            writer.write(head if head_only else head + body)
            async with asyncio.timeout(self._read_timeout_s):
                await writer.drain()
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass  # the client went away or stalled; nothing to tell it
        except Exception:
            self._log.exception("health_request_failed")
        finally:
            await self._close(writer)
            del self._connections[task]

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        # A client that stops reading must not keep the connection (and its task) alive.
        writer.close()
        try:
            async with asyncio.timeout(self._read_timeout_s):
                await writer.wait_closed()
        except (ConnectionError, TimeoutError):
            writer.transport.abort()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes, bool]:
        text = "text/plain; charset=utf-8"
        try:
            async with asyncio.timeout(self._read_timeout_s):
                request_head = await reader.readuntil(b"\r\n\r\n")
        except TimeoutError:
            return 408, text, b"request timeout\n", False
        except asyncio.LimitOverrunError:
            return 431, text, b"request too large\n", False
        parts = request_head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            return 400, text, b"bad request\n", False
        target, _, query = parts[1].partition(b"?")
        method = parts[0]
        if method not in (b"GET", b"HEAD"):
            return 405, text, b"method not allowed\n", False
        head_only = method == b"HEAD"
        if target == b"/healthz":
            return 200, text, b"ok", head_only
        if target == b"/readyz":
            return (*self._ready(), head_only)
        if target == b"/metrics":
            try:
                metrics = prometheus_client.generate_latest(self._registry)
            except Exception:
                self._log.exception("metrics_render_failed")
                return 500, text, b"metrics unavailable\n", head_only
            return 200, prometheus_client.CONTENT_TYPE_LATEST, metrics, head_only
        if target == b"/debug/inflight" and self._inflight is not None:
            return (*self._inflight_answer(query), head_only)
        return 404, text, b"not found\n", head_only

    def _inflight_answer(self, query: bytes) -> tuple[int, str, bytes]:
        assert self._inflight is not None
        text = "text/plain; charset=utf-8"
        limit = DEFAULT_INFLIGHT_LIMIT
        for pair in query.split(b"&"):
            name, _, value = pair.partition(b"=")
            if name == b"limit":
                if not value.isdigit() or int(value) < 1:
                    return 400, text, b"limit must be a whole number >= 1\n"
                limit = int(value) if len(value) <= 6 else 10**6  # the snapshot caps it
        try:
            snapshot = self._inflight(limit)
        except Exception:
            self._log.exception("inflight_snapshot_failed")
            return 500, text, b"in-flight snapshot unavailable\n"
        return 200, "application/json", orjson.dumps(snapshot, default=str) + b"\n"

    def _ready(self) -> tuple[int, str, bytes]:
        try:
            ready, detail = self._readiness()
        except Exception as exc:
            self._log.exception("readiness_check_failed")
            ready, detail = False, {"error": f"readiness check failed: {type(exc).__name__}"}
        body = orjson.dumps({"ready": ready, "detail": dict(detail)}, default=str) + b"\n"
        return (200 if ready else 503), "application/json", body
