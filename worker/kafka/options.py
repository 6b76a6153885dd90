"""Kafka TLS and SASL settings turned into aiokafka client options (consumer, producers, admin).

Secrets (the SASL password, OAUTHBEARER tokens) are read from
the environment or from files, handed to the client libraries, and never put in
an error message or a log line: errors name the setting and the file, not the value.
"""

from __future__ import annotations

import asyncio
import shlex
import ssl
from typing import Any

from aiokafka.abc import AbstractTokenProvider
from aiokafka.helpers import create_ssl_context

from worker.settings import ConfigError, KafkaAuthSettings
from worker.settings.secrets import check_file, read_secret

#: Bound on one run of WORKER_SASL_OAUTH_TOKEN_COMMAND.
_TOKEN_COMMAND_TIMEOUT_S = 30.0


def sasl_password(auth: KafkaAuthSettings) -> str | None:
    """The SASL password: WORKER_SASL_PASSWORD, else the content of WORKER_SASL_PASSWORD_FILE."""
    if auth.sasl_password is not None:
        return auth.sasl_password
    if auth.sasl_password_file is not None:
        return read_secret(auth.sasl_password_file, "WORKER_SASL_PASSWORD_FILE")
    return None


class OAuthTokenProvider(AbstractTokenProvider):  # type: ignore[misc]
    """OAUTHBEARER tokens from a file (re-read) or a command (run) at each authentication.

    aiokafka asks for a token whenever it opens and authenticates a connection,
    so a token renewed on disk, or by the command, is used from the next connection on.
    """

    def __init__(self, token_file: str | None, token_command: str | None) -> None:
        if (token_file is None) == (token_command is None):
            raise ConfigError(
                "WORKER_SASL_OAUTH_TOKEN_FILE",
                "WORKER_SASL_OAUTH_TOKEN_FILE: OAUTHBEARER needs exactly one of "
                "WORKER_SASL_OAUTH_TOKEN_FILE and WORKER_SASL_OAUTH_TOKEN_COMMAND",
            )
        self._file = token_file
        self._command = shlex.split(token_command) if token_command is not None else None

    async def token(self) -> str:
        """A current token (never logged)."""
        if self._file is not None:
            return await asyncio.to_thread(read_secret, self._file, "WORKER_SASL_OAUTH_TOKEN_FILE")
        assert self._command is not None
        return await self._run_command(self._command)

    @staticmethod
    async def _run_command(argv: list[str]) -> str:
        setting = "WORKER_SASL_OAUTH_TOKEN_COMMAND"
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL
            )
        except OSError as exc:
            raise ConfigError(
                setting, f"{setting}: cannot run {argv[0]!r}: {exc.strerror}"
            ) from None
        try:
            stdout, _ = await asyncio.wait_for(process.communicate(), _TOKEN_COMMAND_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise ConfigError(
                setting,
                f"{setting}: {argv[0]!r} printed no token within {_TOKEN_COMMAND_TIMEOUT_S}s",
            ) from None
        token = stdout.decode("utf-8", errors="replace").strip()
        if process.returncode != 0 or not token:
            raise ConfigError(
                setting,
                f"{setting}: {argv[0]!r} exited with status {process.returncode} "
                f"and {'a' if token else 'no'} token",
            )
        return token


def sasl_credentials(auth: KafkaAuthSettings, mechanism: str | None) -> tuple[str, str]:
    """The SASL user name and password (PLAIN, SCRAM); ConfigError naming what is missing."""
    if auth.sasl_username is None:
        raise ConfigError(
            "WORKER_SASL_USERNAME", f"WORKER_SASL_USERNAME: required for SASL {mechanism}"
        )
    password = sasl_password(auth)
    if password is None:
        raise ConfigError(
            "WORKER_SASL_PASSWORD",
            f"WORKER_SASL_PASSWORD: required for SASL {mechanism} "
            "(or set WORKER_SASL_PASSWORD_FILE)",
        )
    return auth.sasl_username, password


def _kafka_ssl_context(auth: KafkaAuthSettings) -> ssl.SSLContext:
    check_file(auth.ssl_cafile, "WORKER_SSL_CAFILE")
    check_file(auth.ssl_certfile, "WORKER_SSL_CERTFILE")
    check_file(auth.ssl_keyfile, "WORKER_SSL_KEYFILE")
    try:
        context: ssl.SSLContext = create_ssl_context(
            cafile=auth.ssl_cafile,
            certfile=auth.ssl_certfile,
            keyfile=auth.ssl_keyfile,
        )
    except ssl.SSLError as exc:
        raise ConfigError(
            "WORKER_SSL_CAFILE",
            f"WORKER_SSL_CAFILE/CERTFILE/KEYFILE: not valid PEM files: {exc.reason}",
        ) from None
    return context


def refuse_tls_files_without_tls(auth: KafkaAuthSettings) -> None:
    """ConfigError for a CA or certificate file given to a listener without TLS (both
    clients would ignore it, and the user meant TLS)."""
    for name, value in (
        ("WORKER_SSL_CAFILE", auth.ssl_cafile),
        ("WORKER_SSL_CERTFILE", auth.ssl_certfile),
    ):
        if value is not None:
            raise ConfigError(name, f"{name}: needs WORKER_SECURITY_PROTOCOL SSL or SASL_SSL")


def kafka_client_kwargs(auth: KafkaAuthSettings) -> dict[str, Any]:
    """Keyword arguments for every aiokafka client (consumer, producers, admin).

    Raises ConfigError (naming the setting, never a secret) when a file cannot
    be read or a SASL credential is missing.
    """
    protocol = auth.security_protocol
    kwargs: dict[str, Any] = {"security_protocol": protocol}
    uses_tls = protocol in ("SSL", "SASL_SSL")
    if uses_tls:
        kwargs["ssl_context"] = _kafka_ssl_context(auth)
    else:
        refuse_tls_files_without_tls(auth)
    if not protocol.startswith("SASL_"):
        return kwargs
    mechanism = auth.sasl_mechanism
    kwargs["sasl_mechanism"] = mechanism
    if mechanism == "OAUTHBEARER":
        kwargs["sasl_oauth_token_provider"] = OAuthTokenProvider(
            auth.sasl_oauth_token_file, auth.sasl_oauth_token_command
        )
        return kwargs
    username, password = sasl_credentials(auth, mechanism)
    kwargs["sasl_plain_username"] = username
    kwargs["sasl_plain_password"] = password
    return kwargs
