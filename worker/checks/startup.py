"""Start-up checks: refuse to start on a security misconfiguration instead of retrying forever.

A wrong password, an untrusted certificate, a missing ACL or a refused Triton
token are configuration problems: no retry fixes them, and dead-lettering every
record because of them would lose nothing but help no one either. They stop the
worker at start-up with one line saying what to fix (never a secret).

So are a missing topic, and a topic or group the worker's principal may not use as it
must: the worker would wait for them forever, or stop at its first result. A Triton that is
merely down is not such a problem: the outage handling deals with it, so the checks
let it pass. Kafka not answering at all is not one either, but the worker cannot start
without it: it exits 5 after a bounded wait, and its orchestrator starts it again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]
import structlog
from tritonclient.grpc import InferenceServerException, service_pb2

from worker.checks import probes
from worker.checks.kafka import inspect_kafka
from worker.checks.kafka import scrub as _scrub
from worker.checks.mappings import inspect_mappings
from worker.checks.rows import kafka_rows, refusal
from worker.errors import CannotRun
from worker.events.mapping import Mappings, problems_message
from worker.settings import Settings
from worker.triton._compat import grpc_stub
from worker.triton.auth import TritonAuth

log = structlog.get_logger(__name__)

#: Bound on the Triton check, so that a start-up never hangs on it.
CHECK_TIMEOUT_S = 15.0


class StartupCheckFailed(CannotRun):
    """The worker cannot work with this configuration; the message is one line to act on."""


async def check_kafka(settings: Settings) -> None:
    """Check that the worker may use its topics and group before it joins the group.

    Refuses (StartupCheckFailed, one line, exit 2) a refused TLS handshake or SASL
    authentication, a security protocol the listener does not speak, a topic that does
    not exist, and a topic or group the worker's principal may not use as it must (Read
    on the input topics and the group, Write on the output, dead-letter and audit
    topics, from the operations the broker reports). Raises KafkaUnavailable (exit 5)
    when no bootstrap server answered within WORKER_KAFKA_STARTUP_TIMEOUT_S.
    """
    wait_s = settings.kafka.kafka_startup_timeout_s

    def waiting(reason: str) -> None:
        log.info("kafka_not_answering", reason=reason, timeout_s=wait_s)

    findings = await inspect_kafka(settings, wait_s, on_wait=waiting)
    line = refusal(findings.where, kafka_rows(settings, findings))
    if line is not None:
        raise StartupCheckFailed(line)


async def check_triton(settings: Settings, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """With TLS or a token configured, check Triton accepts both before taking any record.

    Asks for the server metadata (metadata protocol) and sends an inference for
    no model (inference protocol): a refused token fails either before the
    model is even looked up. Raises StartupCheckFailed on a TLS or token
    failure; returns quietly when Triton is merely unreachable.
    """
    auth = TritonAuth(settings.triton)
    if not settings.triton.triton_ssl and not auth.enabled:
        return
    # Every endpoint: one refusing the credentials is a configuration problem even
    # while the others accept them.
    for address, target in await probes.triton_addresses(settings):
        client = probes.triton_client(settings, address, target)
        try:
            await asyncio.wait_for(_check_triton(client, auth, settings, address), timeout_s)
        except TimeoutError:
            continue  # an outage, handled by the breakers once running
        finally:
            await client.close()


async def _check_triton(client: Any, auth: TritonAuth, settings: Settings, address: str) -> None:
    headers = dict(auth.headers())
    secrets = list(headers.values())
    where = f"Triton {address}"
    try:
        await client.get_server_metadata(headers=headers)
        await grpc_stub(client).ModelInfer(
            service_pb2.ModelInferRequest(model_name=""), metadata=tuple(headers.items())
        )
    except InferenceServerException as exc:
        _raise_if_fatal(where, str(exc.status() or ""), exc.message() or "", settings, secrets)
    except grpc.aio.AioRpcError as exc:
        _raise_if_fatal(where, exc.code().name, exc.details() or "", settings, secrets)


def _raise_if_fatal(
    where: str, status: str, message: str, settings: Settings, secrets: list[str]
) -> None:
    text = message.lower()
    detail = _scrub(message, secrets)
    if "restricted" in text or status.endswith(("PERMISSION_DENIED", "UNAUTHENTICATED")):
        raise StartupCheckFailed(
            f"{where} refused the request's credentials in header "
            f"{settings.triton.triton_auth_header.lower()!r} ({detail}); "
            "check WORKER_TRITON_AUTH_TOKEN_FILE"
        )
    if "ssl" in text or "handshake" in text or "certificate" in text:
        raise StartupCheckFailed(
            f"{where}: TLS failed ({detail}); check WORKER_TRITON_SSL_CAFILE, "
            "WORKER_TRITON_SSL_CERTFILE and WORKER_TRITON_SSL_KEYFILE"
        )
    if settings.triton.triton_ssl and "socket closed" in text:
        # A listening server that drops the connection during the TLS handshake
        # (a refused server is "connection refused"): mutual TLS without a client certificate.
        raise StartupCheckFailed(
            f"{where}: the server closed the connection during the TLS handshake ({detail}); "
            "does it require a client certificate? set WORKER_TRITON_SSL_CERTFILE and "
            "WORKER_TRITON_SSL_KEYFILE"
        )
    # Anything else (unknown model "", server unreachable) is not a credentials problem.


async def check_mappings(
    settings: Settings, timeout_s: float = CHECK_TIMEOUT_S, mappings: Mappings | None = None
) -> None:
    """The mapping file (WORKER_MAPPING_FILE, or ``mappings`` as loaded from it) against the
    models it names: a model Triton does not serve, or a mapping that does not fit it,
    refuses the start (one line per problem); a Triton that does not answer, or a model in
    a rollout, lets it pass (logged)."""
    findings = await inspect_mappings(settings, timeout_s, mappings)
    if findings is None:
        return
    if findings.unreachable is not None:
        log.warning("mapping_not_checked", reason=f"Triton {findings.unreachable}")
    for topic, reason in findings.waiting.items():
        log.warning("mapping_not_checked", topic=topic, reason=reason)
    lines = findings.lines()
    if lines:
        assert settings.limits.mapping_file is not None
        raise StartupCheckFailed(problems_message(settings.limits.mapping_file, lines))


async def run_startup_checks(settings: Settings, mappings: Mappings | None = None) -> None:
    """Every start-up check, Kafka and Triton side by side; the first failure is raised.
    ``mappings``: the mapping file as the worker loaded it."""
    outcomes = await asyncio.gather(
        check_kafka(settings),
        check_triton(settings),
        check_mappings(settings, mappings=mappings),
        return_exceptions=True,
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
