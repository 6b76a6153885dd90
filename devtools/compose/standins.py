"""Local stand-ins for the registry images of docker-compose.yml, built without a registry.

A Debian bookworm base comes from ``mmdebstrap`` (Debian's mirror, the one the host's
apt uses); each stand-in is built from its Containerfile in ``deploy/compose-test/``.
What the builds would otherwise download from inside a container is prepared on the
host, where the package registries are reachable: wheels (for the worker and for
Triton), Kafka's jars and the Schema Registry's jar. Docker's layer cache makes a second
build of an unchanged stand-in take seconds; the base is made once and kept until its
image is removed.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from devtools.devstack.paths import PROJECT_ROOT, cache_dir, state_home
from devtools.devstack.registry import ensure_registry_jar
from devtools.devstack.triton import TRITON_REQUIREMENTS

STANDINS_DIR = PROJECT_ROOT / "deploy" / "compose-test"
OVERRIDE_FILE = STANDINS_DIR / "docker-compose.test.yml"
IMAGE_PREFIX = "localhost/kafka-triton-worker-test"
BASE_IMAGE = f"{IMAGE_PREFIX}/debian:bookworm"
DEBIAN_SUITE = "bookworm"
#: The stand-in Python's minor version: the wheels are fetched for it.
STANDIN_PYTHON = "3.11"

Log = Callable[[str], None]


@dataclass(frozen=True)
class StandIn:
    """One stand-in image: its folder under deploy/compose-test and its tag."""

    name: str
    tag: str

    @property
    def image(self) -> str:
        return f"{IMAGE_PREFIX}/{self.name}:{self.tag}"


#: Tags name what each stands in for (the official images' versions where they match).
STANDINS = (
    StandIn("python", "3.11-bookworm"),
    StandIn("kafka", "4.1.1"),
    StandIn("triton", "2.51"),
    StandIn("prometheus", "2.42"),
    StandIn("schema-registry", "2.4.2.Final"),
)


def _run(argv: list[str], env: Mapping[str, str], what: str) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = "\n".join((done.stdout + done.stderr).splitlines()[-30:])
        raise RuntimeError(f"{what} failed ({' '.join(argv[:3])} ...):\n{output}")


def image_exists(image: str, env: Mapping[str, str]) -> bool:
    """True when the engine has ``image``."""
    argv = ["docker", "image", "inspect", "--format", "{{.Id}}", image]
    return subprocess.run(argv, env=env, capture_output=True, check=False).returncode == 0


def debian_sources(apt_dir: Path = Path("/etc/apt")) -> list[str]:
    """One-line ``deb`` entries of the host's Debian mirror for bookworm and its updates.

    Read from the host's apt configuration (one-line and deb822 files), keeping the
    suites of ``DEBIAN_SUITE`` only: other repositories the host may list stay out.
    """
    entries: list[str] = []
    for path in sorted([apt_dir / "sources.list", *apt_dir.glob("sources.list.d/*")]):
        if path.suffix == ".sources":
            entries += _deb822_entries(path.read_text())
        elif path.name == "sources.list" or path.suffix == ".list":
            entries += _one_line_entries(path.read_text() if path.exists() else "")
    found = [e for e in dict.fromkeys(entries) if e.split()[2].startswith(DEBIAN_SUITE)]
    if not found:
        raise RuntimeError(f"no Debian {DEBIAN_SUITE} source in the host's apt configuration")
    return found


def _one_line_entries(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        words = [w for w in line.split("#", 1)[0].split() if not w.startswith("[")]
        if len(words) >= 4 and words[0] == "deb" and "main" in words[3:]:
            out.append(f"deb {words[1]} {words[2]} main")
    return out


def _deb822_entries(text: str) -> list[str]:
    out = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            key, sep, value = line.partition(":")
            if sep and not line.startswith((" ", "#")):
                fields[key.strip().lower()] = value.strip()
        if "deb" in fields.get("types", "").split() and "main" in fields.get("components", ""):
            for uri in fields.get("uris", "").split():
                out += [f"deb {uri} {suite} main" for suite in fields.get("suites", "").split()]
    return out


def build_base(env: Mapping[str, str], log: Log) -> None:
    """The Debian base image, from ``mmdebstrap`` (once: kept while the image exists)."""
    if image_exists(BASE_IMAGE, env):
        return
    log(f"building {BASE_IMAGE} with mmdebstrap")
    with tempfile.TemporaryDirectory(dir=_work_dir()) as tmp:
        rootfs = Path(tmp) / "rootfs.tar"
        # Retries: a slow or flaky mirror is retried, not a failed run.
        argv = ["mmdebstrap", "--variant=minbase", "--mode=root", "--quiet"]
        argv += ['--aptopt=Acquire::Retries "5"']
        argv += [DEBIAN_SUITE, str(rootfs), *debian_sources()]
        _run(argv, env, "mmdebstrap")
        _run(["docker", "import", str(rootfs), BASE_IMAGE], env, "docker import")


def _work_dir() -> Path:
    path = state_home() / "compose-test"
    path.mkdir(parents=True, exist_ok=True)
    return path


def worker_requirements() -> list[str]:
    """What the image installs: the worker's dependencies and the extras the Dockerfile's
    ``pip install ".[...]"`` names, plus the build backend of ``pyproject.toml`` (pip
    builds the worker in the image)."""
    project = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    build = project["build-system"]["requires"]
    named = re.search(r'"\.\[([\w,]+)\]"', (PROJECT_ROOT / "Dockerfile").read_text())
    assert named is not None, "the Dockerfile installs no extras"
    wanted = [r for name in named.group(1).split(",") for r in extras[name]]
    return [*project["project"]["dependencies"], *wanted, *build]


def _download_wheels(requirements: list[str], dest: Path, *, constrained: bool) -> None:
    """Binary wheels for the stand-ins' CPython, fetched on the host (cached by inputs).

    The worker's are resolved with its dependencies under constraints.txt; Triton's are
    exactly the two pinned wheels (their numpy<2 is not the worker's numpy).
    """
    if (dest / ".complete").exists():
        return
    shutil.rmtree(dest, ignore_errors=True)
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    argv = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check"]
    argv += ["--only-binary=:all:", "--python-version", STANDIN_PYTHON, "--implementation", "cp"]
    argv += ["-d", str(partial)]
    argv += ["-c", str(PROJECT_ROOT / "constraints.txt")] if constrained else ["--no-deps"]
    _run([*argv, *requirements], dict(os.environ), "pip download")
    (partial / ".complete").touch()
    partial.rename(dest)


def _inputs_key(*parts: str) -> str:
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]


def worker_wheels() -> Path:
    """The wheelhouse of the Python stand-in: everything the worker's image installs."""
    requirements = worker_requirements()
    constraints = (PROJECT_ROOT / "constraints.txt").read_text()
    dest = cache_dir() / "compose-test" / f"wheels-{_inputs_key(constraints, *requirements)}"
    _download_wheels(requirements, dest, constrained=True)
    return dest


def triton_wheels() -> Path:
    """The Triton stand-in's wheels: nvidia-pytriton (tritonserver) and numpy<2."""
    dest = cache_dir() / "compose-test" / f"triton-wheels-{_inputs_key(*TRITON_REQUIREMENTS)}"
    _download_wheels(list(TRITON_REQUIREMENTS), dest, constrained=False)
    return dest


def kafka_jars() -> Path:
    """The Kafka stand-in's jars, resolved by Maven from its pom.xml (once)."""
    pom = STANDINS_DIR / "kafka" / "pom.xml"
    dest = cache_dir() / "compose-test" / f"kafka-jars-{_inputs_key(pom.read_text())}"
    if dest.exists():
        return dest
    mvn = shutil.which("mvn")
    if mvn is None:
        raise RuntimeError("mvn not found: Maven resolves the Kafka stand-in's jars")
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    argv = [mvn, "-B", "-q", "-f", str(pom)]
    argv += ["org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy-dependencies"]
    argv += ["-DincludeScope=runtime", f"-DoutputDirectory={partial}"]
    _run(argv, dict(os.environ), "maven")
    partial.rename(dest)
    return dest


def registry_jar() -> Path:
    """The folder of the Schema Registry's runnable jar, the one the local stack runs
    (built by Maven once, ``devtools.devstack.registry``)."""
    return ensure_registry_jar(log=lambda _: None).parent


def _stage(standin: StandIn, extras: Mapping[str, Path]) -> Path:
    """The build context: the stand-in's folder plus the host-made inputs it copies."""
    context = _work_dir() / "contexts" / standin.name
    shutil.rmtree(context, ignore_errors=True)
    shutil.copytree(STANDINS_DIR / standin.name, context)
    for name, source in extras.items():
        # Hard links where possible: the wheelhouse is large and never changed in place.
        shutil.copytree(source, context / name, copy_function=_link_or_copy)
    return context


def _link_or_copy(source: str, dest: str) -> None:
    try:
        Path(dest).hardlink_to(source)
    except OSError:
        shutil.copy2(source, dest)


def build_standin(standin: StandIn, extras: Mapping[str, Path], env: Mapping[str, str]) -> None:
    """``docker build`` of one stand-in on the Debian base."""
    context = _stage(standin, extras)
    argv = ["docker", "build", "--quiet", "--build-arg", f"BASE_IMAGE={BASE_IMAGE}"]
    argv += ["-t", standin.image, "-f", str(context / "Containerfile"), str(context)]
    _run(argv, env, f"building {standin.image}")


def build_standins(
    env: Mapping[str, str],
    log: Log = print,
    then: Mapping[str, Callable[[], None]] | None = None,
) -> None:
    """Every stand-in image, host inputs and the base prepared side by side.

    ``then`` maps a stand-in's name to work that needs only that image (the worker's
    image on the Python stand-in), started as soon as it is built, beside the others.
    """
    hooks = dict(then or {})
    with ThreadPoolExecutor(max_workers=4) as pool:
        base = pool.submit(build_base, env, log)
        inputs = {
            "python": {"wheels": pool.submit(worker_wheels)},
            "kafka": {"jars": pool.submit(kafka_jars)},
            "triton": {"wheels": pool.submit(triton_wheels)},
            "prometheus": {},
            "schema-registry": {"jar": pool.submit(registry_jar)},
        }
        base.result()

        def build(standin: StandIn) -> None:
            extras = {name: future.result() for name, future in inputs[standin.name].items()}
            build_standin(standin, extras, env)
            if standin.name in hooks:
                hooks[standin.name]()

        for done in [pool.submit(build, standin) for standin in STANDINS]:
            done.result()
