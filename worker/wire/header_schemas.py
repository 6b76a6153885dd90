"""The headers of requests and results as typed structures, for the committed JSON Schemas.

Each field is one header, named as it travels (``msgspec`` renames), its value the
UTF-8 text of the header. Dead-letter headers live beside the message types.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from worker.wire.headers import (
    CONTENT_TYPE,
    INFERENCE_HEADER_CONTENT_LENGTH,
    X_MODEL_NAME,
    X_MODEL_VERSION,
    X_REQUEST_ID,
    X_RESPONSE_COUNT,
    X_RESPONSE_FINAL,
    X_RESPONSE_INDEX,
    X_SEQUENCE_END,
    X_SEQUENCE_START,
    X_SOURCE_OFFSET,
    X_SOURCE_PARTITION,
    X_SOURCE_TOPIC,
)

__all__ = ["RequestHeaders", "ResultHeaders"]

_Digits = Annotated[str, msgspec.Meta(pattern=r"^[0-9]+$")]
_Flag = Literal["true", "false"]
_Unset = msgspec.UnsetType
_UNSET = msgspec.UNSET


class RequestHeaders(msgspec.Struct, frozen=True):
    """Headers of a request that the worker reads; all optional."""

    content_type: Annotated[
        Literal["application/json", "application/octet-stream", "application/x-protobuf"] | _Unset,
        msgspec.Meta(description="The value's encoding; absent means JSON."),
    ] = msgspec.field(default=_UNSET, name=CONTENT_TYPE)
    inference_header_content_length: Annotated[
        _Digits | _Unset,
        msgspec.Meta(description="application/octet-stream: bytes of JSON header first."),
    ] = msgspec.field(default=_UNSET, name=INFERENCE_HEADER_CONTENT_LENGTH)
    model_name: Annotated[
        str | _Unset, msgspec.Meta(description="The model; wins over the body's model_name.")
    ] = msgspec.field(default=_UNSET, name=X_MODEL_NAME)
    model_version: Annotated[
        str | _Unset, msgspec.Meta(description="The model version; wins over the body's.")
    ] = msgspec.field(default=_UNSET, name=X_MODEL_VERSION)
    request_id: Annotated[
        str | _Unset, msgspec.Meta(description="The request id when the body has no id.")
    ] = msgspec.field(default=_UNSET, name=X_REQUEST_ID)
    sequence_start: Annotated[
        _Flag | _Unset,
        msgspec.Meta(
            description=(
                "WORKER_SEQUENCE_FROM_KEY, a model with a sequence batcher: true on the first "
                "request of the sequence the record's key names (Triton's sequence_start)."
            )
        ),
    ] = msgspec.field(default=_UNSET, name=X_SEQUENCE_START)
    sequence_end: Annotated[
        _Flag | _Unset,
        msgspec.Meta(description="Like x-sequence-start: true on the sequence's last request."),
    ] = msgspec.field(default=_UNSET, name=X_SEQUENCE_END)


class ResultHeaders(msgspec.Struct, frozen=True):
    """Headers of a result: the request's own come first (same names replaced), then these."""

    content_type: Annotated[
        Literal["application/json", "application/octet-stream", "application/x-protobuf"],
        msgspec.Meta(description="The result's encoding: the request's family."),
    ] = msgspec.field(name=CONTENT_TYPE)
    request_id: Annotated[str, msgspec.Meta(description="The request id.")] = msgspec.field(
        name=X_REQUEST_ID
    )
    model_name: Annotated[str, msgspec.Meta(description="The model that answered.")] = (
        msgspec.field(name=X_MODEL_NAME)
    )
    model_version: Annotated[
        str, msgspec.Meta(description="The version Triton served (or the one asked for).")
    ] = msgspec.field(name=X_MODEL_VERSION)
    source_topic: Annotated[str, msgspec.Meta(description="Topic of the request.")] = msgspec.field(
        name=X_SOURCE_TOPIC
    )
    source_partition: Annotated[_Digits, msgspec.Meta(description="Its partition.")] = (
        msgspec.field(name=X_SOURCE_PARTITION)
    )
    source_offset: Annotated[_Digits, msgspec.Meta(description="Its offset.")] = msgspec.field(
        name=X_SOURCE_OFFSET
    )
    inference_header_content_length: Annotated[
        _Digits | _Unset,
        msgspec.Meta(description="Binary results: bytes of JSON header before the tensors."),
    ] = msgspec.field(default=_UNSET, name=INFERENCE_HEADER_CONTENT_LENGTH)
    response_index: Annotated[
        _Digits | _Unset,
        msgspec.Meta(
            description=(
                "Decoupled model, WORKER_STREAM_OUTPUT=each: this response's place in its "
                "request's stream, from 0."
            )
        ),
    ] = msgspec.field(default=_UNSET, name=X_RESPONSE_INDEX)
    response_final: Annotated[
        _Flag | _Unset,
        msgspec.Meta(
            description="WORKER_STREAM_OUTPUT=each: true on the stream's last result only."
        ),
    ] = msgspec.field(default=_UNSET, name=X_RESPONSE_FINAL)
    response_count: Annotated[
        _Digits | _Unset,
        msgspec.Meta(
            description=(
                "Decoupled model. final: how many responses (with outputs) the result joins; "
                "each: on the last result, how many results the stream has."
            )
        ),
    ] = msgspec.field(default=_UNSET, name=X_RESPONSE_COUNT)
