"""A registry-format topic's result schema: derived from the mapping, the model's outputs
and the events' own schema; registered, or checked against the subject's latest version.

The schema the mapping writes (``derived``) has one field per result field: a copied
event field takes its type from the events' schema (the latest version of the input
topic's ``<topic>-value`` subject), nullable since an event may lack it; an output, an
array of its datatype nested as its shape (``PROBS``) or one element (``PROBS[1]``); an
argmax, a nullable string. ``into`` results are the events' schema with a record of the
outputs added.

With ``WORKER_SCHEMA_REGISTRY_AUTO_REGISTER`` the worker registers it under the result's
subject (``<output topic>-value``; or the record's name, or both, as ``result.subject``
says) and writes with its id. Without it (production), the subject's latest version is
the writer: it must accept what the mapping writes (each field the mapping writes is
there with a type that takes its values, each other field has a default), else the worker
refuses to start with one line naming the first difference.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, Final

import structlog

from worker.errors import CannotRun, WorkerError
from worker.events.mapping import Argmax, Mappings, OutputRef, TopicMapping
from worker.events.paths import EventPath
from worker.registry import Registry
from worker.registry.client import RegistryRefused, RegistryRejected
from worker.registry.formats import SCHEMA_TYPES, Format
from worker.registry.results import ResultWriter
from worker.wire.validation import ModelSpec, TensorSpec

__all__ = ["ResultSchemas", "accepts_avro", "avro_result_schema", "result_subject"]

log = structlog.get_logger(__name__)

#: The Avro type of each Triton datatype (BYTES as text, as JSON results have it).
AVRO_TYPES: Final = {
    "BOOL": "boolean",
    "INT8": "int",
    "INT16": "int",
    "INT32": "int",
    "UINT8": "int",
    "UINT16": "int",
    "INT64": "long",
    "UINT32": "long",
    "UINT64": "long",
    "FP16": "float",
    "FP32": "float",
    "FP64": "double",
    "BF16": "float",
    "BYTES": "string",
}
#: An Avro name: what a record, a field and an output must be called.
_AVRO_NAME: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Writer types a reader type takes without loss (Avro's promotions).
_PROMOTIONS: Final = {
    "int": {"int", "long", "float", "double"},
    "long": {"long", "float", "double"},
    "float": {"float", "double"},
    "double": {"double"},
}
#: A namespace for result records the mapping names no name for.
DEFAULT_NAMESPACE: Final = "kafka_triton_worker"


class ResultSchemaRefused(CannotRun):
    """The result schema cannot be registered, or the subject's does not accept it."""


def result_name(mapping: TopicMapping) -> str:
    """The full name of the topic's result record."""
    if mapping.result.name:
        return mapping.result.name
    safe = re.sub(r"[^A-Za-z0-9_]", "_", mapping.topic)
    return f"{DEFAULT_NAMESPACE}.{'_' if safe[:1].isdigit() else ''}{safe}_result"


def result_subject(mapping: TopicMapping, output_topic: str) -> str:
    """The subject of the topic's results, by its strategy."""
    strategy = mapping.result.subject
    if strategy == "record":
        return result_name(mapping)
    if strategy == "topic-record":
        return f"{output_topic}-{result_name(mapping)}"
    return f"{output_topic}-value"


def _output_type(tensor: TensorSpec, element: bool) -> Any:
    avro: Any = AVRO_TYPES.get(tensor.datatype, "double")
    if element:
        return avro
    for _ in tensor.shape:
        avro = {"type": "array", "items": avro}
    return avro


def _nullable(avro: Any) -> Any:
    branches = avro if isinstance(avro, list) else [avro]
    return ["null", *[b for b in branches if b != "null"]]


def _named(schema: Any, namespace: str | None, found: dict[str, Any]) -> None:
    """Every named type the schema defines, by full name."""
    if isinstance(schema, list):
        for branch in schema:
            _named(branch, namespace, found)
        return
    if not isinstance(schema, dict):
        return
    kind = schema.get("type")
    if kind in ("record", "enum", "fixed", "error"):
        name = schema["name"]
        space = schema.get("namespace", namespace)
        full = name if "." in name or not space else f"{space}.{name}"
        found[full] = schema
        found.setdefault(name, schema)
        namespace = space
    for field in schema.get("fields", ()):
        _named(field.get("type"), namespace, found)
    for key in ("items", "values"):
        if key in schema:
            _named(schema[key], namespace, found)
    if isinstance(kind, dict | list):
        _named(kind, namespace, found)


def _resolve(avro: Any, named: dict[str, Any]) -> Any:
    """A type with names looked up and a nullable union taken to its other branch."""
    while True:
        if isinstance(avro, str) and avro in named:
            avro = named[avro]
        elif isinstance(avro, list):
            others = [b for b in avro if b != "null"]
            if len(others) != 1:
                return avro
            avro = others[0]
        elif isinstance(avro, dict) and isinstance(avro.get("type"), dict | list):
            avro = avro["type"]
        else:
            return avro


def _type_at(schema: Any, path: EventPath) -> Any | None:
    """The Avro type at ``path`` in the events' schema; None where it has none."""
    named: dict[str, Any] = {}
    _named(schema, None, named)
    avro = schema
    for step in path.steps:
        avro = _resolve(avro, named)
        if isinstance(step, str) and isinstance(avro, dict) and avro.get("type") == "record":
            field = next((f for f in avro["fields"] if f["name"] == step), None)
            if field is None:
                return None
            avro = field["type"]
        elif isinstance(step, int) and isinstance(avro, dict) and avro.get("type") == "array":
            avro = avro["items"]
        elif isinstance(step, str) and isinstance(avro, dict) and avro.get("type") == "map":
            avro = avro["values"]
        else:
            return None
    return _plain(_resolve_names(avro, named))


def _resolve_names(avro: Any, named: dict[str, Any]) -> Any:
    """The type with every name it refers to written out (for a schema of its own)."""
    if isinstance(avro, str):
        return _resolve_names(named[avro], named) if avro in named else avro
    if isinstance(avro, list):
        return [_resolve_names(b, named) for b in avro]
    if isinstance(avro, dict):
        out = dict(avro)
        for key in ("items", "values"):
            if key in out:
                out[key] = _resolve_names(out[key], named)
        if "fields" in out:
            out["fields"] = [{**f, "type": _resolve_names(f["type"], named)} for f in out["fields"]]
        if isinstance(out.get("type"), dict | list):
            out["type"] = _resolve_names(out["type"], named)
        return out
    return avro


def _plain(avro: Any) -> Any:
    """Enums as strings and fixed as bytes: a copied field keeps its values, not the
    names of types the result does not define."""
    if isinstance(avro, list):
        return [_plain(b) for b in avro]
    if isinstance(avro, dict):
        kind = avro.get("type")
        if kind == "enum":
            return "string"
        if kind == "fixed":
            return "bytes"
        if kind == "array":
            return {**avro, "items": _plain(avro["items"])}
        if kind == "map":
            return {**avro, "values": _plain(avro["values"])}
    return avro


def avro_result_schema(
    mapping: TopicMapping, spec: ModelSpec, events_schema: Any | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """The Avro schema of the mapping's results, or the problems that prevent one."""
    where = f"topics.{mapping.topic}.result"
    problems: list[str] = []
    outputs = {tensor.name: tensor for tensor in spec.outputs}
    name = result_name(mapping)
    namespace, _, short = name.rpartition(".")
    if not all(_AVRO_NAME.fullmatch(part) for part in name.split(".")):
        problems.append(f"{where}.name: {name!r} is not an Avro name (letters, digits, _)")
    schema: dict[str, Any] = {"type": "record", "name": short, "fields": []}
    if namespace:
        schema["namespace"] = namespace
    if mapping.result.into is not None:
        if not isinstance(events_schema, dict) or events_schema.get("type") != "record":
            problems.append(
                f"{where}.into: the events' schema is no record to add the outputs to; its "
                "subject has none"
            )
            return None, problems
        schema["fields"] = copy.deepcopy(events_schema["fields"])
        record = {
            "type": "record",
            "name": f"{short}_outputs",
            "fields": [
                {"name": tensor.name, "type": _output_type(tensor, element=False)}
                for tensor in spec.outputs
            ],
        }
        schema["fields"].append({"name": mapping.result.into, "type": record})
        if "namespace" not in schema and events_schema.get("namespace"):
            schema["namespace"] = events_schema["namespace"]
        names = [mapping.result.into, *outputs]
    else:
        for field, source in mapping.result.fields:
            avro = _field_type(field, source, outputs, events_schema, where, problems)
            if avro is not None:
                entry: dict[str, Any] = {"name": field, "type": avro}
                if isinstance(avro, list) and avro[0] == "null":
                    entry["default"] = None
                schema["fields"].append(entry)
        names = [field for field, _ in mapping.result.fields]
    for one in names:
        if not _AVRO_NAME.fullmatch(one):
            problems.append(f"{where}: {one!r} is not an Avro field name (letters, digits, _)")
    return (schema if not problems else None), problems


def _field_type(
    field: str,
    source: Any,
    outputs: dict[str, TensorSpec],
    events_schema: Any | None,
    where: str,
    problems: list[str],
) -> Any | None:
    if isinstance(source, EventPath):
        if events_schema is None:
            problems.append(
                f"{where}.fields.{field}: copies {source} from the events, whose schema is "
                "typed by their subject, which has none yet: register the producers' schema "
                "first"
            )
            return None
        found = _type_at(events_schema, source)
        if found is None:
            problems.append(f"{where}.fields.{field}: the events' schema has no {source}")
            return None
        return _nullable(found)
    if isinstance(source, Argmax):
        return ["null", "string"]
    assert isinstance(source, OutputRef)
    tensor = outputs.get(source.output)
    if tensor is None:
        return None  # the mapping check says so
    return _output_type(tensor, element=source.index is not None)


def accepts_avro(latest: Any, derived: dict[str, Any]) -> list[str]:
    """Why the subject's ``latest`` schema cannot write every record ``derived`` describes
    (none: it can)."""
    if not isinstance(latest, dict) or latest.get("type") != "record":
        return ["it is not a record schema"]
    named: dict[str, Any] = {}
    _named(latest, None, named)
    problems: list[str] = []
    fields = {f["name"]: f for f in latest["fields"]}
    written = {f["name"]: f for f in derived["fields"]}
    for name, field in written.items():
        theirs = fields.get(name)
        if theirs is None:
            problems.append(f"it has no field {name!r}, which the mapping writes")
        elif not _takes(theirs["type"], field["type"], named):
            problems.append(
                f"its field {name!r} is {json.dumps(theirs['type'])}, which does not take the "
                f"mapping's {json.dumps(field['type'])}"
            )
    for name, field in fields.items():
        if name not in written and "default" not in field:
            problems.append(f"its field {name!r} has no default and the mapping does not write it")
    return problems


def _takes(reader: Any, writer: Any, named: dict[str, Any]) -> bool:
    """True when every value of Avro type ``writer`` can be written as type ``reader``."""
    reader = named.get(reader, reader) if isinstance(reader, str) else reader
    if isinstance(writer, list):
        return all(_takes(reader, branch, named) for branch in writer)
    if isinstance(reader, list):
        return any(_takes(branch, writer, named) for branch in reader)
    if isinstance(reader, dict) and not isinstance(reader.get("type"), str):
        return _takes(reader["type"], writer, named)
    r_kind = reader.get("type") if isinstance(reader, dict) else reader
    w_kind = writer.get("type") if isinstance(writer, dict) else writer
    if r_kind == "array" and w_kind == "array":
        return _takes(reader["items"], writer["items"], named)
    if r_kind == "record" and w_kind == "record":
        theirs = {f["name"]: f for f in reader["fields"]}
        return all(
            f["name"] in theirs and _takes(theirs[f["name"]]["type"], f["type"], named)
            for f in writer["fields"]
        ) and all(f["name"] in {w["name"] for w in writer["fields"]} or "default" in f
                  for f in reader["fields"])  # fmt: skip
    if r_kind == "string" and w_kind == "enum":
        return True
    if isinstance(r_kind, str) and isinstance(w_kind, str) and w_kind in _PROMOTIONS:
        return r_kind in _PROMOTIONS[w_kind]
    return bool(r_kind == w_kind)


SpecOf = Callable[[str, str], Awaitable[ModelSpec]]


class ResultSchemas:
    """Resolves each registry-format topic's result writer, at start-up or once Triton
    and the registry answer."""

    def __init__(
        self, registry: Registry, mappings: Mappings, output_topic: str, auto_register: bool
    ) -> None:
        self._registry = registry
        self._pending = {t: m for t, m in mappings.items() if m.registry_format}
        self._output_topic = output_topic
        self._auto_register = auto_register
        #: The registry answered once: its URL and the worker's credentials are right.
        self._probed = False

    @property
    def pending(self) -> list[str]:
        """The topics whose results cannot be written yet."""
        return list(self._pending)

    async def resolve(self, spec_of: SpecOf) -> None:
        """Resolve every pending topic it can now; ResultSchemaRefused (exit 2) when a
        result schema is refused, or the registry's URL or credentials are. A Triton or
        registry that does not answer leaves the topic pending (its records wait)."""
        if self._pending and not self._probed:
            try:
                await self._registry.client.schema_types()
            except RegistryRejected as exc:
                raise ResultSchemaRefused(f"WORKER_SCHEMA_REGISTRY_URL: {exc}") from None
            except RegistryRefused as exc:
                raise ResultSchemaRefused(exc.message) from None
            except WorkerError as exc:
                log.warning("result_schema_waiting", reason=exc.message[:300])
                return
            self._probed = True
        for topic, mapping in list(self._pending.items()):
            try:
                spec = await spec_of(mapping.model, mapping.version)
                writer = await self._writer(mapping, spec)
            except RegistryRefused as exc:
                raise ResultSchemaRefused(exc.message) from None
            except WorkerError as exc:  # Triton or its model, or the registry, not answering
                log.warning("result_schema_waiting", topic=topic, reason=exc.message[:300])
                continue
            self._registry.set_result(topic, writer)
            del self._pending[topic]
            log.info(
                "result_schema",
                topic=topic,
                subject=writer.subject,
                schema_id=writer.schema_id,
                version=writer.version,
            )

    async def resolve_loop(self, spec_of: SpecOf, interval_s: float) -> None:
        """Resolve what is pending every ``interval_s`` until nothing is."""
        while self._pending:
            await asyncio.sleep(interval_s)
            await self.resolve(spec_of)

    async def _writer(self, mapping: TopicMapping, spec: ModelSpec) -> ResultWriter:
        fmt: Format = mapping.format  # type: ignore[assignment]
        client = self._registry.client
        events = await client.latest(f"{mapping.topic}-value")
        events_schema = json.loads(events.schema.text) if events is not None else None
        derived, problems = derive(fmt, mapping, spec, events_schema)
        subject = result_subject(mapping, self._output_topic)
        where = f"topics.{mapping.topic}.result"
        if derived is None:
            raise ResultSchemaRefused(f"WORKER_MAPPING_FILE: {problems[0]}")
        if self._auto_register:
            text = json.dumps(derived)
            try:
                schema_id = await client.register(subject, SCHEMA_TYPES[fmt], text)
            except RegistryRejected as exc:
                raise ResultSchemaRefused(
                    f"{where}: the Schema Registry refused the result schema: {exc}"
                ) from None
            return _result_writer(fmt, subject, schema_id, derived, 0, where)
        latest = await client.latest(subject)
        if latest is None:
            raise ResultSchemaRefused(
                f"{where}: subject {subject!r} has no schema: register the mapping's result "
                "schema (`kafka-triton-worker check` shows it), or set "
                "WORKER_SCHEMA_REGISTRY_AUTO_REGISTER=true"
            )
        theirs = json.loads(latest.schema.text)
        refusals = accepts(fmt, theirs, derived)
        if refusals:
            raise ResultSchemaRefused(
                f"{where}: the latest schema of subject {subject!r} (version {latest.version}, "
                f"id {latest.schema_id}) does not accept what the mapping writes: {refusals[0]}"
            )
        return _result_writer(fmt, subject, latest.schema_id, theirs, latest.version, where)


def _result_writer(
    fmt: Format, subject: str, schema_id: int, schema: Any, version: int, where: str
) -> ResultWriter:
    try:
        return ResultWriter.of(fmt, subject, schema_id, schema, version)
    except Exception as exc:  # the library cannot use the schema (a name defined twice)
        raise ResultSchemaRefused(
            f"{where}: schema id {schema_id} of subject {subject!r} cannot be written with: "
            f"{type(exc).__name__}: {str(exc)[:200]}"
        ) from None


def derive(
    fmt: Format, mapping: TopicMapping, spec: ModelSpec, events_schema: Any | None
) -> tuple[dict[str, Any] | None, list[str]]:
    """The result schema of the mapping in its format, or the problems."""
    if fmt == "avro":
        return avro_result_schema(mapping, spec, events_schema)
    from worker.events.json_result_schema import json_result_schema

    return json_result_schema(mapping, spec, events_schema)


def accepts(fmt: Format, latest: Any, derived: dict[str, Any]) -> list[str]:
    """Why ``latest`` cannot write what ``derived`` describes, in the format's terms."""
    if fmt == "avro":
        return accepts_avro(latest, derived)
    from worker.events.json_result_schema import accepts_json

    return accepts_json(latest, derived)
