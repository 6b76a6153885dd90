"""The mapping file (``WORKER_MAPPING_FILE``): which model each mapped topic's events feed,
where each model input's values sit in an event, and what the result event is.

TOML (``.toml``), JSON (``.json``) or YAML (``.yaml``, with the ``yaml`` extra); one file
maps any number of input topics::

    [topics.payments]
    model = "mlp"                          # version = "1" to pin one
    request_id = "/payment_id"             # optional: the field naming the request
    format = "avro"                        # optional: json (the default), avro, json-schema
    [topics.payments.inputs.INPUT0]
    datatype = "FP32"
    from = "/features"                     # an array (nested as the shape), or a scalar
    shape = [64]
    # or: fields = ["/amount", "/age", "/hour"]   several scalars gathered, shape [3]
    # default = 0.0                        # for a missing or null field
    [topics.payments.result]
    into = "prediction"                    # the event, outputs under this field
    # or: fields = { id = "/payment_id", score = "PROBS[1]", label = { argmax = "PROBS",
    #                labels = ["a", "b"] } }

Every problem of a file is found at once and reported one per line (ConfigError, exit 2).
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any, Final

from worker.events.cloudevents import CloudEventsOut
from worker.events.paths import EventPath, parse_path
from worker.events.values import default_problem
from worker.settings import ConfigError
from worker.wire.tensors import DATATYPES

__all__ = [
    "Argmax",
    "InputMap",
    "Mappings",
    "OutputRef",
    "ResultForm",
    "TopicMapping",
    "load_mappings",
    "problems_message",
]

SETTING: Final = "WORKER_MAPPING_FILE"
#: The events' formats: plain JSON, or one of a Schema Registry's (the Confluent wire format).
EVENT_FORMATS: Final = ("json", "avro", "json-schema")
#: The module each registry format needs, and the extra that installs it.
_FORMAT_LIBRARIES: Final = {"avro": "fastavro", "json-schema": "jsonschema"}
#: The result field an event's outputs go under when the mapping names no form.
DEFAULT_INTO: Final = "prediction"
_OUTPUT_REF: Final = re.compile(r"([^\[\]]+?)(?:\[(\d+)\])?")


@dataclass(frozen=True, slots=True)
class InputMap:
    """One model input: its values from one path (``source``) or gathered from several
    scalar fields (``fields``); ``shape`` is one event's, without a batch dimension."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    source: EventPath | None
    fields: tuple[EventPath, ...]
    default: Any  # None: the field is required


@dataclass(frozen=True, slots=True)
class OutputRef:
    """A model output, whole or one element of it (``PROBS`` or ``PROBS[1]``)."""

    output: str
    index: int | None

    def __str__(self) -> str:
        return self.output if self.index is None else f"{self.output}[{self.index}]"


@dataclass(frozen=True, slots=True)
class Argmax:
    """The label of an output's largest element."""

    output: str
    labels: tuple[str, ...]


ResultSource = EventPath | OutputRef | Argmax


#: Subject name strategies of a registry-format topic's results: the output topic's
#: ``<topic>-value`` (Confluent's TopicNameStrategy), the record's full name
#: (RecordNameStrategy), or both (TopicRecordNameStrategy).
SUBJECT_STRATEGIES: Final = ("topic", "record", "topic-record")


@dataclass(frozen=True, slots=True)
class ResultForm:
    """The result: the event with the outputs ``into`` a field, or new ``fields``."""

    into: str | None
    fields: tuple[tuple[str, ResultSource], ...]
    #: A registry-format topic's result record: its full name (None: derived from the
    #: topic) and its subject name strategy.
    name: str | None = None
    subject: str = "topic"


@dataclass(frozen=True, slots=True)
class TopicMapping:
    """How one topic's events become requests, and their results events."""

    topic: str
    model: str
    version: str
    request_id: EventPath | None
    inputs: tuple[InputMap, ...]
    result: ResultForm
    #: The type and source of result events, when the requests are CloudEvents.
    cloudevents: CloudEventsOut = CloudEventsOut()  # noqa: RUF009 (frozen: shared safely)
    #: How the events are written: json, or a registry format (avro, json-schema).
    format: str = "json"

    @property
    def registry_format(self) -> bool:
        """True when the events are in the Confluent wire format, their schemas in a
        Schema Registry."""
        return self.format != "json"

    def outputs(self) -> tuple[str, ...]:
        """The model outputs the result reads (none named: all of them)."""
        names = [s.output for _, s in self.result.fields if isinstance(s, OutputRef | Argmax)]
        return tuple(dict.fromkeys(names))


#: Mapped topics by name.
Mappings = dict[str, TopicMapping]


def load_mappings(path: str, input_topics: tuple[str, ...]) -> Mappings:
    """Read and check the mapping file; ConfigError with one line per problem."""
    document = _read(path)
    problems: list[str] = []
    mappings: Mappings = {}
    topics = document.get("topics")
    if not isinstance(topics, dict) or not topics:
        problems.append("topics: expected a table of input topics, e.g. [topics.payments]")
        topics = {}
    _unknown(document, {"topics"}, "", problems)
    for topic, table in topics.items():
        where = f"topics.{topic}"
        if topic not in input_topics:
            problems.append(
                f"{where}: not one of WORKER_INPUT_TOPICS ({', '.join(input_topics)}); "
                "map only the topics the worker consumes"
            )
        if not isinstance(table, dict):
            problems.append(f"{where}: expected a table")
            continue
        mapping = _topic(topic, table, where, problems)
        if mapping is not None:
            mappings[topic] = mapping
    if problems:
        raise ConfigError(SETTING, problems_message(path, problems))
    return mappings


def problems_message(path: str, problems: list[str]) -> str:
    """``WORKER_MAPPING_FILE: <path>: 2 problems:`` then one indented line per problem."""
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
    lines = "\n".join(f"  {problem}" for problem in problems)
    return f"{SETTING}: {path}: {count}:\n{lines}"


def _read(path: str) -> dict[str, Any]:
    file = Path(path)
    try:
        text = file.read_bytes()
    except OSError as exc:
        raise ConfigError(SETTING, f"{SETTING}: cannot read {path}: {exc.strerror}") from None
    try:
        if file.suffix.lower() == ".json":
            document = json.loads(text)
        elif file.suffix.lower() == ".toml":
            document = tomllib.loads(text.decode("utf-8-sig"))
        elif file.suffix.lower() in (".yaml", ".yml"):
            document = _yaml(path, text)
        else:
            raise ConfigError(
                SETTING, f"{SETTING}: {path}: name it .toml (TOML), .json (JSON) or .yaml (YAML)"
            )
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            SETTING, f"{SETTING}: {path}: not valid {file.suffix[1:].upper()}: {exc}"
        ) from None
    if not isinstance(document, dict):
        raise ConfigError(SETTING, f"{SETTING}: {path}: expected a table of topics")
    return document


def _yaml(path: str, text: bytes) -> Any:
    """A YAML mapping file, read with PyYAML (the ``yaml`` extra) as plain data."""
    try:
        import yaml  # type: ignore[import-untyped, unused-ignore]
    except ImportError:
        raise ConfigError(
            SETTING,
            f"{SETTING}: {path}: reading YAML needs PyYAML: pip install "
            "'kafka-triton-worker[yaml]', or write the mapping as TOML or JSON",
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = str(exc).replace("\n", " ")
        raise ConfigError(SETTING, f"{SETTING}: {path}: not valid YAML: {where}") from None


def _unknown(table: dict[str, Any], known: set[str], where: str, problems: list[str]) -> None:
    for key in table:
        if key not in known:
            expected = ", ".join(sorted(known))
            problems.append(f"{where}{'.' if where else ''}{key}: unknown key; expected {expected}")


def _text(table: dict[str, Any], key: str, where: str, problems: list[str]) -> str | None:
    value = table.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        problems.append(f"{where}.{key}: expected a non-empty string, got {value!r}")
        return None
    return value


def _path(value: Any, where: str, problems: list[str]) -> EventPath | None:
    try:
        return parse_path(value)
    except ValueError as exc:
        problems.append(f"{where}: {exc}")
        return None


def _topic(
    topic: str, table: dict[str, Any], where: str, problems: list[str]
) -> TopicMapping | None:
    known = {"model", "version", "request_id", "inputs", "result", "cloudevents", "format"}
    _unknown(table, known, where, problems)
    fmt = _format(table.get("format", "json"), where, problems)
    model = _text(table, "model", where, problems)
    if model is None and "model" not in table:
        problems.append(f"{where}.model: missing; name the model the events feed")
    version = table.get("version", "")
    if isinstance(version, int) and not isinstance(version, bool):
        version = str(version)
    if not isinstance(version, str) or (version and not version.isdigit()):
        problems.append(f"{where}.version: expected a version number, got {version!r}")
        version = ""
    request_id = None
    if "request_id" in table:
        request_id = _path(table["request_id"], f"{where}.request_id", problems)
    inputs_table = table.get("inputs")
    inputs: list[InputMap] = []
    if not isinstance(inputs_table, dict) or not inputs_table:
        problems.append(
            f"{where}.inputs: expected a table per model input, e.g. [{where}.inputs.INPUT0]"
        )
    else:
        for name, spec in inputs_table.items():
            one = _input(name, spec, f"{where}.inputs.{name}", problems)
            if one is not None:
                inputs.append(one)
    result = _result(table.get("result", {}), f"{where}.result", problems)
    cloudevents = _cloudevents(table.get("cloudevents", {}), f"{where}.cloudevents", problems)
    if model is None or result is None:
        return None
    version = version.lstrip("0") or version[:1]
    return TopicMapping(topic, model, version, request_id, tuple(inputs), result, cloudevents, fmt)


def _format(value: Any, where: str, problems: list[str]) -> str:
    if value not in EVENT_FORMATS:
        problems.append(
            f"{where}.format: expected one of {', '.join(EVENT_FORMATS)}, got {value!r}"
        )
        return "json"
    module = _FORMAT_LIBRARIES.get(value)
    if module is not None and find_spec(module) is None:
        # At once, as for YAML: one line naming the extra, whatever else the file holds.
        raise ConfigError(
            SETTING,
            f"{SETTING}: {where}.format: reading {value} events needs {module}: pip install "
            "'kafka-triton-worker[registry]'",
        )
    return str(value)


def _input(name: str, spec: Any, where: str, problems: list[str]) -> InputMap | None:
    if not isinstance(spec, dict):
        problems.append(f"{where}: expected a table (datatype, from or fields, shape)")
        return None
    _unknown(spec, {"datatype", "from", "fields", "shape", "default"}, where, problems)
    datatype = spec.get("datatype")
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        problems.append(
            f"{where}.datatype: expected one of {', '.join(DATATYPES)}, got {datatype!r}"
        )
        return None
    if ("from" in spec) == ("fields" in spec):
        problems.append(f"{where}: give either from (one path) or fields (paths gathered)")
        return None
    source: EventPath | None = None
    fields: tuple[EventPath, ...] = ()
    if "from" in spec:
        source = _path(spec["from"], f"{where}.from", problems)
    else:
        raw_fields = spec["fields"]
        if not isinstance(raw_fields, list) or not raw_fields:
            problems.append(f"{where}.fields: expected a list of paths, got {raw_fields!r}")
            return None
        parsed = [
            _path(field, f"{where}.fields[{i}]", problems) for i, field in enumerate(raw_fields)
        ]
        fields = tuple(path for path in parsed if path is not None)
    shape = _shape(spec, fields, where, problems)
    default = spec.get("default")
    if default is not None:
        problem = default_problem(datatype, default)
        if problem is not None:
            problems.append(f"{where}.default: {problem}")
    if shape is None or (source is None and not fields):
        return None
    return InputMap(name, datatype, shape, source, fields, default)


def _shape(
    spec: dict[str, Any], fields: tuple[EventPath, ...], where: str, problems: list[str]
) -> tuple[int, ...] | None:
    shape = spec.get("shape")
    if shape is None:
        if fields:
            return (len(fields),)
        problems.append(
            f"{where}.shape: missing; give one event's shape, e.g. [64] "
            "(-1 for a dimension of any size)"
        )
        return None
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and (d >= 1 or d == -1) for d in shape
    ):
        problems.append(f"{where}.shape: expected a list of sizes (-1 for any), got {shape!r}")
        return None
    if fields and shape != [len(fields)]:
        problems.append(
            f"{where}.shape: {shape}, but {len(fields)} fields are gathered; "
            f"drop the shape or make it [{len(fields)}]"
        )
        return None
    return tuple(shape)


def _result(table: Any, where: str, problems: list[str]) -> ResultForm | None:
    if not isinstance(table, dict):
        problems.append(f"{where}: expected a table (into, or fields)")
        return None
    _unknown(table, {"into", "fields", "name", "subject"}, where, problems)
    name = _text(table, "name", where, problems)
    subject = table.get("subject", "topic")
    if subject not in SUBJECT_STRATEGIES:
        problems.append(
            f"{where}.subject: expected one of {', '.join(SUBJECT_STRATEGIES)}, got {subject!r}"
        )
        subject = "topic"
    if "into" in table and "fields" in table:
        problems.append(
            f"{where}: give either into (the event, enriched) or fields (a new event), not both"
        )
        return None
    if "fields" not in table:
        into = _text(table, "into", where, problems) if "into" in table else DEFAULT_INTO
        return ResultForm(into, (), name, subject) if into is not None else None
    fields = table["fields"]
    if not isinstance(fields, dict) or not fields:
        problems.append(
            f'{where}.fields: expected a table of result fields, e.g. {{ score = "PROBS[1]" }}'
        )
        return None
    parsed: list[tuple[str, ResultSource]] = []
    for field, source in fields.items():
        one = _result_source(source, f"{where}.fields.{field}", problems)
        if one is not None:
            parsed.append((field, one))
    return ResultForm(None, tuple(parsed), name, subject)


def _result_source(source: Any, where: str, problems: list[str]) -> ResultSource | None:
    if isinstance(source, dict):
        _unknown(source, {"argmax", "labels"}, where, problems)
        output, labels = source.get("argmax"), source.get("labels")
        if not isinstance(output, str) or not output:
            problems.append(f"{where}.argmax: expected an output name, got {output!r}")
            return None
        if (
            not isinstance(labels, list)
            or not labels
            or not all(isinstance(label, str) for label in labels)
        ):
            problems.append(f"{where}.labels: expected a list of strings, got {labels!r}")
            return None
        return Argmax(output, tuple(labels))
    if not isinstance(source, str) or not source:
        problems.append(
            f"{where}: expected an event path ('/id', '$.id'), an output "
            f"('PROBS', 'PROBS[1]') or {{ argmax, labels }}, got {source!r}"
        )
        return None
    if source.startswith(("/", "$")):
        return _path(source, where, problems)
    match = _OUTPUT_REF.fullmatch(source)
    if match is None:
        problems.append(f"{where}: {source!r} is neither an event path nor an output")
        return None
    name, index = match.groups()
    return OutputRef(name, int(index) if index is not None else None)


def _cloudevents(table: Any, where: str, problems: list[str]) -> CloudEventsOut:
    if not isinstance(table, dict):
        problems.append(f"{where}: expected a table (type, source)")
        return CloudEventsOut()
    _unknown(table, {"type", "source"}, where, problems)
    default = CloudEventsOut()
    kind = _text(table, "type", where, problems) or default.type
    source = _text(table, "source", where, problems) or default.source
    return CloudEventsOut(kind, source)
