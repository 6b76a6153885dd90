"""Settings: env parsing, flags over env, defaults, and one-line errors naming the setting."""

from __future__ import annotations

import argparse
import dataclasses
import os

import msgspec
import pytest

from worker.settings import (
    SETTINGS_SPEC,
    ConfigError,
    Settings,
    TopicSettings,
    TritonSettings,
    add_run_arguments,
    load_settings,
    read_settings,
    reference_table_markdown,
    settings_env_names,
    settings_from_args,
)

REQUIRED = {
    "WORKER_INPUT_TOPICS": "requests",
    "WORKER_OUTPUT_TOPIC": "results",
    "WORKER_DLQ_TOPIC": "dead-letters",
}


def _env(**extra: str) -> dict[str, str]:
    return {**REQUIRED, **extra}


def _error(env: dict[str, str], argv: list[str] | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_settings(env, argv or [])
    return info.value


def test_defaults() -> None:
    """With only the required settings, every other field takes its documented default."""
    settings = load_settings(REQUIRED)
    assert settings.topics.input_topics == ("requests",)
    assert settings.topics.output_topic == "results"
    assert settings.topics.dlq_topic == "dead-letters"
    assert settings.kafka.bootstrap_servers == "localhost:9092"
    assert settings.kafka.group_id == "kafka-triton-worker"
    assert settings.triton.triton_url == "localhost:8001"
    assert settings.limits.default_model is None
    assert settings.flow.max_in_flight == 256
    assert settings.flow.max_in_flight_per_partition == 128
    assert settings.triton.triton_streams == 2
    assert settings.kafka.commit_interval_ms == 250
    assert settings.ops.shutdown_timeout_s == 30.0
    assert settings.ops.metrics_port == 9400
    assert settings.ops.log_level == "info"
    assert settings.triton.request_timeout_ms == 30_000
    assert settings.limits.max_request_bytes == 8 * 1024 * 1024
    assert settings.limits.max_output_bytes == 1024 * 1024
    assert settings.kafka.linger_ms == 5
    assert settings.kafka.max_poll_records == 500
    assert settings.kafka.auto_offset_reset == "earliest"
    assert settings.kafka.client_id.startswith("kafka-triton-worker-")
    assert settings.kafka.client_id.endswith(f"-{os.getpid()}")


def test_log_format_default_follows_the_terminal() -> None:
    """The log format defaults to console on a terminal and JSON elsewhere."""
    assert load_settings(REQUIRED, isatty=True).ops.log_format == "console"
    assert load_settings(REQUIRED, isatty=False).ops.log_format == "json"
    assert load_settings(_env(WORKER_LOG_FORMAT="json"), isatty=True).ops.log_format == "json"


def test_env_parsing_of_every_type() -> None:
    """Each kind of value (topics, host:port, int, float, size, choice, optional) parses."""
    env = _env(
        WORKER_INPUT_TOPICS=" a , b.c ,d_e ",
        WORKER_BOOTSTRAP_SERVERS="k1:9092, [::1]:9093",
        WORKER_TRITON_URL="triton.svc:8001",
        WORKER_DEFAULT_MODEL="resnet",
        WORKER_MAX_IN_FLIGHT="7",
        WORKER_TRITON_STREAMS="64",
        WORKER_SHUTDOWN_TIMEOUT_S="2.5",
        WORKER_MAX_REQUEST_BYTES="2MiB",
        WORKER_MAX_OUTPUT_BYTES="4096",
        WORKER_AUTO_OFFSET_RESET="LATEST",
        WORKER_LOG_LEVEL="debug",
        WORKER_METRICS_PORT="0",
        WORKER_LINGER_MS="0",
        WORKER_CLIENT_ID="w-1",
    )
    settings = load_settings(env)
    assert settings.topics.input_topics == ("a", "b.c", "d_e")
    assert settings.kafka.bootstrap_servers == "k1:9092,[::1]:9093"
    assert settings.triton.triton_url == "triton.svc:8001"
    assert settings.limits.default_model == "resnet"
    assert settings.flow.max_in_flight == 7
    assert settings.triton.triton_streams == 64
    assert settings.ops.shutdown_timeout_s == 2.5
    assert settings.limits.max_request_bytes == 2 * 1024 * 1024
    assert settings.limits.max_output_bytes == 4096
    assert settings.kafka.auto_offset_reset == "latest"
    assert settings.ops.log_level == "debug"
    assert settings.ops.metrics_port == 0
    assert settings.kafka.linger_ms == 0
    assert settings.kafka.client_id == "w-1"


def test_empty_env_var_counts_as_unset() -> None:
    """An empty variable (as compose passes ``${VAR:-}``) leaves the default in place."""
    settings = load_settings(_env(WORKER_MAX_IN_FLIGHT="", WORKER_DEFAULT_MODEL=""))
    assert settings.flow.max_in_flight == 256
    assert settings.limits.default_model is None


def test_flags_win_over_env() -> None:
    """A flag overrides the variable of the same setting; other variables still apply."""
    env = _env(WORKER_MAX_IN_FLIGHT="10", WORKER_GROUP_ID="from-env")
    settings = load_settings(env, ["--max-in-flight", "20", "--input-topics=x,y"])
    assert settings.flow.max_in_flight == 20
    assert settings.topics.input_topics == ("x", "y")
    assert settings.kafka.group_id == "from-env"


def test_flags_alone_satisfy_required_settings() -> None:
    """The required settings may come from flags with no environment at all."""
    argv = ["--input-topics", "in", "--output-topic", "out", "--dlq-topic", "dlq"]
    settings = load_settings({}, argv)
    assert (
        settings.topics.input_topics,
        settings.topics.output_topic,
        settings.topics.dlq_topic,
    ) == (
        ("in",),
        "out",
        "dlq",
    )


def test_unknown_env_var_is_named_with_a_suggestion() -> None:
    """A misspelt WORKER_ variable fails and the message suggests the closest name."""
    error = _error(_env(WORKER_MAX_INFLIGHT="3"))
    assert error.setting == "WORKER_MAX_INFLIGHT"
    assert "unknown setting" in error.message
    assert "WORKER_MAX_IN_FLIGHT" in error.message


def test_unrelated_env_vars_are_ignored() -> None:
    """Variables without the WORKER_ prefix are none of the worker's business."""
    settings = load_settings(_env(PATH="/bin", HOME="/home/app", KAFKA_HEAP_OPTS="-Xmx1g"))
    assert settings.topics.output_topic == "results"


def test_the_settings_know_no_tooling_variable() -> None:
    """Dev and test tooling reads DEVSTACK_* variables; a WORKER_* one is always a setting."""
    assert not any("DEVSTACK" in name or "DOCKER" in name for name in settings_env_names())
    error = _error(_env(WORKER_DEVSTACK_DIR="somewhere"))
    assert error.setting == "WORKER_DEVSTACK_DIR"
    assert settings_from_args(_env(DEVSTACK_DIR="x"), argparse.Namespace()).topics.dlq_topic


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_missing_required_setting_is_named(name: str) -> None:
    """Each required setting, when absent, fails with its own name."""
    env = {key: value for key, value in REQUIRED.items() if key != name}
    error = _error(env)
    assert error.setting == name
    assert error.message.startswith(f"{name}: required")


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("WORKER_INPUT_TOPICS", ","),
        ("WORKER_INPUT_TOPICS", "a,a"),
        ("WORKER_INPUT_TOPICS", "bad topic"),
        ("WORKER_OUTPUT_TOPIC", "a/b"),
        ("WORKER_DLQ_TOPIC", ".."),
        ("WORKER_BOOTSTRAP_SERVERS", "localhost"),
        ("WORKER_BOOTSTRAP_SERVERS", "k1:9092,"),
        ("WORKER_TRITON_URL", "grpc://localhost:8001"),
        ("WORKER_TRITON_URL", "localhost:70000"),
        ("WORKER_MAX_IN_FLIGHT", "abc"),
        ("WORKER_MAX_IN_FLIGHT", "0"),
        ("WORKER_MAX_IN_FLIGHT_PER_PARTITION", "-1"),
        ("WORKER_TRITON_STREAMS", "65"),
        ("WORKER_COMMIT_INTERVAL_MS", "9"),
        ("WORKER_SHUTDOWN_TIMEOUT_S", "0"),
        ("WORKER_SHUTDOWN_TIMEOUT_S", "nan"),
        ("WORKER_METRICS_PORT", "65536"),
        ("WORKER_REQUEST_TIMEOUT_MS", "1.5"),
        ("WORKER_MAX_REQUEST_BYTES", "8MB"),
        ("WORKER_MAX_OUTPUT_BYTES", "0"),
        ("WORKER_LINGER_MS", "-5"),
        ("WORKER_MAX_POLL_RECORDS", "0"),
        ("WORKER_AUTO_OFFSET_RESET", "none"),
        ("WORKER_LOG_FORMAT", "xml"),
        ("WORKER_LOG_LEVEL", "trace"),
        ("WORKER_GROUP_ID", "   "),
    ],
)
def test_invalid_value_is_named(name: str, raw: str) -> None:
    """An invalid value fails with a one-line message naming the variable and the value."""
    error = _error(_env(**{name: raw}))
    assert error.setting == name
    assert error.message.startswith(f"{name}: must be ")
    assert error.message.endswith(f"got {raw!r}")
    assert "\n" not in error.message


def test_invalid_integer_message_reads_as_documented() -> None:
    """The message for a non-integer is exactly the documented example."""
    error = _error(_env(WORKER_MAX_IN_FLIGHT="abc"))
    assert error.message == "WORKER_MAX_IN_FLIGHT: must be an integer >= 1, got 'abc'"


def test_invalid_flag_value_names_the_flag() -> None:
    """A bad value given as a flag is reported under that flag, keeping the env name."""
    error = _error(REQUIRED, ["--triton-streams", "0"])
    assert error.setting == "WORKER_TRITON_STREAMS"
    assert error.message == "--triton-streams: must be an integer from 1 to 64, got '0'"


def test_unknown_flag_is_named_with_a_suggestion() -> None:
    """An unknown flag fails naming it and suggesting the closest known flag."""
    error = _error(REQUIRED, ["--max-inflight=4"])
    assert error.setting == "--max-inflight"
    assert "--max-in-flight" in error.message


def test_flag_without_value_is_named() -> None:
    """A flag missing its value is an error naming the flag, not an exit."""
    error = _error(REQUIRED, ["--group-id"])
    assert error.setting == "--group-id"
    assert "expected one argument" in error.message


@pytest.mark.parametrize("name", ["WORKER_OUTPUT_TOPIC", "WORKER_DLQ_TOPIC"])
def test_output_topics_must_not_be_inputs(name: str) -> None:
    """Writing results or dead letters to an input topic would feed the worker itself."""
    error = _error(_env(WORKER_INPUT_TOPICS="a,b", **{name: "b"}))
    assert error.setting == name
    assert error.message == f"{name}: must not be an input topic, got 'b'"


def test_per_partition_limit_may_exceed_global_limit() -> None:
    """A per-partition limit above the global one is accepted: the global one still bounds."""
    env = _env(WORKER_MAX_IN_FLIGHT="4", WORKER_MAX_IN_FLIGHT_PER_PARTITION="64")
    assert load_settings(env).flow.max_in_flight_per_partition == 64


def test_settings_are_frozen_and_validated_when_built_in_code() -> None:
    """Sections built directly are checked the same way, and cannot be changed later."""
    topics = TopicSettings(input_topics=("in",), output_topic="out", dlq_topic="dlq")
    settings = Settings(topics=topics)
    assert settings.flow.max_in_flight == 256
    with pytest.raises(AttributeError):
        settings.flow.max_in_flight = 3  # type: ignore[misc]
    with pytest.raises(ConfigError) as info:
        Settings(topics=topics, triton=TritonSettings(triton_streams=0))
    assert info.value.setting == "WORKER_TRITON_STREAMS"
    with pytest.raises(ConfigError) as cross:
        TopicSettings(input_topics=("in",), output_topic="in", dlq_topic="dlq")
    assert cross.value.setting == "WORKER_OUTPUT_TOPIC"


def test_redacted_is_plain_data_and_hides_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The start-up view lists every field as plain data; a field marked secret shows ***."""
    settings = load_settings(REQUIRED)
    view = settings.redacted()
    assert list(view) == [spec.field for spec in SETTINGS_SPEC]
    assert view["input_topics"] == ["requests"]
    assert view["max_in_flight"] == 256
    secrets = [spec.field for spec in SETTINGS_SPEC if spec.secret]
    assert secrets == ["sasl_password", "schema_registry_password"]
    with_secret = load_settings(
        {
            **REQUIRED,
            "WORKER_SECURITY_PROTOCOL": "SASL_SSL",
            "WORKER_SASL_MECHANISM": "PLAIN",
            "WORKER_SASL_PASSWORD": "hunter2",
            "WORKER_SCHEMA_REGISTRY_USER": "reader",
            "WORKER_SCHEMA_REGISTRY_PASSWORD": "swordfish",
        }
    )
    assert with_secret.redacted()["sasl_password"] == "***"
    assert with_secret.redacted()["schema_registry_password"] == "***"
    assert "hunter2" not in repr(with_secret.redacted())
    assert "swordfish" not in repr(with_secret) + repr(with_secret.redacted())
    marked = tuple(
        dataclasses.replace(spec, doc=dataclasses.replace(spec.doc, secret=True))
        if spec.field == "group_id"
        else spec
        for spec in SETTINGS_SPEC
    )
    monkeypatch.setattr("worker.settings.schema.SETTINGS_SPEC", marked)
    view = settings.redacted()
    assert view["group_id"] == "***"
    assert view["output_topic"] == "results"


def test_spec_matches_fields_and_naming_rule() -> None:
    """Each field has one declaration; env and flag names follow from the field name."""
    fields = [f.name for cls in Settings.SECTIONS.values() for f in msgspec.structs.fields(cls)]
    assert [spec.field for spec in SETTINGS_SPEC] == fields
    for spec in SETTINGS_SPEC:
        assert spec.env == "WORKER_" + spec.field.upper()
        assert spec.flag == "--" + spec.field.replace("_", "-")
    assert settings_env_names() == {spec.env for spec in SETTINGS_SPEC}


def test_reference_table_lists_every_setting() -> None:
    """The settings reference has a row per setting with its env var, flag and default."""
    table = reference_table_markdown()
    rows = table.strip().splitlines()
    assert rows[0] == "| env var | flag | type | default | meaning |"
    assert len(rows) == 2 + len(SETTINGS_SPEC)
    for spec, row in zip(SETTINGS_SPEC, rows[2:], strict=True):
        assert row.startswith(f"| `{spec.env}` | `{spec.flag}` |")
    assert "`256`" in rows[2 + [s.field for s in SETTINGS_SPEC].index("max_in_flight")]


def test_run_arguments_show_every_flag_and_env_var() -> None:
    """``run --help`` lists every flag and the variable it overrides."""
    parser = argparse.ArgumentParser(prog="run")
    add_run_arguments(parser)
    text = parser.format_help()
    for spec in SETTINGS_SPEC:
        assert spec.flag in text
        assert spec.env in text


def test_settings_from_a_cli_namespace() -> None:
    """A CLI that parsed its own flags builds the same settings from its namespace."""
    parser = argparse.ArgumentParser(prog="run")
    add_run_arguments(parser)
    namespace = parser.parse_args(["--linger-ms", "9"])
    settings = settings_from_args(_env(WORKER_LINGER_MS="1"), namespace)
    assert settings.kafka.linger_ms == 9
    assert not hasattr(namespace, "max_in_flight")


def test_a_subset_of_the_settings_is_read_alone() -> None:
    """read_settings reads only the specs asked for: others are not judged, unknown names are."""
    wanted = [s for s in SETTINGS_SPEC if s.field in ("dlq_topic", "bootstrap_servers")]
    env = {"WORKER_DLQ_TOPIC": "dead", "WORKER_MAX_IN_FLIGHT": "abc"}
    flags = argparse.Namespace(bootstrap_servers="k1:9092,k2:9092")

    values = read_settings(env, flags, wanted)

    assert values["topics"] == {"dlq_topic": "dead"}
    assert values["kafka"] == {"bootstrap_servers": "k1:9092,k2:9092"}
    assert values["flow"] == {}
    with pytest.raises(ConfigError, match="WORKER_DLQ_TOPIC: required"):
        read_settings({}, argparse.Namespace(), wanted)
    with pytest.raises(ConfigError, match="WORKER_MAX_INFLIGHT: unknown setting"):
        read_settings({**env, "WORKER_MAX_INFLIGHT": "8"}, flags, wanted)


def test_joined_bytes_need_the_final_stream_output() -> None:
    """WORKER_STREAM_JOIN_BYTES joins one result's pieces: refused with each-mode output."""
    error = _error(_env(WORKER_STREAM_OUTPUT="each", WORKER_STREAM_JOIN_BYTES="true"))
    assert error.setting == "WORKER_STREAM_JOIN_BYTES"
    assert "WORKER_STREAM_OUTPUT final" in error.message
    joined = load_settings(_env(WORKER_STREAM_JOIN_BYTES="true"))
    assert (joined.delivery.stream_output, joined.delivery.stream_join_bytes) == ("final", True)
