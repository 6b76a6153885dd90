"""The mapping file against the models Triton serves: for the start-up gate and ``check``.

Each mapped model is asked of Triton once (ready? its metadata and config). A model Triton
does not serve, or a mapping that does not fit its model, is a problem: ``run`` refuses to
start with one line per problem (exit 2), ``check`` fails the mapping's rows. A Triton that
does not answer is not: the records' own checks (INVALID_REQUEST) stand in once it does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from worker.checks import probes
from worker.checks.rows import CheckResult, Outcome
from worker.events import Mappings, TopicMapping, load_mappings
from worker.events.check import describe_input, mapping_problems
from worker.settings import Settings
from worker.triton import repository
from worker.triton.auth import TritonAuth
from worker.triton.repository import SERVABLE_STATES
from worker.wire.validation import ModelSpec

__all__ = ["MappingFindings", "inspect_mappings", "mapping_rows"]


@dataclass
class MappingFindings:
    """What Triton said of the mapped models: their specs, or why none came."""

    mappings: dict[str, TopicMapping]
    specs: dict[tuple[str, str], ModelSpec] = field(default_factory=dict)
    #: The problems per topic: a model not served, or a mapping that does not fit it.
    problems: dict[str, list[str]] = field(default_factory=dict)
    #: Triton did not answer (the reason): nothing could be checked against the models.
    unreachable: str | None = None
    #: Topics whose model is in a rollout (not ready, but listed by the repository): why
    #: their mapping could not be checked now.
    waiting: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        """Every problem, one line each, in the file's order."""
        return [line for topic in self.mappings for line in self.problems.get(topic, [])]


async def inspect_mappings(
    settings: Settings, timeout_s: float, mappings: Mappings | None = None
) -> MappingFindings | None:
    """The mapped models asked of the first Triton endpoint; None without a mapping file.
    ``mappings``: the file as already loaded (else it is read here)."""
    path = settings.limits.mapping_file
    if path is None:
        return None
    if mappings is None:
        mappings = load_mappings(path, settings.topics.input_topics)
    findings = MappingFindings(mappings)
    try:
        address, target = (await probes.triton_addresses(settings))[0]
    except Exception as exc:  # not resolved: an outage to the worker, not a mapping problem
        findings.unreachable = probes.reason(exc)
        return findings
    auth = TritonAuth(settings.triton)
    client = probes.triton_client(settings, address, target)
    try:
        for topic, mapping in findings.mappings.items():
            key = (mapping.model, mapping.version)
            if key not in findings.specs:
                try:
                    spec = await _spec(client, auth, key, timeout_s)
                except Exception as exc:
                    findings.unreachable = f"{address}: {probes.reason(exc)}"
                    return findings
                if spec is None:
                    state, retired = await _state(client, auth, key, timeout_s)
                    _not_ready(findings, topic, address, state, retired)
                    continue
                findings.specs[key] = spec
            if key in findings.specs:
                findings.problems[topic] = mapping_problems(mapping, findings.specs[key])
    finally:
        await client.close()
    return findings


def _not_ready(
    findings: MappingFindings, topic: str, address: str, state: str | None, retired: str
) -> None:
    """A mapped model that is not ready: in a rollout (listed), a version retired while its
    model serves (``retired`` says why), or not served at all."""
    mapping = findings.mappings[topic]
    version = f" version {mapping.version}" if mapping.version else ""
    if retired:
        findings.problems[topic] = [f"topics.{topic}.model: {retired}"]
        return
    if state is not None:
        findings.waiting[topic] = (
            f"Triton {address} lists {mapping.model!r}{version} as {state} (a rollout): "
            "checked against each event once it is ready"
        )
        return
    findings.problems[topic] = [
        f"topics.{topic}.model: Triton {address} does not serve {mapping.model!r}{version}; "
        "load it, or map the topic to a model it serves"
    ]


async def _state(
    client: Any, auth: TritonAuth, key: tuple[str, str], timeout_s: float
) -> tuple[str | None, str]:
    """The model's state in Triton's repository index when it is one a rollout passes
    through (loading, unloading, unloaded), else None (absent, or never loaded); and why
    the version is retired when it is (see ``worker.triton.repository``), else ""."""
    name, version = key
    try:
        index = await client.get_model_repository_index(
            headers=auth.headers(), client_timeout=timeout_s
        )
    except Exception:  # no index, no evidence of a rollout: the model is not served
        return None, ""
    states = {
        m.state
        for m in index.models
        if m.name == name and (not version or m.version == version) and m.state in SERVABLE_STATES
    }
    retired = repository.listing(repository.read_index(index.models), name, version).retired
    return "/".join(sorted(states)) or None, retired


async def _spec(
    client: Any, auth: TritonAuth, key: tuple[str, str], timeout_s: float
) -> ModelSpec | None:
    name, version = key
    headers = auth.headers()
    if not await client.is_model_ready(name, version, headers=headers, client_timeout=timeout_s):
        return None
    metadata = await client.get_model_metadata(
        name, version, headers=headers, client_timeout=timeout_s
    )
    config = await client.get_model_config(name, version, headers=headers, client_timeout=timeout_s)
    return ModelSpec.from_triton(metadata, config)


def mapping_rows(findings: MappingFindings | None) -> list[CheckResult]:
    """``check``'s rows: each mapped input beside its model's, and each topic's result."""
    if findings is None:
        return []
    rows: list[CheckResult] = []
    for topic, mapping in findings.mappings.items():
        skipped = (
            f"Triton {findings.unreachable}"
            if findings.unreachable is not None
            else findings.waiting.get(topic)
        )
        spec = findings.specs.get((mapping.model, mapping.version))
        left = list(findings.problems.get(topic, []))
        for one in mapping.inputs:
            tensor = spec.input(one.name) if spec is not None else None
            model = f"{tensor.datatype} {list(tensor.shape)}" if tensor is not None else "-"
            detail = f"{describe_input(one)} -> {mapping.model} {model}"
            prefix = f"topics.{topic}.inputs.{one.name}"
            mine = [p for p in left if p.startswith((f"{prefix}.", f"{prefix}:"))]
            left = [p for p in left if p not in mine]
            outcome: Outcome = "skip" if skipped else "fail" if mine or spec is None else "ok"
            extra = [skipped] if skipped else mine
            rows.append(
                CheckResult(f"mapping {topic} {one.name}", outcome, "; ".join([detail, *extra]))
            )
        result = mapping.result
        shown = (
            f"the event, outputs under {result.into!r}"
            if result.into is not None
            else "fields " + ", ".join(name for name, _ in result.fields)
        )
        missing = [p for p in left if p.startswith(f"topics.{topic}.inputs:")]
        if missing:  # model inputs the mapping does not give: no mapped input's row
            rows.append(CheckResult(f"mapping {topic} inputs", "fail", "; ".join(missing)))
            left = [p for p in left if p not in missing]
        ending: Outcome = "skip" if skipped else "fail" if left else "ok"
        rows.append(CheckResult(f"mapping {topic} result", ending, "; ".join([shown, *left])))
    return rows
