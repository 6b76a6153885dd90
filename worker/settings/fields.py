"""The vocabulary of the settings: value kinds named once, documentation, and ConfigError."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "AuditMode",
    "Compression",
    "ConfigError",
    "DeliveryMode",
    "DlqHeaderStyle",
    "Doc",
    "GroupProtocol",
    "KafkaClient",
    "LogFormat",
    "LogLevel",
    "OffsetReset",
    "Ordering",
    "SaslMechanism",
    "SecurityProtocol",
    "ShmMode",
    "StreamOutput",
    "TritonTrace",
    "WindowMode",
    "default_client_id",
    "log_format_for",
]

LogFormat = Literal["json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
OffsetReset = Literal["earliest", "latest"]
Ordering = Literal["unordered", "key", "partition"]
DeliveryMode = Literal["at_least_once", "exactly_once"]
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]
WindowMode = Literal["fixed", "adaptive"]
ShmMode = Literal["none", "system"]
TritonTrace = Literal["stream", "unary"]
AuditMode = Literal["none", "log", "topic", "both"]
Compression = Literal["none", "gzip", "snappy", "lz4", "zstd"]
StreamOutput = Literal["final", "each"]
KafkaClient = Literal["aiokafka", "confluent"]
GroupProtocol = Literal["classic", "consumer"]
DlqHeaderStyle = Literal["worker", "connect", "both"]


class ConfigError(Exception):
    """A setting is unknown, missing or invalid; the message is one line naming it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        #: The environment variable concerned (or the flag, when the flag itself is unknown).
        self.setting = setting
        self.message = message


@dataclass(frozen=True, slots=True)
class Doc:
    """A setting's documentation: its meaning, and how its default reads."""

    help: str
    secret: bool = False
    default_doc: str | None = None  # prose instead of the literal default
    #: A default that depends on the environment: f(stderr is a terminal) -> value.
    contextual_default: Callable[[bool], object] | None = None


def default_client_id() -> str:
    """``kafka-triton-worker-<hostname>-<pid>``: unique per process, readable in broker logs."""
    return f"kafka-triton-worker-{socket.gethostname()}-{os.getpid()}"


def log_format_for(isatty: bool) -> object:
    # People at a terminal read; collectors parse. Neither has to configure it.
    return "console" if isatty else "json"
