"""``check``'s Schema Registry rows: the registry answers, and each registry-format topic's
subjects (its events', its results') as the worker would find them at start-up.

Nothing is registered: with ``WORKER_SCHEMA_REGISTRY_AUTO_REGISTER`` the result row says
what the worker would register; without it, whether the subject's latest version accepts
what the mapping writes (the start-up gate refuses when not).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from worker.checks.mappings import MappingFindings
from worker.checks.rows import CheckResult, Outcome
from worker.errors import RegistryUnavailable
from worker.events.mapping import TopicMapping
from worker.events.result_schemas import accepts, derive, result_subject
from worker.registry.client import RegistryClient, RegistryRejected
from worker.registry.formats import Format
from worker.settings import Settings

__all__ = ["registry_rows"]


async def registry_rows(
    settings: Settings, findings: MappingFindings | None, timeout_s: float
) -> list[CheckResult]:
    """The registry's row, then one per registry-format topic (none without a registry)."""
    url = settings.registry.schema_registry_url
    topics = [m for m in (findings.mappings.values() if findings else ()) if m.registry_format]
    if url is None:
        if not topics:
            return []
        return [CheckResult("Schema Registry", "fail", "not set", "set WORKER_SCHEMA_REGISTRY_URL")]
    client = RegistryClient(settings.registry)
    try:
        types = await asyncio.wait_for(client.schema_types(), timeout_s)
    except (RegistryUnavailable, RegistryRejected, TimeoutError) as exc:
        reason = getattr(exc, "message", None) or str(exc) or "no answer in time"
        outcome: Outcome = "fail" if topics else "skip"
        rows = [CheckResult("Schema Registry", outcome, f"{url}: {reason}")]
        return rows + [
            CheckResult(f"registry {m.topic}", "skip", "registry unreachable") for m in topics
        ]
    used = "" if topics else " (no mapped topic is avro or json-schema)"
    rows = [CheckResult("Schema Registry", "ok", f"{url}: {', '.join(types)}{used}")]
    for mapping in topics:
        spec = findings.specs.get((mapping.model, mapping.version)) if findings else None
        rows.append(await _topic_row(settings, client, mapping, spec, timeout_s))
    return rows


async def _topic_row(
    settings: Settings, client: RegistryClient, mapping: TopicMapping, spec: Any, timeout_s: float
) -> CheckResult:
    fmt: Format = mapping.format  # type: ignore[assignment]
    name = f"registry {mapping.topic}"
    subject = result_subject(mapping, settings.topics.output_topic)
    try:
        events = await asyncio.wait_for(client.latest(f"{mapping.topic}-value"), timeout_s)
        theirs = await asyncio.wait_for(client.latest(subject), timeout_s)
    except (RegistryUnavailable, TimeoutError) as exc:
        return CheckResult(name, "fail", getattr(exc, "message", None) or "no answer in time")
    shown = (
        f"events {mapping.topic}-value version {events.version}"
        if events is not None
        else f"events {mapping.topic}-value: none yet"
    )
    detail = f"{fmt}; {shown}; results under {subject!r}"
    if spec is None:
        return CheckResult(name, "skip", f"{detail}; the model's outputs unknown (Triton)")
    derived, problems = derive(
        fmt, mapping, spec, json.loads(events.schema.text) if events else None
    )
    if derived is None:
        return CheckResult(name, "fail", detail, "; ".join(problems))
    if settings.registry.schema_registry_auto_register:
        what = f"registered at start-up: {json.dumps(derived)}"
        return CheckResult(name, "ok", f"{detail}, {what}")
    if theirs is None:
        return CheckResult(
            name,
            "fail",
            f"{detail}: none registered; the mapping writes {json.dumps(derived)}",
            "register it, or set WORKER_SCHEMA_REGISTRY_AUTO_REGISTER=true",
        )
    refusals = accepts(fmt, json.loads(theirs.schema.text), derived)
    version = f"version {theirs.version}, id {theirs.schema_id}"
    if refusals:
        return CheckResult(
            name,
            "fail",
            f"{detail} ({version}) does not accept what the mapping writes: {refusals[0]}",
            "register a version that does",
        )
    return CheckResult(name, "ok", f"{detail} ({version}) accepts what the mapping writes")
