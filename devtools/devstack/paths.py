"""Where the local stack keeps its caches and its running state."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from devtools.devstack.process import pid_alive

#: Project root: the folder holding ``pyproject.toml`` and ``models/``.
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def state_home() -> Path:
    """The project-local folder (ignored by git) for caches and run state.

    ``DEVSTACK_DIR`` moves it, for example to share caches between clones.
    """
    override = os.environ.get("DEVSTACK_DIR")
    return Path(override).resolve() if override else PROJECT_ROOT / ".devstack"


def cache_dir() -> Path:
    """Downloaded artifacts that later runs reuse (Kafka jars, the Triton wheel)."""
    return state_home() / "cache"


def run_dir() -> Path:
    """State of a stack started by ``dev up`` (pids, addresses, logs)."""
    return state_home() / "run"


def models_dir() -> Path:
    """The Triton model repository shipped with the project."""
    return PROJECT_ROOT / "models"


def remove_stale_partials(root: Path) -> None:
    """Drop half-built installs of ``root`` (``.NAME.partial-PID`` beside it) left by
    processes that no longer run."""
    for partial in root.parent.glob(f".{root.name}.partial-*"):
        pid = partial.name.rsplit("-", 1)[1]
        if not (pid.isdigit() and pid_alive(int(pid))):
            shutil.rmtree(partial, ignore_errors=True)
