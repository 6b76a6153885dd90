"""What a listener speaks, told apart from what the client was set to speak."""

from __future__ import annotations

import asyncio
import struct

import pytest

from worker.checks import listener
from worker.checks.listener import Listener, Unreachable, identify, mismatch

pytestmark = pytest.mark.unit

SASL_SSL = Listener("k:9093", tls=True, sasl=True, mechanisms=("SCRAM-SHA-512", "PLAIN"))
PLAINTEXT = Listener("k:9092", tls=False, sasl=False)


@pytest.mark.parametrize(
    ("seen", "protocol", "expected"),
    [
        (SASL_SSL, "PLAINTEXT", "set WORKER_SECURITY_PROTOCOL to SASL_SSL"),
        (SASL_SSL, "SSL", "set WORKER_SECURITY_PROTOCOL to SASL_SSL"),
        (PLAINTEXT, "SASL_SSL", "set WORKER_SECURITY_PROTOCOL to PLAINTEXT"),
        (PLAINTEXT, "SASL_PLAINTEXT", "set WORKER_SECURITY_PROTOCOL to PLAINTEXT"),
        (Listener("k:1", tls=True, sasl=None), "PLAINTEXT", "to SSL or SASL_SSL"),
    ],
)
def test_a_protocol_the_listener_does_not_speak_names_the_setting(
    seen: Listener, protocol: str, expected: str
) -> None:
    """TLS or SASL on one side only: one line naming WORKER_SECURITY_PROTOCOL and the fix."""
    line = mismatch(seen, protocol, None)
    assert line is not None and expected in line
    assert f"but WORKER_SECURITY_PROTOCOL is {protocol}" in line


def test_agreeing_protocols_pass_and_an_unknown_sasl_side_is_not_held_against() -> None:
    """Same TLS and SASL (or SASL unknown behind a client-certificate TLS): no mismatch."""
    assert mismatch(SASL_SSL, "SASL_SSL", "SCRAM-SHA-512") is None
    assert mismatch(PLAINTEXT, "PLAINTEXT", None) is None
    assert mismatch(Listener("k:1", tls=True, sasl=None), "SSL", None) is None


def test_a_mechanism_the_listener_does_not_offer_names_the_setting() -> None:
    """SASL on both sides, but not the mechanism: WORKER_SASL_MECHANISM, with those offered."""
    line = mismatch(SASL_SSL, "SASL_SSL", "SCRAM-SHA-256")
    assert line is not None and "WORKER_SASL_MECHANISM is SCRAM-SHA-256" in line
    assert "SCRAM-SHA-512, PLAIN" in line


def test_sasl_handshake_answer_is_read() -> None:
    """The answer's error code and mechanism list, after the correlation id."""
    names = b"".join(struct.pack(">h", len(n)) + n for n in (b"PLAIN", b"SCRAM-SHA-256"))
    answer = struct.pack(">ihi", 1, 33, 2) + names
    assert listener._parse_sasl_handshake(answer) == (33, ("PLAIN", "SCRAM-SHA-256"))
    request = listener._sasl_handshake_request()
    assert struct.unpack_from(">ihh", request) == (len(request) - 4, 17, 1)


async def test_a_closed_port_is_unreachable_with_its_reason() -> None:
    """Nothing listens: the address and "connection refused", no exception."""
    server = await asyncio.start_server(lambda _r, _w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    found = await identify([f"127.0.0.1:{port}"], 2.0)
    assert isinstance(found, Unreachable)
    assert str(found) == "connection refused"
