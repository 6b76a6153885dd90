"""The soak's traffic: each record of a partition, drawn from the seed, and what must become of it.

Most records are good requests for the ordinary models; the rest mix in what a
producer may also send: hostile records (every bad sample, null key and value, a
header that is not UTF-8), a model name no Triton has heard of (a new one each
time), a request whose result is over the output topic's limit, token streams of
the decoupled ``tokens`` model and steps of ``running_sum`` sequences keyed by the
record's key.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from devtools import samples
from devtools.samples import Tensor, encode_request, expected_tokens, token_request

#: Every model the soak's Tritons serve (a model reload picks one of them).
MODELS = ("double", "mlp", "echo_bytes", "tokens", "running_sum")
#: The ordinary (stateless, one response) models of the good requests.
PLAIN_MODELS = ("double", "mlp", "echo_bytes")
#: The output topic refuses records over this size (the worker's own limit is larger).
OUTPUT_MAX_BYTES = 64 * 1024
#: Floats of an oversized ``double`` request: a 80 kB input (within the request limit),
#: so a result of 80 kB, over OUTPUT_MAX_BYTES in every encoding that can carry it.
OVERSIZED_WIDTH = 20_000
#: A key, or one header's value, just over the output topic's limit on a small request:
#: its result is refused for what it copies of the request, not for its value.
BIG_PART_BYTES = OUTPUT_MAX_BYTES + 512
#: A JSON request padded to this size: over the request limit and over the dead-letter
#: topic's (the broker's default 1 MiB) once decompressed; a few kB compressed. The
#: producers' own limit lets it through.
COMPRESSED_HUGE_BYTES = 3 * 2**19
PRODUCER_MAX_BYTES = 4 * 2**20
#: The version of ``double`` the soak's Tritons retire (their version policy serves 2 only).
RETIRED_VERSION = "1"
_BAD = {s.request_id.removeprefix("bad-"): s for s in samples.bad_requests()}
#: Hostile kinds: every bad sample, plus two a librdkafka producer can send.
HOSTILE_KINDS = (*sorted(_BAD), "null-record", "header-not-utf8")
_WORDS = ("alpha", "beta", "straße", "café", "日本語", "ok")
#: Upper bounds of each kind's share, drawn in this order (the rest: good plain requests).
_SHARES = (
    ("hostile", 0.05),
    ("unserved-model", 0.08),
    ("tokens", 0.11),
    ("sequence", 0.17),
    ("result-too-large", 0.171),
    ("big-key-or-header", 0.172),
    ("compressed-too-large", 0.173),
    ("retired-version", 0.178),
)

_INPUTS = {
    "double": samples.double_inputs,
    "mlp": samples.mlp_inputs,
    "echo_bytes": samples.echo_bytes_inputs,
}

#: Passed through to the result as they came: a null value and a repeated name.
ODD_HEADERS: list[tuple[str, bytes | None]] = [
    ("x-trace", None),
    ("x-trace", b"1"),
    ("x-trace", b"2"),
]


class NotYet(Exception):
    """A record cannot be made now (its producer's registry is out as it first writes a
    schema version): the same record is made again at the next try."""


@dataclass(slots=True)
class Sent:
    """One produced record and what must become of it."""

    rid: str
    partition: int  # the input's number (Inputs): its partition on the ordinary topic
    kind: str
    expected_code: str | None = None  # the dead-letter code it must get, if any
    model: str | None = None
    encoding: str | None = None
    tensors: list[Tensor] | None = None  # inputs, to check the result's values
    tokens: list[str] | None = None  # a token stream's expected tokens
    sequence: str | None = None  # a ``running_sum`` step: its sequence (the record's key)
    step: int = 0
    expected_sum: int = 0  # the step's running sum when nothing disturbs the sequence
    fields: dict[str, Any] | None = None  # a mapped event's fields its result must copy
    #: A result is right as well as its dead letter (a retired version a Triton's restart or
    #: a model reload brought back).
    result_allowed: bool = False
    produced_ms: int = 0  # wall clock when handed to the producer


@dataclass(frozen=True, slots=True)
class Produced:
    sent: Sent
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


@dataclass(slots=True)
class _Sequence:
    """The ``running_sum`` sequence a partition has open."""

    key: str
    length: int
    step: int = 0
    total: int = 0


class Traffic:
    """The records of one partition, drawn from the seed: ``make(seq)`` gives record ``seq``.

    Null records and null header values only go through librdkafka (aiokafka refuses to
    send them). ``tag`` names the run in sequence keys. Each partition has at most one
    ``running_sum`` sequence open at a time, so the four partitions never need more than
    Triton's eight sequence slots.
    """

    def __init__(
        self, seed: int, partition: int, *, librdkafka: bool, tag: str, compressed: bool = True
    ) -> None:
        """``compressed``: the partition's producer compresses (else a request over the
        topic's limit as it is would be refused: none is made)."""
        self._rng = np.random.default_rng([seed, partition])
        self._partition = partition
        self._tag = tag  # in sequence keys: a run's sequences are its own in Triton
        self._librdkafka = librdkafka
        self._compressed = compressed
        self._open: _Sequence | None = None
        self._sequences = 0

    def make(self, seq: int) -> Produced:
        """Record ``seq`` of the partition."""
        rid = f"p{self._partition}-s{seq}"
        draw = self._rng.random()
        kind = next((k for k, upper in _SHARES if draw < upper), "plain")
        made = {
            "hostile": self._hostile,
            "unserved-model": self._unknown_model,
            "tokens": self._tokens,
            "sequence": self._sequence_step,
            "result-too-large": self._oversized,
            "big-key-or-header": self._big_key_or_header,
            "compressed-too-large": self._compressed_too_large,
            "retired-version": self._retired_version,
            "plain": self._plain,
        }[kind](rid)
        made.sent.produced_ms = int(time.time() * 1000)
        return made

    def _encoding(self) -> samples.Encoding:
        return samples.ENCODINGS[int(self._rng.integers(len(samples.ENCODINGS)))]

    def _plain(self, rid: str) -> Produced:
        """A good request for an ordinary model, 1 to 3 rows, with some legal oddities
        (model named in a header, a UTF-8 BOM before JSON, null and repeated headers)."""
        rng = self._rng
        model = PLAIN_MODELS[int(rng.integers(len(PLAIN_MODELS)))]
        encoding = self._encoding()
        tensors = _INPUTS[model](rng, int(rng.integers(1, 4)))
        kind, oddity = "plain", rng.random()
        if oddity < 0.05:
            kind = "model-in-header"
        elif oddity < 0.08:
            kind, encoding = "bom-json", "json"
        elif oddity < 0.12 and self._librdkafka:
            kind = "odd-headers"
        value, headers = encode_request(
            model, tensors, encoding, rid, model_in_header=kind == "model-in-header"
        )
        out_headers: list[tuple[str, bytes | None]] = list(headers)
        if kind == "bom-json":
            value = codecs.BOM_UTF8 + value
        if kind == "odd-headers":
            out_headers += ODD_HEADERS
        sent = Sent(rid, self._partition, kind, None, model, encoding, tensors)
        return Produced(sent, rid.encode(), value, out_headers)

    def _hostile(self, rid: str) -> Produced:
        kinds = [k for k in HOSTILE_KINDS if self._librdkafka or k != "null-record"]
        kind = str(kinds[int(self._rng.integers(len(kinds)))])
        tag = [("x-request-id", rid.encode())]
        partition = self._partition
        if kind == "null-record":
            return Produced(Sent(rid, partition, kind, "DECODE_ERROR"), None, None, list(tag))
        if kind == "header-not-utf8":
            value, headers = encode_request("double", samples.double_inputs(self._rng), "json", rid)
            bad: list[tuple[str, bytes | None]] = [*headers, ("x-model-name", b"\xff\xfe"), *tag]
            return Produced(Sent(rid, partition, kind, "DECODE_ERROR"), rid.encode(), value, bad)
        sample = _BAD[kind]
        kept: list[tuple[str, bytes | None]] = [
            (k, v) for k, v in sample.headers if k != "x-request-id"
        ]
        sent = Sent(rid, partition, kind, sample.expected_code)
        return Produced(sent, rid.encode(), sample.value, [*kept, *tag])

    def _unknown_model(self, rid: str) -> Produced:
        """A good ``double`` request naming a model of its own that no Triton serves."""
        encoding = self._encoding()
        model = f"gone-{rid}"
        value, headers = encode_request(model, samples.double_inputs(self._rng), encoding, rid)
        sent = Sent(rid, self._partition, "unserved-model", "MODEL_NOT_FOUND", model, encoding)
        return Produced(sent, rid.encode(), value, _named(headers, rid))

    def _oversized(self, rid: str) -> Produced:
        """A ``double`` request whose result is over the output topic's limit (binary or
        protobuf: the JSON of so many floats would be over the request limit itself)."""
        encoding: samples.Encoding = "binary" if self._rng.random() < 0.5 else "protobuf"
        tensors = samples.double_inputs(self._rng, 1, OVERSIZED_WIDTH)
        value, headers = encode_request("double", tensors, encoding, rid)
        sent = Sent(
            rid, self._partition, "result-too-large", "OUTPUT_TOO_LARGE", "double", encoding
        )
        return Produced(sent, rid.encode(), value, _named(headers, rid))

    def _big_key_or_header(self, rid: str) -> Produced:
        """A small good ``double`` request whose key, or one header, is just over the output
        topic's limit: its result is OUTPUT_TOO_LARGE for what it copies of the request (the
        ceiling on results must not be learnt from it: the results around it are answered)."""
        value, headers = encode_request("double", samples.double_inputs(self._rng), "json", rid)
        # Random bytes: the worker's producers compress, and the broker judges what they send.
        big = bytes(self._rng.integers(0, 256, BIG_PART_BYTES, dtype=np.uint8))
        key, named = rid.encode(), _named(headers, rid)
        kind = "big-key" if self._rng.random() < 0.5 else "big-header"
        if kind == "big-key":
            key = big
        else:
            named.append(("x-big", big))
        sent = Sent(rid, self._partition, kind, "OUTPUT_TOO_LARGE", "double", "json")
        return Produced(sent, key, value, named)

    def _compressed_too_large(self, rid: str) -> Produced:
        """A JSON request of 1.5 MiB, mostly padding: TOO_LARGE, and its dead letter over the
        dead-letter topic's limit (written without its value). Sent compressed, a few kB on
        the wire; on a partition whose producer does not compress, a plain request instead."""
        if not self._compressed:
            return self._plain(rid)
        value, headers = encode_request("double", samples.double_inputs(self._rng), "json", rid)
        padded = value[:-1] + b', "pad": "' + b"x" * COMPRESSED_HUGE_BYTES + b'"}'
        sent = Sent(rid, self._partition, "compressed-too-large", "TOO_LARGE", "double", "json")
        return Produced(sent, rid.encode(), padded, _named(headers, rid))

    def _retired_version(self, rid: str) -> Produced:
        """A good ``double`` request naming its version 1, which the soak's Tritons retired
        by their version policy (version 2 serves): MODEL_NOT_FOUND after a short hold, or a
        result where a Triton's restart or a model reload served version 1 again."""
        encoding = self._encoding()
        tensors = samples.double_inputs(self._rng)
        value, headers = encode_request("double", tensors, encoding, rid)
        named = [*_named(headers, rid), ("x-model-version", RETIRED_VERSION.encode())]
        sent = Sent(rid, self._partition, "retired-version", "MODEL_NOT_FOUND", "double", encoding)
        sent.tensors, sent.result_allowed = tensors, True
        return Produced(sent, rid.encode(), value, named)

    def _tokens(self, rid: str) -> Produced:
        """A token stream of 1 to 12 responses, a few ms apart, its final flag alone or not."""
        rng = self._rng
        text = " ".join(str(_WORDS[int(i)]) for i in rng.integers(0, len(_WORDS), 3))
        max_tokens = int(rng.integers(1, 13))
        separate = (None, False, True)[int(rng.integers(3))]
        encoding = self._encoding()
        request = token_request(
            rid,
            text,
            max_tokens,
            encoding,
            delay_ms=int(rng.integers(1, 5)),
            separate_final=separate,
        )
        sent = Sent(rid, self._partition, "tokens", None, "tokens", encoding)
        sent.tokens = expected_tokens(text, max_tokens)
        return Produced(sent, rid.encode(), request.value, _named(request.headers, rid))

    def _sequence_step(self, rid: str) -> Produced:
        """The next step of the partition's open ``running_sum`` sequence (a new one of 2 to 6
        steps when none is open), keyed by the sequence."""
        rng = self._rng
        if self._open is None:
            key = f"{self._tag}-p{self._partition}-q{self._sequences}"
            self._open = _Sequence(key, int(rng.integers(2, 7)))
            self._sequences += 1
        open_, value = self._open, int(rng.integers(1, 10))
        open_.total += value
        encoding = self._encoding()
        request = samples.running_sum_request(
            rid, value, encoding, start=open_.step == 0, end=open_.step == open_.length - 1
        )
        sent = Sent(rid, self._partition, "sequence", None, "running_sum", encoding)
        sent.sequence, sent.step, sent.expected_sum = open_.key, open_.step, open_.total
        open_.step += 1
        if open_.step == open_.length:
            self._open = None
        return Produced(sent, open_.key.encode(), request.value, list(request.headers))


def _named(headers: list[tuple[str, bytes]], rid: str) -> list[tuple[str, bytes | None]]:
    """The headers and the request id: a dead letter carries the record's headers, not the
    id decoded from its body, and the oracle finds a record's outcomes by it."""
    return [*headers, ("x-request-id", rid.encode())]
