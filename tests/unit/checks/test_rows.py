"""Kafka's answers judged: which rows refuse the start, and the one line that says so."""

from __future__ import annotations

from typing import Any

import pytest

from worker.checks import probes
from worker.checks.kafka import Findings
from worker.checks.rows import kafka_rows, refusal
from worker.settings import Settings, load_settings

pytestmark = pytest.mark.unit

#: The operations field when the broker does not report them.
NOT_REPORTED = -(2**31)
READ_ONLY = (1 << probes.READ) | (1 << 8)  # Read and Describe (AclOperation 8)
WRITE_ONLY = (1 << probes.WRITE) | (1 << 8)


def _settings(**extra: str) -> Settings:
    env = {
        "WORKER_INPUT_TOPICS": "in",
        "WORKER_OUTPUT_TOPIC": "out",
        "WORKER_DLQ_TOPIC": "dlq",
        "WORKER_GROUP_ID": "g",
        **{f"WORKER_{k.upper()}": v for k, v in extra.items()},
    }
    return load_settings(env)


def _topic(name: str, code: int = 0, ops: int = NOT_REPORTED, leader: int = 1) -> dict[str, Any]:
    partitions = [] if code else [{"partition": 0, "leader": leader}]
    return {
        "topic": name,
        "error_code": code,
        "partitions": partitions,
        "topic_authorized_operations": ops,
    }


def _group(code: int = 0, ops: int = READ_ONLY, kind: str = "consumer") -> dict[str, Any]:
    return {
        "error_code": code,
        "protocol_type": kind,
        "state": "Empty",
        "members": [],
        "authorized_operations": ops,
    }


def _findings(topics: list[dict[str, Any]], group: dict[str, Any]) -> Findings:
    metadata = {"brokers": [{"node_id": 1}], "cluster_id": "c", "topics": topics}
    return Findings("Kafka b:9092", metadata, group)


def test_every_problem_that_needs_a_change_is_in_one_line() -> None:
    """Missing input, output without Write, group without Read: one line, each with its fix."""
    findings = _findings(
        [_topic("in", code=3), _topic("out", ops=READ_ONLY), _topic("dlq", ops=WRITE_ONLY)],
        _group(ops=1 << 8),
    )
    line = refusal(findings.where, kafka_rows(_settings(), findings))
    assert line == (
        "Kafka b:9092: input topic in: does not exist (create it, or correct "
        "WORKER_INPUT_TOPICS); output topic out: 1 partitions, but no write permission "
        "(grant the worker's principal Write on it); consumer group g: no read permission "
        "on the group: cannot join it (grant the worker's principal Read on it)"
    )


def test_what_may_pass_by_itself_does_not_refuse_the_start() -> None:
    """A partition without a leader, or operations not reported: a row, but no refusal."""
    findings = _findings([_topic("in", leader=-1), _topic("out"), _topic("dlq")], _group())
    rows = kafka_rows(_settings(), findings)
    assert [r.outcome for r in rows] == ["ok", "fail", "ok", "ok", "ok"]
    assert refusal(findings.where, rows) is None


def test_refusals_name_the_user_and_the_grant() -> None:
    """With SASL the principal is the user; a topic not even describable needs both grants."""
    settings = _settings(
        security_protocol="SASL_SSL",
        sasl_mechanism="PLAIN",
        sasl_username="u",
        sasl_password="p",
    )
    findings = _findings([_topic("in", code=29), _topic("out"), _topic("dlq")], _group(code=30))
    line = refusal(findings.where, kafka_rows(settings, findings))
    assert line is not None
    assert "input topic in: not authorized to describe it (grant user 'u' Describe and Read" in line
    assert (
        "consumer group g: not authorized to describe the group (grant user 'u' Describe "
        "and Read on it, or change WORKER_GROUP_ID)" in line
    )


def test_a_group_id_of_another_kind_of_group_is_refused() -> None:
    """A group id in use by, say, Kafka Connect: choose another WORKER_GROUP_ID."""
    findings = _findings([_topic("in"), _topic("out"), _topic("dlq")], _group(kind="connect"))
    line = refusal(findings.where, kafka_rows(_settings(), findings))
    assert line is not None and "choose another WORKER_GROUP_ID" in line
