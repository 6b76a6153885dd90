"""Security options (Kafka's, Triton's, the Schema Registry's), secrets kept out of messages,
the model allowlist and the tensor limits."""

from __future__ import annotations

import base64
import contextlib
import http.server
import json
import os
import ssl
import sys
import threading
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tritonclient.grpc import service_pb2

from devtools.devstack.certs import LocalPki, make_pki
from worker import errors, wire
from worker.checks.kafka import scrub as _scrub
from worker.checks.startup import StartupCheckFailed, _raise_if_fatal
from worker.kafka.options import OAuthTokenProvider, kafka_client_kwargs
from worker.records import RecordRules
from worker.registry.client import RegistryClient, RegistryRefused
from worker.settings import ConfigError, KafkaAuthSettings, Settings, load_settings
from worker.triton.auth import TritonAuth, triton_client_kwargs

PASSWORD = "hunter2-Secret-value"
BASE = {
    "WORKER_INPUT_TOPICS": "requests",
    "WORKER_OUTPUT_TOPIC": "results",
    "WORKER_DLQ_TOPIC": "dead",
}


def settings(**extra: str) -> Settings:
    return load_settings({**BASE, **{f"WORKER_{k.upper()}": v for k, v in extra.items()}})


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    """Certificates generated for this module."""
    return make_pki(tmp_path_factory.mktemp("pki"))


# -- Kafka client options ------------------------------------------------------------


def test_plaintext_gives_only_the_protocol() -> None:
    """The default configuration adds nothing but security_protocol=PLAINTEXT."""
    assert kafka_client_kwargs(settings().kafka_auth) == {"security_protocol": "PLAINTEXT"}


def test_sasl_ssl_scram_reads_the_password_file_and_builds_a_tls_context(
    pki: LocalPki, tmp_path: Path
) -> None:
    """SASL_SSL + SCRAM: user, password from its file, and an SSL context trusting the CA."""
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    kwargs = kafka_client_kwargs(
        settings(
            security_protocol="SASL_SSL",
            sasl_mechanism="SCRAM-SHA-256",
            sasl_username="alice",
            sasl_password_file=str(password_file),
            ssl_cafile=str(pki.ca_cert),
            ssl_certfile=str(pki.client.cert),
            ssl_keyfile=str(pki.client.key),
        ).kafka_auth
    )
    assert kwargs["sasl_mechanism"] == "SCRAM-SHA-256"
    assert (kwargs["sasl_plain_username"], kwargs["sasl_plain_password"]) == ("alice", PASSWORD)
    assert isinstance(kwargs["ssl_context"], ssl.SSLContext)
    assert kwargs["ssl_context"].verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    ("extra", "setting"),
    [
        ({"sasl_password": PASSWORD}, "WORKER_SASL_USERNAME"),
        ({"sasl_username": "alice"}, "WORKER_SASL_PASSWORD"),
        (
            {"sasl_username": "alice", "sasl_password_file": "/nonexistent/password"},
            "WORKER_SASL_PASSWORD_FILE",
        ),
        (
            {"sasl_username": "a", "sasl_password": PASSWORD, "ssl_cafile": "/nonexistent/ca"},
            "WORKER_SSL_CAFILE",
        ),
    ],
)
def test_missing_credentials_name_the_setting_and_never_the_password(
    extra: dict[str, str], setting: str
) -> None:
    """A missing user, password, password file or CA file: ConfigError naming it, no secret."""
    with pytest.raises(ConfigError) as caught:
        kafka_client_kwargs(
            settings(security_protocol="SASL_SSL", sasl_mechanism="PLAIN", **extra).kafka_auth
        )
    assert caught.value.setting == setting
    assert PASSWORD not in str(caught.value)


def test_ca_file_without_tls_protocol_is_refused(pki: LocalPki) -> None:
    """A CA file with PLAINTEXT would be silently ignored: it is an error instead."""
    with pytest.raises(ConfigError, match="WORKER_SSL_CAFILE"):
        kafka_client_kwargs(settings(ssl_cafile=str(pki.ca_cert)).kafka_auth)


def test_garbage_ca_file_is_a_config_error(tmp_path: Path) -> None:
    """A CA file that is not PEM fails at start-up with the setting's name."""
    bad = tmp_path / "ca.pem"
    bad.write_text("not a certificate")
    with pytest.raises(ConfigError, match="WORKER_SSL_CAFILE"):
        kafka_client_kwargs(settings(security_protocol="SSL", ssl_cafile=str(bad)).kafka_auth)


async def test_oauth_token_file_is_read_again_at_each_authentication(tmp_path: Path) -> None:
    """OAUTHBEARER from a file: a token renewed on disk is the next one handed out."""
    token_file = tmp_path / "token"
    token_file.write_text("first-token\n")
    kwargs = kafka_client_kwargs(
        settings(
            security_protocol="SASL_SSL",
            sasl_mechanism="OAUTHBEARER",
            sasl_oauth_token_file=str(token_file),
        ).kafka_auth
    )
    provider = kwargs["sasl_oauth_token_provider"]
    first = await provider.token()
    token_file.write_text("second-token")
    assert (first, await provider.token()) == ("first-token", "second-token")


async def test_oauth_token_command_is_run_for_each_token() -> None:
    """OAUTHBEARER from a command: its stdout, stripped, is the token."""
    command = f"{sys.executable} -c \"print('from-command')\""
    provider = OAuthTokenProvider(None, command)
    assert await provider.token() == "from-command"


async def test_failing_oauth_command_names_the_setting_not_the_output() -> None:
    """A command exiting non-zero is a ConfigError that does not echo what it printed."""
    command = f"{sys.executable} -c \"print('leaked-token'); raise SystemExit(3)\""
    with pytest.raises(ConfigError) as caught:
        await OAuthTokenProvider(None, command).token()
    assert "status 3" in str(caught.value)
    assert "leaked-token" not in str(caught.value)


def test_oauth_needs_exactly_one_token_source() -> None:
    """OAUTHBEARER with neither a token file nor a command is refused."""
    with pytest.raises(ConfigError, match="WORKER_SASL_OAUTH_TOKEN_FILE"):
        kafka_client_kwargs(
            settings(security_protocol="SASL_SSL", sasl_mechanism="OAUTHBEARER").kafka_auth
        )


# -- secrets stay out of messages ----------------------------------------------------


def test_settings_repr_and_redacted_hide_the_password() -> None:
    """repr() and redacted() show *** for the SASL password."""
    loaded = settings(
        security_protocol="SASL_SSL",
        sasl_mechanism="PLAIN",
        sasl_username="alice",
        sasl_password=PASSWORD,
    )
    assert loaded.redacted()["sasl_password"] == "***"
    assert PASSWORD not in repr(loaded)
    assert PASSWORD not in json.dumps(loaded.redacted())


def test_config_error_about_sasl_settings_never_echoes_the_password() -> None:
    """Both a password and a password file, or a blank password: the message has no secret."""
    with pytest.raises(ConfigError) as both:
        settings(
            security_protocol="SASL_SSL",
            sasl_mechanism="PLAIN",
            sasl_password=PASSWORD,
            sasl_password_file="/run/secrets/kafka",
        )
    assert both.value.setting == "WORKER_SASL_PASSWORD"
    assert PASSWORD not in str(both.value)
    blank = "   \t  "
    with pytest.raises(ConfigError) as invalid:
        KafkaAuthSettings(sasl_password=blank)
    assert "***" in str(invalid.value) and blank not in str(invalid.value)


def test_startup_check_messages_scrub_secrets() -> None:
    """Whatever a library says, a secret in a start-up check message becomes ***."""
    assert (
        _scrub(f"login failed with {PASSWORD}\nretry", [PASSWORD]) == "login failed with *** retry"
    )


def test_refused_triton_token_is_fatal_and_not_echoed() -> None:
    """Triton's 'protocol is restricted' answer stops start-up; the token is not in the message."""
    loaded = settings(triton_auth_header="triton-grpc-protocol-key")
    with pytest.raises(StartupCheckFailed) as caught:
        _raise_if_fatal(
            "Triton x",
            "UNAVAILABLE",
            f"This protocol is restricted (got {PASSWORD})",
            loaded,
            [PASSWORD],
        )
    assert "WORKER_TRITON_AUTH_TOKEN_FILE" in str(caught.value)
    assert PASSWORD not in str(caught.value)


def test_unreachable_triton_is_not_a_startup_failure() -> None:
    """Connection refused is an outage (handled while running), not a configuration error."""
    _raise_if_fatal(
        "Triton x", "UNAVAILABLE", "failed to connect: Connection refused", settings(), []
    )


# -- Triton client options and token ---------------------------------------------------


def test_triton_tls_options_are_file_paths(pki: LocalPki) -> None:
    """TLS with a CA and a client certificate gives the client's ssl keyword arguments."""
    kwargs = triton_client_kwargs(
        settings(
            triton_ssl="true",
            triton_ssl_cafile=str(pki.ca_cert),
            triton_ssl_certfile=str(pki.client.cert),
            triton_ssl_keyfile=str(pki.client.key),
        ).triton
    )
    assert kwargs == {
        "ssl": True,
        "root_certificates": str(pki.ca_cert),
        "certificate_chain": str(pki.client.cert),
        "private_key": str(pki.client.key),
    }
    assert triton_client_kwargs(settings().triton) == {}


def test_triton_tls_files_are_checked(pki: LocalPki) -> None:
    """A missing CA file, or a CA file without TLS, is a ConfigError naming the setting."""
    with pytest.raises(ConfigError, match="WORKER_TRITON_SSL_CAFILE"):
        triton_client_kwargs(settings(triton_ssl="true", triton_ssl_cafile="/nonexistent").triton)
    with pytest.raises(ConfigError, match="WORKER_TRITON_SSL=true"):
        triton_client_kwargs(settings(triton_ssl_cafile=str(pki.ca_cert)).triton)


def test_triton_auth_reads_the_token_and_rereads_it_when_the_file_changes(
    tmp_path: Path,
) -> None:
    """The header carries the file's token; a rewritten file gives the new one."""
    token_file = tmp_path / "token"
    token_file.write_text("Bearer one\n")
    auth = TritonAuth(
        settings(triton_auth_header="Authorization", triton_auth_token_file=str(token_file)).triton
    )
    first = dict(auth.headers())
    token_file.write_text("Bearer two-longer")
    assert first == {"authorization": "Bearer one"}
    assert dict(auth.headers()) == {"authorization": "Bearer two-longer"}


def test_triton_auth_caches_while_the_file_is_unchanged(tmp_path: Path) -> None:
    """Same mtime, size and inode: the cached token is served without reading the file."""
    token_file = tmp_path / "token"
    token_file.write_text("Bearer aaaa")
    auth = TritonAuth(settings(triton_auth_token_file=str(token_file)).triton)
    assert dict(auth.headers()) == {"authorization": "Bearer aaaa"}
    stat = token_file.stat()
    with token_file.open("r+") as handle:  # same inode, same size
        handle.write("Bearer bbbb")
    os.utime(token_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert dict(auth.headers()) == {"authorization": "Bearer aaaa"}


def test_triton_auth_keeps_the_last_token_while_the_file_is_replaced(tmp_path: Path) -> None:
    """Missing at first use: ConfigError; missing later (being replaced): the last token."""
    token_file = tmp_path / "token"
    auth = TritonAuth(settings(triton_auth_token_file=str(token_file)).triton)
    with pytest.raises(ConfigError, match="WORKER_TRITON_AUTH_TOKEN_FILE"):
        auth.headers()
    token_file.write_text("Bearer kept")
    auth.headers()
    token_file.unlink()
    assert dict(auth.headers()) == {"authorization": "Bearer kept"}


def test_no_token_file_sends_no_header() -> None:
    """Without WORKER_TRITON_AUTH_TOKEN_FILE no metadata is added."""
    assert dict(TritonAuth(settings().triton).headers()) == {}


# -- model allowlist ---------------------------------------------------------------------


def test_allowlist_rules() -> None:
    """Listed models pass, others are FORBIDDEN; '*' allows all; unlisted topics are open."""
    loaded = settings(model_allowlist="requests=double|mlp;other=*")
    RecordRules.from_settings(loaded).check_model_allowed("requests", "double")
    RecordRules.from_settings(loaded).check_model_allowed("other", "anything")
    RecordRules.from_settings(loaded).check_model_allowed("unlisted", "anything")
    with pytest.raises(errors.Forbidden) as caught:
        RecordRules.from_settings(loaded).check_model_allowed("requests", "echo_bytes")
    assert caught.value.code == "FORBIDDEN" and not caught.value.retryable
    RecordRules.from_settings(settings()).check_model_allowed("requests", "anything")


# -- tensor limits -------------------------------------------------------------------------


def _decode(value: bytes, headers: list[tuple[str, bytes]], **limits: Any) -> Any:
    return wire.decode_request(
        value,
        headers,
        source=wire.Source("t", 0, 0),
        default_model="m",
        limits=wire.DecodeLimits(64 * 1024 * 1024, **limits),
    )


def _json(shape: list[int], data: list[Any], datatype: str = "FP32") -> bytes:
    tensor = {"name": "x", "shape": shape, "datatype": datatype, "data": data}
    return json.dumps({"inputs": [tensor]}).encode()


def _binary(shape: list[int], raw: bytes) -> tuple[bytes, list[tuple[str, bytes]]]:
    tensor: dict[str, object] = {"name": "x", "shape": shape, "datatype": "FP32"}
    tensor["parameters"] = {"binary_data_size": len(raw)}
    header = json.dumps({"inputs": [tensor]}).encode()
    headers = [
        ("content-type", b"application/octet-stream"),
        ("inference-header-content-length", str(len(header)).encode()),
    ]
    return header + raw, headers


def _protobuf(shape: list[int], raw: bytes) -> tuple[bytes, list[tuple[str, bytes]]]:
    request = service_pb2.ModelInferRequest()
    tensor = request.inputs.add()
    tensor.name, tensor.datatype = "x", "FP32"
    tensor.shape.extend(shape)
    request.raw_input_contents.append(raw)
    return request.SerializeToString(), [("content-type", b"application/x-protobuf")]


def test_tensor_within_limits_decodes() -> None:
    """Exactly at both limits the request decodes."""
    decoded = _decode(_json([2, 2], [1.0] * 4), [], max_tensor_elements=4, max_tensor_bytes=16)
    assert list(decoded.infer_request.inputs[0].shape) == [2, 2]


@pytest.mark.parametrize("encoding", ["json", "binary", "protobuf"])
def test_too_many_elements_is_too_large_in_every_encoding(encoding: str) -> None:
    """A 5-element tensor against max_tensor_elements=4 is TOO_LARGE, whatever the encoding."""
    raw = b"\0" * 20
    headers: list[tuple[str, bytes]]
    if encoding == "json":
        value, headers = _json([5], [0.0] * 5), []
    elif encoding == "binary":
        value, headers = _binary([5], raw)
    else:
        value, headers = _protobuf([5], raw)
    with pytest.raises(errors.TooLarge, match="4-element limit"):
        _decode(value, headers, max_tensor_elements=4)


@pytest.mark.parametrize("encoding", ["json", "binary", "protobuf"])
def test_too_many_bytes_is_too_large_in_every_encoding(encoding: str) -> None:
    """A 64-byte FP32 tensor against max_tensor_bytes=63 is TOO_LARGE."""
    raw = b"\0" * 64
    headers: list[tuple[str, bytes]]
    if encoding == "json":
        value, headers = _json([16], [0.0] * 16), []
    elif encoding == "binary":
        value, headers = _binary([16], raw)
    else:
        value, headers = _protobuf([16], raw)
    with pytest.raises(errors.TooLarge, match="63-byte limit"):
        _decode(value, headers, max_tensor_bytes=63)


def test_bytes_tensor_is_held_to_its_serialized_size() -> None:
    """BYTES has no fixed element size: its serialized length is what the limit checks."""
    value = _json([1], ["x" * 100], datatype="BYTES")
    with pytest.raises(errors.TooLarge, match="50-byte limit"):
        _decode(value, [], max_tensor_bytes=50)


@pytest.mark.parametrize("encoding", ["json", "binary", "protobuf"])
def test_huge_shape_with_little_data_is_refused_before_allocating(encoding: str) -> None:
    """shape [10**12] with 4 bytes of data: TOO_LARGE, with no large allocation on the way."""
    shape = [10**12]
    headers: list[tuple[str, bytes]]
    if encoding == "json":
        value, headers = _json(shape, [1.0]), []
    elif encoding == "binary":
        value, headers = _binary(shape, b"\0" * 4)
    else:
        value, headers = _protobuf(shape, b"\0" * 4)
    tracemalloc.start()
    try:
        with pytest.raises(errors.TooLarge):
            _decode(value, headers, max_tensor_elements=16 * 1024 * 1024)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 1024 * 1024


def test_small_shape_with_huge_data_is_refused_by_the_byte_limit() -> None:
    """shape [1] with 8 MiB of binary data: TOO_LARGE by max_tensor_bytes, not a slice copy."""
    value, headers = _binary([1], b"\0" * (8 * 1024 * 1024))
    tracemalloc.start()
    try:
        with pytest.raises(errors.TooLarge, match="data is 8388608 bytes"):
            _decode(value, headers, max_tensor_bytes=1024 * 1024)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The value itself is copied once into bytes(); no tensor-sized buffer beyond it.
    assert peak_bytes < 9 * 1024 * 1024 + 512 * 1024


def test_limits_default_to_off_in_decode_request() -> None:
    """Without limits a large tensor decodes (the worker always passes its settings)."""
    decoded = _decode(_json([1000], [0.0] * 1000), [])
    assert len(decoded.infer_request.raw_input_contents[0]) == 4000


class _Registry(http.server.BaseHTTPRequestHandler):
    """A Schema Registry's seam: answers ``status`` with ``body``, notes what it was sent."""

    status = 200
    body = b'["AVRO"]'
    seen: list[str | None] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.headers.get("Authorization"))
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        """Quiet."""


@contextlib.contextmanager
def _registry(context: ssl.SSLContext | None = None) -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Registry)
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        scheme = "https" if context is not None else "http"
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}/apis/ccompat/v7"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


async def test_registry_basic_auth_is_sent_and_its_refusal_never_shows_the_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The user and the password file's password go as HTTP basic auth; a 401 is
    RegistryRefused naming the settings, never the password."""
    secret = tmp_path / "registry-password"
    secret.write_text(PASSWORD + "\n")
    monkeypatch.setattr(_Registry, "status", 401)
    monkeypatch.setattr(_Registry, "body", b'{"message": "Unauthorized", "error_code": 401}')
    monkeypatch.setattr(_Registry, "seen", [])
    with _registry() as url:
        client = RegistryClient(
            settings(
                schema_registry_url=url,
                schema_registry_user="reader",
                schema_registry_password_file=str(secret),
            ).registry
        )
        with pytest.raises(RegistryRefused) as refused:
            await client.schema_types()
    token = base64.b64encode(f"reader:{PASSWORD}".encode()).decode()
    assert _Registry.seen == [f"Basic {token}"]
    assert "refused the worker (401 Unauthorized)" in refused.value.message
    assert "WORKER_SCHEMA_REGISTRY_PASSWORD" in refused.value.message
    assert PASSWORD not in refused.value.message and token not in refused.value.message


async def test_registry_tls_trusts_its_ca_and_presents_the_client_certificate(
    pki: LocalPki, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An https registry that requires a client certificate: answered with the CA file and
    the client's certificate; a CA that did not sign it is RegistryUnavailable (the
    verification's reason), a certificate without its key a config error at once."""
    monkeypatch.setattr(_Registry, "status", 200)
    monkeypatch.setattr(_Registry, "body", b'["AVRO", "JSON"]')
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(pki.ca_cert))
    server.load_cert_chain(pki.server.cert, pki.server.key)
    server.verify_mode = ssl.CERT_REQUIRED
    with _registry(server) as url:
        trusted = settings(
            schema_registry_url=url,
            schema_registry_cafile=str(pki.ca_cert),
            schema_registry_certfile=str(pki.client.cert),
            schema_registry_keyfile=str(pki.client.key),
        )
        assert await RegistryClient(trusted.registry).schema_types() == ["AVRO", "JSON"]
        other = settings(schema_registry_url=url, schema_registry_cafile=str(pki.other_ca_cert))
        with pytest.raises(errors.RegistryUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await RegistryClient(other.registry).schema_types()
    with pytest.raises(ConfigError, match="WORKER_SCHEMA_REGISTRY_KEYFILE"):
        settings(schema_registry_url=url, schema_registry_certfile=str(pki.client.cert))
