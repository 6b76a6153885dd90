"""The stop rule for bugs: too many records in a row that met one make the worker stop.

Kept by ``worker.records.steps`` for both paths (per record and batch): a record
answered either way ends a run of bugs.
"""

from __future__ import annotations

from worker import errors

__all__ = ["InternalErrorGuard"]


class InternalErrorGuard:
    """Counts records in a row that met a bug; past the limit the worker must stop."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._run = 0

    def observe(self, internal: bool) -> None:
        """One more outcome; raises TooManyInternalErrors at the limit (before its dead letter)."""
        if not internal:
            self._run = 0
            return
        self._run += 1
        if self._run >= self._limit:
            raise errors.TooManyInternalErrors(
                f"{self._run} records in a row met a bug (INTERNAL_ERROR); stopping rather "
                f"than dead-letter the whole topic (WORKER_MAX_CONSECUTIVE_INTERNAL_ERRORS="
                f"{self._limit}); the log has the tracebacks"
            )
