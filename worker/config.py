"""The worker's settings: one frozen object built once at start-up.

Every setting is declared once, as a field of `Settings` whose metadata names its
parser, help text and secrecy. The environment variable (``WORKER_<FIELD>``), the
``run`` flag (``--<field-with-dashes>``), the README table and the checks of the
deployment files all derive from those declarations. Flags win over the
environment; an unknown ``WORKER_*`` variable fails start-up instead of being ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import math
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NoReturn, TypeGuard

ENV_PREFIX = "WORKER_"

#: ``WORKER_*`` variables read by the development and test tooling, not by the worker.
TOOLING_ENV_NAMES: frozenset[str] = frozenset({"WORKER_TEST_DOCKER", "WORKER_DEVSTACK_DIR"})

LogFormat = Literal["json", "console"]
LogLevel = Literal["debug", "info", "warning", "error"]
OffsetReset = Literal["earliest", "latest"]
Ordering = Literal["unordered", "key", "partition"]
Delivery = Literal["at_least_once", "exactly_once"]
SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]
WindowMode = Literal["fixed", "adaptive"]
ShmMode = Literal["none", "system"]
AuditMode = Literal["none", "log", "topic", "both"]
Compression = Literal["none", "gzip", "snappy", "lz4", "zstd"]

_MIB = 1024 * 1024
_TOPIC_RE = re.compile(r"[A-Za-z0-9._-]{1,249}")
_HOST_PORT_RE = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})")
_SIZE_RE = re.compile(r"([0-9]+)\s*(B|KiB|MiB|GiB)?")
_SIZE_UNITS = {None: 1, "B": 1, "KiB": 1024, "MiB": _MIB, "GiB": 1024 * _MIB}


class ConfigError(Exception):
    """A setting is unknown, missing or invalid; the message is one line naming it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(message)
        #: The environment variable concerned (or the flag, when the flag itself is unknown).
        self.setting = setting
        self.message = message


# -- parsers: text -> typed value; `check` also validates values built in code --------


@dataclass(frozen=True, slots=True)
class Parser:
    """Turns the text of an env var or flag into a typed value, or raises ValueError."""

    type_doc: str  # how the type reads in the reference table
    metavar: str  # the placeholder shown in --help
    expected: str  # completes "must be ..." in error messages
    convert: Callable[[str], object]
    valid: Callable[[object], bool]

    def parse(self, raw: str) -> object:
        """Convert stripped text and validate it."""
        try:
            value = self.convert(raw.strip())
        except ValueError:
            raise ValueError(f"must be {self.expected}") from None
        self.check(value)
        return value

    def check(self, value: object) -> None:
        """Validate an already typed value."""
        if not self.valid(value):
            raise ValueError(f"must be {self.expected}")


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(low: int, high: int | None = None) -> Parser:
    def valid(v: object) -> bool:
        return _is_int(v) and low <= v and (high is None or v <= high)

    if high is None:
        return Parser(f"integer >= {low}", "N", f"an integer >= {low}", int, valid)
    return Parser(f"integer {low}..{high}", "N", f"an integer from {low} to {high}", int, valid)


def _size(raw: str) -> int:
    match = _SIZE_RE.fullmatch(raw)
    if match is None:
        raise ValueError(raw)
    return int(match[1]) * _SIZE_UNITS[match[2]]


def _bytes(low: int) -> Parser:
    return Parser(
        "bytes (suffix KiB, MiB, GiB allowed)",
        "SIZE",
        f"a size in bytes >= {low}, such as 1048576 or 1MiB",
        _size,
        lambda v: _is_int(v) and v >= low,
    )


def _seconds() -> Parser:
    # NaN and infinity would turn every deadline computed from the value into nonsense.
    def valid(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and 0 < v < math.inf

    return Parser("seconds > 0", "SECONDS", "a number of seconds > 0", float, valid)


def _seconds_or_zero() -> Parser:
    def valid(v: object) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v < math.inf

    return Parser("number >= 0", "N", "a number >= 0", float, valid)


def _optional_choice(*options: str) -> Parser:
    base = _choice(*options)
    return Parser(
        base.type_doc,
        base.metavar,
        base.expected,
        lambda raw: base.convert(raw) if raw else None,
        lambda v: v is None or base.valid(v),
    )


def _choice(*options: str) -> Parser:
    return Parser(
        " \\| ".join(options),
        "{" + ",".join(options) + "}",
        "one of " + ", ".join(options),
        # Case-insensitive, but the value is always the canonical spelling.
        lambda raw: next((o for o in options if o.lower() == raw.lower()), raw),
        lambda v: v in options,
    )


def _text(optional: bool = False) -> Parser:
    return Parser(
        "string",
        "TEXT",
        "a non-empty string",
        (lambda s: s or None) if optional else str,
        lambda v: (optional and v is None) or (isinstance(v, str) and bool(v.strip())),
    )


def _bool() -> Parser:
    truth = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}

    def convert(raw: str) -> bool:
        if raw.lower() not in truth:
            raise ValueError(raw)
        return truth[raw.lower()]

    return Parser(
        "true \\| false", "{true,false}", "true or false", convert, lambda v: isinstance(v, bool)
    )


def _allowlist() -> Parser:
    """``topic=model|model;topic2=*``: which models each input topic may ask for."""

    def convert(raw: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
        rules = []
        for part in filter(None, (p.strip() for p in raw.split(";"))):
            topic, sep, models = part.partition("=")
            if not sep:
                raise ValueError(part)
            rules.append((topic.strip(), tuple(m.strip() for m in models.split("|") if m.strip())))
        return tuple(rules)

    def valid(v: object) -> bool:
        return isinstance(v, tuple) and all(
            _is_topic(topic) and len(models) > 0 for topic, models in v
        )

    return Parser(
        "topic=model\\|model;...",
        "RULES",
        "rules like 'requests=double|mlp;other=*' (topic=models separated by |)",
        convert,
        valid,
    )


def _is_topic(name: object) -> bool:
    return isinstance(name, str) and bool(_TOPIC_RE.fullmatch(name)) and name not in {".", ".."}


def _topic() -> Parser:
    return Parser("topic name", "TOPIC", "a Kafka topic name ([A-Za-z0-9._-])", str, _is_topic)


def _topics() -> Parser:
    def valid(v: object) -> bool:
        if not isinstance(v, tuple):
            return False
        return 0 < len(v) == len(set(v)) and all(_is_topic(name) for name in v)

    return Parser(
        "comma-separated topic names",
        "TOPIC[,TOPIC...]",
        "one or more distinct Kafka topic names, comma-separated",
        lambda s: tuple(part.strip() for part in s.split(",")),
        valid,
    )


def _is_host_port(text: str) -> bool:
    match = _HOST_PORT_RE.fullmatch(text)
    return match is not None and 1 <= int(match[2]) <= 65535


def _host_ports(many: bool) -> Parser:
    if not many:
        return Parser(
            "host:port",
            "HOST:PORT",
            "host:port (no scheme, port 1-65535)",
            str,
            lambda v: isinstance(v, str) and _is_host_port(v),
        )
    return Parser(
        "comma-separated host:port",
        "HOST:PORT[,...]",
        "host:port pairs separated by commas (no scheme, port 1-65535)",
        lambda s: ",".join(part.strip() for part in s.split(",")),
        lambda v: isinstance(v, str) and all(_is_host_port(p) for p in v.split(",")),
    )


# -- declarations --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Meta:
    parser: Parser
    help: str
    secret: bool
    default_doc: str | None
    contextual_default: Callable[[bool], object] | None


def _meta(
    parser: Parser,
    help: str,
    *,
    secret: bool = False,
    default_doc: str | None = None,
    contextual_default: Callable[[bool], object] | None = None,
) -> dict[str, _Meta]:
    return {"setting": _Meta(parser, help, secret, default_doc, contextual_default)}


def _setting(
    default: object,
    parser: Parser,
    help: str,
    *,
    secret: bool = False,
    default_doc: str | None = None,
    contextual_default: Callable[[bool], object] | None = None,
) -> Any:
    """Declare a setting with a default: its field, parser, help text and secrecy."""
    meta = _meta(
        parser, help, secret=secret, default_doc=default_doc, contextual_default=contextual_default
    )
    if callable(default):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)


def default_client_id() -> str:
    """``kafka-triton-worker-<hostname>-<pid>``: unique per process, readable in broker logs."""
    return f"kafka-triton-worker-{socket.gethostname()}-{os.getpid()}"


def _log_format_for(isatty: bool) -> object:
    # People at a terminal read; collectors parse. Neither has to configure it.
    return "console" if isatty else "json"


# fmt: off
@dataclass(frozen=True, slots=True)
class Settings:
    """Everything the worker is told at start-up; validated on construction.

    Field ``x`` is read from env ``WORKER_X`` and flag ``--x`` (underscores as dashes).
    """

    input_topics: tuple[str, ...] = field(metadata=_meta(
        _topics(), "Topics to consume inference requests from."))
    output_topic: str = field(metadata=_meta(_topic(), "Topic the results are published to."))
    dlq_topic: str = field(metadata=_meta(
        _topic(), "Dead-letter topic: failed requests with the reason in headers."))
    bootstrap_servers: str = _setting(
        "localhost:9092", _host_ports(many=True), "Kafka bootstrap servers.")
    group_id: str = _setting(
        "kafka-triton-worker", _text(), "Consumer group; workers sharing it share partitions.")
    client_id: str = _setting(
        default_client_id, _text(), "Kafka client id, shown in broker logs and quotas.",
        default_doc="kafka-triton-worker-<hostname>-<pid>")
    # `_setting` returns a dataclasses.Field; RUF009 only sees a call.
    auto_offset_reset: OffsetReset = _setting(  # noqa: RUF009
        "earliest", _choice("earliest", "latest"),
        "Where a group without committed offsets starts reading.")
    max_poll_records: int = _setting(500, _int(1), "Most records returned by one fetch.")
    commit_interval_ms: int = _setting(1000, _int(10), "How often done offsets are committed.")
    linger_ms: int = _setting(5, _int(0), "Producer linger: time spent filling a batch.")
    compression_type: Compression = _setting(  # noqa: RUF009
        "none", _choice("none", "gzip", "snappy", "lz4", "zstd"),
        "Compression of the batches the worker produces (results, dead letters, audit). "
        "Input batches of every codec are read whatever this says.")
    triton_url: str = _setting("localhost:8001", _host_ports(many=False), "Triton gRPC endpoint.")
    triton_streams: int = _setting(2, _int(1, 64), "Number of stream_infer streams to Triton.")
    default_model: str | None = _setting(
        None, _text(optional=True), "Model used when neither headers nor body name one.")
    max_in_flight: int = _setting(256, _int(1), "Most requests in flight in this worker.")
    max_in_flight_per_partition: int = _setting(
        64, _int(1), "Most requests in flight from one partition.")
    request_timeout_ms: int = _setting(
        30_000, _int(1), "Client-side deadline of one try on a Triton stream.")
    max_request_bytes: int = _setting(
        8 * _MIB, _bytes(1), "Largest request value accepted; larger ones get TOO_LARGE.")
    max_output_bytes: int = _setting(
        _MIB, _bytes(1), "Largest result published; keep it below the broker's max message "
        "size. Larger results get OUTPUT_TOO_LARGE.")
    shutdown_timeout_s: float = _setting(
        30.0, _seconds(), "Bound on draining in-flight work at shutdown.")
    metrics_port: int = _setting(
        9400, _int(0, 65535), "Port of /metrics, /healthz and /readyz; 0 disables them.")
    log_format: LogFormat = _setting(  # noqa: RUF009
        "json", _choice("json", "console"), "Logs as JSON lines, or human-readable.",
        default_doc="console on a terminal, else json", contextual_default=_log_format_for)
    log_level: LogLevel = _setting(  # noqa: RUF009
        "info", _choice("debug", "info", "warning", "error"), "Least level logged.")

    # -- reliability ---------------------------------------------------------------
    max_attempts: int = _setting(
        5, _int(1, 100), "Tries of a request that fails for a retryable reason.")
    retry_backoff_ms: int = _setting(
        100, _int(1), "First retry backoff; it doubles per try (full jitter).")
    retry_backoff_max_ms: int = _setting(5000, _int(1), "Longest retry backoff.")
    record_deadline_ms: int = _setting(
        300_000, _int(1), "Overall deadline of one record across all its tries.")
    breaker_failure_threshold: int = _setting(
        5, _int(1), "Consecutive Triton failures that open the circuit breaker.")
    breaker_probe_interval_ms: int = _setting(
        1000, _int(10), "How often Triton health is probed (and the open breaker retried).")
    max_poll_interval_ms: int = _setting(
        300_000, _int(1000), "Kafka max.poll.interval.ms of the consumer.")
    session_timeout_ms: int = _setting(
        10_000, _int(1000), "Kafka session timeout: how soon a dead member is noticed.")
    max_consecutive_internal_errors: int = _setting(
        100, _int(1),
        "Records in a row that may meet a bug (INTERNAL_ERROR) before the worker stops "
        "with exit 3 rather than dead-letter a whole topic.")
    revoke_timeout_s: float = _setting(
        10.0, _seconds(), "Bound on waiting for a revoked partition's in-flight records.")
    ordering: Ordering = _setting(  # noqa: RUF009
        "unordered", _choice("unordered", "key", "partition"),
        "unordered; key: one at a time per key in offset order; partition: results "
        "published in offset order per partition.")
    delivery: Delivery = _setting(  # noqa: RUF009
        "at_least_once", _choice("at_least_once", "exactly_once"),
        "exactly_once: results, dead letters and offsets in one Kafka transaction.")
    transactional_id_prefix: str = _setting(
        "kafka-triton-worker", _text(),
        "exactly_once: prefix of the producers' transactional ids (one per input partition).")
    # -- performance ---------------------------------------------------------------
    batch_max_size: int = _setting(
        32, _int(1, 1024),
        "Client-side micro-batching: most requests coalesced into one Triton request "
        "(1 disables it).")
    batch_delay_ms: float = _setting(
        2.0, _seconds_or_zero(), "Longest wait for a micro-batch to fill, in milliseconds.")
    window_mode: WindowMode = _setting(  # noqa: RUF009
        "fixed", _choice("fixed", "adaptive"),
        "adaptive: the window grows while latency stays low and shrinks on overload, "
        "between WORKER_MIN_IN_FLIGHT and WORKER_MAX_IN_FLIGHT.")
    min_in_flight: int = _setting(4, _int(1), "Lower bound of the adaptive window.")
    triton_shm: ShmMode = _setting(  # noqa: RUF009
        "none", _choice("none", "system"),
        "system: send large tensors through system shared memory (Triton on the same host).")
    shm_min_bytes: int = _setting(
        _MIB, _bytes(1), "Tensors at least this large go through shared memory.")
    shm_pool_bytes: int = _setting(
        256 * _MIB, _bytes(_MIB), "Total size of the registered shared-memory regions.")
    # -- security ------------------------------------------------------------------
    security_protocol: SecurityProtocol = _setting(  # noqa: RUF009
        "PLAINTEXT", _choice("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"),
        "Kafka security protocol, for the consumer and every producer.")
    sasl_mechanism: SaslMechanism | None = _setting(  # noqa: RUF009
        None, _optional_choice("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"),
        "Kafka SASL mechanism.")
    sasl_username: str | None = _setting(None, _text(optional=True), "Kafka SASL user name.")
    sasl_password: str | None = _setting(
        None, _text(optional=True), "Kafka SASL password (prefer WORKER_SASL_PASSWORD_FILE).",
        secret=True)
    sasl_password_file: str | None = _setting(
        None, _text(optional=True), "File holding the Kafka SASL password.")
    sasl_oauth_token_file: str | None = _setting(
        None, _text(optional=True), "OAUTHBEARER: file holding the token (re-read on refresh).")
    sasl_oauth_token_command: str | None = _setting(
        None, _text(optional=True), "OAUTHBEARER: command printing a token (run on refresh).")
    ssl_cafile: str | None = _setting(
        None, _text(optional=True), "CA bundle that signs the Kafka brokers' certificates.")
    ssl_certfile: str | None = _setting(
        None, _text(optional=True), "Client certificate for Kafka (mutual TLS).")
    ssl_keyfile: str | None = _setting(
        None, _text(optional=True), "Client private key for Kafka (mutual TLS).")
    triton_ssl: bool = _setting(False, _bool(), "Connect to Triton over gRPC with TLS.")
    triton_ssl_cafile: str | None = _setting(
        None, _text(optional=True), "CA bundle that signs Triton's certificate.")
    triton_ssl_certfile: str | None = _setting(
        None, _text(optional=True), "Client certificate for Triton (mutual TLS).")
    triton_ssl_keyfile: str | None = _setting(
        None, _text(optional=True), "Client private key for Triton (mutual TLS).")
    triton_auth_header: str = _setting(
        "authorization", _text(), "gRPC metadata header carrying the Triton token.")
    triton_auth_token_file: str | None = _setting(
        None, _text(optional=True),
        "File holding the Triton token (sent as the whole header value, e.g. 'Bearer x'); "
        "re-read when it changes.")
    audit: AuditMode = _setting(  # noqa: RUF009
        "none", _choice("none", "log", "topic", "both"),
        "One audit record per request: to a log stream, an audit topic, or both.")
    audit_topic: str | None = _setting(
        None, _text(optional=True), "Topic of the audit records (audit=topic or both).")
    max_tensor_elements: int = _setting(
        16 * _MIB, _int(1), "Most elements in one input tensor; more get TOO_LARGE.")
    max_tensor_bytes: int = _setting(
        64 * _MIB, _bytes(1), "Largest input tensor in bytes; larger get TOO_LARGE.")
    model_allowlist: tuple[tuple[str, tuple[str, ...]], ...] = _setting(
        (), _allowlist(),
        "Models each input topic may use ('requests=double|mlp;other=*'); others get "
        "FORBIDDEN. Empty allows all.",
        default_doc="empty (all models allowed)")
    # fmt: on

    def __post_init__(self) -> None:
        for spec in SETTINGS_SPEC:
            value = getattr(self, spec.field)
            try:
                spec.parser.check(value)
            except ValueError as exc:
                shown = "***" if spec.secret else repr(value)
                raise ConfigError(spec.env, f"{spec.env}: {exc}, got {shown}") from None
        # Reading our own output would loop forever and grow without bound.
        for name, topic in (
            ("WORKER_OUTPUT_TOPIC", self.output_topic),
            ("WORKER_DLQ_TOPIC", self.dlq_topic),
        ):
            if topic in self.input_topics:
                raise ConfigError(name, f"{name}: must not be an input topic, got {topic!r}")
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Settings that only make sense together; each error names the one to fix."""
        sasl = self.security_protocol.startswith("SASL_")
        problems = [
            ("WORKER_SASL_MECHANISM", sasl and self.sasl_mechanism is None,
             f"required when WORKER_SECURITY_PROTOCOL is {self.security_protocol}"),
            ("WORKER_SASL_MECHANISM", not sasl and self.sasl_mechanism is not None,
             "needs WORKER_SECURITY_PROTOCOL SASL_PLAINTEXT or SASL_SSL"),
            ("WORKER_SASL_PASSWORD", self.sasl_password is not None
             and self.sasl_password_file is not None,
             "set either WORKER_SASL_PASSWORD or WORKER_SASL_PASSWORD_FILE, not both"),
            ("WORKER_AUDIT_TOPIC", self.audit in ("topic", "both") and self.audit_topic is None,
             f"required when WORKER_AUDIT is {self.audit}"),
            ("WORKER_MIN_IN_FLIGHT",
             self.window_mode == "adaptive" and self.min_in_flight > self.max_in_flight,
             "must not exceed WORKER_MAX_IN_FLIGHT when WORKER_WINDOW_MODE is adaptive"),
            ("WORKER_RETRY_BACKOFF_MAX_MS", self.retry_backoff_max_ms < self.retry_backoff_ms,
             "must not be below WORKER_RETRY_BACKOFF_MS"),
            ("WORKER_SSL_KEYFILE", (self.ssl_certfile is None) != (self.ssl_keyfile is None),
             "WORKER_SSL_CERTFILE and WORKER_SSL_KEYFILE go together"),
            ("WORKER_TRITON_SSL_KEYFILE",
             (self.triton_ssl_certfile is None) != (self.triton_ssl_keyfile is None),
             "WORKER_TRITON_SSL_CERTFILE and WORKER_TRITON_SSL_KEYFILE go together"),
        ]
        for name, wrong, why in problems:
            if wrong:
                raise ConfigError(name, f"{name}: {why}")

    def __repr__(self) -> str:
        # The dataclass repr would print secrets; show the redacted view instead.
        return f"Settings({self.redacted()!r})"

    def redacted(self) -> dict[str, object]:
        """The settings as plain data for the start-up log; secret values show as ``***``."""
        out: dict[str, object] = {}
        for spec in SETTINGS_SPEC:
            value = getattr(self, spec.field)
            if spec.secret and value is not None:
                out[spec.field] = "***"
            else:
                out[spec.field] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """One setting as read from the environment and flags, and as documented."""

    field: str
    env: str
    flag: str
    parser: Parser
    help: str
    required: bool
    secret: bool
    default: object
    default_doc: str
    default_is_value: bool  # default_doc is a literal value rather than prose
    contextual_default: Callable[[bool], object] | None


def _default_doc(value: object) -> str:
    if value is None:
        return "(none)"
    if _is_int(value) and value >= _MIB and value % _MIB == 0:
        return f"{value // _MIB}MiB"
    return str(value)


def _build_spec() -> tuple[SettingSpec, ...]:
    specs = []
    for f in dataclasses.fields(Settings):
        meta: _Meta = f.metadata["setting"]
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        default = None if f.default is dataclasses.MISSING else f.default
        doc = meta.default_doc or ("required" if required else _default_doc(default))
        doc_is_value = meta.default_doc is None and default is not None
        specs.append(
            SettingSpec(
                field=f.name,
                env=ENV_PREFIX + f.name.upper(),
                flag="--" + f.name.replace("_", "-"),
                parser=meta.parser,
                help=meta.help,
                required=required,
                secret=meta.secret,
                default=default,
                default_doc=doc,
                default_is_value=doc_is_value,
                contextual_default=meta.contextual_default,
            )
        )
    return tuple(specs)


#: Every setting, in declaration order: the single source for env, flags and docs.
SETTINGS_SPEC: tuple[SettingSpec, ...] = _build_spec()


def settings_env_names() -> frozenset[str]:
    """All ``WORKER_*`` environment variables the settings know (not the tooling ones)."""
    return frozenset(spec.env for spec in SETTINGS_SPEC)


def _md(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def reference_table_markdown() -> str:
    """The settings as a Markdown table (env var | flag | type | default | meaning)."""
    lines = ["| env var | flag | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
    for spec in SETTINGS_SPEC:
        cells = [
            f"`{spec.env}`",
            f"`{spec.flag}`",
            spec.parser.type_doc,
            f"`{spec.default_doc}`" if spec.default_is_value else _md(spec.default_doc),
            _md(spec.help),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


# -- loading -------------------------------------------------------------------------


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting to ``parser``; its help names the env var and default.

    Flags default to "absent" so that the environment applies unless a flag is given.
    """
    group = parser.add_argument_group("settings (flags override WORKER_* environment variables)")
    for spec in SETTINGS_SPEC:
        help_text = f"{spec.help} [env {spec.env}; default: {spec.default_doc}]"
        group.add_argument(
            spec.flag,
            dest=spec.field,
            metavar=spec.parser.metavar,
            default=argparse.SUPPRESS,
            help=help_text.replace("%", "%%"),
        )


class _FlagParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # argparse would print usage and exit; start-up errors go through ConfigError.
        raise ConfigError("argv", f"invalid arguments: {message}")


def _closest(name: str, known: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f" (did you mean {match[0]}?)" if match else ""


def _check_unknown_env(env: Mapping[str, str]) -> None:
    known = settings_env_names()
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name not in known and name not in TOOLING_ENV_NAMES:
            hint = _closest(name, sorted(known))
            raise ConfigError(name, f"{name}: unknown setting{hint}")


def settings_from_args(
    env: Mapping[str, str], flags: argparse.Namespace, *, isatty: bool = False
) -> Settings:
    """Build the settings from ``env`` and a namespace filled by `add_run_arguments` flags.

    For a CLI that parses its own arguments; `load_settings` is the usual entry point.
    An empty env var counts as unset, because compose files pass ``${VAR:-}`` through.
    """
    _check_unknown_env(env)
    values: dict[str, Any] = {}
    for spec in SETTINGS_SPEC:
        flag_value: str | None = getattr(flags, spec.field, None)
        if flag_value is not None:
            source, raw = spec.flag, flag_value
        elif env.get(spec.env, ""):
            source, raw = spec.env, env[spec.env]
        elif spec.required:
            raise ConfigError(spec.env, f"{spec.env}: required, set it or pass {spec.flag}")
        else:
            if spec.contextual_default is not None:
                values[spec.field] = spec.contextual_default(isatty)
            continue
        try:
            values[spec.field] = spec.parser.parse(raw)
        except ValueError as exc:
            shown = "***" if spec.secret else repr(raw)
            raise ConfigError(spec.env, f"{source}: {exc}, got {shown}") from None
    return Settings(**values)


def load_settings(
    env: Mapping[str, str], argv: Sequence[str] = (), *, isatty: bool = False
) -> Settings:
    """Build the settings from environment variables, then ``run`` flags (flags win).

    ``isatty`` says whether stderr is a terminal; it picks the default log format.
    Raises ConfigError naming the setting at the first problem.
    """
    parser = _FlagParser(prog="run", add_help=False, allow_abbrev=False, exit_on_error=False)
    add_run_arguments(parser)
    try:
        namespace, extra = parser.parse_known_args(list(argv))
    except argparse.ArgumentError as exc:
        flag = exc.argument_name or "argv"
        raise ConfigError(flag, f"{flag}: {exc.message}") from None
    if extra:
        unknown = extra[0].split("=", 1)[0]
        hint = _closest(unknown, [spec.flag for spec in SETTINGS_SPEC])
        raise ConfigError(unknown, f"{unknown}: unknown flag{hint}")
    return settings_from_args(env, namespace, isatty=isatty)
