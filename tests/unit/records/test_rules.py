"""The record rules read from the settings: the limits, the retry policy, the mapped topics."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.records import RecordRules
from worker.settings import ConfigError, load_settings

ENV = {
    "WORKER_INPUT_TOPICS": "payments,plain",
    "WORKER_OUTPUT_TOPIC": "out",
    "WORKER_DLQ_TOPIC": "dlq",
}

MAPPING = """
[topics.payments]
model = "mlp"
[topics.payments.inputs.INPUT0]
datatype = "FP32"
from = "/features"
shape = [64]
"""


def rules(**extra: str) -> RecordRules:
    return RecordRules.from_settings(load_settings({**ENV, **extra}, [], isatty=False))


def test_the_limits_and_the_retry_policy_come_from_their_settings() -> None:
    read = rules(
        WORKER_MAX_REQUEST_BYTES="1000",
        WORKER_MAX_ATTEMPTS="4",
        WORKER_RETRY_BACKOFF_MS="50",
        WORKER_RECORD_DEADLINE_MS="9000",
    )
    assert read.limits.max_request_bytes == 1000
    assert read.retry.max_attempts == 4
    assert read.retry.backoff.first_s == pytest.approx(0.05)
    assert read.retry.record_deadline_s == pytest.approx(9.0)
    assert read.mappings == {}


def test_the_mapping_file_names_the_mapped_topics(tmp_path: Path) -> None:
    path = tmp_path / "mapping.toml"
    path.write_text(MAPPING)
    read = rules(WORKER_MAPPING_FILE=str(path))
    assert list(read.mappings) == ["payments"]
    assert read.mappings["payments"].model == "mlp"


def test_a_mapping_file_with_a_problem_refuses_the_settings(tmp_path: Path) -> None:
    path = tmp_path / "mapping.toml"
    path.write_text(MAPPING.replace("payments", "elsewhere"))
    with pytest.raises(ConfigError, match=r"topics.elsewhere: not one of WORKER_INPUT_TOPICS"):
        rules(WORKER_MAPPING_FILE=str(path))
