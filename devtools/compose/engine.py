"""A Docker engine for the compose test: the one that answers, or a dockerd of its own.

When no engine answers at ``DOCKER_HOST`` (or the default socket), ``dockerd`` is
started on a socket, run folder and data folder of its own, so that it never touches a
system Docker's containers, and is stopped again by its pid. Its pid file is kept
where the next run finds it: an engine left behind by an interrupted run is taken over
(and stopped at the end) when it answers, or killed when it does not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from devtools.devstack.process import StartupError, pid_alive

#: The default socket of a system Docker engine.
DEFAULT_HOST = "unix:///var/run/docker.sock"
#: Run state of the engine this module starts: socket, pid file, containerd's sockets.
#: Short and fixed (Unix socket paths are limited to 107 bytes; the next run looks here).
RUN_DIR = Path("/run/kafka-triton-worker-test")
#: Images, containers and volumes of that engine, apart from a system Docker's.
DATA_DIR = Path("/var/lib/kafka-triton-worker-test/docker")
#: Open-files limit of its containers: dockerd's default is above the hard limit of
#: some machines, where containers then fail to start.
NOFILE_LIMIT = "20000:20000"


def answers(host: str, timeout_s: float = 3.0) -> bool:
    """True when a Docker engine answers ``/_ping`` at ``host`` (``unix://`` only)."""
    if not host.startswith("unix://"):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(host.removeprefix("unix://"))
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            return b" 200 " in sock.recv(256)
    except OSError:
        return False


@dataclass
class Engine:
    """A Docker engine to talk to; ``pid`` is set when this process must stop it.

    ``process`` is the dockerd this process started (None for one taken over): kept so
    that it is waited for, not left a zombie.
    """

    host: str
    pid: int | None = None
    process: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        """The environment for ``docker`` and ``docker-compose``, pointed at this engine."""
        return {**os.environ, "DOCKER_HOST": self.host}

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop the engine if it is ours (SIGTERM, then SIGKILL); idempotent."""
        if self.pid is None:
            return
        _terminate(self.pid, timeout_s)
        if self.process is not None:
            self.process.wait(timeout=10)
            self.process = None
        self.pid = None
        _remove_run_files()


def _own_host() -> str:
    return f"unix://{RUN_DIR / 'docker.sock'}"


def _pidfile() -> Path:
    return RUN_DIR / "dockerd.pid"


def _recorded_pid() -> int | None:
    try:
        pid = int(_pidfile().read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) and _is_dockerd(pid) else None


def _is_dockerd(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == "dockerd"
    except OSError:
        return False


def _terminate(pid: int, timeout_s: float) -> None:
    """SIGTERM (dockerd stops its containerd), SIGKILL after ``timeout_s``."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not pid_alive(pid):
                return
            time.sleep(0.2)
    raise RuntimeError(f"dockerd (pid {pid}) did not exit")


def _remove_run_files() -> None:
    for name in ("docker.sock", "dockerd.pid"):
        (RUN_DIR / name).unlink(missing_ok=True)


def _wait_answering(host: str, pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if answers(host):
            return True
        if not pid_alive(pid):
            return False
        time.sleep(0.2)
    return False


def _start_dockerd(log_path: Path, timeout_s: float) -> Engine:
    dockerd = shutil.which("dockerd")
    if dockerd is None:
        raise StartupError("dockerd not found: install Debian's docker.io (make compose-test does)")
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    argv = [dockerd, "--host", _own_host(), "--pidfile", str(_pidfile())]
    argv += ["--exec-root", str(RUN_DIR / "exec"), "--data-root", str(DATA_DIR)]
    argv += ["--default-ulimit", f"nofile={NOFILE_LIMIT}"]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        # A session of its own: a Ctrl-C meant for the tests must not reach the engine
        # before the containers are down; it is stopped by its pid instead.
        process = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
    if not _wait_answering(_own_host(), process.pid, timeout_s):
        _terminate(process.pid, 30.0)
        process.wait(timeout=10)
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-20:])
        raise StartupError(f"dockerd did not answer within {timeout_s:.0f} s:\n{tail}")
    return Engine(_own_host(), process.pid, process)


@contextlib.contextmanager
def exclusive(timeout_s: float = 900.0) -> Iterator[None]:
    """Hold the machine's compose-test lock: two runs would share one engine and project.

    A second run (another clone on the same machine) waits for the first to finish.
    """
    RUN_DIR.mkdir(parents=True, exist_ok=True)
    with (RUN_DIR.parent / f"{RUN_DIR.name}.lock").open("w") as lock:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise StartupError("another compose test holds the lock") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def ensure_engine(log_path: Path, log: Callable[[str], None] = print) -> Engine:
    """An engine that answers: the configured one, a leftover of ours, or a new dockerd."""
    configured = os.environ.get("DOCKER_HOST")
    if configured and configured != _own_host():
        if not answers(configured):
            raise StartupError(f"DOCKER_HOST={configured} does not answer")
        return Engine(configured)
    if not configured and answers(DEFAULT_HOST):
        return Engine(DEFAULT_HOST)
    leftover = _recorded_pid()
    if leftover is not None:
        if _wait_answering(_own_host(), leftover, 30.0):
            log(f"taking over the dockerd (pid {leftover}) an interrupted run left")
            return Engine(_own_host(), leftover)
        log(f"stopping the dockerd (pid {leftover}) an interrupted run left: it does not answer")
        _terminate(leftover, 30.0)
    _remove_run_files()
    started = time.monotonic()
    engine = _start_dockerd(log_path, timeout_s=60.0)
    log(f"dockerd started (pid {engine.pid}) in {time.monotonic() - started:.1f}s")
    return engine
