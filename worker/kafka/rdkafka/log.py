"""librdkafka's log lines and error reports as the worker's own structured log lines.

Left alone, librdkafka writes its log to stderr in a format of its own
(``%3|1700000000.123|FAIL|rdkafka#producer-1| ...``) and, without an error callback,
logs its errors there too. Every librdkafka client the worker builds takes ``callbacks()``
instead: both go to the stdlib logger ``librdkafka``, through the worker's one handler (JSON
lines), kept at WARNING and above like every library's logger.

librdkafka tries a refused connection again every few hundred milliseconds and reports each
failure, the same text both as a log line and as an error: a text is logged once per
``REPEAT_WINDOW_S``, the next time with how many were left out meanwhile.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from typing import Any

__all__ = ["REPEAT_WINDOW_S", "RdLogger", "Repeats", "callbacks", "on_error", "on_error_awaited"]

#: The logger of every librdkafka line (see ``worker.observability.logging``).
log = logging.getLogger("librdkafka")

#: A text repeated within this window is counted, not logged again.
REPEAT_WINDOW_S = 60.0
#: Texts remembered at most (a broker's address is part of them: few distinct ones).
_MAX_TEXTS = 256
#: The part of librdkafka's texts that changes between two tries of the same thing.
_VARYING = re.compile(
    r"\s*\(after \d+ms in state [A-Z_]+(, \d+ identical error\(s\) suppressed)?\)"
)


class Repeats:
    """The texts logged lately, and how many repeats of each were left out (thread-safe:
    librdkafka calls back from its own threads)."""

    def __init__(
        self, window_s: float = REPEAT_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[float, int]] = {}

    def admit(self, text: str) -> int | None:
        """None to leave ``text`` out; else how many repeats of it were left out before."""
        now = self._clock()
        with self._lock:
            last = self._seen.get(text)
            if last is not None and now - last[0] < self._window_s:
                self._seen[text] = (last[0], last[1] + 1)
                return None
            if last is None and len(self._seen) >= _MAX_TEXTS:
                self._seen.clear()
            self._seen[text] = (now, 0)
            return last[1] if last is not None else 0


_REPEATS = Repeats()


def _emit(level: int, event: str, text: str, repeats: Repeats, **fields: Any) -> None:
    if not log.isEnabledFor(level):
        return
    detail = _VARYING.sub("", text)
    left_out = repeats.admit(detail)
    if left_out is None:
        return
    if left_out:
        fields["repeated"] = left_out
    log.log(level, event, extra={"detail": detail, **fields})


class RdLogger:
    """What librdkafka's ``logger`` property takes: an object with ``log``."""

    def __init__(self, repeats: Repeats = _REPEATS) -> None:
        self._repeats = repeats

    def log(self, level: int, message: str, *args: Any, **_: Any) -> None:
        """One librdkafka line; the binding calls ``log(level, "%s [%s] %s", facility,
        client, text)`` with the level already a stdlib one."""
        if len(args) == 3:
            facility, client, text = (str(arg) for arg in args)
        else:
            facility, client, text = "", "", message % args if args else message
        _emit(level, "librdkafka_log", text, self._repeats, facility=facility, client=client)


def on_error(error: Any, repeats: Repeats = _REPEATS) -> None:
    """librdkafka's ``error_cb``: one line per error (a fatal one at ERROR level)."""
    fatal = bool(error.fatal())
    _emit(
        logging.ERROR if fatal else logging.WARNING,
        "kafka_client_error",
        str(error.str()),
        repeats,
        code=str(error.name()),
        fatal=fatal,
    )


class _Done:
    """An awaitable that is already done (awaiting it returns None at once)."""

    def __await__(self) -> Generator[None, None, None]:
        yield from ()


_DONE = _Done()


def on_error_awaited(error: Any) -> Awaitable[None]:
    """``on_error`` for a client of confluent-kafka's asyncio API (``AIOConsumer``), which
    awaits what its ``error_cb`` returns: a plain function's None made the librdkafka call
    that served the error (consume, close) raise TypeError, which ended the worker at the
    first broker it could not reach. It logs at once and returns an awaitable already
    done (not a coroutine, which would be reported as never awaited if the callback came
    after the event loop had closed)."""
    on_error(error)
    return _DONE


def callbacks(*, asyncio_api: bool = False) -> dict[str, Any]:
    """The ``logger`` and ``error_cb`` properties of a librdkafka client's configuration
    (``asyncio_api``: for a client of confluent-kafka's asyncio API)."""
    return {"logger": RdLogger(), "error_cb": on_error_awaited if asyncio_api else on_error}
