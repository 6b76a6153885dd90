"""The result events of a registry-format topic: written in the Confluent wire format with
the output subject's schema.

A ``ResultWriter`` is resolved once per topic at start-up (``worker.events.
result_schemas``): the schema the mapping's result is written with, its id in the
registry, the subject it is under. Encoding a result is then local: fastavro writes the
record (Avro), orjson the JSON (JSON Schema), framed with the id.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import orjson

from worker.errors import SchemaMismatch
from worker.registry.formats import Format
from worker.registry.framing import frame

__all__ = ["CONTENT_TYPES", "ResultWriter"]

#: The content type of a result of each format (its payload's, behind the 5-byte frame).
CONTENT_TYPES: dict[Format, bytes] = {
    "avro": b"application/avro",
    "json-schema": b"application/json",
}


@dataclass(frozen=True, slots=True)
class ResultWriter:
    """How one topic's results are written: the schema, its id, its subject."""

    fmt: Format
    subject: str
    schema_id: int
    #: The schema as the registry holds it (a parsed Avro schema, a JSON Schema document).
    schema: Any
    #: The schema's version under the subject (0 when registered by this worker).
    version: int = 0

    @classmethod
    def of(
        cls, fmt: Format, subject: str, schema_id: int, schema: Any, version: int = 0
    ) -> ResultWriter:
        """The writer of ``schema`` (parsed once here: fastavro for Avro)."""
        if fmt == "avro":
            import fastavro

            schema = fastavro.parse_schema(schema)
        return cls(fmt, subject, schema_id, schema, version)

    @property
    def content_type(self) -> bytes:
        return CONTENT_TYPES[self.fmt]

    def encode(self, document: dict[str, Any]) -> bytes:
        """The result event, framed with the schema's id; SchemaMismatch when a value does
        not fit the schema (a copied field of another type than the subject's)."""
        if self.fmt == "json-schema":
            payload = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
            return frame(self.schema_id, payload)
        from fastavro import schemaless_writer

        out = io.BytesIO()
        try:
            schemaless_writer(out, self.schema, document)
        except Exception as exc:  # a value of another type than the schema's
            raise SchemaMismatch(
                f"the result does not fit schema id {self.schema_id} of subject "
                f"{self.subject!r}: {type(exc).__name__}: {str(exc)[:200]}"
            ) from None
        return frame(self.schema_id, out.getvalue())
