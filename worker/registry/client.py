"""The Schema Registry's Confluent REST API, as the worker uses it: a schema by id, a
subject's latest version, a registration.

Confluent Schema Registry, Karapace and Apicurio (``/apis/ccompat/v7``) serve it. Calls go
through the standard library's HTTP client on a thread of their own, each bounded by
``WORKER_SCHEMA_REGISTRY_TIMEOUT_MS``: the worker asks rarely (a schema once per id, the
results' subjects at start-up), so no HTTP library is needed. Basic auth and TLS (a CA,
a client certificate) come from the settings; the password is never part of a message.

What an answer means is decided here: unreachable, timed out, 5xx or 429 is
``RegistryUnavailable`` (the records wait); 401 or 403 is ``RegistryRefused`` (the
credentials: at start-up one line and exit 2, once running the records wait too); a
schema id the registry does not have is ``SchemaNotFound`` (the record's dead letter).
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote

from worker.errors import RegistryUnavailable, SchemaNotFound
from worker.settings import RegistrySettings
from worker.settings.secrets import check_file, read_secret

__all__ = [
    "RegisteredSchema",
    "RegistryClient",
    "RegistryRefused",
    "RegistryRejected",
    "SubjectVersion",
]

_CONTENT_TYPE: Final = "application/vnd.schemaregistry.v1+json"
#: Confluent's error codes: no such subject, version, schema.
_SUBJECT_NOT_FOUND: Final = frozenset({40401, 40402})
_SCHEMA_NOT_FOUND: Final = 40403
#: How much of an answer's text a message shows.
_SHOWN: Final = 300


class RegistryRefused(RegistryUnavailable):
    """The registry refused the worker's credentials (401) or access (403)."""


class RegistryRejected(Exception):
    """The registry refused a request for what it asks (an incompatible or invalid schema
    to register); the message is the registry's."""


@dataclass(frozen=True, slots=True)
class RegisteredSchema:
    """A schema as the registry holds it: its type (AVRO, JSON, PROTOBUF) and its text."""

    schema_type: str
    text: str
    #: Other schemas it names (Confluent's references), as the registry lists them.
    references: tuple[Any, ...] = ()


@dataclass(frozen=True, slots=True)
class SubjectVersion:
    """A subject's version: its schema id and number, and the schema."""

    schema_id: int
    version: int
    schema: RegisteredSchema


class RegistryClient:
    """Calls to one Schema Registry, with the settings' auth and TLS."""

    def __init__(self, settings: RegistrySettings) -> None:
        assert settings.schema_registry_url is not None
        self.url = settings.schema_registry_url.rstrip("/")
        self._timeout_s = settings.schema_registry_timeout_ms / 1000
        self._headers = {"Accept": _CONTENT_TYPE}
        password = settings.schema_registry_password
        if settings.schema_registry_password_file is not None:
            password = read_secret(
                settings.schema_registry_password_file, "WORKER_SCHEMA_REGISTRY_PASSWORD_FILE"
            )
        if settings.schema_registry_user is not None:
            token = f"{settings.schema_registry_user}:{password or ''}".encode()
            self._headers["Authorization"] = "Basic " + base64.b64encode(token).decode()
        self._context = _tls_context(settings) if self.url.startswith("https://") else None

    @property
    def authenticated(self) -> bool:
        """True when requests carry basic-auth credentials."""
        return "Authorization" in self._headers

    async def schema(self, schema_id: int) -> RegisteredSchema:
        """The schema of ``schema_id``; SchemaNotFound when the registry has none."""
        status, body = await self._call("GET", f"/schemas/ids/{schema_id}")
        if status == 404 and _error_code(body) in (_SCHEMA_NOT_FOUND, None):
            raise SchemaNotFound(
                f"schema id {schema_id}: the Schema Registry at {self.url} has no such schema "
                "(written against another registry, or not a framed record)"
            )
        _expect_ok(status, body, f"schema id {schema_id}")
        return _registered(body)

    async def latest(self, subject: str) -> SubjectVersion | None:
        """The subject's latest version; None when the subject has none."""
        status, body = await self._call(
            "GET", f"/subjects/{quote(subject, safe='')}/versions/latest"
        )
        if status == 404 and _error_code(body) in (*_SUBJECT_NOT_FOUND, None):
            return None
        _expect_ok(status, body, f"subject {subject!r}")
        return SubjectVersion(int(body["id"]), int(body["version"]), _registered(body))

    async def register(self, subject: str, schema_type: str, text: str) -> int:
        """Register ``text`` under ``subject`` (an identical schema keeps its id); its id.
        RegistryRejected when the registry refuses it (incompatible, invalid)."""
        request: dict[str, Any] = {"schema": text}
        if schema_type != "AVRO":
            request["schemaType"] = schema_type
        path = f"/subjects/{quote(subject, safe='')}/versions"
        status, body = await self._call("POST", path, request)
        if status in (409, 422):
            raise RegistryRejected(f"subject {subject!r}: {_message(body)} (HTTP {status})")
        _expect_ok(status, body, f"subject {subject!r}")
        return int(body["id"])

    async def schema_types(self) -> list[str]:
        """The schema types the registry serves (AVRO, JSON, PROTOBUF): a cheap probe."""
        status, body = await self._call("GET", "/schemas/types")
        if status == 404:
            raise RegistryRejected(
                f"{self.url} serves no Schema Registry API (404 for /schemas/types): give the "
                "base of its Confluent API (Apicurio: http://HOST:PORT/apis/ccompat/v7)"
            )
        _expect_ok(status, body, "schema types")
        return [str(kind) for kind in body]

    async def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return await asyncio.to_thread(self._request, method, path, body)

    def _request(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        """One HTTP exchange: (status, parsed JSON answer or None)."""
        data = json.dumps(body).encode() if body is not None else None
        headers = dict(self._headers)
        if data is not None:
            headers["Content-Type"] = _CONTENT_TYPE
        request = urllib.request.Request(self.url + path, data, headers, method=method)
        try:
            with urllib.request.urlopen(
                request, timeout=self._timeout_s, context=self._context
            ) as answer:
                return answer.status, _json(answer.read())
        except urllib.error.HTTPError as exc:
            status, answer = exc.code, _json(exc.read())
            exc.close()
        except (OSError, ValueError) as exc:  # refused, reset, timed out, TLS, bad URL
            raise RegistryUnavailable(
                f"Schema Registry {self.url} unreachable: {_reason(exc)}"
            ) from None
        if status in (401, 403):
            raise RegistryRefused(
                f"Schema Registry {self.url} refused the worker ({status} {_message(answer)}); "
                "check WORKER_SCHEMA_REGISTRY_USER and WORKER_SCHEMA_REGISTRY_PASSWORD(_FILE)"
            )
        if status >= 500 or status == 429:
            raise RegistryUnavailable(
                f"Schema Registry {self.url} answered {status}: {_message(answer)}"
            )
        return status, answer


def _tls_context(settings: RegistrySettings) -> ssl.SSLContext:
    for name, path in (
        ("WORKER_SCHEMA_REGISTRY_CAFILE", settings.schema_registry_cafile),
        ("WORKER_SCHEMA_REGISTRY_CERTFILE", settings.schema_registry_certfile),
        ("WORKER_SCHEMA_REGISTRY_KEYFILE", settings.schema_registry_keyfile),
    ):
        check_file(path, name)
    context = ssl.create_default_context(cafile=settings.schema_registry_cafile)
    if settings.schema_registry_certfile is not None:
        context.load_cert_chain(settings.schema_registry_certfile, settings.schema_registry_keyfile)
    return context


def _json(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw[:_SHOWN].decode("utf-8", "replace")


def _error_code(body: Any) -> int | None:
    code = body.get("error_code") if isinstance(body, dict) else None
    return code if isinstance(code, int) else None


def _message(body: Any) -> str:
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return str(body["message"])[:_SHOWN]
    return str(body)[:_SHOWN] if body is not None else "no message"


def _expect_ok(status: int, body: Any, what: str) -> None:
    if status >= 300 or not isinstance(body, dict | list):
        raise RegistryUnavailable(
            f"Schema Registry: {what}: unexpected answer {status}: {_message(body)}"
        )


def _registered(body: dict[str, Any]) -> RegisteredSchema:
    references = body.get("references") or ()
    return RegisteredSchema(
        str(body.get("schemaType") or "AVRO"), str(body["schema"]), tuple(references)
    )


def _reason(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.URLError):
        exc = exc.reason if isinstance(exc.reason, BaseException) else exc
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return str(text)
