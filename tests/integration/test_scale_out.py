"""Scale-out: three worker processes in one group against one, on a latency-bound model."""

from __future__ import annotations

from pathlib import Path

import pytest

from devtools.bench.scaleout import measure_workers
from tests.support import KafkaUnderTest, TritonUnderTest

# The worker's Kafka client plays no part here: run in the aiokafka passes only.
pytestmark = [pytest.mark.timeout(120), pytest.mark.one_client]


async def test_three_workers_in_one_group_move_at_least_twice_the_records_of_one(
    kafka: KafkaUnderTest, triton: TritonUnderTest, tmp_path: Path
) -> None:
    """Window-limited workers (1 in flight, 20 ms model sleep): three in a group give >= 2x one.

    The benchmark (`python -m devtools bench --variants scale_out`) reports the real
    ratio against the issue's 2.5x; this test asserts 2.0x so that a noisy 2-core
    machine running Kafka, Triton and four Python processes does not make it flaky.
    """
    one = await measure_workers(
        kafka.bootstrap_servers, triton.grpc_address, tmp_path, workers=1, records=150
    )
    three = await measure_workers(
        kafka.bootstrap_servers, triton.grpc_address, tmp_path, workers=3, records=150
    )
    assert one.records == three.records == 150
    ratio = three.records_per_s / one.records_per_s
    assert ratio >= 2.0, (
        f"3 workers {three.records_per_s:.1f}/s vs 1 worker {one.records_per_s:.1f}/s"
    )
