"""The Schema Registry: mapped topics whose events are Avro or JSON Schema in the
Confluent wire format, read with their writers' schemas (fetched once by id, cached,
waited for while the registry is out)."""

from worker.registry.topics import Registry, SchemaPending, build_registry

__all__ = ["Registry", "SchemaPending", "build_registry"]
