"""Fixtures of the Kafka unit tests."""

from __future__ import annotations

import confluent_kafka
import pytest

from tests.unit.kafka.rdkafka.fakes import Broker


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> Broker:
    """Every librdkafka producer the test makes is an in-memory fake writing to this broker."""
    made = Broker()
    monkeypatch.setattr(confluent_kafka, "Producer", made.producer)
    return made
