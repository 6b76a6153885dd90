"""Plain events in, events out: mapped topics against the real broker and Triton.

Events are produced by librdkafka (``confluent-kafka``), as a pipeline's own producers
would: compressed, keyed, some hostile. A topic of ``mlp`` events is answered by new events
of chosen fields; a topic of ``double`` readings by the events themselves, enriched. Every
hostile event gets a dead letter naming the field and what was expected, the good events
around them get their results, in both delivery modes. A mapping that does not fit its
model stops the worker before its first record, one line per problem.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from devtools.devstack.kafka import run_sync
from devtools.samples import MLP_EVENTS_MAPPING
from tests.integration.test_foreign_traffic import LARGE_PRODUCER, LARGE_TOPIC, Out, produce
from tests.integration.test_replay import _read as read_records
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    collect,
    mlp_reference,
    run_to_exit,
    running_worker,
    settings_for,
    spawn_worker,
    worker_env,
)
from tests.support.worker import clear_settings
from worker import cli
from worker.checks.report import run_checks
from worker.wire import header_value

pytestmark = pytest.mark.timeout(180)

LABELS = [f"class-{i}" for i in range(10)]

MAPPING = MLP_EVENTS_MAPPING.replace("{topic}", "{events}") + (
    """score = "PROBS[1]"
label = {{ argmax = "PROBS", labels = {labels} }}

[topics.{readings}]
model = "double"
request_id = "$.sensor.id"
[topics.{readings}.inputs.INPUT0]
datatype = "FP32"
fields = ["/a", "/b", "$.sensor.c"]
default = 0
[topics.{readings}.result]
into = "doubled"
"""
)


def write_mapping(tmp_path: Path, events: str, readings: str, text: str = MAPPING) -> str:
    path = tmp_path / "mapping.toml"
    path.write_text(text.format(events=events, readings=readings, labels=json.dumps(LABELS)))
    return str(path)


def event(name: str, **fields: Any) -> Out:
    return Out(orjson.dumps({"id": name, **fields}), name.encode())


def raw(name: str, value: bytes | None) -> Out:
    return Out(value, name.encode())


def features(rng: np.random.Generator) -> list[float]:
    return [float(x) for x in rng.standard_normal(64).astype(np.float32)]


#: A CloudEvent's required attributes, which the hostile CloudEvents change.
ATTRIBUTES = {"specversion": "1.0", "id": "c-1", "source": "/s", "type": "t"}


def cloud_event(name: str, mode: str, **changed: str | None) -> Out:
    """An event of 64 features as a CloudEvent in ``mode`` (binary: ``ce_*`` headers;
    structured: the envelope), its attributes ``changed`` (None: left out)."""
    attributes = {k: v for k, v in {**ATTRIBUTES, **changed}.items() if v is not None}
    data = {"id": name, "features": [0.0] * 64}
    if mode == "binary":
        headers: list[tuple[str, bytes | None]] = [
            (f"ce_{k}", v.encode()) for k, v in attributes.items()
        ]
        return Out(orjson.dumps(data), name.encode(), headers)
    envelope = {**attributes, "data": data}
    headers = [("content-type", b"application/cloudevents+json")]
    return Out(orjson.dumps(envelope), name.encode(), headers)


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
async def test_mapped_events_get_result_events_and_hostile_ones_dead_letters(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path, delivery: str
) -> None:
    topics = Topics.fresh(unique)
    readings = f"readings-{unique}"
    await kafka.create_topics([topics.input, topics.dlq], partitions=1, configs=LARGE_TOPIC)
    await kafka.create_topics([readings, topics.output], partitions=1)
    rng = np.random.default_rng(7)
    good = {f"good-{i}": features(rng) for i in range(6)}
    deep = b'{"id": "deep", "features": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    hostile = {
        "no-features": ("INVALID_REQUEST", event("no-features", other=1)),
        "not-a-number": (
            "INVALID_REQUEST",
            event("not-a-number", features=[1.0, 2.0, 3.0, "n/a", *[0.0] * 60]),
        ),
        "a-null": ("INVALID_REQUEST", event("a-null", features=[0.0] * 5 + [None] + [0.0] * 58)),
        "short": ("INVALID_REQUEST", event("short", features=[0.0] * 63)),
        "nested": (
            "INVALID_REQUEST",
            event("nested", features=[0.0] * 10 + [[1.0, 2.0]] + [0.0] * 53),
        ),
        "megabyte": (
            "INVALID_REQUEST",
            event("megabyte", features=["x" * 1024 * 1024] + [0.0] * 63),
        ),
        "tombstone": ("DECODE_ERROR", raw("tombstone", None)),
        "not-json": ("DECODE_ERROR", raw("not-json", b"amount=12")),
        "an-array": ("DECODE_ERROR", raw("an-array", b"[1, 2, 3]")),
        "deep": ("DECODE_ERROR", raw("deep", deep)),
        # A CloudEvent's id, source and type without its specversion: still a CloudEvent.
        "ce-no-specversion": (
            "DECODE_ERROR",
            cloud_event("ce-no-specversion", "binary", specversion=None),
        ),
        "ce-0.3-binary": (
            "DECODE_ERROR",
            cloud_event("ce-0.3-binary", "binary", specversion="0.3"),
        ),
        "ce-0.3-structured": (
            "DECODE_ERROR",
            cloud_event("ce-0.3-structured", "structured", specversion="0.3"),
        ),
        "ce-empty-id": ("DECODE_ERROR", cloud_event("ce-empty-id", "structured", id="")),
        "ce-empty-source": (
            "DECODE_ERROR",
            cloud_event("ce-empty-source", "structured", source=""),
        ),
    }
    messages = {
        "no-features": "$.features: missing; expected a number (FP32) for input INPUT0 of "
        f"model 'mlp' (the mapping of topic '{topics.input}' gives no default)",
        "not-a-number": '$.features[3]: expected a number (FP32), got "n/a"',
        "a-null": "$.features[5]: expected a number (FP32), got null",
        "short": "$.features: 63 elements, expected 64 (dimension 0 of shape [64])",
        "nested": "$.features[10]: expected a number (FP32), got [1.0,2.0]",
        "megabyte": '$.features[0]: expected a number (FP32), got "xxxxxxxxxxxxxxxxxxxxxxxx'
        "xxxxxxxxxxxxxxx... (1048578 characters)",
        "an-array": f"record value: topic '{topics.input}' expects a JSON object (an event), "
        "got list",
        "ce-no-specversion": "binary CloudEvent: header(s) ce_specversion missing or empty",
        "ce-0.3-binary": "binary CloudEvent: ce_specversion is '0.3'; this worker reads "
        "CloudEvents 1.0 only",
        "ce-0.3-structured": "structured CloudEvent: specversion is '0.3'; this worker reads "
        "CloudEvents 1.0 only",
        "ce-empty-id": "structured CloudEvent: attribute(s) id missing, empty or not strings",
        "ce-empty-source": "structured CloudEvent: attribute(s) source missing, empty or not "
        "strings",
    }
    events = [event(name, features=values) for name, values in list(good.items())[:3]]
    # A plain event may carry ce_* headers of no required attribute: it stays plain, and
    # its result carries none of them.
    extensions: list[tuple[str, bytes | None]] = [("ce_subject", b"payment"), ("ce_time", b"now")]
    events[0] = replace(events[0], headers=extensions)
    # Features this large overflow mlp's layers: every probability is NaN, and no label.
    events.append(event("overflow", features=[3e38] * 64))
    events += [out for _, out in hostile.values()]
    bom = Out(b"\xef\xbb\xbf" + orjson.dumps({"id": "bom", "features": good["good-3"]}), b"bom")
    events += [bom, *(event(name, features=v) for name, v in list(good.items())[4:])]
    good["bom"] = good.pop("good-3")
    plain_readings = [
        event("r-1", a=1.5, b=2, sensor={"id": "r-1", "c": -3}),
        Out(orjson.dumps({"a": 1, "sensor": {"id": "r-2"}}), b"r-2"),  # b, c missing: 0
        Out(orjson.dumps({"a": 1, "b": True, "sensor": {"id": "r-3"}}), b"r-3"),
    ]
    mapping = write_mapping(tmp_path, topics.input, readings)
    settings = settings_for(
        kafka,
        triton,
        topics,
        input_topics=f"{topics.input},{readings}",
        mapping_file=mapping,
        delivery=delivery,
    )
    async with running_worker(settings) as worker:
        await produce(
            kafka.bootstrap_servers,
            topics.input,
            events,
            {"compression.type": "lz4", "linger.ms": "50", **LARGE_PRODUCER},
        )
        await produce(kafka.bootstrap_servers, readings, plain_readings)
        got = await collect(kafka.bootstrap_servers, topics, len(events) + len(plain_readings))
        ready, detail = worker.readiness()
        assert ready, detail

    assert got.duplicates == 0
    for name, values in good.items():
        record = got.results[name]
        body = orjson.loads(record.value)
        expected = mlp_reference(np.asarray([values], dtype=np.float32))[0]
        assert body["id"] == name and set(body) == {"id", "score", "probs", "label"}
        np.testing.assert_allclose(body["probs"], expected, rtol=1e-5)
        assert body["score"] == pytest.approx(float(expected[1]), rel=1e-5)
        assert body["label"] == LABELS[int(np.argmax(expected))]
        assert header_value(record.headers, "content-type") == b"application/json"
        assert header_value(record.headers, "x-model-name") == b"mlp"
        assert record.key == name.encode()
        assert [k for k, _ in record.headers if k.lower().startswith("ce_")] == [], name
    overflow = orjson.loads(got.results["overflow"].value)
    assert overflow == {"id": "overflow", "probs": [None] * 10, "score": None, "label": None}
    answered = sorted(name for name in hostile if name not in got.dead_letters)
    assert answered == [], "answered instead of dead-lettered"
    for name, (code, sent) in hostile.items():
        letter = got.dead_letters[name]
        assert header_value(letter.headers, "x-error-code") == code.encode(), name
        message = (header_value(letter.headers, "x-error-message") or b"").decode()
        assert message.startswith(messages.get(name, "")), (name, message)
        # The event as it came (the tombstone's null too), the 1 MiB one included: the
        # dead-letter topic takes 4 MiB.
        assert letter.value == sent.value, name

    enriched = orjson.loads(got.results["r-1"].value)
    assert enriched == {
        "id": "r-1",
        "a": 1.5,
        "b": 2,
        "sensor": {"id": "r-1", "c": -3},
        "doubled": {"OUTPUT0": [3.0, 4.0, -6.0]},
    }
    assert orjson.loads(got.results["r-2"].value)["doubled"] == {"OUTPUT0": [2.0, 0.0, 0.0]}
    letter = got.dead_letters["r-3"]
    assert header_value(letter.headers, "x-error-message") == (
        b"$.b: expected a number (FP32), got true"
    )


MISFIT = """
[topics.{events}]
model = "mlp"
[topics.{events}.inputs.INPUT0]
datatype = "FP64"
from = "/features"
shape = [32]
[topics.{events}.result.fields]
score = "PROBS[10]"

[topics.{readings}]
model = "no_such_model"
[topics.{readings}.inputs.INPUT0]
datatype = "FP32"
fields = ["/a"]
"""


async def test_a_mapping_that_does_not_fit_its_model_stops_the_start_one_line_each(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    topics = Topics.fresh(unique)
    readings = f"readings-{unique}"
    await kafka.create_topics([topics.input, readings, topics.output, topics.dlq])
    mapping = write_mapping(tmp_path, topics.input, readings, MISFIT)
    extra = {"input_topics": f"{topics.input},{readings}", "mapping_file": mapping}

    exited = run_to_exit(worker_env(kafka, triton, topics, **extra), tmp_path / "w.log", 60.0)

    assert exited.code == 2, exited.lines[-20:]
    plain = [line for line in exited.lines if not line.startswith("{")]
    assert plain == [
        f"error: WORKER_MAPPING_FILE: {mapping}: 4 problems:",
        f"  topics.{topics.input}.inputs.INPUT0.datatype: FP64, model 'mlp' expects FP32",
        f"  topics.{topics.input}.inputs.INPUT0.shape: [32], model 'mlp' expects [64] for one "
        "event (-1: any size)",
        f"  topics.{topics.input}.result.fields.score: PROBS[10] is past the end of PROBS "
        "(10 elements)",
        f"  topics.{readings}.model: Triton {triton.grpc_address} does not serve "
        "'no_such_model'; load it, or map the topic to a model it serves",
    ], exited.lines[-20:]
    assert not any("Traceback" in line for line in exited.lines)

    rows = await run_checks(settings_for(kafka, triton, topics, **extra), 10.0)
    mapped = {row.check: (row.outcome, row.detail) for row in rows if "mapping" in row.check}
    assert mapped == {
        f"mapping {topics.input} INPUT0": (
            "fail",
            "FP64 [32] from $.features -> mlp FP32 [64]; "
            f"topics.{topics.input}.inputs.INPUT0.datatype: FP64, model 'mlp' expects FP32; "
            f"topics.{topics.input}.inputs.INPUT0.shape: [32], model 'mlp' expects [64] for "
            "one event (-1: any size)",
        ),
        f"mapping {topics.input} result": (
            "fail",
            f"fields score; topics.{topics.input}.result.fields.score: PROBS[10] is past the "
            "end of PROBS (10 elements)",
        ),
        f"mapping {readings} INPUT0": ("fail", "FP32 [1] from $.a -> no_such_model -"),
        f"mapping {readings} result": (
            "fail",
            "the event, outputs under 'prediction'; "
            f"topics.{readings}.model: Triton {triton.grpc_address} does not serve "
            "'no_such_model'; load it, or map the topic to a model it serves",
        ),
    }


#: Mappings that fit their models, but with defaults their inputs cannot hold.
OUT_OF_RANGE = """
[topics.{events}]
model = "faulty"
[topics.{events}.inputs.INPUT0]
datatype = "FP32"
fields = ["/x"]
[topics.{events}.inputs.DELAY_MS]
datatype = "INT32"
from = "/delay_ms"
shape = [1]
default = 3000000000

[topics.{readings}]
model = "double"
[topics.{readings}.inputs.INPUT0]
datatype = "FP32"
fields = ["/a", "/b"]
default = 1e39
"""


def test_a_default_its_input_cannot_hold_stops_run_and_check_one_line_each(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    unique: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An INT32 default past 2**31 and an FP32 default past its range: `run` and `check`
    exit 2, one line per default naming its topic, input, value and datatype's range."""
    topics = Topics.fresh(unique)
    readings = f"readings-{unique}"
    run_sync(lambda: kafka.create_topics([topics.input, readings, topics.output, topics.dlq]))
    mapping = write_mapping(tmp_path, topics.input, readings, OUT_OF_RANGE)
    env = worker_env(
        kafka, triton, topics, input_topics=f"{topics.input},{readings}", mapping_file=mapping
    )
    expected = [
        f"error: WORKER_MAPPING_FILE: {mapping}: 2 problems:",
        f"  topics.{topics.input}.inputs.DELAY_MS.default: 3000000000 is outside the range of "
        "INT32 (-2147483648..2147483647); give a value it can hold",
        f"  topics.{readings}.inputs.INPUT0.default: 1e+39 is outside the range of FP32 "
        "(-3.4028235e+38..3.4028235e+38); give a value it can hold",
    ]

    exited = run_to_exit(env, tmp_path / "w.log", 60.0)

    assert exited.code == 2, exited.lines[-20:]
    assert [line for line in exited.lines if not line.startswith("{")] == expected

    clear_settings(monkeypatch)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    assert cli.main(["check"]) == 2
    assert capsys.readouterr().err.splitlines() == expected


CLICKS = """
[topics.{events}]
model = "double"
[topics.{events}.inputs.INPUT0]
datatype = "FP32"
fields = ["/x", "/y"]
[topics.{events}.result.fields]
x = "/x"
doubled = "OUTPUT0"
[topics.{events}.cloudevents]
type = "com.example.click.scored"
source = "/scoring/clicks"
"""


def binary_click(i: int) -> Out:
    headers: list[tuple[str, bytes | None]] = [
        ("ce_specversion", b"1.0"),
        ("ce_id", f"click-{i}".encode()),
        ("ce_source", b"/web"),
        ("ce_type", b"com.example.click"),
        ("ce_subject", b"button"),
        ("content-type", b"application/json"),
    ]
    return Out(orjson.dumps({"x": i, "y": -i}), f"k-{i}".encode(), headers)


def structured_click(i: int) -> Out:
    envelope = {
        "specversion": "1.0",
        "id": f"click-{i}",
        "source": "/web",
        "type": "com.example.click",
        "data": {"x": i, "y": -i},
    }
    return Out(
        orjson.dumps(envelope),
        f"k-{i}".encode(),
        [("content-type", b"application/cloudevents+json")],
    )


async def test_cloud_events_are_answered_in_their_mode_with_ids_that_survive_a_sigkill(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """Binary and structured CloudEvents, each answered in its mode. The first worker is
    SIGKILLed before it commits (a commit interval of a minute): the second answers every
    event again, and each answer's id is the same as the first's, so consumers can
    deduplicate."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.output, topics.dlq])
    mapping = write_mapping(tmp_path, topics.input, "unused", CLICKS)
    clicks = [binary_click(i) if i % 2 else structured_click(i) for i in range(10)]
    extra = {"mapping_file": mapping, "commit_interval_ms": "60000"}
    first = spawn_worker(worker_env(kafka, triton, topics, **extra), tmp_path / "first.log")
    try:
        offsets = await produce(kafka.bootstrap_servers, topics.input, clicks)
        await read_records(kafka.bootstrap_servers, topics.output, len(clicks))
    finally:
        first.kill()
        first.wait()
    assert await kafka.committed_offsets(topics.group) == {}, "committed before the SIGKILL"
    async with running_worker(settings_for(kafka, triton, topics, **extra)):
        answers = await read_records(kafka.bootstrap_servers, topics.output, 2 * len(clicks))

    by_offset: dict[int, list[Any]] = {}
    for record in answers:
        by_offset.setdefault(int(header_value(record.headers, "x-source-offset") or b"-1"), [])
        by_offset[int(header_value(record.headers, "x-source-offset") or b"-1")].append(record)
    assert sorted(by_offset) == offsets
    for i, offset in enumerate(offsets):
        first_answer, again = by_offset[offset]
        assert (first_answer.value, first_answer.key) == (again.value, again.key)
        assert dict(first_answer.headers) == dict(again.headers)
        headers = dict(first_answer.headers)
        if i % 2:
            assert orjson.loads(first_answer.value) == {"x": i, "doubled": [2.0 * i, -2.0 * i]}
            assert {k: v for k, v in headers.items() if k.startswith("ce_")} == {
                "ce_specversion": b"1.0",
                "ce_id": f"{topics.input}/0/{offset}".encode(),
                "ce_source": b"/scoring/clicks",
                "ce_type": b"com.example.click.scored",
                "ce_correlationid": f"click-{i}".encode(),
            }
            assert headers["content-type"] == b"application/json"
        else:
            body = orjson.loads(first_answer.value)
            assert body == {
                "specversion": "1.0",
                "id": f"{topics.input}/0/{offset}",
                "source": "/scoring/clicks",
                "type": "com.example.click.scored",
                "correlationid": f"click-{i}",
                "datacontenttype": "application/json",
                "data": {"x": i, "doubled": [2.0 * i, -2.0 * i]},
            }
            assert headers["content-type"] == b"application/cloudevents+json"
        assert headers["x-request-id"] == f"click-{i}".encode()
