"""Where both paths meet: an outcome handed over by the batch path is only published by the
per-record path, and neither path's module imports the other for it."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from tests.unit.records.fakes import (
    TP,
    AckedDelivery,
    FakeSink,
    FakeTriton,
    good_record,
    sample,
    single_path,
    steps_for,
)
from worker.flow.window import Window
from worker.observability import InFlight, Metrics
from worker.records import outcome
from worker.records.outcome import Outcome
from worker.wire import Source

pytestmark = pytest.mark.timeout(10)

RECORDS = Path(outcome.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """The modules ``path`` imports from (``from X import ...`` and ``import X``)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


async def test_an_outcome_handed_over_with_its_result_is_only_published() -> None:
    """A result the batch path encoded but could not publish: the per-record path publishes
    it as it is (no second inference), marks the record done and counts the result."""
    triton, sink, metrics = FakeTriton(), FakeSink(), Metrics(version="test")
    steps = steps_for(metrics=metrics)
    delivery, window = AckedDelivery(sink), Window(8, 8)
    path = single_path(triton, steps, delivery=delivery, window=window)
    record = good_record(offset=3)
    request = steps.decode(record.value, record.headers, Source.of(record))
    handed = Outcome(record, Source.of(record), time.monotonic(), request)
    handed.value, handed.headers, handed.served_version = b"encoded", [("x-request-id", b"r1")], "1"
    ticket = delivery.track(record)
    assert window.try_acquire(TP)  # the slot the record held on the batch path
    await path.run(record, ticket, None, None, handed, InFlight("in", 0, 3, 0.0))
    assert (sink.results, triton.tries, delivery.completed) == ([b"encoded"], 0, [3])
    assert sample(metrics, "worker_results_published_total", model="double") == 1
    assert window.in_flight == 0


def test_the_paths_meet_in_outcome_not_in_each_other() -> None:
    """batch.py takes Outcome and HandOver from outcome.py and never imports single.py; the
    dispatcher takes them from outcome.py too."""
    batch = imported_modules(RECORDS / "batch.py")
    assert "worker.records.single" not in batch
    assert "worker.records.outcome" in batch
    assert "worker.records.outcome" in imported_modules(RECORDS / "dispatch.py")
