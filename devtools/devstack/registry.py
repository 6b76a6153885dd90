"""A real Schema Registry as a local process: Apicurio Registry, Confluent's API at
``/apis/ccompat/v7``.

No Confluent Schema Registry is published to the registries this project reaches, but
Apicurio Registry serves the same API and builds from Maven Central into one runnable jar
(the Maven project ``schema-registry/`` beside this file). The jar is built once into the
devstack cache and reused by later runs. Its schemas are kept in a file (an H2 database
under the server's work folder), so that a restart keeps them, as a production registry
(Confluent's stores them in a Kafka topic) does.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devtools.devstack.kafka import java_binary
from devtools.devstack.paths import cache_dir
from devtools.devstack.process import ManagedProcess, StartupError, free_port

_PROJECT = Path(__file__).resolve().parent / "schema-registry"
#: Where the Confluent-compatible API is served.
CCOMPAT_PATH = "/apis/ccompat/v7"
#: A small heap and the client compiler: ready in a few seconds, under 200 MB resident.
_JVM_FLAGS = ("-Xmx128m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")


def registry_version() -> str:
    """The Apicurio Registry release the Maven project builds (read from its pom)."""
    found = re.search(r"<apicurio.version>([^<]+)<", (_PROJECT / "pom.xml").read_text())
    assert found is not None, "schema-registry/pom.xml names no apicurio.version"
    return found.group(1)


def ensure_registry_jar(log: Callable[[str], None] = print) -> Path:
    """Build the registry's runnable jar with Maven into the cache (once); return it."""
    version = registry_version()
    jar = cache_dir() / f"schema-registry-{version}" / "registry-runner.jar"
    if jar.exists():
        return jar
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StartupError("mvn not found: Maven is needed once to build the Schema Registry")
    log(f"building Apicurio Registry {version} from Maven Central (once, about a minute)...")
    jar.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=jar.parent) as tmp:
        project = Path(tmp) / "project"
        shutil.copytree(_PROJECT, project)
        cmd = [mvn, "-B", "-q", "-f", str(project / "pom.xml"), "package", "-DskipTests"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        built = sorted((project / "target").glob("*-runner.jar"))
        if done.returncode != 0 or not built:
            raise StartupError(f"maven could not build the Schema Registry:\n{done.stdout[-3000:]}")
        # Moved into place only when complete, so an interrupted build is done again.
        built[0].rename(jar)
    return jar


@dataclass(frozen=True)
class RegistryTls:
    """HTTPS instead of HTTP: the server's certificate chain and key (PEM files)."""

    cert_file: Path
    key_file: Path


class SchemaRegistry:
    """One Apicurio Registry on 127.0.0.1 on a free port, its data under ``workdir``."""

    def __init__(
        self, jar: Path, workdir: Path, port: int = 0, tls: RegistryTls | None = None
    ) -> None:
        self.jar = jar
        self.workdir = workdir
        self.port = port or free_port()
        self.tls = tls
        self._proc = self._process()

    @property
    def url(self) -> str:
        """The base URL of the Confluent API, as clients (and the worker) are given it."""
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "registry.log"

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def _process(self) -> ManagedProcess:
        argv = [java_binary(), *_JVM_FLAGS, "-Dquarkus.http.host=127.0.0.1"]
        env = {
            **os.environ,
            # The port is honoured only through HTTP_PORT (the app's own property).
            "HTTP_PORT": str(self.port),
            "REGISTRY_DATASOURCE_URL": f"jdbc:h2:file:{self.workdir / 'data' / 'registry'}",
        }
        if self.tls is not None:
            argv += [
                f"-Dquarkus.http.ssl-port={self.port}",
                f"-Dquarkus.http.ssl.certificate.files={self.tls.cert_file}",
                f"-Dquarkus.http.ssl.certificate.key-files={self.tls.key_file}",
                "-Dquarkus.http.insecure-requests=disabled",
            ]
            env["HTTP_PORT"] = str(free_port())  # the plain port, refused but bound
        argv += ["-jar", str(self.jar)]
        return ManagedProcess("schema-registry", argv, self.log_path, env=env, cwd=self.workdir)

    def start(self, timeout_s: float = 90.0) -> float:
        """Start the server; wait until its Confluent API answers; return the seconds."""
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._proc.start()
        self._proc.wait_ready(self._answers, timeout_s)
        return time.monotonic() - started

    def _answers(self) -> bool:
        return self.get("/schemas/types") is not None

    def get(self, path: str) -> Any:
        """The JSON answer of ``GET <url><path>`` (None when the server does not answer)."""
        context = None
        if self.tls is not None:
            import ssl

            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE  # readiness only; clients verify
        try:
            with urllib.request.urlopen(self.url + path, timeout=2, context=context) as answer:
                return json.loads(answer.read())
        except (OSError, urllib.error.URLError, ValueError):
            return None

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``. Idempotent."""
        self._proc.stop(timeout_s)

    def kill(self) -> None:
        """SIGKILL at once (a crash, for fault tests)."""
        self._proc.kill()

    def restart(self, timeout_s: float = 90.0) -> float:
        """Stop, then start again on the same port with the same data."""
        self.stop()
        return self.start(timeout_s)

    def running(self) -> bool:
        return self._proc.running()

    # -- state for `dev up` / `dev down` ----------------------------------

    def to_state(self) -> dict[str, Any]:
        return {
            "jar": str(self.jar),
            "workdir": str(self.workdir),
            "port": self.port,
            "pid": self.pid,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SchemaRegistry:
        registry = cls(Path(state["jar"]), Path(state["workdir"]), state["port"])
        registry._proc.pid = state["pid"]
        return registry
