"""Bytes and headers to inference requests and back: the wire contract, pure (no I/O)."""

from worker.wire.headers import (
    CONTENT_TYPE,
    CONTENT_TYPE_BINARY,
    CONTENT_TYPE_JSON,
    CONTENT_TYPE_PROTOBUF,
    INFERENCE_HEADER_CONTENT_LENGTH,
    Headers,
    Source,
    check_header_keys,
    dead_letter_headers,
    header_text,
    header_value,
    omitted_value_headers,
    replay_count,
    replay_headers,
    rfc3339_utc,
)
from worker.wire.requests import (
    DecodedRequest,
    DecodeLimits,
    Encoding,
    decode_request,
    request_names,
)
from worker.wire.results import ResultHeaders, encode_result, result_headers

__all__ = [
    "CONTENT_TYPE",
    "CONTENT_TYPE_BINARY",
    "CONTENT_TYPE_JSON",
    "CONTENT_TYPE_PROTOBUF",
    "INFERENCE_HEADER_CONTENT_LENGTH",
    "DecodeLimits",
    "DecodedRequest",
    "Encoding",
    "Headers",
    "ResultHeaders",
    "Source",
    "check_header_keys",
    "dead_letter_headers",
    "decode_request",
    "encode_result",
    "header_text",
    "header_value",
    "omitted_value_headers",
    "replay_count",
    "replay_headers",
    "request_names",
    "result_headers",
    "rfc3339_utc",
]
