"""run_async: the process's event loop, and the cyclic collector's young-generation cadence."""

from __future__ import annotations

import gc

from worker.app import GC_YOUNG_THRESHOLD, run_async


async def _answer() -> int:
    return 7


def test_run_async_returns_the_exit_code_and_collects_the_young_generation_often() -> None:
    """A threshold above 700 (Python 3.13's 2,000) is lowered; the older ones are kept."""
    saved = gc.get_threshold()
    try:
        gc.set_threshold(2000, 11, 12)
        assert run_async(_answer()) == 7
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, 11, 12)
        gc.set_threshold(500, 10, 10)
        run_async(_answer())
        assert gc.get_threshold() == (500, 10, 10)  # already more often: left alone
    finally:
        gc.set_threshold(*saved)
