"""The quixstreams peer's virtualenv: built in the devstack cache on first use, then reused.

quixstreams 3.28.1 pins ``confluent-kafka<2.13`` while the project runs 2.16.1, so the
peer (``quix_app.py``) runs in an environment of its own, every package pinned in
``quix-requirements.txt`` and installed without resolving (``--no-deps``). As the Triton
install does, it is built in a temporary folder and renamed into place, so an
interrupted install is never mistaken for a finished one.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from devtools.devstack.paths import cache_dir, remove_stale_partials

__all__ = ["APP", "QUIX_VERSION", "REQUIREMENTS", "ensure_quix", "quix_python"]

QUIX_VERSION = "3.28.1"
#: Every package of the peer's virtualenv, pinned.
REQUIREMENTS = Path(__file__).with_name("quix-requirements.txt")
#: The peer itself, run by the virtualenv's interpreter (it imports nothing of the project).
APP = Path(__file__).with_name("quix_app.py")
#: Written last into a finished virtualenv.
_DONE = "installed"


def _root() -> Path:
    """Where the virtualenv lives: per quixstreams version, pins and CPython (wheels are)."""
    pins = hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()[:10]
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    return cache_dir() / f"quixstreams-{QUIX_VERSION}" / f"{tag}-{pins}"


def quix_python() -> Path:
    """The virtualenv's interpreter (``ensure_quix`` builds it when missing)."""
    return _root() / "bin" / "python"


def ensure_quix(log: Callable[[str], None] = print) -> Path:
    """Create the peer's virtualenv once (about 30 s: the pinned wheels); its interpreter."""
    root = _root()
    if (root / _DONE).exists():
        return quix_python()
    if root.exists():  # damaged by hand: renames are atomic
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(root)
    partial = root.with_name(f".{root.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    log(f"installing quixstreams {QUIX_VERSION} into a virtualenv of its own, {root}")
    started = time.monotonic()
    try:
        # The virtualenv's interpreter finds its pyvenv.cfg beside its own path, so the
        # folder still works once renamed (its pip's scripts would not; they are not used).
        _run([sys.executable, "-m", "venv", str(partial)], "creating the virtualenv")
        _run(
            [
                str(partial / "bin" / "python"), "-m", "pip", "install", "--no-deps",
                "--no-input", "--only-binary=:all:", "--disable-pip-version-check",
                "-r", str(REQUIREMENTS),
            ],
            "installing quixstreams",
        )  # fmt: skip
        (partial / _DONE).write_text(f"quixstreams {QUIX_VERSION}\n")
        try:
            partial.rename(root)
        except OSError:
            if not (root / _DONE).exists():  # not a concurrent installer winning the race
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    log(f"quixstreams installed in {time.monotonic() - started:.1f}s")
    return quix_python()


def _run(argv: list[str], what: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        output = "\n".join((done.stdout + done.stderr).splitlines()[-20:])
        raise RuntimeError(f"{what} failed ({' '.join(argv)}):\n{output}")
