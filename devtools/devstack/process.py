"""Start, watch and stop one local server process (Kafka node, Triton server)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class StartupError(RuntimeError):
    """A local server did not become ready; the message carries the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, or a note that it is empty."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:]) or f"(empty log at {path})"


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] == "Z":
            return False
    return True


def terminate_group(pid: int, timeout_s: float = 15.0) -> None:
    """SIGTERM the process group led by ``pid``; SIGKILL it if still alive after the timeout."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    while pid_alive(pid):
        time.sleep(0.02)


def stop_all(processes: Sequence[ManagedProcess], timeout_s: float = 20.0) -> None:
    """SIGTERM every process at once, then SIGKILL what is left after the timeout.

    Nodes of a cluster must be signalled together: stopped one by one, the last
    ones lose their quorum and wait out their whole shutdown timeout.
    """
    live = [p for p in processes if p.pid is not None and p.running()]
    for proc in live:
        assert proc.pid is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in live:
        assert proc.pid is not None
        terminate_group(proc.pid, max(0.0, deadline - time.monotonic()))
        proc._reap()


@dataclass
class ManagedProcess:
    """One server process in its own session, its output in ``log_path``.

    Started in a new session so that ``dev up`` can leave it running after the
    command exits, and so that stop/kill reach the whole process group.
    """

    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    _popen: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)
    pid: int | None = field(default=None, init=False)

    def start(self) -> None:
        """Launch the process; returns at once (readiness is the caller's concern)."""
        if self.running():
            return
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._popen = subprocess.Popen(
                list(self.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(self.env) if self.env is not None else None,
                cwd=self.cwd,
                start_new_session=True,
            )
        self.pid = self._popen.pid

    def running(self) -> bool:
        """True while the process is alive."""
        if self._popen is not None:
            return self._popen.poll() is None
        return self.pid is not None and pid_alive(self.pid)

    def wait_ready(
        self, probe: Callable[[], bool], timeout_s: float, interval_s: float = 0.25
    ) -> float:
        """Call ``probe`` until it returns True; return seconds waited.

        Raises StartupError with the log tail if the process dies or the
        timeout passes first.
        """
        started = time.monotonic()
        while True:
            if not self.running():
                raise StartupError(f"{self.name} exited during start-up:\n{tail(self.log_path)}")
            with contextlib.suppress(Exception):
                if probe():
                    return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise StartupError(
                    f"{self.name} not ready after {timeout_s:.0f}s:\n{tail(self.log_path)}"
                )
            time.sleep(interval_s)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``. Idempotent."""
        if self.pid is not None:
            terminate_group(self.pid, timeout_s)
        self._reap()

    def kill(self) -> None:
        """SIGKILL at once (a crash, for fault tests)."""
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        self._reap()

    def _reap(self) -> None:
        if self._popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._popen.wait(timeout=10)
            self._popen = None
