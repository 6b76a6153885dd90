"""What the settings say about handling one record, read once: limits, the default model,
the allowlist, the retry policy, the mapped topics (and the Schema Registry of those whose
events are Avro or JSON Schema)."""

from __future__ import annotations

from dataclasses import dataclass

from worker import errors, wire
from worker.events import Mappings, load_mappings
from worker.flow.retry import Backoff, RetryPolicy
from worker.registry import Registry, build_registry
from worker.settings import Settings

__all__ = ["Allowlist", "RecordRules"]

Allowlist = tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True, slots=True)
class RecordRules:
    """What the settings say about handling one record."""

    limits: wire.DecodeLimits
    default_model: str | None
    max_output_bytes: int
    allowlist: Allowlist  # (topic, models) rules; "*" allows every model
    group_id: str
    retry: RetryPolicy
    max_consecutive_internal_errors: int
    sequence_from_key: bool
    #: Topics whose records are plain events, by topic (WORKER_MAPPING_FILE).
    mappings: Mappings
    #: Which headers say why a dead letter failed (WORKER_DLQ_HEADER_STYLE).
    dlq_header_style: str = "worker"
    #: Where the registry-format topics' records find their schemas (None: no such topic).
    registry: Registry | None = None

    @classmethod
    def from_settings(cls, settings: Settings) -> RecordRules:
        limits, retry = settings.limits, settings.retry
        mappings = (
            load_mappings(limits.mapping_file, settings.topics.input_topics)
            if limits.mapping_file
            else {}
        )
        formats = {topic: mapping.format for topic, mapping in mappings.items()}
        return cls(
            limits=wire.DecodeLimits(
                limits.max_request_bytes, limits.max_tensor_elements, limits.max_tensor_bytes
            ),
            default_model=limits.default_model,
            max_output_bytes=limits.max_output_bytes,
            allowlist=limits.model_allowlist,
            group_id=settings.kafka.group_id,
            retry=RetryPolicy(
                max_attempts=retry.max_attempts,
                backoff=Backoff(retry.retry_backoff_ms / 1000, retry.retry_backoff_max_ms / 1000),
                record_deadline_s=retry.record_deadline_ms / 1000,
                try_timeout_s=settings.triton.request_timeout_ms / 1000,
            ),
            max_consecutive_internal_errors=retry.max_consecutive_internal_errors,
            sequence_from_key=settings.delivery.sequence_from_key,
            mappings=mappings,
            dlq_header_style=settings.topics.dlq_header_style,
            registry=build_registry(settings, formats),
        )

    def check_model_allowed(self, topic: str, model: str) -> None:
        """Raise Forbidden when the input topic may not use ``model``."""
        for rule_topic, models in self.allowlist:
            if rule_topic == topic and "*" not in models and model not in models:
                raise errors.Forbidden(f"model {model!r} is not allowed for topic {topic!r}")
