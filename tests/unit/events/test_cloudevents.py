"""CloudEvents in both modes of the Kafka binding: read as events, answered in their mode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2

from worker.errors import DecodeError
from worker.events import TopicMapping, decode_event, load_mappings
from worker.events.cloudevents import DEFAULT_SOURCE, DEFAULT_TYPE
from worker.settings import ConfigError
from worker.wire import DecodeLimits, Source, encode_result, result_headers

MAPPING = """
[topics.clicks]
model = "double"
[topics.clicks.inputs.INPUT0]
datatype = "FP32"
fields = ["/x", "/y"]
[topics.clicks.result]
into = "doubled"
[topics.clicks.cloudevents]
type = "com.example.click.scored"
source = "/scoring/clicks"
"""

SOURCE = Source("clicks", 1, 99)
LIMITS = DecodeLimits(max_request_bytes=1 << 20)
BINARY = [
    ("ce_specversion", b"1.0"),
    ("ce_id", b"click-7"),
    ("ce_source", b"/web"),
    ("ce_type", b"com.example.click"),
    ("ce_time", b"2026-12-06T08:00:00Z"),
    ("content-type", b"application/json; charset=utf-8"),
    ("trace", b"t-1"),
]


def mapping(tmp_path: Path, text: str = MAPPING) -> TopicMapping:
    path = tmp_path / "m.toml"
    path.write_text(text)
    return load_mappings(str(path), ("clicks",))["clicks"]


def answered(request: Any, record_headers: Any) -> tuple[bytes, dict[str, bytes | None]]:
    response = service_pb2.ModelInferResponse(model_name="double", model_version="1")
    out = response.outputs.add(name="OUTPUT0", datatype="FP32")
    out.shape.extend([2])
    response.raw_output_contents.append(np.array([2.0, 4.0], "<f4").tobytes())
    value, encoding = encode_result(request, response)
    headers = result_headers(record_headers, request, encoding, SOURCE)
    return value, dict(headers)


def test_a_binary_cloud_event_is_answered_by_one(tmp_path: Path) -> None:
    request = decode_event(mapping(tmp_path), b'{"x": 1, "y": 2}', BINARY, SOURCE, LIMITS)
    assert request.request_id == "click-7"
    value, headers = answered(request, BINARY)
    assert orjson.loads(value) == {"x": 1, "y": 2, "doubled": {"OUTPUT0": [2.0, 4.0]}}
    ce = {k: v for k, v in headers.items() if k.startswith("ce_")}
    assert ce == {
        "ce_specversion": b"1.0",
        "ce_id": b"clicks/1/99",
        "ce_source": b"/scoring/clicks",
        "ce_type": b"com.example.click.scored",
        "ce_correlationid": b"click-7",
    }
    assert headers["content-type"] == b"application/json"
    assert headers["trace"] == b"t-1"


def test_a_structured_cloud_event_is_answered_by_one(tmp_path: Path) -> None:
    envelope = {
        "specversion": "1.0",
        "id": 'c"8',
        "source": "/web",
        "type": "com.example.click",
        "data": {"x": 3, "y": 4},
    }
    headers_in = [("content-type", b"application/cloudevents+json")]
    request = decode_event(mapping(tmp_path), orjson.dumps(envelope), headers_in, SOURCE, LIMITS)
    value, headers = answered(request, headers_in)
    assert orjson.loads(value) == {
        "specversion": "1.0",
        "id": "clicks/1/99",
        "source": "/scoring/clicks",
        "type": "com.example.click.scored",
        "correlationid": 'c"8',
        "datacontenttype": "application/json",
        "data": {"x": 3, "y": 4, "doubled": {"OUTPUT0": [2.0, 4.0]}},
    }
    assert headers["content-type"] == b"application/cloudevents+json"


def test_the_result_id_is_the_request_record_s_coordinates_whoever_answers(
    tmp_path: Path,
) -> None:
    """The same record answered twice (after a crash) carries the same id both times."""
    one = mapping(tmp_path)
    ids = {
        answered(decode_event(one, b'{"x": 1, "y": 2}', BINARY, SOURCE, LIMITS), BINARY)[1]["ce_id"]
        for _ in range(2)
    }
    assert ids == {b"clicks/1/99"}


def test_a_plain_event_is_answered_by_a_plain_event(tmp_path: Path) -> None:
    """A ce_* header of no required attribute leaves an event plain; its result carries
    none of the request's ce_* headers, the other headers pass through."""
    extensions = [("ce_subject", b"button"), ("Ce_Time", b"2026-12-06T08:00:00Z")]
    headers_in = [*extensions, ("trace", b"t-1")]
    request = decode_event(mapping(tmp_path), b'{"x": 1, "y": 2}', headers_in, SOURCE, LIMITS)
    assert request.event.cloud is None and request.request_id == "clicks-1-99"
    value, headers = answered(request, headers_in)
    assert orjson.loads(value) == {"x": 1, "y": 2, "doubled": {"OUTPUT0": [2.0, 4.0]}}
    assert [k for k in headers if k.lower().startswith("ce_")] == []
    assert headers["trace"] == b"t-1"


@pytest.mark.parametrize(
    ("headers", "value", "message"),
    [
        (
            [("ce_specversion", b"1.0"), ("ce_id", b"1")],
            b"{}",
            r"^binary CloudEvent: header\(s\) ce_source, ce_type missing or empty$",
        ),
        (
            [*BINARY[:4], ("content-type", b"text/plain")],
            b"{}",
            r"^binary CloudEvent: content-type 'text/plain'; expected JSON data",
        ),
        (
            [("content-type", b"application/cloudevents+json")],
            b'{"specversion": "1.0", "id": "1", "data": {}}',
            r"^structured CloudEvent: attribute\(s\) source, type missing, empty or not strings$",
        ),
        (
            [("content-type", b"application/cloudevents+json")],
            b'{"specversion": "1.0", "id": "", "source": "", "type": "t", "data": {}}',
            r"^structured CloudEvent: attribute\(s\) id, source missing, empty or not strings$",
        ),
        (
            [("content-type", b"application/cloudevents+json")],
            b'{"specversion": "0.3", "id": "1", "source": "s", "type": "t", "data": {}}',
            r"^structured CloudEvent: specversion is '0.3'; this worker reads CloudEvents 1.0 "
            r"only$",
        ),
        (
            [("ce_specversion", b"0.3"), *BINARY[1:]],
            b"{}",
            r"^binary CloudEvent: ce_specversion is '0.3'; this worker reads CloudEvents 1.0 only$",
        ),
        (
            BINARY[1:],
            b"{}",
            r"^binary CloudEvent: header\(s\) ce_specversion missing or empty$",
        ),
        (
            [("CE_Type", b"t"), ("content-type", b"application/json")],
            b"{}",
            r"^binary CloudEvent: header\(s\) ce_id, ce_source, ce_specversion missing or empty$",
        ),
        (
            [("content-type", b"application/cloudevents+json")],
            b'{"specversion": "1.0", "id": "1", "source": "s", "type": "t", "data_base64": "e30="}',
            r"^structured CloudEvent: data_base64 given; expected JSON data$",
        ),
        (
            [("content-type", b"application/cloudevents+json")],
            b'{"specversion": "1.0", "id": "1", "source": "s", "type": "t", "data": [1]}',
            r"^structured CloudEvent: data is \[1\]; expected a JSON object \(the event\)$",
        ),
    ],
)
def test_a_cloud_event_missing_what_the_binding_requires_is_a_decode_error(
    tmp_path: Path, headers: Any, value: bytes, message: str
) -> None:
    with pytest.raises(DecodeError, match=message):
        decode_event(mapping(tmp_path), value, headers, SOURCE, LIMITS)


def test_the_type_and_source_default_and_are_checked(tmp_path: Path) -> None:
    plain = mapping(tmp_path, MAPPING.split("[topics.clicks.cloudevents]")[0])
    assert (plain.cloudevents.type, plain.cloudevents.source) == (DEFAULT_TYPE, DEFAULT_SOURCE)
    with pytest.raises(ConfigError, match=r"topics.clicks.cloudevents.id: unknown key"):
        mapping(tmp_path, MAPPING + 'id = "fixed"\n')
