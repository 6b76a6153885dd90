"""The commands beside ``run`` read the worker's Kafka settings (the client library
included), and document every flag."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import CoroutineType
from typing import Any

import pytest
from aiokafka.structs import ConsumerRecord

from worker.cli import build_parser
from worker.commands.session import read_connection, topic_problem
from worker.commands.tail import record_line
from worker.settings import ConfigError


def _subcommand(name: str) -> argparse.ArgumentParser:
    commands = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    parser: argparse.ArgumentParser = commands.choices[name]
    return parser


def _args(command: str, *argv: str) -> argparse.Namespace:
    return _subcommand(command).parse_args(list(argv))


@pytest.mark.parametrize("command", ["produce", "topics", "tail", "replay"])
def test_every_flag_of_the_kafka_commands_has_help(command: str) -> None:
    """--help explains each flag: none is listed without a text."""
    parser = _subcommand(command)
    bare = [
        action.option_strings or action.dest
        for action in parser._actions
        if not action.help and action.dest != "help"
    ]
    assert bare == []
    text = parser.format_help()
    for flag in ("--bootstrap-servers", "--security-protocol", "--sasl-mechanism", "--ssl-cafile"):
        assert flag in text


def test_produce_needs_no_worker_topics_and_takes_kafka_from_the_environment() -> None:
    """WORKER_BOOTSTRAP_SERVERS and SASL come from the env; the input topics are not required."""
    env = {
        "WORKER_BOOTSTRAP_SERVERS": "broker-1:9093",
        "WORKER_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "WORKER_SASL_MECHANISM": "SCRAM-SHA-512",
        "WORKER_SASL_USERNAME": "alice",
        "WORKER_SASL_PASSWORD": "pw",
    }
    connection = read_connection(
        _args("produce", "--file", "-"), optional=["input_topics"], env=env
    )
    assert connection.bootstrap_servers == "broker-1:9093"
    assert connection.auth.sasl_username == "alice"
    assert "input_topics" not in connection.values


def test_flags_win_over_the_environment_and_optional_settings_are_read_when_set() -> None:
    """--bootstrap-servers overrides the env; WORKER_INPUT_TOPICS, when set, is read."""
    env = {"WORKER_BOOTSTRAP_SERVERS": "env:9092", "WORKER_INPUT_TOPICS": "a,b"}
    args = _args("produce", "--file", "-", "--bootstrap-servers", "flag:9092")
    connection = read_connection(args, optional=["input_topics"], env=env)
    assert connection.bootstrap_servers == "flag:9092"
    assert connection.values["input_topics"] == ("a", "b")


_TOPIC = {"WORKER_OUTPUT_TOPIC": "results"}


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"WORKER_BOOTSTRAP_SERVER": "x:1"}, "WORKER_BOOTSTRAP_SERVER"),
        ({**_TOPIC, "WORKER_BOOTSTRAP_SERVERS": "http://x"}, "WORKER_BOOTSTRAP_SERVERS"),
        ({**_TOPIC, "WORKER_SECURITY_PROTOCOL": "SASL_SSL"}, "WORKER_SASL_MECHANISM"),
        ({}, "WORKER_OUTPUT_TOPIC"),
    ],
)
def test_settings_errors_name_the_setting(env: dict[str, str], named: str) -> None:
    """A typo, a bad value, a missing credential or topic: ConfigError naming the setting."""
    with pytest.raises(ConfigError) as raised:
        read_connection(_args("tail", "results"), ["output_topic"], env=env)
    assert raised.value.setting == named


def test_topic_problem_says_what_is_wrong() -> None:
    """Missing, not authorized, no permission, or fine: one phrase each."""
    allowed, nothing = (1 << 3) | (1 << 4), 0
    metadata = {
        "topics": [
            {"topic": "ok", "error_code": 0, "topic_authorized_operations": allowed},
            {"topic": "locked", "error_code": 0, "topic_authorized_operations": nothing},
            {"topic": "hidden", "error_code": 29, "topic_authorized_operations": 0},
        ]
    }
    assert topic_problem(metadata, "ok", 4) is None
    assert "no write permission" in str(topic_problem(metadata, "locked", 4))
    assert "not authorized" in str(topic_problem(metadata, "hidden", 3))
    assert "does not exist" in str(topic_problem(metadata, "gone", 3))


def _record(value: bytes | None, headers: list[tuple[str, bytes | None]]) -> ConsumerRecord:
    return ConsumerRecord(
        "t",
        0,
        7,
        1700000000000,
        0,
        b"k",
        value,
        None,
        1,
        1,
        headers,
    )


def test_a_record_line_holds_its_value_as_json_text_or_base64() -> None:
    """A JSON value stays a document, other UTF-8 stays text, binary is base64; headers decode."""
    line = record_line(_record(b'{"id": "r1"}', [("x-error-code", b"DECODE_ERROR"), ("n", None)]))
    assert line["value"] == {"id": "r1"}
    assert line["headers"] == {"x-error-code": "DECODE_ERROR", "n": None}
    assert (line["topic"], line["partition"], line["offset"], line["key"]) == ("t", 0, 7, "k")
    assert record_line(_record(b"not json", []))["value"] == "not json"
    assert record_line(_record(b"\xff\x00", []))["value_base64"] == "/wA="
    assert record_line(_record(None, []))["value"] is None


def test_produce_with_a_topic_does_not_judge_the_input_topics(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--topic given: an unusable WORKER_INPUT_TOPICS is neither needed nor refused."""
    from worker.commands import produce

    started: list[str] = []

    def run_command(work: CoroutineType[Any, Any, int]) -> int:
        started.append(work.cr_code.co_name)  # the Kafka side is not this test's concern
        work.close()
        return 0

    monkeypatch.setattr(produce, "run_command", run_command)
    monkeypatch.setenv("WORKER_INPUT_TOPICS", "a,a")  # duplicate names: invalid
    requests = tmp_path / "requests.json"
    requests.write_text('{"id": "r1", "inputs": []}')
    assert produce.run_produce(_args("produce", "--file", str(requests), "--topic", "t")) == 0
    assert started == ["_produce"]


_COMMANDS = {
    "produce": ("--file", "-"),
    "tail": ("results",),
    "topics": (),
    "replay": (),
}


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_every_command_reads_the_kafka_client(command: str) -> None:
    """WORKER_KAFKA_CLIENT, or --kafka-client, chooses the client of every command (before,
    the commands ignored it and ran on aiokafka)."""
    args = _args(command, *_COMMANDS[command])
    env = {"WORKER_KAFKA_CLIENT": "confluent", "WORKER_OUTPUT_TOPIC": "results"}
    assert read_connection(args, env=env).kafka.kafka_client == "confluent"
    flagged = _args(command, *_COMMANDS[command], "--kafka-client", "confluent")
    assert read_connection(flagged, env={}).kafka.kafka_client == "confluent"
    assert read_connection(args, env={}).kafka.kafka_client == "aiokafka"


@pytest.mark.parametrize("command", sorted(_COMMANDS))
def test_confluent_without_its_extra_is_refused_as_run_refuses_it(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """WORKER_KAFKA_CLIENT=confluent where confluent-kafka is not installed: ConfigError
    naming the setting and the extra to install, before any connection."""
    monkeypatch.setitem(sys.modules, "confluent_kafka", None)  # as if not installed
    with pytest.raises(ConfigError) as raised:
        read_connection(
            _args(command, *_COMMANDS[command]), env={"WORKER_KAFKA_CLIENT": "confluent"}
        )
    assert raised.value.setting == "WORKER_KAFKA_CLIENT"
    assert "kafka-triton-worker[confluent]" in str(raised.value)
