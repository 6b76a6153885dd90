"""librdkafka's daemon threads: started when a call needs one, not when the module loads."""

from __future__ import annotations

import subprocess
import sys

import pytest

from worker.kafka import rdkafka_threads

pytestmark = pytest.mark.unit


def test_importing_the_worker_starts_no_thread() -> None:
    """A worker on aiokafka imports the librdkafka modules; they must not start threads
    (idle threads cost memory and show up in every profile of the process)."""
    code = (
        "import threading, worker.app, worker.cli, worker.kafka.edge; "
        "print(sorted(t.name for t in threading.enumerate()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "['MainThread']"


async def test_in_thread_runs_the_call_on_a_daemon_thread_started_on_first_use() -> None:
    import threading

    def where() -> tuple[str, bool]:
        thread = threading.current_thread()
        return thread.name, thread.daemon

    name, daemon = await rdkafka_threads.in_thread(where)
    assert name.startswith("rdkafka-call-") and daemon
    assert await rdkafka_threads.in_thread(pow, 2, 10) == 1024
