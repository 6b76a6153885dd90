"""`python -m devtools dev up|status|down` starts a stack that outlives it and stops it fully."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.devstack.paths import PROJECT_ROOT, cache_dir
from devtools.devstack.process import pid_alive

pytestmark = pytest.mark.timeout(240)


def _dev(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
    env |= {"DEVSTACK_DIR": str(home), "COLUMNS": "160"}
    return subprocess.run(
        [sys.executable, "-m", "devtools", "dev", *args],
        env=env,
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=180,
        check=False,
    )


def test_dev_up_status_down_leaves_nothing_running(tmp_path: Path) -> None:
    """`dev up` prints the addresses, `status` sees every process, `down` leaves none behind."""
    home = tmp_path / "devstack"
    home.mkdir()
    (home / "cache").symlink_to(cache_dir())  # reuse the downloaded jars and wheel

    up = _dev(home, "up", "--models", "double")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((home / "run" / "state.json").read_text())
        pids = [n["pid"] for n in state["kafka"]["nodes"]] + [state["triton"]["pid"]]
        assert all(pid_alive(pid) for pid in pids)
        bootstrap = ",".join(f"127.0.0.1:{n['broker_port']}" for n in state["kafka"]["nodes"])
        assert bootstrap in up.stdout
        assert "dev down" in up.stdout

        status = _dev(home, "status")
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("running") == len(pids)
    finally:
        down = _dev(home, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(pid_alive(pid) for pid in pids)
    assert _dev(home, "status").returncode == 1
