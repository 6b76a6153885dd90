"""Is a result right for what was sent? The values of every model, checked as they are read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from aiokafka.structs import ConsumerRecord

from tests.support import mlp_reference, result_outputs
from tests.support.soak.traffic import ODD_HEADERS, Sent

_CONTENT_TYPES = {
    "json": b"application/json",
    "binary": b"application/octet-stream",
    "protobuf": b"application/x-protobuf",
}


@dataclass(frozen=True, slots=True)
class MlpCheck:
    """An ``mlp`` result to compare with the reference, computed later for many rows at once."""

    rid: str
    rows: np.ndarray[Any, Any]
    probs: np.ndarray[Any, Any]


def first_header(headers: Any, name: str) -> bytes | None:
    """The first value of a header (a record's own headers come before those the worker adds)."""
    for key, value in headers:
        if key == name:
            return value if value is None else bytes(value)
    return None


def running_sum_of(record: ConsumerRecord[bytes, bytes]) -> int:
    """The SUM a ``running_sum`` result carries."""
    return int(np.asarray(result_outputs(record)["SUM"]).reshape(-1)[0])


def check_result(
    sent: Sent, record: ConsumerRecord[bytes, bytes], deferred: list[MlpCheck]
) -> str | None:
    """Why a result record is wrong for what was sent, or None when it is right.

    ``mlp`` values are checked later (``check_mlp``): the reference costs a few ms a call.
    A ``running_sum`` step's sum is judged with its whole sequence, by the oracle.
    """
    assert sent.model is not None and sent.encoding is not None
    headers = record.headers
    content_type = first_header(headers, "content-type")
    if content_type != _CONTENT_TYPES[sent.encoding]:
        return f"content-type {content_type!r} for a {sent.encoding} request"
    if first_header(headers, "x-model-name") != sent.model.encode():
        return f"x-model-name {first_header(headers, 'x-model-name')!r}, sent {sent.model}"
    if sent.kind == "odd-headers":
        passed = [(k, v) for k, v in headers if k == "x-trace"]
        if passed != ODD_HEADERS:
            return f"headers not passed through as sent: {passed}"
    if sent.model == "tokens":
        return _check_tokens(sent, record)
    if sent.model == "running_sum":
        return None if "SUM" in result_outputs(record) else "no SUM output"
    return _check_values(sent, record, deferred)


def cut_short(sent: Sent, record: ConsumerRecord[bytes, bytes]) -> bool:
    """True when a token stream's result holds only the first of its tokens, in order: what
    a Triton that crashed midway answered as complete (the oracle allows it only then)."""
    if sent.model != "tokens" or sent.tokens is None:
        return False
    got = result_outputs(record).get("text_output") or []
    return 0 < len(got) < len(sent.tokens) and list(got) == sent.tokens[: len(got)]


def _check_tokens(sent: Sent, record: ConsumerRecord[bytes, bytes]) -> str | None:
    got = result_outputs(record).get("text_output")
    if got != sent.tokens:
        return f"text_output {got} != {sent.tokens}"
    count = first_header(record.headers, "x-response-count")
    assert sent.tokens is not None
    if count != str(len(sent.tokens)).encode():
        return f"x-response-count {count!r} for {len(sent.tokens)} tokens"
    return None


def _check_values(
    sent: Sent, record: ConsumerRecord[bytes, bytes], deferred: list[MlpCheck]
) -> str | None:
    assert sent.tensors is not None
    outputs = result_outputs(record)
    values = sent.tensors[0].values
    if sent.model == "echo_bytes":
        want = [str(v).upper() for v in values]
        got = outputs.get("TEXT_UPPER")
        return None if got == want else f"TEXT_UPPER {got} != {want}"
    rows = np.asarray(values, dtype=np.float32)
    name = "OUTPUT0" if sent.model == "double" else "PROBS"
    got_array = np.asarray(outputs.get(name, []), dtype=np.float64)
    width = rows.shape[1] if sent.model == "double" else 10
    if got_array.size != rows.shape[0] * width:
        return f"{name} has {got_array.size} values for {rows.shape[0]} rows"
    got_array = got_array.reshape(rows.shape[0], width)
    if sent.model == "mlp":
        deferred.append(MlpCheck(sent.rid, rows, got_array))
        return None
    return None if np.allclose(got_array, rows * 2, rtol=1e-6) else f"{name} is not 2 x INPUT0"


def check_mlp(checks: list[MlpCheck]) -> list[str]:
    """The ``mlp`` results that differ from the reference computed here."""
    if not checks:
        return []
    expected = mlp_reference(np.concatenate([c.rows for c in checks]))
    wrong, row = [], 0
    for check in checks:
        rows = len(check.rows)
        if not np.allclose(check.probs, expected[row : row + rows], rtol=1e-5, atol=1e-7):
            wrong.append(f"{check.rid} (mlp): PROBS differ from the reference")
        row += rows
    return wrong
