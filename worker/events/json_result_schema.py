"""The JSON Schema of a json-schema topic's results, and whether a subject's accepts it.

As for Avro (``worker.events.result_schemas``): a copied field takes its schema from the
events' own (nullable), an output is an array of its datatype's JSON type nested as its
shape (or one element), an argmax a nullable string; ``into`` results are the events'
schema with an object of the outputs added.
"""

from __future__ import annotations

import copy
from typing import Any, Final

from worker.events.mapping import Argmax, OutputRef, TopicMapping
from worker.events.paths import EventPath
from worker.wire.validation import ModelSpec, TensorSpec

__all__ = ["accepts_json", "json_result_schema"]

_DRAFT: Final = "http://json-schema.org/draft-07/schema#"


def _json_type(datatype: str) -> str:
    if datatype == "BOOL":
        return "boolean"
    if datatype == "BYTES":
        return "string"
    return "number" if datatype.startswith(("FP", "BF")) else "integer"


def _output_schema(tensor: TensorSpec, element: bool) -> dict[str, Any]:
    # A float output's NaN (an overflowing model) is written as null, as JSON results do.
    kind = _json_type(tensor.datatype)
    schema: dict[str, Any] = {"type": [kind, "null"] if kind == "number" else kind}
    if element:
        return schema
    for _ in tensor.shape:
        schema = {"type": "array", "items": schema}
    return schema


def _schema_at(schema: Any, path: EventPath) -> Any | None:
    node = schema
    for step in path.steps:
        if not isinstance(node, dict):
            return None
        if isinstance(step, str):
            node = (node.get("properties") or {}).get(step)
        else:
            node = node.get("items")
        if node is None:
            return None
    return node


def json_result_schema(
    mapping: TopicMapping, spec: ModelSpec, events_schema: Any | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """The JSON Schema of the mapping's results, or the problems that prevent one."""
    where = f"topics.{mapping.topic}.result"
    outputs = {tensor.name: tensor for tensor in spec.outputs}
    title = mapping.result.name or f"{mapping.topic} result"
    if mapping.result.into is not None:
        if not isinstance(events_schema, dict):
            return None, [f"{where}.into: the events' subject has no schema to add the outputs to"]
        schema = copy.deepcopy(events_schema)
        schema["title"] = title
        schema.setdefault("properties", {})[mapping.result.into] = {
            "type": "object",
            "properties": {
                name: _output_schema(tensor, element=False) for name, tensor in outputs.items()
            },
        }
        return schema, []
    problems: list[str] = []
    properties: dict[str, Any] = {}
    for field, source in mapping.result.fields:
        if isinstance(source, EventPath):
            found = _schema_at(events_schema, source) if events_schema is not None else None
            if found is None:
                problems.append(
                    f"{where}.fields.{field}: the events' schema (their subject's latest) has "
                    f"no {source}"
                )
                continue
            properties[field] = {"anyOf": [found, {"type": "null"}]}
        elif isinstance(source, Argmax):
            properties[field] = {"type": ["string", "null"]}
        else:
            assert isinstance(source, OutputRef)
            tensor = outputs.get(source.output)
            if tensor is not None:
                properties[field] = _output_schema(tensor, element=source.index is not None)
    schema = {
        "$schema": _DRAFT,
        "title": title,
        "type": "object",
        "properties": properties,
        "required": [field for field, _ in mapping.result.fields],
    }
    return (schema if not problems else None), problems


def accepts_json(latest: Any, derived: dict[str, Any]) -> list[str]:
    """Why the subject's ``latest`` JSON Schema would refuse results ``derived`` describes
    (none: it takes them): a property it lacks while closed, a property it requires that
    the mapping does not write, a property of another type."""
    if not isinstance(latest, dict) or latest.get("type", "object") != "object":
        return ["it is not an object schema"]
    theirs = latest.get("properties") or {}
    ours = derived.get("properties") or {}
    problems = []
    for name, schema in ours.items():
        if name not in theirs:
            if latest.get("additionalProperties") is False:
                problems.append(f"it has no property {name!r} and takes no other")
            continue
        mine, other = _types(schema), _types(theirs[name])
        # JSON Schema's number takes integers too.
        widened = other | ({"integer"} if "number" in other else set())
        if mine and other and not mine <= widened:
            problems.append(f"its property {name!r} is of type {sorted(other)}, not {sorted(mine)}")
    for name in latest.get("required") or ():
        if name not in ours:
            problems.append(f"it requires {name!r}, which the mapping does not write")
    return problems


def _types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {str(k) for k in kind}
    found: set[str] = set()
    for branch in schema.get("anyOf") or ():
        found |= _types(branch) or {"any"}
    return set() if "any" in found else found
