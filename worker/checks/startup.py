"""Start-up checks: refuse to start on a security misconfiguration instead of retrying forever.

A wrong password, an untrusted certificate, a missing ACL or a refused Triton
token are configuration problems: no retry fixes them, and dead-lettering every
record because of them would lose nothing but help no one either. They stop the
worker at start-up with one line saying what to fix (never a secret).

A server that is merely down is not such a problem: the usual start-up and
outage handling deal with it, so these checks let it pass.
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import grpc  # type: ignore[import-untyped, unused-ignore]
from aiokafka import errors as kafka_errors
from aiokafka.conn import create_conn
from aiokafka.protocol.coordination import FindCoordinatorRequest
from tritonclient.grpc import InferenceServerException, service_pb2

from worker.checks import probes
from worker.kafka.options import kafka_client_kwargs
from worker.settings import Settings
from worker.triton._compat import grpc_stub
from worker.triton.auth import TritonAuth

#: Bound on each check, so that a start-up never hangs on them.
CHECK_TIMEOUT_S = 15.0
_TOPIC_AUTHORIZATION_FAILED = 29
_GROUP_AUTHORIZATION_FAILED = 30


class StartupCheckFailed(Exception):
    """The worker cannot work with this configuration; the message is one line to act on."""


def _scrub(text: str, secrets: list[str]) -> str:
    # Belt and braces: no message of ours ever carries a secret, even if a
    # library were to echo one.
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return " ".join(text.split())


def _split_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


async def check_kafka(settings: Settings, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Authenticate to a bootstrap broker and check the worker's topics and group are allowed.

    Raises StartupCheckFailed on a TLS, SASL or authorization failure; returns
    quietly when no broker can be reached (the consumer's own start reports that).
    """
    kwargs = kafka_client_kwargs(settings.kafka_auth)
    secrets = [str(kwargs.get("sasl_plain_password") or "")]
    try:
        await asyncio.wait_for(_check_kafka(settings, kwargs), timeout_s)
    except StartupCheckFailed as exc:
        raise StartupCheckFailed(_scrub(str(exc), secrets)) from None
    except TimeoutError:
        return  # no broker answered: the consumer's own start reports it


def _who(settings: Settings) -> str:
    if settings.kafka_auth.sasl_username:
        return f"user {settings.kafka_auth.sasl_username!r}"
    return "this client"


async def _check_kafka(settings: Settings, kwargs: dict[str, Any]) -> None:
    if settings.kafka.kafka_client == "confluent":
        await _check_kafka_rd(settings)
        return
    who = _who(settings)
    for address in settings.kafka.bootstrap_servers.split(","):
        host, port = _split_host_port(address)
        where = f"Kafka {host}:{port}"
        try:
            conn = await create_conn(
                host,
                port,
                client_id=settings.kafka.client_id,
                request_timeout_ms=int(CHECK_TIMEOUT_S * 1000),
                **kwargs,
            )
        except ssl.SSLCertVerificationError as exc:
            raise StartupCheckFailed(
                f"{where}: TLS certificate not trusted ({exc.verify_message}); "
                "check WORKER_SSL_CAFILE"
            ) from None
        except ssl.SSLError as exc:
            raise StartupCheckFailed(
                f"{where}: TLS handshake failed ({exc.reason or exc}); check the WORKER_SSL_* files"
            ) from None
        except kafka_errors.SaslAuthenticationFailed as exc:
            raise StartupCheckFailed(
                f"{where}: SASL {settings.kafka_auth.sasl_mechanism} authentication failed for "
                f"{who}: {exc.args[0] if exc.args else exc}"
            ) from None
        except kafka_errors.UnsupportedSaslMechanismError as exc:
            raise StartupCheckFailed(f"{where}: {exc}; check WORKER_SASL_MECHANISM") from None
        except (OSError, kafka_errors.KafkaError, TimeoutError):
            continue  # unreachable: try the next bootstrap server
        try:
            await _check_authorization(conn, settings, where, who)
        finally:
            conn.close()
        return


async def _check_kafka_rd(settings: Settings) -> None:
    """The same checks through librdkafka's admin API, with the worker's own configuration."""
    from confluent_kafka import KafkaException

    from worker.kafka.rdkafka_admin import RdAdmin, refusal_message

    where, who = f"Kafka {settings.kafka.bootstrap_servers}", _who(settings)
    admin = RdAdmin(settings, CHECK_TIMEOUT_S)
    try:
        topics = [topic for _, topic, _ in probes.topics_to_check(settings)]
        metadata = await admin.describe_topics(topics)
        _refuse_topics(metadata, where, who)
        group = await admin.describe_group(settings.kafka.group_id)
        _refuse_group(int(group["error_code"]), settings, where, who)
    except KafkaException:
        if admin.refusal is not None:
            raise StartupCheckFailed(
                refusal_message(admin.refusal, where, who, settings.kafka_auth.sasl_mechanism)
            ) from None
        return  # no broker answered: the consumer's own start reports it
    finally:
        admin.close()


async def _check_authorization(conn: Any, settings: Settings, where: str, who: str) -> None:
    topics = [topic for _, topic, _ in probes.topics_to_check(settings)]
    _refuse_topics(await probes.describe_topics(conn.send, topics), where, who)
    coordinator = await conn.send(FindCoordinatorRequest(settings.kafka.group_id, 0))
    _refuse_group(coordinator.error_code, settings, where, who)


def _refuse_topics(metadata: dict[str, Any], where: str, who: str) -> None:
    refused = sorted(
        t["topic"] for t in metadata["topics"] if t["error_code"] == _TOPIC_AUTHORIZATION_FAILED
    )
    if refused:
        raise StartupCheckFailed(
            f"{where}: {who} is not authorized for topics {', '.join(refused)} "
            "(missing ACL: Describe and Read on input topics, Describe and Write on the "
            "output, dead-letter and audit topics)"
        )


def _refuse_group(code: int, settings: Settings, where: str, who: str) -> None:
    if code == _GROUP_AUTHORIZATION_FAILED:
        raise StartupCheckFailed(
            f"{where}: {who} is not authorized for consumer group {settings.kafka.group_id!r} "
            "(missing ACL: Describe and Read on the group)"
        )


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


async def run_startup_checks(settings: Settings) -> None:
    """Every start-up check, Kafka and Triton side by side; the first failure is raised."""
    outcomes = await asyncio.gather(
        check_kafka(settings), check_triton(settings), return_exceptions=True
    )
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome
