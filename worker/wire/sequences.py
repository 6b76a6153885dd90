"""Requests to a stateful model: the record's Kafka key as the sequence's correlation id.

With ``WORKER_SEQUENCE_FROM_KEY`` a request to a model with a sequence batcher gets
Triton's ``sequence_id`` parameter from the record's key: the key itself where the
model takes string ids, otherwise a stable 63-bit hash of it (BLAKE2b, never 0,
which Triton reads as "no sequence"). Headers ``x-sequence-start`` and
``x-sequence-end`` (``true``) become ``sequence_start`` and ``sequence_end``.
Parameters the request carries itself win over all three.
"""

from __future__ import annotations

import hashlib
from typing import Final

from worker.errors import InvalidRequest
from worker.wire.headers import X_SEQUENCE_END, X_SEQUENCE_START, Headers, header_text
from worker.wire.requests import DecodedRequest

__all__ = ["apply_sequence", "sequence_id_of_key"]

_MASK_63: Final = (1 << 63) - 1


def sequence_id_of_key(key: bytes) -> int:
    """A stable id in 1..2**63-1 for ``key``: the first 8 bytes of its BLAKE2b digest.

    Two keys share an id with probability 2**-63; with n sequences live at once the
    chance that any two collide is about n**2 / 2**64 (one in 18 million for a million).
    """
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return (int.from_bytes(digest, "big") & _MASK_63) or 1


def _flag(headers: Headers, name: str) -> bool:
    text = header_text(headers, name)
    if text is None or text.lower() == "false":
        return False
    if text.lower() == "true":
        return True
    raise InvalidRequest(f"header {name}: expected true or false, got {text!r}")


def apply_sequence(
    request: DecodedRequest, key: bytes | None, headers: Headers, *, string_ids: bool
) -> None:
    """Set the request's sequence parameters from the record's key and headers.

    InvalidRequest when the record has no key (and the request names no
    ``sequence_id`` itself), or, for string ids, a key that is not UTF-8.
    """
    params = request.infer_request.parameters
    model = request.model_name
    if "sequence_id" not in params:
        if key is None:
            raise InvalidRequest(
                f"model {model!r} keeps state per sequence and WORKER_SEQUENCE_FROM_KEY is on: "
                "the record needs a key (its sequence id), or a sequence_id parameter"
            )
        if string_ids:
            try:
                params["sequence_id"].string_param = key.decode()
            except UnicodeDecodeError:
                raise InvalidRequest(
                    f"model {model!r} takes string sequence ids: the record's key must be "
                    "UTF-8 text"
                ) from None
        else:
            params["sequence_id"].int64_param = sequence_id_of_key(key)
    for parameter, header in (
        ("sequence_start", X_SEQUENCE_START),
        ("sequence_end", X_SEQUENCE_END),
    ):
        if parameter not in params and _flag(headers, header):
            params[parameter].bool_param = True
