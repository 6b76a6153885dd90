"""The worker's settings: sections built once at start-up from ``WORKER_*`` variables and flags."""

from worker.settings.reference import reference_table_markdown
from worker.settings.schema import (
    ENV_PREFIX,
    SETTINGS_SPEC,
    ConfigError,
    DeliverySettings,
    FlowSettings,
    KafkaAuthSettings,
    KafkaSettings,
    LimitSettings,
    OpsSettings,
    RetrySettings,
    Settings,
    SettingSpec,
    StreamOutput,
    TopicSettings,
    TritonSettings,
)
from worker.settings.sources import (
    add_run_arguments,
    add_setting_arguments,
    load_settings,
    read_settings,
    settings_env_names,
    settings_from_args,
)

__all__ = [
    "ENV_PREFIX",
    "SETTINGS_SPEC",
    "ConfigError",
    "DeliverySettings",
    "FlowSettings",
    "KafkaAuthSettings",
    "KafkaSettings",
    "LimitSettings",
    "OpsSettings",
    "RetrySettings",
    "SettingSpec",
    "Settings",
    "StreamOutput",
    "TopicSettings",
    "TritonSettings",
    "add_run_arguments",
    "add_setting_arguments",
    "load_settings",
    "read_settings",
    "reference_table_markdown",
    "settings_env_names",
    "settings_from_args",
]
