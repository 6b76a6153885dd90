"""The error taxonomy: every failure the worker handles has a code and a retry flag.

This module is the only place that decides whether a failure is retryable and
which dead-letter code it carries. Callers raise or receive a `WorkerError`
subclass and look at `retryable`; they never inspect gRPC codes or Triton
error texts themselves (``worker.triton.errors`` maps those to these classes).

Non-retryable errors end in a dead letter with their own `code`. Retryable
errors are retried within the record's deadline; when the budget is spent the
record is dead-lettered as `RetriesExhausted`, which names the last error.
"""

from __future__ import annotations

import enum
from typing import ClassVar, Final

__all__ = [
    "ERROR_CODES",
    "BadMagicByte",
    "CannotRun",
    "DecodeError",
    "ExitCode",
    "Fatal",
    "Forbidden",
    "InferenceError",
    "InternalError",
    "InvalidRequest",
    "KafkaUnavailable",
    "ModelNotFound",
    "ModelNotReady",
    "OutputTooLarge",
    "PartitionRevoked",
    "RegistryUnavailable",
    "RetriesExhausted",
    "SchemaMismatch",
    "SchemaNotFound",
    "TooLarge",
    "TooManyInternalErrors",
    "TritonFailover",
    "TritonOverloaded",
    "TritonTimeout",
    "TritonUnavailable",
    "WorkerError",
    "WriteFailed",
]


class WorkerError(Exception):
    """Base of every handled failure; `message` says what is wrong and where."""

    code: ClassVar[str] = "INTERNAL"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        #: Facts about this failure for the dead letter's headers (name, value), e.g. how
        #: many responses of a stream had arrived; the wire module names them.
        self.facts: tuple[tuple[str, bytes], ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


# --- Non-retryable: the record itself is at fault, or Triton refused it for good.


class DecodeError(WorkerError):
    """The value is not decodable, or does not match the request schema."""

    code = "DECODE_ERROR"


class InvalidRequest(WorkerError):
    """The request decodes but is inconsistent, or does not match the model."""

    code = "INVALID_REQUEST"


class ModelNotFound(WorkerError):
    """No model is named, or Triton does not know the named model."""

    code = "MODEL_NOT_FOUND"


class TooLarge(WorkerError):
    """The request is larger than the configured limit."""

    code = "TOO_LARGE"


class InferenceError(WorkerError):
    """Triton or the model rejected the request in a way a retry will not fix."""

    code = "INFERENCE_ERROR"


class SequenceGone(InferenceError):
    """A step of a sequence whose state Triton no longer holds (never started, dropped
    when idle, or lost in a restart). The record's own failure, not the model's: it never
    counts toward the model's failure-rate breaker, and is never held by it."""


class RetriesExhausted(WorkerError):
    """A retryable failure persisted until the record's retry budget was spent."""

    code = "RETRIES_EXHAUSTED"

    @classmethod
    def after(cls, last_error: WorkerError, attempts: int) -> RetriesExhausted:
        """Build the error that closes a record after `attempts` failed tries."""
        error = cls(
            f"gave up after {attempts} attempts; last error {last_error.code}: {last_error}"
        )
        error.facts = last_error.facts
        return error


class OutputTooLarge(WorkerError):
    """The inference result is larger than what can be published."""

    code = "OUTPUT_TOO_LARGE"


class Forbidden(WorkerError):
    """Triton refused the worker's credentials for this request."""

    code = "FORBIDDEN"


class BadMagicByte(WorkerError):
    """A record of a registry-format topic is not in the Confluent wire format: empty, or
    its first byte is not 0 (a plain JSON value, or another format's)."""

    code = "BAD_MAGIC_BYTE"


class SchemaNotFound(WorkerError):
    """A record names a schema id its Schema Registry does not have."""

    code = "SCHEMA_NOT_FOUND"


class SchemaMismatch(WorkerError):
    """A record's payload does not decode with the schema it names (truncated, garbage,
    bytes left over), or does not match it (a JSON Schema's rules)."""

    code = "SCHEMA_MISMATCH"


class InternalError(WorkerError):
    """A bug met while handling one record: that record is dead-lettered, the worker goes on."""

    code = "INTERNAL_ERROR"

    @classmethod
    def wrapping(cls, exc: BaseException) -> InternalError:
        """The dead letter's error for an unexpected exception: its type and message."""
        text = str(exc)
        return cls(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)


# --- Retryable: the record is fine, Triton is not (yet) able to serve it.


class TritonUnavailable(WorkerError):
    """Triton cannot be reached, or the stream carrying the request broke."""

    code = "TRITON_UNAVAILABLE"
    retryable = True


class TritonFailover(TritonUnavailable):
    """The Triton endpoint serving the request was lost while another one is up: not an
    outage, the request is sent again elsewhere at once."""


class TritonTimeout(WorkerError):
    """The request did not complete within its deadline."""

    code = "TRITON_TIMEOUT"
    retryable = True


class TritonOverloaded(WorkerError):
    """Triton shed the request because its queues are full."""

    code = "TRITON_OVERLOADED"
    retryable = True


class ModelNotReady(WorkerError):
    """The model exists but is loading, unloading or has no ready version."""

    code = "MODEL_NOT_READY"
    retryable = True


class RegistryUnavailable(WorkerError):
    """The Schema Registry cannot be reached, or answers with a server error: the records
    that need it are held until it answers, never dead-lettered for it."""

    code = "REGISTRY_UNAVAILABLE"
    retryable = True


ERROR_CODES: Final[tuple[str, ...]] = tuple(
    cls.code for cls in WorkerError.__subclasses__() if not cls.retryable
)
"""The codes a dead letter can carry, in the order the classes are declared (retryable
errors end as RETRIES_EXHAUSTED)."""

RETRY_REASONS: Final[tuple[str, ...]] = tuple(
    cls.code for cls in WorkerError.__subclasses__() if cls.retryable
)
"""The codes of the retryable errors: the reasons a record is retried."""


class ExitCode(enum.IntEnum):
    """The worker's process exit codes (docs/running.md's table is generated from the comments)."""

    #: Done: ``run`` stopped cleanly (every record it took finished and committed, or its
    #: start-up abandoned before taking any); another command did all it was asked.
    OK = 0
    #: ``run`` abandoned records, which stay uncommitted and are consumed again: a second
    #: signal, or a drain that outlived ``WORKER_SHUTDOWN_TIMEOUT_S``. ``check``: a check failed.
    FORCED = 1
    #: Invalid settings; a credential, certificate, security protocol or ACL problem, a
    #: missing topic, or a mapping file that does not fit its models, found at start-up;
    #: the broker refusing the worker its group or topics while it runs; a file
    #: ``produce`` cannot read.
    CONFIG = 2
    #: An outcome can never be written, or too many records in a row met a bug.
    FATAL = 3
    #: ``replay``: some selected dead letters were not re-produced (refused, or the broker
    #: did not take them; the summary says which), or the dead-letter topic cannot be read.
    #: ``produce``, ``topics``, ``tail``: not all was done (not every request acknowledged;
    #: a topic without leaders; fewer records than ``--wait`` asked).
    INCOMPLETE = 4
    #: Kafka could not be reached: by ``run`` at start-up (no bootstrap server answered
    #: within ``WORKER_KAFKA_STARTUP_TIMEOUT_S``; the orchestrator's restart tries again),
    #: by ``produce``, ``topics``, ``tail`` or ``replay`` at all.
    UNAVAILABLE = 5
    #: Ctrl-C stopped a command other than ``run`` (128 + SIGINT, the shells' convention);
    #: ``run`` stops on it as on SIGTERM.
    INTERRUPTED = 130


class CannotRun(Exception):
    """The worker cannot run with these settings against these servers: the process ends
    with ``exit_code`` and the message as its one line (what is wrong, what to do).

    Not a WorkerError: it concerns the worker, not a record. Its message never holds a
    secret.
    """

    exit_code: ClassVar[ExitCode] = ExitCode.CONFIG


class KafkaUnavailable(CannotRun):
    """No Kafka bootstrap server answered at start-up within the bounded wait."""

    exit_code = ExitCode.UNAVAILABLE


class Fatal(RuntimeError):
    """The worker must stop (exit 3): going on would lose records or dead-letter a topic.

    Not a WorkerError: no dead letter can fix it. The offsets of the records
    concerned are never committed, so nothing is lost.
    """


class WriteFailed(Fatal):
    """An outcome (result, dead letter, audit record) could not be written after every retry."""


class PartitionRevoked(Exception):
    """The partition moved away before the record's outcome was committed; its next owner
    processes the record again. Control flow, not a failure of the record."""


class TooManyInternalErrors(Fatal):
    """So many records in a row met a bug that the worker stops rather than dead-letter them all."""
