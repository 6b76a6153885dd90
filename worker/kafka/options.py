"""Security settings turned into client options: Kafka TLS/SASL, Triton TLS and tokens, limits.

Secrets (the SASL password, OAUTHBEARER tokens, the Triton token) are read from
the environment or from files, handed to the client libraries, and never put in
an error message or a log line: errors name the setting and the file, not the value.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from aiokafka.abc import AbstractTokenProvider
from aiokafka.helpers import create_ssl_context

from worker import errors
from worker.settings import ConfigError, Settings

#: Bound on one run of WORKER_SASL_OAUTH_TOKEN_COMMAND.
_TOKEN_COMMAND_TIMEOUT_S = 30.0


def _read_secret(path: str, setting: str) -> str:
    """The stripped text of a secret file; ConfigError naming the setting (never the content)."""
    try:
        text = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise ConfigError(setting, f"{setting}: cannot read {path!r}: {reason}") from None
    if not text:
        raise ConfigError(setting, f"{setting}: {path!r} is empty")
    return text


def _check_file(path: str | None, setting: str) -> None:
    if path is not None and not Path(path).is_file():
        raise ConfigError(setting, f"{setting}: {path!r} is not a readable file")


def sasl_password(settings: Settings) -> str | None:
    """The SASL password: WORKER_SASL_PASSWORD, else the content of WORKER_SASL_PASSWORD_FILE."""
    if settings.kafka_auth.sasl_password is not None:
        return settings.kafka_auth.sasl_password
    if settings.kafka_auth.sasl_password_file is not None:
        return _read_secret(settings.kafka_auth.sasl_password_file, "WORKER_SASL_PASSWORD_FILE")
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
            return await asyncio.to_thread(_read_secret, self._file, "WORKER_SASL_OAUTH_TOKEN_FILE")
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


def _kafka_ssl_context(settings: Settings) -> ssl.SSLContext:
    _check_file(settings.kafka_auth.ssl_cafile, "WORKER_SSL_CAFILE")
    _check_file(settings.kafka_auth.ssl_certfile, "WORKER_SSL_CERTFILE")
    _check_file(settings.kafka_auth.ssl_keyfile, "WORKER_SSL_KEYFILE")
    try:
        context: ssl.SSLContext = create_ssl_context(
            cafile=settings.kafka_auth.ssl_cafile,
            certfile=settings.kafka_auth.ssl_certfile,
            keyfile=settings.kafka_auth.ssl_keyfile,
        )
    except ssl.SSLError as exc:
        raise ConfigError(
            "WORKER_SSL_CAFILE",
            f"WORKER_SSL_CAFILE/CERTFILE/KEYFILE: not valid PEM files: {exc.reason}",
        ) from None
    return context


def kafka_client_kwargs(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for every aiokafka client (consumer, producers, admin).

    Raises ConfigError (naming the setting, never a secret) when a file cannot
    be read or a SASL credential is missing.
    """
    protocol = settings.kafka_auth.security_protocol
    kwargs: dict[str, Any] = {"security_protocol": protocol}
    uses_tls = protocol in ("SSL", "SASL_SSL")
    if uses_tls:
        kwargs["ssl_context"] = _kafka_ssl_context(settings)
    else:
        for name, value in (
            ("WORKER_SSL_CAFILE", settings.kafka_auth.ssl_cafile),
            ("WORKER_SSL_CERTFILE", settings.kafka_auth.ssl_certfile),
        ):
            if value is not None:
                raise ConfigError(name, f"{name}: needs WORKER_SECURITY_PROTOCOL SSL or SASL_SSL")
    if not protocol.startswith("SASL_"):
        return kwargs
    mechanism = settings.kafka_auth.sasl_mechanism
    kwargs["sasl_mechanism"] = mechanism
    if mechanism == "OAUTHBEARER":
        kwargs["sasl_oauth_token_provider"] = OAuthTokenProvider(
            settings.kafka_auth.sasl_oauth_token_file, settings.kafka_auth.sasl_oauth_token_command
        )
        return kwargs
    if settings.kafka_auth.sasl_username is None:
        raise ConfigError(
            "WORKER_SASL_USERNAME", f"WORKER_SASL_USERNAME: required for SASL {mechanism}"
        )
    password = sasl_password(settings)
    if password is None:
        raise ConfigError(
            "WORKER_SASL_PASSWORD",
            f"WORKER_SASL_PASSWORD: required for SASL {mechanism} "
            "(or set WORKER_SASL_PASSWORD_FILE)",
        )
    kwargs["sasl_plain_username"] = settings.kafka_auth.sasl_username
    kwargs["sasl_plain_password"] = password
    return kwargs


def triton_client_kwargs(settings: Settings) -> dict[str, Any]:
    """Keyword arguments for ``tritonclient.grpc.aio.InferenceServerClient``.

    The client reads the PEM files itself; they are checked here so that a
    wrong path fails at start-up with the setting's name.
    """
    files = (
        ("WORKER_TRITON_SSL_CAFILE", settings.triton.triton_ssl_cafile),
        ("WORKER_TRITON_SSL_CERTFILE", settings.triton.triton_ssl_certfile),
        ("WORKER_TRITON_SSL_KEYFILE", settings.triton.triton_ssl_keyfile),
    )
    if not settings.triton.triton_ssl:
        for name, value in files:
            if value is not None:
                raise ConfigError(name, f"{name}: needs WORKER_TRITON_SSL=true")
        return {}
    for name, value in files:
        _check_file(value, name)
    kwargs: dict[str, Any] = {"ssl": True}
    if settings.triton.triton_ssl_cafile is not None:
        kwargs["root_certificates"] = settings.triton.triton_ssl_cafile
    if settings.triton.triton_ssl_certfile is not None:
        kwargs["certificate_chain"] = settings.triton.triton_ssl_certfile
        kwargs["private_key"] = settings.triton.triton_ssl_keyfile
    return kwargs


class TritonAuth:
    """gRPC metadata sent with every Triton call (for example ``authorization: Bearer …``).

    The token file is read at first use and again whenever its modification
    time, size or inode changes, so a rotated token is used by the next call
    without a restart. Streams already open keep the metadata they opened with
    (Triton checks it when a call starts).
    """

    def __init__(self, settings: Settings) -> None:
        # gRPC metadata keys are lower-case on the wire.
        self._header = settings.triton.triton_auth_header.strip().lower()
        self._path = settings.triton.triton_auth_token_file
        self._stamp: tuple[int, int, int] | None = None
        self._headers: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        """True when a token file is configured."""
        return self._path is not None

    def headers(self) -> Mapping[str, str]:
        """``{header: token}``, or ``{}`` without a token file.

        Raises ConfigError when the file cannot be read the first time; later a
        file briefly missing (being replaced) keeps the last token.
        """
        if self._path is None:
            return {}
        try:
            info = os.stat(self._path)
        except OSError:
            if self._stamp is not None:
                return self._headers
            raise ConfigError(
                "WORKER_TRITON_AUTH_TOKEN_FILE",
                f"WORKER_TRITON_AUTH_TOKEN_FILE: cannot read {self._path!r}",
            ) from None
        stamp = (info.st_mtime_ns, info.st_size, info.st_ino)
        if stamp != self._stamp:
            try:
                token = _read_secret(self._path, "WORKER_TRITON_AUTH_TOKEN_FILE")
            except ConfigError:
                if self._stamp is not None:
                    return self._headers
                raise
            self._headers = {self._header: token}
            self._stamp = stamp
        return self._headers


def check_model_allowed(settings: Settings, topic: str, model: str) -> None:
    """Raise Forbidden when the input topic may not use ``model``."""
    for rule_topic, models in settings.limits.model_allowlist:
        if rule_topic == topic and "*" not in models and model not in models:
            raise errors.Forbidden(f"model {model!r} is not allowed for topic {topic!r}")
