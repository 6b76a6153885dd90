"""What a Kafka listener speaks, asked with plain sockets: TLS or not, SASL or not.

When a client gets no answer from a bootstrap server, the cause is either that
nothing answers there (Kafka down, a wrong host or port: an outage) or that the
client speaks another security protocol than the listener (a configuration
error, which no retry fixes). Both clients report the second as a closed
connection, a failed handshake or an illegal SASL state; this module tells them
apart the same way for both:

1. a TLS handshake, trusting any certificate (nothing is sent but the hello): a
   listener that completes it, or answers with a TLS alert, speaks TLS; one that
   closes the connection does not;
2. over that connection (TLS or not), a SaslHandshake request for a mechanism no
   broker offers: a SASL listener answers with the mechanisms it enables, any other
   listener with ILLEGAL_SASL_STATE.

No credential is sent, and nothing is asked of the broker beyond those two steps.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from dataclasses import dataclass

__all__ = ["Listener", "Unreachable", "identify", "mismatch"]

#: SaslHandshake (api key 17) v1, and the error a listener without SASL answers it with.
_SASL_HANDSHAKE, _SASL_HANDSHAKE_V1, _ILLEGAL_SASL_STATE = 17, 1, 34
#: A mechanism no broker enables: the answer lists those it does.
_PROBE_MECHANISM = b"kafka-triton-worker-probe"
#: Largest answer read (a list of mechanism names).
_MAX_ANSWER_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Listener:
    """What one listener speaks. ``sasl`` is None when it could not be asked (a TLS
    listener requiring a client certificate the probe does not have)."""

    address: str
    tls: bool
    sasl: bool | None
    mechanisms: tuple[str, ...] = ()

    @property
    def protocol(self) -> str:
        """The WORKER_SECURITY_PROTOCOL this listener takes (two when SASL is unknown)."""
        if self.sasl is None:
            return "SSL or SASL_SSL"
        return ("SASL_" if self.sasl else "") + ("SSL" if self.tls else "PLAINTEXT")


@dataclass(frozen=True, slots=True)
class Unreachable:
    """No listener could be asked: why, for each address tried (address, reason)."""

    reasons: tuple[tuple[str, str], ...]

    def __str__(self) -> str:
        if len(self.reasons) == 1:
            return self.reasons[0][1]
        return "; ".join(f"{address}: {why}" for address, why in self.reasons)


def mismatch(listener: Listener, protocol: str, mechanism: str | None) -> str | None:
    """One line when the listener does not speak ``protocol`` (or offers no ``mechanism``),
    naming the setting to change; None when they agree as far as can be told."""
    tls, sasl = protocol in ("SSL", "SASL_SSL"), protocol.startswith("SASL_")
    offered = f" (SASL mechanisms {', '.join(listener.mechanisms)})" if listener.mechanisms else ""
    where = f"Kafka {listener.address} is a {listener.protocol} listener{offered}"
    if listener.tls != tls or (listener.sasl is not None and listener.sasl != sasl):
        return (
            f"{where}, but WORKER_SECURITY_PROTOCOL is {protocol}: set WORKER_SECURITY_PROTOCOL "
            f"to {listener.protocol}, or point WORKER_BOOTSTRAP_SERVERS at the broker's "
            f"{protocol} listener"
        )
    if sasl and mechanism is not None and listener.mechanisms:
        if mechanism not in listener.mechanisms:
            return f"{where}, but WORKER_SASL_MECHANISM is {mechanism}: use one it offers"
    return None


def _reason(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, socket.gaierror):
        return "host name not resolved"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError):
        return f"no answer within {timeout_s:g} s"
    return (exc.strerror if isinstance(exc, OSError) and exc.strerror else None) or str(exc)


async def identify(addresses: list[str], timeout_s: float) -> Listener | Unreachable:
    """The first of ``addresses`` (``host:port``) that accepts a connection, identified."""
    reasons = []
    for address in addresses:
        host, _, port = address.rpartition(":")
        try:
            async with asyncio.timeout(timeout_s):
                return await _identify(address, host.strip("[]"), int(port))
        except (OSError, TimeoutError) as exc:
            reasons.append((address, _reason(exc, timeout_s)))
    return Unreachable(tuple(reasons))


async def _identify(address: str, host: str, port: int) -> Listener:
    # A TCP connection first: refused, unresolved or silent ends here as OSError/timeout.
    _, writer = await asyncio.open_connection(host, port)
    await _close(writer)
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        reader, writer = await asyncio.open_connection(
            host, port, ssl=context, server_hostname=host
        )
    except ssl.SSLError as exc:
        if "alert" in str(exc).lower():
            return Listener(address, tls=True, sasl=None)  # a TLS peer refusing us
        return await _ask_sasl(address, host, port, tls=False)
    except (ConnectionError, asyncio.IncompleteReadError):
        return await _ask_sasl(address, host, port, tls=False)
    return await _sasl_over(address, reader, writer, tls=True)


async def _ask_sasl(address: str, host: str, port: int, *, tls: bool) -> Listener:
    reader, writer = await asyncio.open_connection(host, port)
    return await _sasl_over(address, reader, writer, tls=tls)


async def _sasl_over(
    address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, tls: bool
) -> Listener:
    try:
        writer.write(_sasl_handshake_request())
        await writer.drain()
        size = struct.unpack(">i", await reader.readexactly(4))[0]
        answer = await reader.readexactly(min(size, _MAX_ANSWER_BYTES))
    except ssl.SSLError:
        # The handshake completed on our side, then the server refused: no client certificate.
        return Listener(address, tls=True, sasl=None)
    except (ConnectionError, asyncio.IncompleteReadError) as exc:
        if tls:
            return Listener(address, tls=True, sasl=None)
        raise ConnectionError("closed the connection without answering a Kafka request") from exc
    finally:
        await _close(writer)
    error_code, mechanisms = _parse_sasl_handshake(answer)
    if error_code == _ILLEGAL_SASL_STATE:
        return Listener(address, tls=tls, sasl=False)
    return Listener(address, tls=tls, sasl=True, mechanisms=mechanisms)


def _sasl_handshake_request() -> bytes:
    client_id = b"kafka-triton-worker"
    body = struct.pack(">hhih", _SASL_HANDSHAKE, _SASL_HANDSHAKE_V1, 1, len(client_id))
    body += client_id + struct.pack(">h", len(_PROBE_MECHANISM)) + _PROBE_MECHANISM
    return struct.pack(">i", len(body)) + body


def _parse_sasl_handshake(answer: bytes) -> tuple[int, tuple[str, ...]]:
    """The error code and mechanisms of a SaslHandshake answer (after the correlation id)."""
    error_code, count = struct.unpack_from(">hi", answer, 4)
    offset, mechanisms = 10, []
    for _ in range(max(count, 0)):
        (length,) = struct.unpack_from(">h", answer, offset)
        mechanisms.append(answer[offset + 2 : offset + 2 + length].decode("utf-8", "replace"))
        offset += 2 + length
    return error_code, tuple(mechanisms)


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    try:
        await writer.wait_closed()
    except (OSError, ssl.SSLError):
        pass  # the peer closed first: nothing to do
