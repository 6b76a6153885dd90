"""CloudEvents on Kafka (the Kafka protocol binding, v1.0): events in, result events out.

A mapped topic's record is a CloudEvent when it says so: in **binary** mode its
attributes are ``ce_*`` headers and its value is the data; in **structured** mode its
content type is ``application/cloudevents+json`` and its value the whole event, the data
under ``data``. The mapping's paths read the data. The result event goes out in the same
mode, with the ``type`` and ``source`` the mapping names, an ``id`` made of the request
record's coordinates (a record answered twice after a crash carries the same id, so a
consumer can drop the duplicate) and the request's own id as the ``correlationid``
extension.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal

import orjson

from worker.errors import DecodeError
from worker.wire.headers import CONTENT_TYPE, Headers, Source, header_text

__all__ = [
    "CE_PREFIX",
    "STRUCTURED",
    "CloudEvent",
    "CloudEventsOut",
    "cloud_event_of",
    "is_structured",
]

#: The header prefix of a binary-mode event's attributes.
CE_PREFIX: Final = "ce_"
STRUCTURED: Final = "application/cloudevents+json"
SPEC_VERSION: Final = "1.0"
#: The attributes every CloudEvent has.
_REQUIRED: Final = ("id", "source", "type", "specversion")
#: Their headers in binary mode: any one of them makes a record a CloudEvent.
_REQUIRED_HEADERS: Final = frozenset(f"{CE_PREFIX}{name}" for name in _REQUIRED)
#: Used where the mapping names no type or source.
DEFAULT_TYPE: Final = "kafka-triton-worker.result"
DEFAULT_SOURCE: Final = "kafka-triton-worker"

Mode = Literal["binary", "structured"]


@dataclass(frozen=True, slots=True)
class CloudEventsOut:
    """What the mapping says of the result events: their ``type`` and ``source``."""

    type: str = DEFAULT_TYPE
    source: str = DEFAULT_SOURCE


@dataclass(frozen=True, slots=True)
class CloudEvent:
    """A request that came as a CloudEvent: its mode and the id it carried."""

    mode: Mode
    id: str

    def result(
        self,
        data: bytes,
        out: CloudEventsOut,
        source: Source,
        content_type: bytes = b"application/json",
    ) -> tuple[bytes, list[tuple[str, bytes]]]:
        """The result event of ``data`` (JSON, unless a binary event's ``content_type``
        says otherwise) in this event's mode: value and headers."""
        attributes = {
            "specversion": SPEC_VERSION,
            "id": f"{source.topic}/{source.partition}/{source.offset}",
            "source": out.source,
            "type": out.type,
            "correlationid": self.id,
        }
        if self.mode == "binary":
            headers = [(f"{CE_PREFIX}{k}", v.encode()) for k, v in attributes.items()]
            return data, [(CONTENT_TYPE, content_type), *headers]
        fields = b",".join(b'"%s":"%s"' % (k.encode(), _escape(v)) for k, v in attributes.items())
        envelope = b'{%s,"datacontenttype":"application/json","data":%s}' % (fields, data)
        return envelope, [(CONTENT_TYPE, STRUCTURED.encode())]


def _escape(text: str) -> bytes:
    return orjson.dumps(text)[1:-1]


def cloud_event_of(
    headers: Headers, envelope: Any | None, *, json_data: bool = True
) -> CloudEvent | None:
    """The record's CloudEvent, if it is one: structured when ``envelope`` (the parsed
    value of an ``application/cloudevents+json`` record) is given, binary when any header
    of a required attribute (``ce_specversion``, ``ce_id``, ``ce_source``, ``ce_type``)
    is there; DecodeError when a required attribute is missing or empty, or the event is
    not of CloudEvents 1.0. ``json_data``: a binary event's data must be JSON (its
    content type says so); False for a registry format's, which its framing tells."""
    if envelope is not None:
        if not isinstance(envelope, dict):
            raise DecodeError("structured CloudEvent: expected a JSON object")
        missing = [name for name in _REQUIRED if not _non_empty(envelope.get(name))]
        if missing:
            raise DecodeError(
                f"structured CloudEvent: attribute(s) {', '.join(missing)} missing, empty "
                "or not strings"
            )
        _check_version("structured CloudEvent: specversion", envelope["specversion"])
        if "data_base64" in envelope:
            raise DecodeError("structured CloudEvent: data_base64 given; expected JSON data")
        return CloudEvent("structured", envelope["id"])
    # Any one required attribute's header makes it a CloudEvent: one missing the others
    # (its specversion most often) is refused, not taken for a plain event.
    if not any(name.lower() in _REQUIRED_HEADERS for name, _ in headers):
        return None
    values = {name: header_text(headers, f"{CE_PREFIX}{name}") for name in _REQUIRED}
    missing = [f"{CE_PREFIX}{name}" for name, value in values.items() if not value]
    if missing:
        raise DecodeError(f"binary CloudEvent: header(s) {', '.join(missing)} missing or empty")
    _check_version(f"binary CloudEvent: {CE_PREFIX}specversion", values["specversion"] or "")
    if not json_data:
        return CloudEvent("binary", values["id"] or "")
    content_type = (header_text(headers, CONTENT_TYPE) or "application/json").lower()
    media = content_type.split(";", 1)[0].strip()
    if media != "application/json" and not media.endswith("+json"):
        raise DecodeError(
            f"binary CloudEvent: content-type {content_type!r}; expected JSON data "
            "(application/json)"
        )
    return CloudEvent("binary", values["id"] or "")


def _non_empty(value: Any) -> bool:
    """True for a non-empty string: what a required attribute must be (CloudEvents 1.0)."""
    return isinstance(value, str) and bool(value)


def _check_version(where: str, version: str) -> None:
    # Another version's attributes may differ in name and meaning (0.3's schemaurl, a
    # later one's): reading it as 1.0 could answer with the wrong correlation.
    if version != SPEC_VERSION:
        raise DecodeError(
            f"{where} is {version!r}; this worker reads CloudEvents {SPEC_VERSION} only"
        )


def is_structured(headers: Headers) -> bool:
    """True for a record whose content type is a structured CloudEvent's."""
    content_type = header_text(headers, CONTENT_TYPE) or ""
    return content_type.split(";", 1)[0].strip().lower() == STRUCTURED
