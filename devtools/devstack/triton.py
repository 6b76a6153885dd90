"""A local Triton Inference Server (CPU, Python backend) for development and tests.

The server comes from the ``nvidia-pytriton`` wheel, which ships a complete
``tritonserver`` binary, the Python backend and its stubs. It is installed once
into the devstack cache, in an environment of its own: its ``numpy<2`` must not
constrain the worker's environment.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from devtools.devstack.paths import cache_dir, remove_stale_partials
from devtools.devstack.process import ManagedProcess, StartupError, free_port, pid_alive, tail

TRITON_VERSION = "2.51"
#: The wheel carrying tritonserver 2.51, and the numpy the models import (cp311 wheel exists).
TRITON_REQUIREMENTS = ("nvidia-pytriton==0.7.0", "numpy==1.26.4")
#: Environment variable naming the site directory the models put first on ``sys.path``.
SITE_PACKAGES_ENV = "TRITON_MODEL_SITE_PACKAGES"

TRITON_DIED_HINT = (
    "Triton died. Triton 2.51 can crash (SIGSEGV in TRITONSERVER_InferenceRequestDelete) "
    "when a client ends a stream_infer request iterator while requests are still in "
    "flight: keep a stream open until all its responses have arrived."
)

_WHEEL_SERVER = Path("pytriton/tritonserver")
_BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
_STUB = "triton_python_backend_stub"
_SHM_PREFIX = "triton_python_backend_shm_region_"


@dataclass(frozen=True)
class ModelPython:
    """The CPython that runs the models (the Python backend's stub links its libpython)."""

    executable: str
    version: str  # "3.11"
    libdir: str  # where its libpython3.X.so.1.0 is

    @property
    def tag(self) -> str:
        return "cp" + self.version.replace(".", "")


#: CPython versions with a numpy<2 wheel, newest first: the models' interpreter is one of them.
MODEL_PYTHON_VERSIONS = ("3.12", "3.11")


def model_python() -> ModelPython:
    """The interpreter for the models: this one if numpy<2 exists for it, else one beside it.

    The stub needs numpy<2 (pitfall 3), whose last wheels are for CPython 3.12. A
    worker running on a newer Python (3.13) serves its Triton models with a 3.12 or
    3.11 found on PATH or in pyenv; the worker itself never imports that numpy.
    """
    current = _python_version()
    if current in MODEL_PYTHON_VERSIONS:
        return ModelPython(sys.executable, current, str(sysconfig.get_config_var("LIBDIR")))
    for candidate in _model_python_candidates():
        found = _probe_python(candidate)
        if found is not None and found.version in MODEL_PYTHON_VERSIONS:
            return found
    raise RuntimeError(
        f"Triton's Python backend needs CPython {' or '.join(MODEL_PYTHON_VERSIONS)} beside "
        f"Python {current} (numpy<2 has no wheel for {current}); install one, for example "
        "with 'pyenv install 3.12'"
    )


def _model_python_candidates() -> list[str]:
    found = []
    for version in MODEL_PYTHON_VERSIONS:
        on_path = shutil.which(f"python{version}")
        if on_path:
            found.append(on_path)
        pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
        found += sorted(str(p) for p in pyenv_root.glob(f"versions/{version}*/bin/python{version}"))
    return found


def _probe_python(executable: str) -> ModelPython | None:
    """Version and LIBDIR of ``executable``, or None if it does not run (a bare pyenv shim)."""
    code = (
        "import sys, sysconfig; print('%d.%d' % sys.version_info[:2]); "
        "print(sysconfig.get_config_var('LIBDIR'))"
    )
    try:
        done = subprocess.run(
            [executable, "-c", code], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    if done.returncode != 0 or len(lines) != 2:
        return None
    return ModelPython(executable, lines[0], lines[1])


@dataclass(frozen=True)
class TritonInstall:
    """Paths of one installed tritonserver and the Python backend prepared for it."""

    site_dir: Path
    server_binary: Path
    backend_dir: Path
    libs_dir: Path
    python_libdir: Path  # the models' interpreter's libpython folder

    @classmethod
    def at(cls, root: Path, python_libdir: str | Path) -> TritonInstall:
        """The layout of an install rooted at ``root`` (``site/`` and ``backends/``)."""
        site = root / "site"
        return cls(
            site_dir=site,
            server_binary=site / _WHEEL_SERVER / "bin" / "tritonserver",
            backend_dir=root / "backends",
            libs_dir=site / "nvidia_pytriton.libs",
            python_libdir=Path(python_libdir),
        )

    def complete(self) -> bool:
        """True when every part of the install is in place."""
        python = self.backend_dir / "python"
        parts = [self.server_binary, self.libs_dir, self.site_dir / "numpy", python / _STUB]
        parts += [python / name for name in _BACKEND_FILES]
        return all(part.exists() for part in parts)


def _python_version() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def install_root(python: ModelPython) -> Path:
    """Where the install for the models' interpreter lives (numpy's wheel is per CPython)."""
    return cache_dir() / f"triton-{TRITON_VERSION}" / python.tag


def prepare_backend_dir(site_dir: Path, backend_dir: Path, python_version: str) -> None:
    """Fill ``backend_dir/python/`` with the backend library, its utils and the stub.

    Symlinks, not copies: the stub finds ``nvidia_pytriton.libs`` through an
    RPATH relative to its real location, which a copy would break. Relative
    links, so the install can be renamed into place after it is built.
    """
    server = site_dir / _WHEEL_SERVER
    sources = {name: server / "backends" / "python" / name for name in _BACKEND_FILES}
    sources[_STUB] = server / "python_backend_stubs" / python_version / _STUB
    target = backend_dir / "python"
    target.mkdir(parents=True, exist_ok=True)
    for name, source in sources.items():
        if not source.exists():
            raise RuntimeError(f"the Triton wheel has no {source.relative_to(site_dir)}")
        link = target / name
        link.unlink(missing_ok=True)
        link.symlink_to(os.path.relpath(source, target))


def _pip_install(site_dir: Path, python: ModelPython) -> None:
    # This interpreter's pip, fetching wheels for the models' one.
    argv = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--target"]
    argv += [str(site_dir), "--only-binary=:all:", "--disable-pip-version-check"]
    argv += ["--python-version", python.version, "--implementation", "cp"]
    argv += TRITON_REQUIREMENTS
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise RuntimeError(f"installing Triton failed ({' '.join(argv[1:])}):\n{output}")


def ensure_triton(log: Callable[[str], None] = print) -> TritonInstall:
    """Install tritonserver and numpy<2 into the devstack cache once; reuse it afterwards.

    The install is built in a temporary folder and renamed into place, so an
    interrupted install is never mistaken for a finished one.
    """
    python = model_python()
    root = install_root(python)
    install = TritonInstall.at(root, python.libdir)
    if install.complete():
        return install
    if root.exists() and not install.complete():  # damaged by hand: renames are atomic
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(root)
    partial = root.with_name(f".{root.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    log(f"installing Triton {TRITON_VERSION} ({', '.join(TRITON_REQUIREMENTS)}) into {root}")
    started = time.monotonic()
    try:
        _pip_install(partial / "site", python)
        prepare_backend_dir(partial / "site", partial / "backends", python.version)
        try:
            partial.rename(root)
        except OSError:
            if not install.complete():  # not a concurrent installer winning the race
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    if not install.complete():
        raise RuntimeError(f"Triton install at {root} is incomplete after installing")
    log(f"Triton installed in {time.monotonic() - started:.1f}s")
    return install


def triton_env(install: TritonInstall, base_env: Mapping[str, str]) -> dict[str, str]:
    """The environment for the tritonserver process (and the stubs it starts).

    - The models' interpreter's libpython directory comes first on
      ``LD_LIBRARY_PATH``: otherwise the stub may load the system's libpython
      while the standard library comes from that interpreter's install.
    - ``nvidia_pytriton.libs`` follows, for the libraries the binaries link.
    - ``TRITON_MODEL_SITE_PACKAGES`` names the site directory with numpy<2: the
      stub ignores ``PYTHONPATH``, so the models put it on ``sys.path`` themselves.
    - The models' numpy runs one BLAS thread (``OPENBLAS_NUM_THREADS``, unless given):
      OpenBLAS starts a thread per core that spins on ``sched_yield`` between calls, and
      the rows of a micro-batch are far too few to share. On two cores the ``mlp`` stub
      took 70-80 µs of CPU per row that way, more than the worker beside it; 4-5 µs so.
    """
    env = dict(base_env)
    libdir = str(install.python_libdir)
    existing = [part for part in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if part]
    env["LD_LIBRARY_PATH"] = os.pathsep.join([libdir, str(install.libs_dir), *existing])
    env[SITE_PACKAGES_ENV] = str(install.site_dir)
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env


#: Starts tried on freshly picked ports when a picked one was taken meanwhile.
PORT_TRIES = 3


def _port_taken(error: StartupError) -> bool:
    """The server exited because a port it was given is in use."""
    return "already in use" in str(error)


@dataclass(frozen=True)
class TritonPorts:
    """The three ports one server listens on, all on 127.0.0.1."""

    grpc: int
    http: int
    metrics: int

    @classmethod
    def pick(cls) -> TritonPorts:
        """Three distinct ports that are free right now."""
        ports: list[int] = []
        while len(ports) < 3:
            port = free_port()
            if port not in ports:
                ports.append(port)
        return cls(*ports)


def server_argv(
    install: TritonInstall,
    model_repository: Path,
    ports: TritonPorts,
    models: Sequence[str] | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The tritonserver command line.

    Explicit model control always, so tests can load and unload models later;
    ``models=None`` loads every model in the repository at start-up.
    """
    argv = [
        str(install.server_binary),
        f"--model-repository={model_repository}",
        f"--backend-directory={install.backend_dir}",
        "--model-control-mode=explicit",
        f"--grpc-port={ports.grpc}",
        f"--http-port={ports.http}",
        f"--metrics-port={ports.metrics}",
        "--grpc-address=127.0.0.1",
        "--http-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--log-verbose=0",
        "--exit-timeout-secs=5",
    ]
    argv += (
        [f"--load-model={name}" for name in models] if models is not None else ["--load-model=*"]
    )
    return [*argv, *extra_args]


class TritonServer:
    """One local tritonserver process, started, restarted and stopped on fixed ports."""

    def __init__(
        self,
        install: TritonInstall,
        model_repository: Path,
        workdir: Path,
        models: Sequence[str] | None = None,
        extra_args: Sequence[str] = (),
        *,
        ports: TritonPorts | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        """Prepare a server; ``env`` replaces ``triton_env(install, os.environ)``."""
        self.install = install
        self.model_repository = Path(model_repository)
        self.workdir = Path(workdir)
        self.models = tuple(models) if models is not None else None
        self.extra_args = tuple(extra_args)
        #: Ports picked here are picked again if one is taken by the time the server starts
        #: (servers prepared together pick theirs before any of them listens).
        self._picked_ports = ports is None
        self.ports = ports if ports is not None else TritonPorts.pick()
        self._proc = ManagedProcess(
            name="tritonserver",
            argv=self._argv(),
            log_path=self.log_path,
            env=dict(env) if env is not None else triton_env(install, os.environ),
            cwd=self.workdir,
        )
        # Set while the server should be up: a stop on request is not a death.
        self._expected_up = False
        self._exit_note: str | None = None
        # Noted while up, removed after stop or kill: a crashed server cannot tell.
        self._shm_regions: set[str] = set()

    @property
    def grpc_address(self) -> str:
        """``host:port`` of the gRPC endpoint."""
        return f"127.0.0.1:{self.ports.grpc}"

    @property
    def http_address(self) -> str:
        """``host:port`` of the HTTP endpoint."""
        return f"127.0.0.1:{self.ports.http}"

    @property
    def metrics_address(self) -> str:
        """``host:port`` of the Prometheus metrics endpoint."""
        return f"127.0.0.1:{self.ports.metrics}"

    @property
    def log_path(self) -> Path:
        """The server's log (appended to across restarts)."""
        return self.workdir / "tritonserver.log"

    @property
    def pid(self) -> int | None:
        """Process id of the server, once started."""
        return self._proc.pid

    def _ready(self) -> bool:
        url = f"http://{self.http_address}/v2/health/ready"
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return bool(response.status == 200)

    def _argv(self) -> list[str]:
        return server_argv(
            self.install, self.model_repository, self.ports, self.models, self.extra_args
        )

    def start(self, timeout_s: float = 120.0) -> float:
        """Start the server and wait until it and its models are ready; return seconds taken.

        A port picked here and taken meanwhile (the server exits: "already in use") is
        picked again, up to ``PORT_TRIES`` times. On failure the process is stopped and
        StartupError carries the log tail.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(1, PORT_TRIES + 1):
            self._exit_note = None
            self._expected_up = True
            self._proc.start()
            try:
                seconds = self._proc.wait_ready(self._ready, timeout_s, interval_s=0.1)
            except StartupError as exc:
                self.stop(timeout_s=5.0)
                if not (self._picked_ports and attempt < PORT_TRIES and _port_taken(exc)):
                    raise
                self.ports = TritonPorts.pick()
                self._proc.argv = self._argv()
                continue
            self._shm_regions.update(_stub_shm_regions(self.pid))
            return seconds
        raise AssertionError("unreachable")  # pragma: no cover

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM the server and its stubs, SIGKILL after ``timeout_s``. Idempotent."""
        if self.running():  # models loaded since start have regions of their own
            self._shm_regions.update(_stub_shm_regions(self.pid))
        self._expected_up = False
        self._proc.stop(timeout_s)
        self._remove_shm()

    def kill(self) -> None:
        """SIGKILL the server and its stubs at once (a crash, for fault tests)."""
        if self.running():
            self._shm_regions.update(_stub_shm_regions(self.pid))
        self._exit_note = "killed with SIGKILL on request"
        self._proc.kill()
        self._remove_shm()

    def _remove_shm(self) -> None:
        for region in self._shm_regions:
            with contextlib.suppress(OSError):
                (Path("/dev/shm") / region).unlink(missing_ok=True)
        self._shm_regions.clear()

    def restart(self, timeout_s: float = 120.0) -> float:
        """Stop, then start again on the same ports so clients reconnect; return seconds."""
        self.stop()
        return self.start(timeout_s)

    def running(self) -> bool:
        """True while the server process is alive."""
        return self._proc.running()

    def death_report(self) -> str | None:
        """Why the server is gone, with its log tail, if it died; None while up or stopped."""
        if not self._expected_up or self.running():
            return None
        return (
            f"tritonserver (pid {self.pid}) is not running: {self._exit_status()}.\n"
            f"{TRITON_DIED_HINT}\nLast lines of {self.log_path}:\n{tail(self.log_path, 40)}"
        )

    def _exit_status(self) -> str:
        if self._exit_note is not None:
            return self._exit_note
        # ManagedProcess keeps the Popen of a process it started; its return code
        # tells a crash (negative: a signal) from an exit.
        popen = self._proc._popen
        code = popen.returncode if popen is not None else None
        if code is None:
            return "exit status unknown"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def to_state(self) -> dict[str, Any]:
        """JSON-ready description, so another process can find and stop this server."""
        return {
            "pid": self.pid,
            "ports": asdict(self.ports),
            "install": {key: str(value) for key, value in asdict(self.install).items()},
            "model_repository": str(self.model_repository),
            "workdir": str(self.workdir),
            "models": list(self.models) if self.models is not None else None,
            "extra_args": list(self.extra_args),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> TritonServer:
        """The server described by ``to_state()``; a restart uses the default environment."""
        paths = {key: Path(value) for key, value in state["install"].items()}
        # State written before the models' interpreter was recorded: it was this one's.
        paths.setdefault("python_libdir", Path(str(sysconfig.get_config_var("LIBDIR"))))
        install = TritonInstall(**paths)
        server = cls(
            install,
            Path(state["model_repository"]),
            Path(state["workdir"]),
            models=state["models"],
            extra_args=state["extra_args"],
            ports=TritonPorts(**state["ports"]),
        )
        pid = state.get("pid")
        if isinstance(pid, int) and _is_tritonserver(pid):
            server._proc.pid = pid
            server._expected_up = True
        return server


def _stub_shm_regions(pgid: int | None) -> list[str]:
    """Shared-memory regions of the stubs in a process group, named on their command lines.

    A killed server leaves them in /dev/shm (1 MiB or more each); repeated crash
    tests would fill it, so stop() and kill() remove them once the process is gone.
    """
    regions: list[str] = []
    for proc in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[2]) == pgid:
                args = (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")
                regions += [arg for arg in args if arg.startswith(_SHM_PREFIX)]
    return regions


def _is_tritonserver(pid: int) -> bool:
    """True when ``pid`` is alive and is a tritonserver (not a reused pid)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return pid_alive(pid) and b"tritonserver" in cmdline.split(b"\0", 1)[0]
