"""`python -m devtools dev up|status|down` starts a stack that outlives it and stops it fully."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.devstack.paths import PROJECT_ROOT, cache_dir
from devtools.devstack.process import pid_alive
from tests.support.worker import env_without_settings

pytestmark = pytest.mark.timeout(240)


def _dev(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = env_without_settings()
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
    """`dev up` prints the addresses and the exports (the Schema Registry's among them),
    creates the topics; a second `dev up` says one line; `status` sees every process, `down`
    leaves none behind."""
    home = tmp_path / "devstack"
    home.mkdir()
    (home / "cache").symlink_to(cache_dir())  # reuse the downloaded jars and wheel

    up = _dev(home, "up", "--models", "double")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        state = json.loads((home / "run" / "state.json").read_text())
        pids = [n["pid"] for n in state["kafka"]["nodes"]] + [state["triton"]["pid"]]
        pids.append(state["registry"]["pid"])
        assert all(pid_alive(pid) for pid in pids)
        bootstrap = ",".join(f"127.0.0.1:{n['broker_port']}" for n in state["kafka"]["nodes"])
        assert bootstrap in up.stdout
        assert "dev down" in up.stdout
        exports = _exports(up.stdout)
        assert exports == {
            "WORKER_BOOTSTRAP_SERVERS": bootstrap,
            "WORKER_TRITON_URL": f"127.0.0.1:{state['triton']['ports']['grpc']}",
            "WORKER_INPUT_TOPICS": "inference-requests",
            "WORKER_OUTPUT_TOPIC": "inference-results",
            "WORKER_DLQ_TOPIC": "inference-dead-letters",
            "WORKER_SCHEMA_REGISTRY_URL": (
                f"http://127.0.0.1:{state['registry']['port']}/apis/ccompat/v7"
            ),
        }
        _assert_topics_exist(exports)

        again = _dev(home, "up")
        assert again.returncode == 0, again.stderr
        assert again.stderr == ""
        (line,) = again.stdout.splitlines()
        assert "already running" in line and bootstrap in line and "dev down" in line

        status = _dev(home, "status")
        assert status.returncode == 0, status.stdout
        assert status.stdout.count("running") == len(pids)
    finally:
        down = _dev(home, "down")
    assert down.returncode == 0, down.stdout + down.stderr
    assert not any(pid_alive(pid) for pid in pids)
    assert _dev(home, "status").returncode == 1


def _exports(stdout: str) -> dict[str, str]:
    """The `export NAME=value` lines, as the shell would read them."""
    lines = [line.split(" ", 1)[1] for line in stdout.splitlines() if line.startswith("export ")]
    return dict(line.split("=", 1) for line in lines)


def _assert_topics_exist(exports: dict[str, str]) -> None:
    """`check` with the exported settings finds every topic (and Triton) ready."""
    clean = env_without_settings()
    done = subprocess.run(
        [sys.executable, "-m", "worker", "check"],
        env=clean | exports | {"COLUMNS": "200"},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for topic in ("inference-requests", "inference-results", "inference-dead-letters"):
        assert topic in done.stdout
