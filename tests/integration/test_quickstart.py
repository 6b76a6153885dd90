"""The README's quickstart (also on docs/getting-started.md), run as written against the local
Kafka and Triton.

Only the placeholders change: the example addresses become the local stack's, and the
topic names get a suffix of this test's own. Every command of the block runs, in
bash, with ``set -euo pipefail``: one that fails fails the test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.contract.test_readme import quickstart_block
from tests.support import KafkaUnderTest, TritonUnderTest
from tests.support.worker import env_without_settings

pytestmark = pytest.mark.timeout(240)


def _script(kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str) -> str:
    block = quickstart_block()
    for placeholder, value in {
        "kafka.example.com:9092": kafka.bootstrap_servers,
        "triton.example.com:8001": triton.grpc_address,
        "inference-requests": f"qs-requests-{unique}",
        "inference-results": f"qs-results-{unique}",
        "inference-dead-letters": f"qs-dead-letters-{unique}",
    }.items():
        assert placeholder in block, f"the quickstart no longer says {placeholder}"
        block = block.replace(placeholder, value)
    return block


def test_the_readme_quickstart_answers_one_request_and_dead_letters_another(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """topics, check, run, produce, tail: the good request's result and the bad one's dead
    letter are printed, and the worker exits 0."""
    env = env_without_settings()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["COLUMNS"] = "200"
    done = subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + _script(kafka, triton, unique)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
        check=False,
    )
    log = (tmp_path / "worker.log").read_text() if (tmp_path / "worker.log").exists() else ""
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log[-3000:]
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    result, dead_letter = records
    assert result["key"] == "good-1"
    assert result["value"]["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]
    assert dead_letter["key"] == "bad-1"
    assert dead_letter["headers"]["x-error-code"] == "INVALID_REQUEST"
    assert "shape [1, 4] needs 4" in dead_letter["headers"]["x-error-message"]
    assert '"event":"worker_stopped"' in log
