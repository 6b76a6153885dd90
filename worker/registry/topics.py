"""The registry-format topics of a worker: their records read with their writers' schemas.

``Registry`` is built once (``build_registry``) when the mapping file names a topic of
format ``avro`` or ``json-schema``. Reading a record is synchronous once its schema is
known (``read``); the paths of a record make sure of that first (``pending``, ``ready``,
``ready_many``), so that records of one schema id are decoded together on the batch path
and only the first of an id waits for the registry.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from worker.errors import SchemaMismatch
from worker.flow.breaker import CircuitBreaker
from worker.flow.retry import Backoff, Budget
from worker.registry.client import RegistryClient
from worker.registry.formats import Format
from worker.registry.framing import schema_id_of, unframe
from worker.registry.results import ResultWriter
from worker.registry.writers import WriterSchemas
from worker.settings import ConfigError, Settings

__all__ = ["Registry", "SchemaPending", "build_registry"]


class SchemaPending(Exception):
    """A record's schema is not known yet: ``Registry.ready`` must fetch it first. Not a
    record's failure: the batch path hands such a record to the per-record path."""


class Registry:
    """The Schema Registry as the record paths use it: schemas by id, formats by topic."""

    def __init__(
        self,
        client: RegistryClient,
        writers: WriterSchemas,
        formats: Mapping[str, Format],
    ) -> None:
        self.client = client
        self.writers = writers
        #: The format of each registry-format topic.
        self.formats = dict(formats)
        #: How each topic's results are written, once resolved (``set_result``).
        self.results: dict[str, ResultWriter] = {}
        self._resolved = {topic: asyncio.Event() for topic in self.formats}

    def set_result(self, topic: str, writer: ResultWriter) -> None:
        """The topic's results are written so from now on; its waiting records go on."""
        self.results[topic] = writer
        self._resolved[topic].set()

    def result(self, topic: str) -> ResultWriter:
        """How the topic's results are written; SchemaPending until it is resolved."""
        writer = self.results.get(topic)
        if writer is None:
            raise SchemaPending(f"the result schema of topic {topic!r}")
        return writer

    def read(self, topic: str, value: bytes) -> Any:
        """The record's data, decoded with its writer's schema. BadMagicByte,
        SchemaNotFound, SchemaMismatch for the record's dead letter; SchemaPending when
        its schema must be fetched first."""
        fmt = self.formats[topic]
        schema_id, payload = unframe(value, topic, fmt)
        writer = self.writers.get(schema_id)
        if writer is None:
            raise SchemaPending(schema_id)
        if writer.fmt != fmt:
            raise SchemaMismatch(
                f"schema id {schema_id} is a {writer.fmt} schema; topic {topic!r} reads {fmt}"
            )
        return writer.decode(payload)

    def pending(self, topic: str, value: bytes | None) -> bool:
        """True when the record's schema must be fetched before it can be read."""
        if topic not in self.formats:
            return False
        if topic not in self.results:
            return True
        schema_id = schema_id_of(value)
        return schema_id is not None and not self.writers.known(schema_id)

    async def ready(self, topic: str, value: bytes | None, budget: Budget | None = None) -> None:
        """Return once the record can be read without a fetch (at once for most)."""
        if not self.pending(topic, value):
            return
        if topic not in self.results:
            waited = time.monotonic()
            await self._resolved[topic].wait()
            if budget is not None:  # not the record's fault: its deadline moves on
                budget.pause(time.monotonic() - waited)
        schema_id = schema_id_of(value)
        if schema_id is not None:
            await self.writers.ensure(schema_id, budget)

    async def ready_many(self, records: Iterable[tuple[str, bytes | None]]) -> None:
        """``ready`` for many (topic, value) records: each schema id fetched once."""
        waiting = [(topic, value) for topic, value in records if self.pending(topic, value)]
        for topic in {topic for topic, _ in waiting if topic not in self.results}:
            await self._resolved[topic].wait()
        ids = {schema_id_of(value) for _, value in waiting}
        await self.writers.ensure_all(i for i in ids if i is not None)

    async def probe_loop(self, interval_s: float) -> None:
        """Closes the registry's breaker once the registry answers again (runs always)."""
        await self.writers.probe_loop(interval_s)


def build_registry(
    settings: Settings,
    formats: Mapping[str, str],
    on_retry: Callable[[str], None] = lambda _: None,
) -> Registry | None:
    """The registry of the topics whose ``formats`` (topic -> format) are registry
    formats; None when there is none. ConfigError when one is but no registry is set."""
    chosen: dict[str, Format] = {
        topic: fmt  # type: ignore[misc]
        for topic, fmt in formats.items()
        if fmt in ("avro", "json-schema")
    }
    if not chosen:
        return None
    registry = settings.registry
    if registry.schema_registry_url is None:
        topics = ", ".join(f"{topic} ({fmt})" for topic, fmt in chosen.items())
        raise ConfigError(
            "WORKER_SCHEMA_REGISTRY_URL",
            f"WORKER_SCHEMA_REGISTRY_URL: the mapping's topics {topics} read their schemas "
            "from a Schema Registry: set its URL",
        )
    retry = settings.retry
    breaker = CircuitBreaker(retry.breaker_failure_threshold, name="registry")
    client = RegistryClient(registry)
    backoff = Backoff(retry.retry_backoff_ms / 1000, retry.retry_backoff_max_ms / 1000)
    writers = WriterSchemas(client, registry.schema_registry_cache_size, breaker, backoff, on_retry)
    return Registry(client, writers, chosen)
