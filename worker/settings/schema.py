"""The worker's settings: one frozen object of sections, built once at start-up.

Every setting is declared once, as a field of a section, annotated with its type,
its msgspec constraints (and a text hook where msgspec has no form for it) and its
documentation. The environment variable (``WORKER_<FIELD>``, flat whatever the
section), the ``run`` flag, the settings reference (docs/configuration.md) and the checks
of the deployment files all derive from those declarations. Components take the section they use.
Every check that involves several settings lives here too.
"""

from __future__ import annotations

import typing
from typing import ClassVar

import msgspec

from worker.settings.fields import AuditMode, ConfigError, DeliveryMode, Doc, StreamOutput
from worker.settings.sections import (
    _SECTION_SPECS,
    DeliverySettings,
    FlowSettings,
    KafkaAuthSettings,
    KafkaSettings,
    LimitSettings,
    OpsSettings,
    RegistrySettings,
    RetrySettings,
    TopicSettings,
    TritonSettings,
    _Section,
)
from worker.settings.spec import ENV_PREFIX, SettingSpec, specs_of

__all__ = [
    "ENV_PREFIX",
    "SETTINGS_SPEC",
    "AuditMode",
    "ConfigError",
    "DeliveryMode",
    "DeliverySettings",
    "Doc",
    "FlowSettings",
    "KafkaAuthSettings",
    "KafkaSettings",
    "LimitSettings",
    "OpsSettings",
    "RegistrySettings",
    "RetrySettings",
    "SettingSpec",
    "Settings",
    "StreamOutput",
    "TopicSettings",
    "TritonSettings",
]


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the worker is told at start-up, by section; validated on construction."""

    topics: TopicSettings
    kafka: KafkaSettings = msgspec.field(default_factory=KafkaSettings)
    kafka_auth: KafkaAuthSettings = msgspec.field(default_factory=KafkaAuthSettings)
    triton: TritonSettings = msgspec.field(default_factory=TritonSettings)
    flow: FlowSettings = msgspec.field(default_factory=FlowSettings)
    retry: RetrySettings = msgspec.field(default_factory=RetrySettings)
    delivery: DeliverySettings = msgspec.field(default_factory=DeliverySettings)
    limits: LimitSettings = msgspec.field(default_factory=LimitSettings)
    registry: RegistrySettings = msgspec.field(default_factory=RegistrySettings)
    ops: OpsSettings = msgspec.field(default_factory=OpsSettings)

    #: Section attribute -> its class, in declaration order (the settings reference's order).
    SECTIONS: ClassVar[dict[str, type[_Section]]]

    def __post_init__(self) -> None:
        audit_topic = self.ops.audit_topic
        if audit_topic is not None and audit_topic in self.topics.input_topics:
            raise ConfigError(
                "WORKER_AUDIT_TOPIC",
                f"WORKER_AUDIT_TOPIC: must not be an input topic, got {audit_topic!r}",
            )

    def __repr__(self) -> str:
        # The default repr would print secrets; show the redacted view instead.
        return f"Settings({self.redacted()!r})"

    def redacted(self) -> dict[str, object]:
        """Every setting as plain data for the start-up log; secrets show as ``***``."""
        out: dict[str, object] = {}
        for spec in SETTINGS_SPEC:
            value = spec.get(self)
            if spec.secret and value is not None:
                out[spec.field] = "***"
            else:
                out[spec.field] = list(value) if isinstance(value, tuple) else value
        return out


Settings.SECTIONS = {
    name: typing.get_type_hints(Settings)[name]
    for name in ("topics", "kafka", "kafka_auth", "triton", "flow", "retry", "delivery",
                 "limits", "registry", "ops")
}  # fmt: skip


_SECTION_SPECS.update({cls: tuple(specs_of(name, cls)) for name, cls in Settings.SECTIONS.items()})

#: Every setting, in declaration order: the single source for env, flags and docs.
SETTINGS_SPEC: tuple[SettingSpec, ...] = tuple(
    spec for specs in _SECTION_SPECS.values() for spec in specs
)
