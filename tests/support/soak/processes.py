"""The processes the soak drives: worker processes (their exits and memory), Triton's models."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from devtools.devstack.process import tail
from tests.support import rss_bytes
from tests.support.soak.outcomes import Tripwire
from tests.support.worker import env_without_settings


class WorkerProcess:
    """``python -m worker run`` as a child process; an exit nobody asked for trips the soak."""

    def __init__(self, name: str, env: Mapping[str, str], log_path: Path, port: int) -> None:
        self.name, self.log_path, self.port = name, log_path, port
        self._env = env
        self.expected_exit: int | None = None  # set just before a signal is sent
        self.returncode: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._exited: asyncio.Task[int] | None = None
        self.warm = False
        self.rss_baseline: int | None = None
        self.rss_peak = 0

    async def start(self, tripwire: Tripwire) -> None:
        full_env = env_without_settings()
        full_env.update(self._env)
        with self.log_path.open("wb") as log:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "worker",
                "run",
                env=full_env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )
        self._exited = asyncio.create_task(self._proc.wait())

        def on_exit(task: asyncio.Task[int]) -> None:
            if task.cancelled():
                return
            self.returncode = task.result()
            if self.expected_exit is None:
                tripwire.trip(
                    f"worker {self.name} exited with {self.returncode} by itself; "
                    f"last lines of its log:\n{tail(self.log_path, 40)}"
                )

        self._exited.add_done_callback(on_exit)

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def signal(self, signum: signal.Signals) -> None:
        """Send a signal the schedule chose; the exit it should cause is then expected."""
        assert self._proc is not None
        self.expected_exit = -signal.SIGKILL if signum == signal.SIGKILL else 0
        self._proc.send_signal(signum)

    async def wait(self) -> int:
        assert self._exited is not None
        return await asyncio.shield(self._exited)

    async def ready(self) -> dict[str, Any] | None:
        """The /readyz body when the worker answers 200, else None."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return None
        try:
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
            await writer.drain()
            response = await asyncio.wait_for(reader.read(), 5)
        except (OSError, TimeoutError):
            return None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        head, _, body = response.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return None
        doc: dict[str, Any] = json.loads(body)
        return doc

    def inflight(self, limit: int = 12) -> str:
        """The worker's ``/debug/inflight`` (its oldest records and where each one is), or
        why it could not be read: what a stall's failure message shows."""
        url = f"http://127.0.0.1:{self.port}/debug/inflight?limit={limit}"
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                return str(response.read().decode(errors="replace"))
        except OSError as exc:
            return f"/debug/inflight of {self.name} not read: {exc}"

    async def wait_fully_ready(self) -> None:
        """Until /readyz is 200 and no model is held (polled: another process's state)."""
        while True:
            doc = await self.ready()
            if doc is not None and "models_not_ready" not in doc.get("detail", {}):
                return
            await asyncio.sleep(0.1)  # polling another process's endpoint: nothing to await

    async def reap(self) -> None:
        """Clean-up: SIGKILL a worker still running when the soak ends early, and reap it."""
        if self._proc is None or self._exited is None:
            return
        if self._proc.returncode is None:
            self.expected_exit = -signal.SIGKILL
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(self._exited), 30)

    def sample_rss(self) -> None:
        """Note the process's resident memory now, once it is warm (the first note is its
        baseline)."""
        if not self.warm or self._proc is None or self._proc.returncode is not None:
            return
        with contextlib.suppress(OSError, AssertionError):  # it may exit meanwhile
            rss = rss_bytes(self._proc.pid)
            if self.rss_baseline is None:
                self.rss_baseline = rss
            self.rss_peak = max(self.rss_peak, rss)

    def mark_warm(self) -> None:
        """The worker has served its first records: its memory from now on is its growth."""
        self.warm = True

    @property
    def rss_growth(self) -> int | None:
        """Peak resident memory over the baseline, once both are known."""
        if self.rss_baseline is None:
            return None
        return self.rss_peak - self.rss_baseline


def triton_model_call(http_address: str, model: str, action: str) -> None:
    """POST /v2/repository/models/NAME/{load,unload} (Triton runs with explicit control)."""
    request = urllib.request.Request(
        f"http://{http_address}/v2/repository/models/{model}/{action}",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200, f"{action} {model}: HTTP {response.status}"


def triton_model_ready(http_address: str, model: str) -> bool:
    try:
        url = f"http://{http_address}/v2/models/{model}/ready"
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False
