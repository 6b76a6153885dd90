"""librdkafka's daemon threads: started when a call needs one, not when the module loads."""

from __future__ import annotations

import subprocess
import sys
import threading
import weakref

import pytest

from worker.kafka.rdkafka import threads as rdkafka_threads

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
    def where() -> tuple[str, bool]:
        thread = threading.current_thread()
        return thread.name, thread.daemon

    name, daemon = await rdkafka_threads.in_thread(where)
    assert name.startswith("rdkafka-call-") and daemon
    assert await rdkafka_threads.in_thread(pow, 2, 10) == 1024


def test_an_idle_thread_holds_nothing_of_the_call_it_ran() -> None:
    """A call has run and its thread waits for the next: the call's arguments are freed (a
    librdkafka client held there outlived its close, its threads still running at exit)."""
    executor = rdkafka_threads.DaemonExecutor(1, "test-idle")

    class Client:
        def poll(self) -> int:
            return 0

    client = Client()
    freed = threading.Event()
    weakref.finalize(client, freed.set)
    assert executor.submit(client.poll).result(timeout=5) == 0
    del client
    assert freed.wait(5), "the idle thread still holds the client"
    executor.shutdown()


async def test_teardown_runs_on_a_thread_of_its_own_within_its_bound() -> None:
    """teardown: True once the call returned; False when it outlasts the bound (left running)."""
    seen: list[tuple[str, bool]] = []

    def destroy() -> None:
        thread = threading.current_thread()
        seen.append((thread.name, thread.daemon))

    assert await rdkafka_threads.teardown(destroy, "client", 5.0) is True
    assert seen == [("rdkafka-teardown-client", True)]
    release = threading.Event()
    assert await rdkafka_threads.teardown(release.wait, "stuck", 0.05) is False
    release.set()


async def test_a_call_left_behind_at_a_stop_fails_without_a_report() -> None:
    """A consumer call still running when the worker stops is left behind; when it fails
    later (its client closed under it), nothing is logged as never retrieved."""
    import asyncio
    import gc

    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    stopping, release = asyncio.Event(), asyncio.Event()

    async def stuck() -> int:
        await release.wait()
        raise RuntimeError("Consumer closed")

    stopping.set()
    call = stuck()
    assert await rdkafka_threads.unless_stopped(stopping, call, 0.01) is None
    release.set()
    for _ in range(3):
        await asyncio.sleep(0)
    del call
    gc.collect()
    await asyncio.sleep(0)
    loop.set_exception_handler(None)
    assert reported == []
