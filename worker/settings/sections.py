"""The sections of the settings: each a frozen group of fields, checked on construction.

Each field is one setting, annotated with its type, its msgspec constraints (and a
text hook where msgspec has no form for it) and its documentation; each section
checks the settings of its own that only make sense together.
"""

from __future__ import annotations

from importlib.util import find_spec
from typing import Annotated

import msgspec
from msgspec import Meta

from worker.settings.fields import (
    AuditMode,
    Compression,
    ConfigError,
    DeliveryMode,
    DlqHeaderStyle,
    Doc,
    GroupProtocol,
    KafkaClient,
    LogFormat,
    LogLevel,
    OffsetReset,
    Ordering,
    SaslMechanism,
    SecurityProtocol,
    ShmMode,
    StreamOutput,
    TritonTrace,
    WindowMode,
    default_client_id,
    log_format_for,
)
from worker.settings.parsers import (
    MIB,
    allowlist,
    host_ports,
    seconds,
    size,
    topic,
    topics,
)
from worker.settings.spec import SettingSpec

__all__ = [
    "DeliverySettings",
    "FlowSettings",
    "KafkaAuthSettings",
    "KafkaSettings",
    "LimitSettings",
    "OpsSettings",
    "RegistrySettings",
    "RetrySettings",
    "TopicSettings",
    "TritonSettings",
]

#: Each section's settings, filled in by ``schema`` once every section is declared.
_SECTION_SPECS: dict[type[_Section], tuple[SettingSpec, ...]] = {}


class _Section(msgspec.Struct, frozen=True, kw_only=True):
    """A group of settings; each field checked on construction, ConfigError naming it."""

    def __post_init__(self) -> None:
        for spec in _SECTION_SPECS[type(self)]:
            value = getattr(self, spec.field)
            try:
                spec.kind.check(value)
            except ValueError as exc:
                shown = "***" if spec.secret else repr(value)
                raise ConfigError(spec.env, f"{spec.env}: {exc}, got {shown}") from None
        self._check_combinations()

    def _check_combinations(self) -> None:
        """Settings of this section that only make sense together."""

    @staticmethod
    def _refuse(problems: list[tuple[str, bool, str]]) -> None:
        for name, wrong, why in problems:
            if wrong:
                raise ConfigError(name, f"{name}: {why}")


# fmt: off
class TopicSettings(_Section, frozen=True, kw_only=True):
    """Where requests come from and where outcomes go."""

    input_topics: Annotated[tuple[str, ...], topics(),
                            Doc("Topics to consume inference requests from.")]
    output_topic: Annotated[str, topic(), Doc("Topic the results are published to.")]
    dlq_topic: Annotated[str, topic(),
                         Doc("Dead-letter topic: failed requests with the reason in headers.")]
    dlq_header_style: Annotated[DlqHeaderStyle, Doc(
        "Headers that say why a dead letter failed: worker (x-error-*, x-source-*), connect "
        "(Kafka Connect's __connect.errors.*, for tools made for Connect's dead letters), "
        "or both.")] = "worker"

    def _check_combinations(self) -> None:
        # Reading our own output would loop forever and grow without bound.
        for name, value in (("WORKER_OUTPUT_TOPIC", self.output_topic),
                            ("WORKER_DLQ_TOPIC", self.dlq_topic)):
            if value in self.input_topics:
                raise ConfigError(name, f"{name}: must not be an input topic, got {value!r}")


class KafkaSettings(_Section, frozen=True, kw_only=True):
    """The Kafka clients: group membership, fetching, producing."""

    kafka_client: Annotated[KafkaClient, Doc(
        "The Kafka client library: aiokafka (pure Python), or confluent (librdkafka through "
        "confluent-kafka; docs/kafka-clients.md).")] = "aiokafka"
    group_protocol: Annotated[GroupProtocol, Doc(
        "Consumer group protocol: classic (eager rebalances), or consumer (KIP-848, "
        "incremental, assignments computed by the broker; needs WORKER_KAFKA_CLIENT "
        "confluent).")] = "classic"
    bootstrap_servers: Annotated[str, host_ports(), Doc("Kafka bootstrap servers.")] = (
        "localhost:9092")
    group_id: Annotated[str, Doc("Consumer group; workers sharing it share partitions.")] = (
        "kafka-triton-worker")
    client_id: Annotated[str, Doc("Kafka client id, shown in broker logs and quotas.",
                                  default_doc="kafka-triton-worker-<hostname>-<pid>")] = (
        msgspec.field(default_factory=default_client_id))
    auto_offset_reset: Annotated[OffsetReset, Doc(
        "Where a group without committed offsets starts reading.")] = "earliest"
    max_poll_records: Annotated[int, Meta(ge=1), Doc("Most records returned by one fetch.")] = 500
    commit_interval_ms: Annotated[int, Meta(ge=10), Doc(
        "How often done offsets are committed (only when a commit point or done run moved).")] = 250
    linger_ms: Annotated[int, Meta(ge=0), Doc(
        "Producer linger: time spent filling a batch.")] = 5
    compression_type: Annotated[Compression, Doc(
        "Compression of the batches the worker produces (results, dead letters, audit). "
        "Input batches of every codec are read whatever this says.")] = "none"
    max_poll_interval_ms: Annotated[int, Meta(ge=1000), Doc(
        "Kafka max.poll.interval.ms of the consumer.")] = 300_000
    session_timeout_ms: Annotated[int, Meta(ge=1000), Doc(
        "Kafka session timeout: how soon a dead member is noticed.")] = 10_000
    revoke_timeout_s: Annotated[float, seconds, Doc(
        "Bound on waiting for a revoked partition's in-flight records.")] = 10.0
    kafka_startup_timeout_s: Annotated[float, seconds, Doc(
        "Longest wait at start-up for a Kafka bootstrap server to answer (and for the "
        "group's coordinator); then the worker exits 5, Kafka unavailable.")] = 30.0

    def _check_combinations(self) -> None:
        self._refuse([
            ("WORKER_GROUP_PROTOCOL",
             self.group_protocol == "consumer" and self.kafka_client != "confluent",
             "consumer needs WORKER_KAFKA_CLIENT confluent (aiokafka speaks only classic)"),
            ("WORKER_KAFKA_CLIENT",
             self.kafka_client == "confluent" and find_spec("confluent_kafka") is None,
             "confluent needs the confluent extra, which is not installed: "
             "pip install 'kafka-triton-worker[confluent]'"),
        ])


class TritonSettings(_Section, frozen=True, kw_only=True):
    """The Triton endpoint and its streams."""

    triton_url: Annotated[str, host_ports(), Doc(
        "Triton gRPC endpoints, comma-separated; a name resolving to several addresses (a "
        "headless Service) is one endpoint per address.")] = "localhost:8001"
    triton_resolve_interval_s: Annotated[float, seconds, Doc(
        "How often the names of WORKER_TRITON_URL are resolved again.")] = 30.0
    triton_streams: Annotated[int, Meta(ge=1, le=64), Doc(
        "Number of stream_infer streams to each Triton endpoint.")] = 2
    request_timeout_ms: Annotated[int, Meta(ge=1), Doc(
        "Client-side deadline of one try on a Triton stream (for a decoupled model: of "
        "its first response).")] = 30_000
    stream_idle_timeout_ms: Annotated[int, Meta(ge=1), Doc(
        "Decoupled models: longest wait between two responses of one request.")] = 30_000
    triton_shm: Annotated[ShmMode, Doc(
        "system: send large tensors through system shared memory (Triton on the same "
        "host).")] = "none"
    shm_min_bytes: Annotated[int, Meta(ge=1), size(1), Doc(
        "Tensors at least this large go through shared memory.")] = MIB
    shm_pool_bytes: Annotated[int, Meta(ge=MIB), size(MIB), Doc(
        "Total size of the registered shared-memory regions.")] = 256 * MIB
    triton_ssl: Annotated[bool, Doc("Connect to Triton over gRPC with TLS.")] = False
    triton_ssl_cafile: Annotated[str | None, Doc(
        "CA bundle that signs Triton's certificate.")] = None
    triton_ssl_certfile: Annotated[str | None, Doc(
        "Client certificate for Triton (mutual TLS).")] = None
    triton_ssl_keyfile: Annotated[str | None, Doc(
        "Client private key for Triton (mutual TLS).")] = None
    triton_auth_header: Annotated[str, Doc(
        "gRPC metadata header carrying the Triton token.")] = "authorization"
    triton_auth_token_file: Annotated[str | None, Doc(
        "File holding the Triton token (sent as the whole header value, e.g. 'Bearer x'); "
        "re-read when it changes.")] = None
    triton_trace: Annotated[TritonTrace, Doc(
        "unary: a record with a sampled W3C traceparent goes to Triton as a ModelInfer call of "
        "its own (not batched), the context as gRPC metadata, so Triton continues the trace; "
        "stream: it shares the streams, whose metadata cannot carry it (docs/tracing.md).")] = (
        "stream")

    def _check_combinations(self) -> None:
        self._refuse([
            ("WORKER_TRITON_SSL_KEYFILE",
             (self.triton_ssl_certfile is None) != (self.triton_ssl_keyfile is None),
             "WORKER_TRITON_SSL_CERTFILE and WORKER_TRITON_SSL_KEYFILE go together"),
        ])


class FlowSettings(_Section, frozen=True, kw_only=True):
    """How much is in flight, and how requests are batched."""

    max_in_flight: Annotated[int, Meta(ge=1), Doc("Most requests in flight in this worker.")] = 256
    # 128 from the benchmark's defaults sweep: at 64 a fetch's records, which come
    # from few partitions at a time, filled their partitions' share before the window.
    max_in_flight_per_partition: Annotated[int, Meta(ge=1), Doc(
        "Most requests in flight from one partition.")] = 128
    batch_max_size: Annotated[int, Meta(ge=1, le=1024), Doc(
        "Client-side micro-batching: most requests coalesced into one Triton request "
        "(1 disables it).")] = 32
    batch_delay_ms: Annotated[float, Meta(ge=0, lt=1e12), Doc(
        "Longest wait for a micro-batch to fill, in milliseconds.")] = 2.0
    window_mode: Annotated[WindowMode, Doc(
        "adaptive: the window grows while latency stays low and shrinks on overload, "
        "between WORKER_MIN_IN_FLIGHT and WORKER_MAX_IN_FLIGHT.")] = "fixed"
    min_in_flight: Annotated[int, Meta(ge=1), Doc("Lower bound of the adaptive window.")] = 4
    fast_path: Annotated[bool, Doc(
        "Records of a batchable model handled in groups (no task per record), in every "
        "delivery, ordering and audit mode; false sends every record down the per-record "
        "path (to compare and diagnose).")] = True

    def _check_combinations(self) -> None:
        self._refuse([
            ("WORKER_MIN_IN_FLIGHT",
             self.window_mode == "adaptive" and self.min_in_flight > self.max_in_flight,
             "must not exceed WORKER_MAX_IN_FLIGHT when WORKER_WINDOW_MODE is adaptive"),
        ])


class RetrySettings(_Section, frozen=True, kw_only=True):
    """Retries, deadlines, the circuit breaker, and the guard against a bug that fails all."""

    max_attempts: Annotated[int, Meta(ge=1, le=100), Doc(
        "Tries of a request that fails for a retryable reason.")] = 5
    retry_backoff_ms: Annotated[int, Meta(ge=1), Doc(
        "First retry backoff; it doubles per try (full jitter).")] = 100
    retry_backoff_max_ms: Annotated[int, Meta(ge=1), Doc("Longest retry backoff.")] = 5000
    record_deadline_ms: Annotated[int, Meta(ge=1), Doc(
        "Overall deadline of one record across all its tries.")] = 300_000
    breaker_failure_threshold: Annotated[int, Meta(ge=1), Doc(
        "Consecutive Triton failures that open the circuit breaker.")] = 5
    breaker_probe_interval_ms: Annotated[int, Meta(ge=10), Doc(
        "How often Triton, and a model whose failure-rate breaker is open, is probed.")] = 1000
    model_failure_rate: Annotated[float, Meta(gt=0, le=1), Doc(
        "Share of a model's recent outcomes that may be INFERENCE_ERROR; above it its records "
        "are held, not dead-lettered. 1 disables the model breaker.")] = 0.5
    model_failure_window: Annotated[int, Meta(ge=1, le=10_000), Doc(
        "A model's last outcomes in which its INFERENCE_ERROR rate is measured.")] = 20
    model_failure_min_samples: Annotated[int, Meta(ge=1), Doc(
        "Outcomes of a model needed before its failure rate counts (at most the window).")] = 10
    max_consecutive_internal_errors: Annotated[int, Meta(ge=1), Doc(
        "Records in a row that may meet a bug (INTERNAL_ERROR) before the worker stops "
        "with exit 3 rather than dead-letter a whole topic.")] = 100

    def _check_combinations(self) -> None:
        self._refuse([
            ("WORKER_RETRY_BACKOFF_MAX_MS", self.retry_backoff_max_ms < self.retry_backoff_ms,
             "must not be below WORKER_RETRY_BACKOFF_MS"),
        ])


class DeliverySettings(_Section, frozen=True, kw_only=True):
    """When a record is done, in what order, and how it is committed."""

    ordering: Annotated[Ordering, Doc(
        "unordered; key: each key's results in offset order (a decoupled or sequence model's "
        "records one at a time); partition: results "
        "published in offset order per partition.")] = "unordered"
    delivery: Annotated[DeliveryMode, Doc(
        "exactly_once: results, dead letters and offsets in one Kafka transaction.")] = (
        "at_least_once")
    transactional_id_prefix: Annotated[str, Doc(
        "exactly_once: prefix of the producers' transactional ids (one per input "
        "partition with aiokafka, one per worker with confluent).")] = "kafka-triton-worker"
    max_uncommitted_per_partition: Annotated[int, Meta(ge=1), Doc(
        "How far past its commit point a partition may dispatch; beyond it the partition "
        "pauses. Bounds the work a crash can redo behind a record stuck in retries.")] = 10_000
    stream_output: Annotated[StreamOutput, Doc(
        "Decoupled models: final publishes one result per request after its last response "
        "(outputs concatenated); each publishes every response as its own result.")] = "final"
    stream_join_bytes: Annotated[bool, Doc(
        "stream_output final: join each BYTES output's pieces into one string (a token "
        "stream's text) instead of a list of them.")] = False
    sequence_from_key: Annotated[bool, Doc(
        "Models with a sequence batcher: the record's key is the sequence id (key ordering "
        "for them, whatever WORKER_ORDERING says).")] = False

    def _check_combinations(self) -> None:
        self._refuse([
            ("WORKER_STREAM_JOIN_BYTES", self.stream_join_bytes and self.stream_output != "final",
             "joins the pieces of one result: needs WORKER_STREAM_OUTPUT final"),
        ])


class LimitSettings(_Section, frozen=True, kw_only=True):
    """What a request may be and ask for."""

    default_model: Annotated[str | None, Doc(
        "Model used when neither headers nor body name one.")] = None
    max_request_bytes: Annotated[int, Meta(ge=1), size(1), Doc(
        "Largest request value accepted; larger ones get TOO_LARGE.")] = 8 * MIB
    max_output_bytes: Annotated[int, Meta(ge=1), size(1), Doc(
        "Largest result published; keep it below the broker's max message size. Larger "
        "results get OUTPUT_TOO_LARGE.")] = MIB
    max_tensor_elements: Annotated[int, Meta(ge=1), Doc(
        "Most elements in one input tensor; more get TOO_LARGE.")] = 16 * MIB
    max_tensor_bytes: Annotated[int, Meta(ge=1), size(1), Doc(
        "Largest input tensor in bytes; larger get TOO_LARGE.")] = 64 * MIB
    model_allowlist: Annotated[tuple[tuple[str, tuple[str, ...]], ...], allowlist(), Doc(
        "Models each input topic may use ('requests=double|mlp;other=*'); others get "
        "FORBIDDEN. Empty allows all.", default_doc="empty (all models allowed)")] = ()
    mapping_file: Annotated[str | None, Doc(
        "TOML or JSON file mapping input topics' plain events to a model's inputs and the "
        "result event (see Events and mappings); the topics it does not name take inference "
        "requests.")] = None


class KafkaAuthSettings(_Section, frozen=True, kw_only=True):
    """TLS and SASL for every Kafka client."""

    security_protocol: Annotated[SecurityProtocol, Doc(
        "Kafka security protocol, for the consumer and every producer.")] = "PLAINTEXT"
    sasl_mechanism: Annotated[SaslMechanism | None, Doc("Kafka SASL mechanism.")] = None
    sasl_username: Annotated[str | None, Doc("Kafka SASL user name.")] = None
    sasl_password: Annotated[str | None, Doc(
        "Kafka SASL password (prefer WORKER_SASL_PASSWORD_FILE).", secret=True)] = None
    sasl_password_file: Annotated[str | None, Doc(
        "File holding the Kafka SASL password.")] = None
    sasl_oauth_token_file: Annotated[str | None, Doc(
        "OAUTHBEARER: file holding the token (re-read on refresh).")] = None
    sasl_oauth_token_command: Annotated[str | None, Doc(
        "OAUTHBEARER: command printing a token (run on refresh).")] = None
    ssl_cafile: Annotated[str | None, Doc(
        "CA bundle that signs the Kafka brokers' certificates.")] = None
    ssl_certfile: Annotated[str | None, Doc("Client certificate for Kafka (mutual TLS).")] = None
    ssl_keyfile: Annotated[str | None, Doc("Client private key for Kafka (mutual TLS).")] = None

    def _check_combinations(self) -> None:
        sasl = self.security_protocol.startswith("SASL_")
        self._refuse([
            ("WORKER_SASL_MECHANISM", sasl and self.sasl_mechanism is None,
             f"required when WORKER_SECURITY_PROTOCOL is {self.security_protocol}"),
            ("WORKER_SASL_MECHANISM", not sasl and self.sasl_mechanism is not None,
             "needs WORKER_SECURITY_PROTOCOL SASL_PLAINTEXT or SASL_SSL"),
            ("WORKER_SASL_PASSWORD",
             self.sasl_password is not None and self.sasl_password_file is not None,
             "set either WORKER_SASL_PASSWORD or WORKER_SASL_PASSWORD_FILE, not both"),
            ("WORKER_SSL_KEYFILE", (self.ssl_certfile is None) != (self.ssl_keyfile is None),
             "WORKER_SSL_CERTFILE and WORKER_SSL_KEYFILE go together"),
        ])


class RegistrySettings(_Section, frozen=True, kw_only=True):
    """The Schema Registry of the mapped topics whose events are Avro or JSON Schema."""

    schema_registry_url: Annotated[str | None, Doc(
        "Base URL of a Schema Registry's Confluent API (Confluent's, Karapace's, Apicurio's "
        "/apis/ccompat/v7), for mapped topics of format avro or json-schema: the writers' "
        "schemas are read from it, the results' checked or registered in it.")] = None
    schema_registry_user: Annotated[str | None, Doc(
        "Schema Registry basic-auth user name.")] = None
    schema_registry_password: Annotated[str | None, Doc(
        "Schema Registry basic-auth password (prefer WORKER_SCHEMA_REGISTRY_PASSWORD_FILE).",
        secret=True)] = None
    schema_registry_password_file: Annotated[str | None, Doc(
        "File holding the Schema Registry basic-auth password.")] = None
    schema_registry_cafile: Annotated[str | None, Doc(
        "CA bundle that signs the Schema Registry's certificate (https URL).")] = None
    schema_registry_certfile: Annotated[str | None, Doc(
        "Client certificate for the Schema Registry (mutual TLS).")] = None
    schema_registry_keyfile: Annotated[str | None, Doc(
        "Client private key for the Schema Registry (mutual TLS).")] = None
    schema_registry_auto_register: Annotated[bool, Doc(
        "Register each registry-format topic's result schema at start-up. Off (for "
        "production): the subject's latest schema must accept what the mapping writes, "
        "else the worker refuses to start.")] = False
    schema_registry_timeout_ms: Annotated[int, Meta(ge=1), Doc(
        "Deadline of one request to the Schema Registry.")] = 10_000
    schema_registry_cache_size: Annotated[int, Meta(ge=1), Doc(
        "Most writers' schemas kept in memory, shared by every mapped topic (each fetched "
        "once by id).")] = 1000

    def _check_combinations(self) -> None:
        self._refuse([
            ("WORKER_SCHEMA_REGISTRY_PASSWORD",
             self.schema_registry_password is not None
             and self.schema_registry_password_file is not None,
             "set either WORKER_SCHEMA_REGISTRY_PASSWORD or WORKER_SCHEMA_REGISTRY_PASSWORD_FILE, "
             "not both"),
            ("WORKER_SCHEMA_REGISTRY_USER",
             self.schema_registry_user is None
             and (self.schema_registry_password or self.schema_registry_password_file)
             is not None,
             "a password is set for no user: set WORKER_SCHEMA_REGISTRY_USER too"),
            ("WORKER_SCHEMA_REGISTRY_KEYFILE",
             (self.schema_registry_certfile is None) != (self.schema_registry_keyfile is None),
             "WORKER_SCHEMA_REGISTRY_CERTFILE and WORKER_SCHEMA_REGISTRY_KEYFILE go together"),
            ("WORKER_SCHEMA_REGISTRY_URL",
             self.schema_registry_url is not None
             and not self.schema_registry_url.startswith(("http://", "https://")),
             f"expected an http:// or https:// URL, got {self.schema_registry_url!r}"),
        ])


class OpsSettings(_Section, frozen=True, kw_only=True):
    """What the worker tells the outside: metrics, logs, audit; and how it stops."""

    shutdown_timeout_s: Annotated[float, seconds, Doc(
        "Bound on draining in-flight work at shutdown.")] = 30.0
    metrics_port: Annotated[int, Meta(ge=0, le=65535), Doc(
        "Port of /metrics, /healthz and /readyz; 0 disables them.")] = 9400
    debug_endpoints: Annotated[bool, Doc(
        "Serve /debug/inflight on the metrics port: the records in flight, by state and age "
        "(it names topics, offsets and request ids; keep the port private).")] = False
    stuck_after_s: Annotated[float, seconds, Doc(
        "A record in flight longer than this is logged once as record_stuck.")] = 60.0
    log_format: Annotated[LogFormat, Doc(
        "Logs as JSON lines, or human-readable.", default_doc="console on a terminal, else json",
        contextual_default=log_format_for)] = "json"
    log_level: Annotated[LogLevel, Doc("Least level logged.")] = "info"
    audit: Annotated[AuditMode, Doc(
        "One audit record per request: to a log stream, an audit topic, or both.")] = "none"
    audit_topic: Annotated[str | None, Doc(
        "Topic of the audit records (audit=topic or both).")] = None

    def _check_combinations(self) -> None:
        self._refuse([
            ("WORKER_AUDIT_TOPIC", self.audit in ("topic", "both") and self.audit_topic is None,
             f"required when WORKER_AUDIT is {self.audit}"),
        ])
# fmt: on
