"""Kafka's answers judged: a row per topic and one for the group, each with what to do.

Both ``check`` (which prints every row) and the start-up gate of ``run`` (which refuses
to start on a row that only a change of configuration or ACLs can fix) judge
``inspect_kafka``'s findings here, so that the two never disagree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from worker.checks import probes
from worker.checks.kafka import Findings, who
from worker.settings import Settings

__all__ = ["CheckResult", "kafka_rows", "refusal"]

Outcome = Literal["ok", "fail", "skip"]

#: Kafka error codes the checks explain in words.
_KAFKA_ERRORS = {
    3: "does not exist",
    5: "has partitions without a leader",
    29: "not authorized to describe it",
    30: "not authorized to describe the group",
}
_UNKNOWN_TOPIC, _TOPIC_AUTHORIZATION_FAILED, _GROUP_AUTHORIZATION_FAILED = 3, 29, 30


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One line of the report. ``fix`` says what to change when only a change of the
    settings, the topics or the ACLs can make the row pass (the gate then refuses to
    start); a failure without one may pass by itself (a partition without a leader)."""

    check: str
    outcome: Outcome
    detail: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        """False only for a failure; a skipped check failed through another one."""
        return self.outcome != "fail"

    @property
    def refuses_start(self) -> bool:
        """A failure that a restart cannot fix."""
        return self.outcome == "fail" and bool(self.fix)


def _verb(operation: int) -> str:
    return "read" if operation == probes.READ else "write"


def _topic_row(use: probes.TopicUse, topic: dict[str, Any] | None, principal: str) -> CheckResult:
    name, verb = use.row, _verb(use.operation)
    if topic is None:
        return CheckResult(name, "fail", "not in the broker's answer")
    code = int(topic["error_code"])
    if code == _UNKNOWN_TOPIC:
        return CheckResult(name, "fail", "does not exist", f"create it, or correct {use.setting}")
    if code == _TOPIC_AUTHORIZATION_FAILED:
        fix = f"grant {principal} Describe and {verb.title()} on it"
        return CheckResult(name, "fail", _KAFKA_ERRORS[code], fix)
    if code:
        return CheckResult(name, "fail", _KAFKA_ERRORS.get(code, f"Kafka error code {code}"))
    partitions = topic["partitions"]
    leaderless = sorted(p["partition"] for p in partitions if p["leader"] < 0)
    if leaderless:
        return CheckResult(name, "fail", f"partitions without a leader: {leaderless}")
    allowed = probes.may(int(topic["topic_authorized_operations"]), use.operation)
    if allowed is False:
        detail = f"{len(partitions)} partitions, but no {verb} permission"
        return CheckResult(name, "fail", detail, f"grant {principal} {verb.title()} on it")
    permission = f"may {verb}" if allowed else f"{verb} permission not reported"
    return CheckResult(name, "ok", f"{len(partitions)} partitions, {permission}")


def _group_row(group_id: str, group: dict[str, Any], principal: str) -> CheckResult:
    name = f"consumer group {group_id}"
    code = int(group["error_code"])
    if code == _GROUP_AUTHORIZATION_FAILED:
        fix = f"grant {principal} Describe and Read on it, or change WORKER_GROUP_ID"
        return CheckResult(name, "fail", _KAFKA_ERRORS[code], fix)
    if code:
        return CheckResult(name, "fail", _KAFKA_ERRORS.get(code, f"Kafka error code {code}"))
    if group["protocol_type"] not in ("", "consumer"):
        kind = group["protocol_type"]
        detail = f"the group id is used by a {kind!r} group"
        return CheckResult(name, "fail", detail, "choose another WORKER_GROUP_ID")
    if probes.may(int(group["authorized_operations"]), probes.READ) is False:
        detail = "no read permission on the group: cannot join it"
        return CheckResult(name, "fail", detail, f"grant {principal} Read on it")
    members = len(group["members"])
    state = "no members yet" if group["state"] in ("Dead", "Empty") else group["state"]
    return CheckResult(name, "ok", f"{state}, {members} members; may join (not joined)")


def kafka_rows(settings: Settings, findings: Findings) -> list[CheckResult]:
    """The broker's row, a row per topic the worker uses, and the group's row."""
    metadata = findings.metadata
    brokers = len(metadata["brokers"])
    rows = [
        CheckResult(
            "Kafka reachable", "ok", f"{brokers} broker(s), cluster {metadata['cluster_id']}"
        )
    ]
    by_name = {t["topic"]: t for t in metadata["topics"]}
    principal = who(settings)
    rows += [
        _topic_row(use, by_name.get(use.topic), principal)
        for use in probes.topics_to_check(settings)
    ]
    rows.append(_group_row(settings.kafka.group_id, findings.group, principal))
    return rows


def refusal(where: str, rows: list[CheckResult]) -> str | None:
    """One line naming every row that refuses the start and what to do; None if none."""
    problems = [f"{row.check}: {row.detail} ({row.fix})" for row in rows if row.refuses_start]
    return f"{where}: {'; '.join(problems)}" if problems else None
