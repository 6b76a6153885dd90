"""librdkafka's admin answers in the check's terms: operation bits, and refusals in one line."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError
from confluent_kafka.admin import AclOperation

from worker.checks import probes
from worker.kafka.rdkafka.admin import NOT_REPORTED, _bits, refusal_message

pytestmark = pytest.mark.unit


def test_operations_become_the_wire_bit_field_the_check_reads() -> None:
    bits = _bits([AclOperation.DESCRIBE, AclOperation.READ])
    assert probes.may(bits, probes.READ) is True
    assert probes.may(bits, probes.WRITE) is False
    assert _bits(None) == NOT_REPORTED
    assert probes.may(_bits(None), probes.READ) is None


def test_refusals_name_what_failed_and_the_setting_to_look_at() -> None:
    where, who = "Kafka b:9093", "user 'alice'"
    untrusted = KafkaError(
        KafkaError._SSL,
        "SSL handshake failed: error:0A000086:SSL routines::certificate verify failed: "
        "broker certificate could not be verified (after 4ms in state SSL_HANDSHAKE)",
    )
    message = refusal_message(untrusted, where, who, "SCRAM-SHA-256")
    assert message.startswith("Kafka b:9093: TLS certificate not trusted (SSL handshake failed")
    assert message.endswith("check WORKER_SSL_CAFILE") and "after 4ms" not in message
    other_tls = KafkaError(KafkaError._SSL, "SSL handshake failed: unexpected eof")
    assert "TLS handshake failed" in refusal_message(other_tls, where, who, None)
    wrong = KafkaError(
        KafkaError._AUTHENTICATION,
        "SASL authentication error: Authentication failed during authentication due to "
        "invalid credentials with SASL mechanism SCRAM-SHA-256 (after 5ms in state AUTH_REQ)",
    )
    assert refusal_message(wrong, where, who, "SCRAM-SHA-256") == (
        "Kafka b:9093: SASL SCRAM-SHA-256 authentication failed for user 'alice': "
        "SASL authentication error: Authentication failed during authentication due to "
        "invalid credentials with SASL mechanism SCRAM-SHA-256"
    )
