"""The registry formats' payloads read with the libraries made for them: Avro with fastavro,
JSON Schema with jsonschema (the ``registry`` extra; imported only by a worker that maps
a topic of such a format).

A ``WriterSchema`` is one schema id's schema, parsed once and kept (``worker.registry.
writers``); its ``decode`` turns a payload into plain Python data (a record into a dict),
or raises SchemaMismatch saying why it cannot.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any, Final, Literal, Protocol

import orjson

from worker.errors import SchemaMismatch
from worker.registry.client import RegisteredSchema
from worker.registry.flat_avro import flat_reader

__all__ = [
    "FORMATS",
    "SCHEMA_TYPES",
    "Format",
    "WriterSchema",
    "missing_library",
    "writer_schema",
]

#: The formats a mapped topic may have beside plain JSON.
Format = Literal["avro", "json-schema"]
FORMATS: Final[tuple[Format, ...]] = ("avro", "json-schema")
#: The registry's name of each format's schemas.
SCHEMA_TYPES: Final[dict[Format, str]] = {"avro": "AVRO", "json-schema": "JSON"}
#: The module each format reads its payloads with.
_LIBRARIES: Final[dict[Format, str]] = {"avro": "fastavro", "json-schema": "jsonschema"}
#: How much of a library's message a dead letter shows.
_SHOWN: Final = 200
_BUFFER: Final = re.compile(r" (?:from|in) <_io\.BytesIO object at 0x[0-9a-f]+>")


def missing_library(fmt: Format) -> str | None:
    """The module ``fmt`` needs when it is not installed (None: it is)."""
    from importlib.util import find_spec

    module = _LIBRARIES[fmt]
    return module if find_spec(module) is None else None


class WriterSchema(Protocol):
    """One schema id's schema, parsed: what its payloads decode to."""

    schema_id: int
    fmt: Format

    def decode(self, payload: memoryview) -> Any:
        """The payload's data; SchemaMismatch when it does not decode with this schema."""
        ...


class AvroWriter:
    """An Avro writer's schema: payloads are read with it alone (no reader schema), so
    each record's fields are those its producer wrote."""

    __slots__ = ("flat", "fmt", "parsed", "schema_id")

    def __init__(self, schema_id: int, schema: Any) -> None:
        import fastavro

        self.schema_id = schema_id
        self.fmt: Format = "avro"
        self.parsed = fastavro.parse_schema(schema)
        #: A flat record's fast reader (its arrays of numbers as numpy arrays), if it is one.
        self.flat = flat_reader(schema)

    def decode(self, payload: memoryview) -> Any:
        if self.flat is not None:
            raw = bytes(payload)
            try:
                record, taken = self.flat.read(raw)
            except Exception:  # fastavro reads it again, and says what is wrong
                pass
            else:
                if taken == len(raw):
                    return record
        return self._fastavro(payload)

    def _fastavro(self, payload: memoryview) -> Any:
        from fastavro import schemaless_reader

        buffer = io.BytesIO(payload)
        try:
            data = schemaless_reader(buffer, self.parsed, None)
        except Exception as exc:  # EOF, a bad length, invalid UTF-8: what fastavro says
            raise SchemaMismatch(
                f"Avro payload does not decode with schema id {self.schema_id}: {_said(exc)}"
            ) from None
        left = len(payload) - buffer.tell()
        if left:
            raise SchemaMismatch(
                f"Avro payload has {left} bytes left over after the record of schema id "
                f"{self.schema_id}: it was not written with that schema"
            )
        return data


class JsonSchemaWriter:
    """A JSON Schema: the payload is JSON text, validated against it."""

    __slots__ = ("fmt", "schema_id", "validator")

    def __init__(self, schema_id: int, schema: Any) -> None:
        from jsonschema.validators import validator_for

        self.schema_id = schema_id
        self.fmt: Format = "json-schema"
        cls = validator_for(schema)
        cls.check_schema(schema)
        self.validator = cls(schema)

    def decode(self, payload: memoryview) -> Any:
        try:
            data = orjson.loads(payload)
        except orjson.JSONDecodeError as exc:
            raise SchemaMismatch(
                f"JSON Schema payload of schema id {self.schema_id} is not valid JSON: {exc}"
            ) from None
        try:
            error = next(iter(self.validator.iter_errors(data)), None)
        except Exception as exc:  # a $ref the schema cannot resolve here, say
            raise SchemaMismatch(
                f"schema id {self.schema_id} cannot validate the payload: {_said(exc)}"
            ) from None
        if error is not None:
            from jsonschema.exceptions import best_match

            best = best_match(self.validator.iter_errors(data)) or error
            where = "$" + "".join(
                f"[{step}]" if isinstance(step, int) else f".{step}" for step in best.path
            )
            raise SchemaMismatch(
                f"{where}: does not match schema id {self.schema_id}: {_said(best.message)}"
            )
        return data


def writer_schema(schema_id: int, registered: RegisteredSchema) -> WriterSchema:
    """The parsed schema of ``schema_id``; SchemaMismatch when it is of a type this worker
    does not read, names other schemas, or does not parse."""
    kind = registered.schema_type.upper()
    if registered.references:
        names = ", ".join(str(ref.get("name", ref)) for ref in registered.references[:3])
        raise SchemaMismatch(
            f"schema id {schema_id} references other schemas ({names}); this worker reads "
            "only self-contained schemas"
        )
    if kind not in ("AVRO", "JSON"):
        raise SchemaMismatch(
            f"schema id {schema_id} is a {kind} schema; this worker reads Avro and JSON Schema"
        )
    try:
        schema = json.loads(registered.text)
        if kind == "AVRO":
            return AvroWriter(schema_id, schema)
        return JsonSchemaWriter(schema_id, schema)
    except Exception as exc:  # any parser's refusal
        raise SchemaMismatch(
            f"schema id {schema_id} ({kind}) does not parse: {_said(exc)}"
        ) from None


def _said(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else str(exc) or type(exc).__name__
    # fastavro names the buffer it read from: no use to anyone reading a dead letter.
    text = _BUFFER.sub("", text)
    if not isinstance(exc, str) and type(exc).__name__ not in text:
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."
