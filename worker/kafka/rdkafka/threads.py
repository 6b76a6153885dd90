"""Daemon threads for librdkafka's blocking calls, so that a call stuck on an unreachable
broker never holds the process at exit.

A forced stop abandons a close or a flush that does not return (``bounded_step``);
asyncio's default executor and ``ThreadPoolExecutor`` join their threads at exit,
which would keep the process alive until librdkafka gave up. These threads are
daemons: abandoned calls end with the process.

A thread keeps nothing of a call once it has run: an idle thread that still held its
last call (``client.poll``) held the client, whose librdkafka threads then outlived
every close and were still at work (retrying a refused SASL handshake) while the
process exited: the C library's exit handlers freed OpenSSL under them (SIGSEGV).
Clients are destroyed by ``teardown``, on a thread of its own, before the process ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from worker.flow.bounded import abandon

__all__ = ["DaemonExecutor", "in_thread", "teardown", "unless_stopped"]

_T = TypeVar("_T")


class DaemonExecutor(Executor):
    """A fixed pool of daemon threads running submitted calls in order of submission."""

    def __init__(self, workers: int, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = (
            queue.SimpleQueue()
        )
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for thread in self._threads:
            thread.start()

    def _work(self) -> None:
        while True:
            item = self._calls.get()
            if item is None:
                return
            _run(*item)
            # Dropped before the next wait: an idle thread holds no call, nor its arguments.
            del item

    def submit(self, fn: Callable[..., _T], /, *args: Any, **kwargs: Any) -> Future[_T]:
        future: Future[_T] = Future()
        self._calls.put((future, lambda: fn(*args, **kwargs)))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        for _ in self._threads:
            self._calls.put(None)


def _run(future: Future[Any], call: Callable[[], Any]) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(call())
    except BaseException as exc:  # handed to the caller
        future.set_exception(exc)


#: Started on first use: a worker on aiokafka imports this module but never starts them.
_SHARED: list[DaemonExecutor] = []


async def in_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` on a daemon thread, awaited."""
    if not _SHARED:
        _SHARED.append(DaemonExecutor(4, "rdkafka-call"))
    return await asyncio.get_running_loop().run_in_executor(_SHARED[0], fn, *args)


async def teardown(call: Callable[[], object], what: str, timeout_s: float) -> bool:
    """Run ``call`` (a librdkafka client's destruction: its threads are joined) on a daemon
    thread of its own; True once it returned, False when it still runs after ``timeout_s``
    (a broker that does not answer: left to the process exit)."""
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()

    def run() -> None:
        with contextlib.suppress(Exception):  # a client whose close fails is dropped anyway
            call()
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits
            loop.call_soon_threadsafe(ended.set)

    threading.Thread(target=run, name=f"rdkafka-teardown-{what}", daemon=True).start()
    try:
        async with asyncio.timeout(timeout_s):
            await ended.wait()
    except TimeoutError:
        return False
    return True


async def unless_stopped(stopping: asyncio.Event, call: Awaitable[_T], grace_s: float) -> _T | None:
    """The call's result; None when ``stopping`` is set and the call has not returned
    ``grace_s`` later (its daemon thread is left to librdkafka: a broker down)."""
    task = asyncio.ensure_future(call)
    if not stopping.is_set():
        stop = asyncio.ensure_future(stopping.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
    if not task.done():
        done, _ = await asyncio.wait({task}, timeout=grace_s)
        if not done:
            abandon(task)  # its later failure (the client closed under it) is no news
            return None
    return task.result()
