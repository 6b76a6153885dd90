"""The models' side of the tests: sample requests decoded, references, result decoding, and
a model loaded as several versions in a Triton of the tests'."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from aiokafka.structs import ConsumerRecord

from devtools.devstack.paths import models_dir
from devtools.samples import Encoding, Tensor, encode_request
from worker import wire
from worker.wire import header_value


def decode_sample(
    model: str, tensors: Sequence[Tensor], request_id: str, encoding: Encoding = "protobuf"
) -> wire.DecodedRequest:
    """Encode tensors as a request for ``model`` and decode it as the worker would."""
    value, headers = encode_request(model, tensors, encoding, request_id)
    return wire.decode_request(
        value,
        headers,
        source=wire.Source("t", 0, 0),
        default_model=None,
        limits=wire.DecodeLimits(1 << 20),
    )


def mlp_reference(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """The ``mlp`` model computed here, from the same seeded weights."""
    rng = np.random.default_rng(1234)
    w1 = (rng.standard_normal((64, 128)) / 8.0).astype(np.float32)
    b1 = (rng.standard_normal(128) * 0.1).astype(np.float32)
    w2 = (rng.standard_normal((128, 10)) / np.sqrt(128.0)).astype(np.float32)
    b2 = (rng.standard_normal(10) * 0.1).astype(np.float32)
    hidden = np.maximum(rows @ w1 + b1, 0.0)
    return _softmax(hidden @ w2 + b2)


def embedding_reference(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """The ``embedding`` model's PROBS computed here, from the same seeded weights."""
    rng = np.random.default_rng(4321)
    w = (rng.standard_normal((768, 4)) / np.sqrt(768.0)).astype(np.float32)
    b = (rng.standard_normal(4) * 0.1).astype(np.float32)
    return _softmax(rows @ w + b)


def _softmax(logits: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Row-wise softmax, as the models compute it (the row's maximum taken off first)."""
    exp = np.exp(logits - logits.max(axis=1, keepdims=True))
    probabilities: npt.NDArray[np.float32] = (exp / exp.sum(axis=1, keepdims=True)).astype(
        np.float32
    )
    return probabilities


def result_outputs(record: ConsumerRecord[bytes, bytes]) -> dict[str, Any]:
    """Decode a result value, whatever its encoding, into {output name: numpy array or list}."""
    import json

    from tritonclient.grpc import service_pb2

    from worker.wire.tensors import deserialize_bytes_tensor, raw_to_numpy

    content_type = (header_value(record.headers, "content-type") or b"").decode()
    value = record.value or b""

    def decode(datatype: str, shape: list[int], raw: bytes) -> Any:
        if datatype == "BYTES":
            return [item.decode() for item in deserialize_bytes_tensor(raw)]
        return raw_to_numpy(datatype, shape, raw)

    if content_type == "application/x-protobuf":
        response = service_pb2.ModelInferResponse.FromString(value)
        return {
            o.name: decode(o.datatype, list(o.shape), raw)
            for o, raw in zip(response.outputs, response.raw_output_contents, strict=True)
        }
    if content_type == "application/octet-stream":
        length = int(header_value(record.headers, "inference-header-content-length") or b"0")
        doc = json.loads(value[:length])
        out, position = {}, length
        for o in doc["outputs"]:
            size = o["parameters"]["binary_data_size"]
            out[o["name"]] = decode(o["datatype"], o["shape"], value[position : position + size])
            position += size
        return out
    doc = json.loads(value)
    return {
        o["name"]: (
            o["data"]
            if o["datatype"] == "BYTES"
            else np.asarray(o["data"], dtype=np.float64).reshape(o["shape"])
        )
        for o in doc["outputs"]
    }


def _get_json(http_address: str, path: str) -> Any:
    with urllib.request.urlopen(f"http://{http_address}{path}", timeout=10) as response:
        return json.loads(response.read())


def load_versions(
    http_address: str, model: str, policy: dict[str, Any], broken: str | None = None
) -> tuple[int, str]:
    """Load ``model`` in the Triton at ``http_address`` (explicit model control) as versions
    1 and 2 of its own code under ``policy`` (Triton's ``version_policy``); ``broken``: the
    version whose code raises as it loads. Triton's HTTP status and answer."""
    config = _get_json(http_address, f"/v2/models/{model}/config")
    config["version_policy"] = policy
    code = (models_dir() / model / "1" / "model.py").read_bytes()
    failing = code + b"\nraise RuntimeError('this version cannot load')\n"
    files = {
        f"file:{version}/model.py": base64.b64encode(
            failing if version == broken else code
        ).decode()
        for version in ("1", "2")
    }
    request = urllib.request.Request(
        f"http://{http_address}/v2/repository/models/{model}/load",
        data=json.dumps({"parameters": {"config": json.dumps(config), **files}}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read().decode()


def version_states(http_address: str, model: str) -> dict[str, str]:
    """Each version of ``model`` Triton's repository index lists, and its state."""
    request = urllib.request.Request(
        f"http://{http_address}/v2/repository/index", data=b"{}", method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        index = json.loads(response.read())
    return {
        e["version"]: e.get("state", "") for e in index if e["name"] == model and "version" in e
    }
