"""Sample requests for the project's models in the three encodings, good and bad.

Used by ``demo``, ``produce``, the tests and the benchmark, so that all of them
speak the same wire contract as real producers would.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from tritonclient.grpc import service_pb2

from worker.wire.tensors import serialize_bytes_tensor

Encoding = Literal["json", "binary", "protobuf"]
ENCODINGS: tuple[Encoding, ...] = ("json", "binary", "protobuf")
Headers = list[tuple[str, bytes]]


@dataclass(frozen=True)
class Tensor:
    """One input tensor: name, OIP datatype, shape and row-major values."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    values: np.ndarray[Any, Any] | list[str]

    def raw(self) -> bytes:
        if self.datatype == "BYTES":
            return serialize_bytes_tensor(str(v).encode() for v in self.values)
        assert isinstance(self.values, np.ndarray)
        return self.values.astype(self.values.dtype.newbyteorder("<")).tobytes()

    def json_data(self) -> list[Any]:
        if isinstance(self.values, np.ndarray):
            return list(self.values.reshape(-1).tolist())
        return list(self.values)


@dataclass(frozen=True)
class SampleRequest:
    """A Kafka record value and headers, plus what the test or demo expects back."""

    value: bytes
    headers: Headers
    model: str
    encoding: Encoding
    request_id: str
    expected_code: str | None = None  # a dead-letter code for bad samples


def encode_request(
    model: str,
    tensors: Sequence[Tensor],
    encoding: Encoding,
    request_id: str,
    *,
    model_in_header: bool = False,
) -> tuple[bytes, Headers]:
    """Encode tensors as a request value in ``encoding``, with its headers."""
    headers: Headers = [("x-model-name", model.encode())] if model_in_header else []
    body_model = {} if model_in_header else {"model_name": model}
    if encoding == "json":
        doc = {
            "id": request_id,
            **body_model,
            "inputs": [
                {
                    "name": t.name,
                    "shape": list(t.shape),
                    "datatype": t.datatype,
                    "data": t.json_data(),
                }
                for t in tensors
            ],
        }
        return json.dumps(doc).encode(), [("content-type", b"application/json"), *headers]
    if encoding == "binary":
        blobs = [t.raw() for t in tensors]
        header = json.dumps(
            {
                "id": request_id,
                **body_model,
                "inputs": [
                    {
                        "name": t.name,
                        "shape": list(t.shape),
                        "datatype": t.datatype,
                        "parameters": {"binary_data_size": len(blob)},
                    }
                    for t, blob in zip(tensors, blobs, strict=True)
                ],
            }
        ).encode()
        return header + b"".join(blobs), [
            ("content-type", b"application/octet-stream"),
            ("inference-header-content-length", str(len(header)).encode()),
            *headers,
        ]
    request = service_pb2.ModelInferRequest(id=request_id, model_name=model)
    if model_in_header:
        request.model_name = ""
    for t in tensors:
        request.inputs.add(name=t.name, datatype=t.datatype, shape=list(t.shape))
        request.raw_input_contents.append(t.raw())
    return request.SerializeToString(), [("content-type", b"application/x-protobuf"), *headers]


# -- the project's models ----------------------------------------------------------


def double_inputs(rng: np.random.Generator, batch: int = 1, width: int = 16) -> list[Tensor]:
    values = rng.standard_normal((batch, width)).astype(np.float32)
    return [Tensor("INPUT0", "FP32", (batch, width), values)]


#: A mapping file (TOML) of plain JSON events to ``mlp``, ``{topic}`` naming their topic: an
#: event's ``features`` (64 numbers) are INPUT0, its ``id`` the request id, and the result
#: event holds the id and the probabilities. The text ends inside the result's fields, so
#: more may be added after it.
MLP_EVENTS_MAPPING = """
[topics.{topic}]
model = "mlp"
request_id = "/id"
[topics.{topic}.inputs.INPUT0]
datatype = "FP32"
from = "$.features"
shape = [64]
[topics.{topic}.result.fields]
id = "/id"
probs = "PROBS"
"""


def mlp_inputs(rng: np.random.Generator, batch: int = 1) -> list[Tensor]:
    values = rng.standard_normal((batch, 64)).astype(np.float32)
    return [Tensor("INPUT0", "FP32", (batch, 64), values)]


def embedding_inputs(rng: np.random.Generator, batch: int = 1) -> list[Tensor]:
    values = rng.standard_normal((batch, 768)).astype(np.float32)
    return [Tensor("EMBEDDING", "FP32", (batch, 768), values)]


_WORDS = ("straße", "café", "naïve", "kafka", "triton", "héllo wörld", "日本語", "ok")


def echo_bytes_inputs(rng: np.random.Generator, batch: int = 1) -> list[Tensor]:
    words = [str(_WORDS[int(i)]) for i in rng.integers(0, len(_WORDS), size=batch * 2)]
    return [Tensor("TEXT", "BYTES", (batch, 2), words)]


def faulty_inputs(
    rng: np.random.Generator, *, fail: bool = False, delay_ms: int = 0
) -> list[Tensor]:
    # `faulty` does not batch: its shapes carry no batch dimension.
    values = rng.standard_normal(4).astype(np.float32)
    return [
        Tensor("INPUT0", "FP32", (4,), values),
        Tensor("FAIL", "BOOL", (1,), np.array([fail], dtype=np.bool_)),
        Tensor("DELAY_MS", "INT32", (1,), np.array([delay_ms], dtype=np.int32)),
    ]


def faulty_request(
    rng: np.random.Generator, request_id: str, *, delay_ms: int = 0, fail: bool = False
) -> SampleRequest:
    """A JSON request for ``faulty`` that sleeps ``delay_ms`` (and fails when asked)."""
    tensors = faulty_inputs(rng, delay_ms=delay_ms, fail=fail)
    value, headers = encode_request("faulty", tensors, "json", request_id)
    return SampleRequest(value, headers, "faulty", "json", request_id)


def token_request(
    request_id: str,
    text: str,
    max_tokens: int,
    encoding: Encoding = "json",
    *,
    fail_after: int | None = None,
    delay_ms: int | None = None,
    separate_final: bool | None = None,
) -> SampleRequest:
    """A request for the decoupled ``tokens`` model: ``max_tokens`` responses of one token."""
    tensors = [
        Tensor("text_input", "BYTES", (1,), [text]),
        Tensor("max_tokens", "INT32", (1,), np.array([max_tokens], dtype=np.int32)),
    ]
    for name, number in (("fail_after", fail_after), ("delay_ms", delay_ms)):
        if number is not None:
            tensors.append(Tensor(name, "INT32", (1,), np.array([number], dtype=np.int32)))
    if separate_final is not None:
        tensors.append(
            Tensor("separate_final", "BOOL", (1,), np.array([separate_final], dtype=np.bool_))
        )
    value, headers = encode_request("tokens", tensors, encoding, request_id)
    return SampleRequest(value, headers, "tokens", encoding, request_id)


def expected_tokens(text: str, max_tokens: int) -> list[str]:
    """The tokens the ``tokens`` model streams for ``text``: its words, cycled, LLM-style."""
    words = text.split()
    return [(" " if i else "") + words[i % len(words)] for i in range(max_tokens)] if words else []


def running_sum_request(
    request_id: str,
    value: int,
    encoding: Encoding = "json",
    *,
    start: bool = False,
    end: bool = False,
) -> SampleRequest:
    """A request for the stateful ``running_sum`` model; the record's key names the sequence."""
    tensors = [Tensor("INPUT", "INT32", (1, 1), np.array([[value]], dtype=np.int32))]
    body, headers = encode_request("running_sum", tensors, encoding, request_id)
    # The key names the sequence, so the request id travels in a header of its own
    # (a dead letter carries the request's headers, not its decoded id).
    headers.append(("x-request-id", request_id.encode()))
    if start:
        headers.append(("x-sequence-start", b"true"))
    if end:
        headers.append(("x-sequence-end", b"true"))
    return SampleRequest(body, headers, "running_sum", encoding, request_id)


MODEL_INPUTS: dict[str, Callable[[np.random.Generator], list[Tensor]]] = {
    "double": double_inputs,
    "mlp": mlp_inputs,
    "echo_bytes": echo_bytes_inputs,
    "embedding": embedding_inputs,
}


def good_requests(
    count: int, seed: int = 7, models: Sequence[str] = ("double", "mlp", "echo_bytes")
) -> list[SampleRequest]:
    """``count`` valid requests cycling over models and all three encodings."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        model = models[i % len(models)]
        encoding = ENCODINGS[(i // len(models)) % len(ENCODINGS)]
        request_id = f"sample-{seed}-{i}"
        value, headers = encode_request(model, MODEL_INPUTS[model](rng), encoding, request_id)
        out.append(SampleRequest(value, headers, model, encoding, request_id))
    return out


#: The request size limit the bad samples assume: the "oversized" one is one byte
#: more, and still fits a broker's default 1 MiB message limit.
BAD_SAMPLES_MAX_REQUEST_BYTES = 256 * 1024


def bad_requests(max_request_bytes: int = BAD_SAMPLES_MAX_REQUEST_BYTES) -> list[SampleRequest]:
    """One request per kind of bad input, each with the dead-letter code it must get.

    The oversized one gets TOO_LARGE from a worker whose WORKER_MAX_REQUEST_BYTES
    is ``max_request_bytes``.
    """
    rng = np.random.default_rng(3)
    json_ct: Headers = [("content-type", b"application/json")]

    def doc(**changes: Any) -> bytes:
        base: dict[str, Any] = {
            "model_name": "double",
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": [1, 4],
                    "datatype": "FP32",
                    "data": [1.0, 2.0, 3.0, 4.0],
                }
            ],
        }
        base.update(changes)
        return json.dumps(base).encode()

    def inp(**changes: Any) -> list[dict[str, Any]]:
        item: dict[str, Any] = {
            "name": "INPUT0",
            "shape": [1, 4],
            "datatype": "FP32",
            "data": [1.0, 2.0, 3.0, 4.0],
        }
        item.update(changes)
        return [item]

    good_bin, bin_headers = encode_request("double", double_inputs(rng, 1, 4), "binary", "b")
    lying_headers = [
        (k, v) if k != "inference-header-content-length" else (k, b"999999") for k, v in bin_headers
    ]
    cases: list[tuple[str, bytes, Headers, str]] = [
        ("invalid-json", b'{"inputs": [', json_ct, "DECODE_ERROR"),
        ("not-the-schema", doc(inputs="nope"), json_ct, "DECODE_ERROR"),
        ("unknown-datatype", doc(inputs=inp(datatype="FP8")), json_ct, "DECODE_ERROR"),
        ("data-length", doc(inputs=inp(shape=[2, 4])), json_ct, "INVALID_REQUEST"),
        ("wrong-input-name", doc(inputs=inp(name="X")), json_ct, "INVALID_REQUEST"),
        (
            "wrong-datatype",
            doc(inputs=inp(datatype="INT32", data=[1, 2, 3, 4])),
            json_ct,
            "INVALID_REQUEST",
        ),
        ("unknown-model", doc(model_name="no_such_model"), json_ct, "MODEL_NOT_FOUND"),
        ("oversized", b" " * (max_request_bytes + 1), json_ct, "TOO_LARGE"),
        (
            "invalid-utf8",
            b'{"model_name": "double\xff\xfe", "inputs": []}',
            json_ct,
            "DECODE_ERROR",
        ),
        (
            "protobuf-garbage",
            b"\xff\xff\xff\x0f\x01garbage",
            [("content-type", b"application/x-protobuf")],
            "DECODE_ERROR",
        ),
        ("binary-header-past-end", good_bin, lying_headers, "DECODE_ERROR"),
    ]
    return [
        SampleRequest(
            value,
            [*headers, ("x-request-id", f"bad-{name}".encode())],
            "double",
            "json",
            f"bad-{name}",
            expected_code=code,
        )
        for name, value, headers, code in cases
    ]


def reading_events(count: int) -> list[SampleRequest]:
    """Sensor readings as CloudEvents for the ``readings`` mapping of ``examples/``, in
    binary mode (``ce_*`` headers) and structured mode (``application/cloudevents+json``)
    by turns; the last one lacks its battery (the mapping's default, 0, stands in)."""
    import json

    out = []
    for i in range(count):
        sensor = f"sensor-{i}"
        data: dict[str, Any] = {
            "sensor": {"id": sensor, "battery": 0.5 + i / 10},
            "temperature": 20.5 + i,
            "humidity": 0.25 * (i + 1),
        }
        if i == count - 1:
            del data["sensor"]["battery"]
        attributes = {
            "specversion": "1.0",
            "id": f"reading-{i}",
            "source": "/examples/sensors",
            "type": "com.example.reading",
        }
        if i % 2 == 0:
            headers = [(f"ce_{k}", v.encode()) for k, v in attributes.items()]
            headers.append(("content-type", b"application/json"))
            value = json.dumps(data).encode()
        else:
            headers = [("content-type", b"application/cloudevents+json")]
            value = json.dumps({**attributes, "data": data}).encode()
        out.append(SampleRequest(value, headers, "double", "json", sensor))
    return out


def payment_events(count: int, seed: int = 9) -> list[SampleRequest]:
    """Plain JSON payment events for the ``payments`` mapping of ``examples/``, then one
    whose features hold a word where a number belongs (an INVALID_REQUEST dead letter)."""
    import json

    rng = np.random.default_rng(seed)
    out = []
    for i in range(count + 1):
        payment_id = f"payment-{i}"
        features: list[Any] = [round(float(x), 4) for x in rng.standard_normal(64)]
        bad = i == count
        if bad:
            features[7] = "n/a"
        event = {
            "payment_id": payment_id,
            "amount": round(float(rng.uniform(1, 500)), 2),
            "features": features,
        }
        out.append(
            SampleRequest(
                json.dumps(event).encode(),
                [],
                "mlp",
                "json",
                payment_id,
                "INVALID_REQUEST" if bad else None,
            )
        )
    return out
