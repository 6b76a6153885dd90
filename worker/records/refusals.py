"""What the output topic refused for its size lately: results as large are not sent again.

The broker refuses a result over the output topic's ``max.message.bytes``, and each
refusal is dear: at_least_once replaces its producer and sends the result again alone;
exactly_once aborts the transaction carrying it, and every outcome in that transaction
is sent again (on librdkafka one at a time, when the refused batch held several). A model
whose results are all over the limit would pay that for every record: a worker on
exactly_once fell to a few hundred records a second. So the smallest result refused
lately is a ceiling: a result at least that large is dead-lettered ``OUTPUT_TOO_LARGE``
without being sent. The ceiling is forgotten ``REMEMBER_S`` after the last refusal, so
once the topic's limit is raised such results are sent again within that time.

One ceiling for the output topic, whatever the record: nothing here is keyed by data.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["REMEMBER_S", "OutputRefusals"]

#: How long a refusal keeps results at least as large from being sent.
REMEMBER_S = 60.0


class OutputRefusals:
    """The smallest result the output topic refused within ``remember_s`` of the last
    refusal (None when there was none)."""

    def __init__(
        self, remember_s: float = REMEMBER_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.remember_s = remember_s
        self._clock = clock
        self._smallest: int | None = None
        self._last = 0.0

    def refused(self, size: int) -> None:
        """The broker refused a result of ``size`` bytes for its size."""
        ceiling = self.ceiling()
        self._smallest = size if ceiling is None else min(ceiling, size)
        self._last = self._clock()

    def ceiling(self) -> int | None:
        """Results of this many bytes or more are refused; None: any size is tried."""
        if self._smallest is not None and self._clock() - self._last > self.remember_s:
            self._smallest = None
        return self._smallest
