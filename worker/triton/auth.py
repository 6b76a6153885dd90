"""Triton TLS settings turned into client options, and the token sent with every call."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from worker.settings import ConfigError, TritonSettings
from worker.settings.secrets import check_file, read_secret

__all__ = ["TritonAuth", "triton_client_kwargs"]


def triton_client_kwargs(settings: TritonSettings) -> dict[str, Any]:
    """Keyword arguments for ``tritonclient.grpc.aio.InferenceServerClient``.

    The client reads the PEM files itself; they are checked here so that a
    wrong path fails at start-up with the setting's name.
    """
    files = (
        ("WORKER_TRITON_SSL_CAFILE", settings.triton_ssl_cafile),
        ("WORKER_TRITON_SSL_CERTFILE", settings.triton_ssl_certfile),
        ("WORKER_TRITON_SSL_KEYFILE", settings.triton_ssl_keyfile),
    )
    if not settings.triton_ssl:
        for name, value in files:
            if value is not None:
                raise ConfigError(name, f"{name}: needs WORKER_TRITON_SSL=true")
        return {}
    for name, value in files:
        check_file(value, name)
    kwargs: dict[str, Any] = {"ssl": True}
    if settings.triton_ssl_cafile is not None:
        kwargs["root_certificates"] = settings.triton_ssl_cafile
    if settings.triton_ssl_certfile is not None:
        kwargs["certificate_chain"] = settings.triton_ssl_certfile
        kwargs["private_key"] = settings.triton_ssl_keyfile
    return kwargs


class TritonAuth:
    """gRPC metadata sent with every Triton call (for example ``authorization: Bearer …``).

    The token file is read at first use and again whenever its modification
    time, size or inode changes, so a rotated token is used by the next call
    without a restart. Streams already open keep the metadata they opened with
    (Triton checks it when a call starts).
    """

    def __init__(self, settings: TritonSettings) -> None:
        # gRPC metadata keys are lower-case on the wire.
        self._header = settings.triton_auth_header.strip().lower()
        self._path = settings.triton_auth_token_file
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
                token = read_secret(self._path, "WORKER_TRITON_AUTH_TOKEN_FILE")
            except ConfigError:
                if self._stamp is not None:
                    return self._headers
                raise
            self._headers = {self._header: token}
            self._stamp = stamp
        return self._headers
