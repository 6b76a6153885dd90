"""The mapping file: what it reads, and every problem reported at once, one per line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from worker.events import decode_event
from worker.events.mapping import Argmax, OutputRef, load_mappings
from worker.events.paths import MISSING, EventPath, parse_path
from worker.settings import ConfigError
from worker.wire import DecodeLimits, Source
from worker.wire.tensors import DATATYPES

PAYMENTS = """
[topics.payments]
model = "mlp"
version = "01"
request_id = "/payment_id"
[topics.payments.inputs.INPUT0]
datatype = "FP32"
fields = ["amount", "$.customer.age", "/hour"]
default = 0
[topics.payments.result.fields]
id = "/payment_id"
score = "PROBS[1]"
probs = "PROBS"
label = { argmax = "PROBS", labels = ["ok", "fraud"] }
"""


def write(tmp_path: Path, text: str, name: str = "mapping.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def problems_of(tmp_path: Path, text: str, topics: tuple[str, ...] = ("payments",)) -> list[str]:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_mappings(path, topics)
    assert caught.value.setting == "WORKER_MAPPING_FILE"
    head, *lines = caught.value.message.splitlines()
    count = f"{len(lines)} problem{'s' if len(lines) > 1 else ''}"
    assert head == f"WORKER_MAPPING_FILE: {path}: {count}:"
    return [line.strip() for line in lines]


@pytest.mark.parametrize(
    ("text", "steps"),
    [
        ("/features/3", ("features", 3)),
        ("$.features[3]", ("features", 3)),
        ("features[3]", ("features", 3)),
        ("customer.age", ("customer", "age")),
        ("/a~1b/c~0d", ("a/b", "c~d")),
        ("/07", ("07",)),
        ("$.a[0][1].b", ("a", 0, 1, "b")),
    ],
)
def test_both_path_forms_read_the_same_steps(text: str, steps: tuple[str | int, ...]) -> None:
    assert parse_path(text).steps == steps


@pytest.mark.parametrize("text", ["", "  ", "$", "a[x]", "a..b"])
def test_a_path_that_names_no_field_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"path|expected"):
        parse_path(text)


def test_a_path_finds_what_is_there_and_missing_for_the_rest() -> None:
    event = {"a": [{"b": 1}, {"b": None}], "3": "x"}
    assert parse_path("$.a[0].b").find(event) == 1
    assert parse_path("$.a[1].b").find(event) is None
    assert parse_path("$.a[2].b").find(event) is MISSING
    assert parse_path("$.a.b").find(event) is MISSING
    assert parse_path("/3").find(event) == "x"
    assert str(EventPath(("a", 0, "odd key"))) == "$.a[0]['odd key']"


def test_a_mapping_is_read_with_each_part(tmp_path: Path) -> None:
    mapping = load_mappings(write(tmp_path, PAYMENTS), ("payments", "other"))["payments"]
    assert (mapping.model, mapping.version) == ("mlp", "1")
    assert mapping.request_id == parse_path("/payment_id")
    (tensor,) = mapping.inputs
    assert (tensor.name, tensor.datatype, tensor.shape, tensor.default) == (
        "INPUT0",
        "FP32",
        (3,),
        0,
    )
    assert [str(path) for path in tensor.fields] == ["$.amount", "$.customer.age", "$.hour"]
    assert mapping.result.into is None
    assert dict(mapping.result.fields) == {
        "id": parse_path("/payment_id"),
        "score": OutputRef("PROBS", 1),
        "probs": OutputRef("PROBS", None),
        "label": Argmax("PROBS", ("ok", "fraud")),
    }
    assert mapping.outputs() == ("PROBS",)


def test_json_is_read_as_toml_is_and_the_result_defaults_to_the_event_enriched(
    tmp_path: Path,
) -> None:
    document = {
        "topics": {
            "clicks": {
                "model": "mlp",
                "inputs": {"INPUT0": {"datatype": "FP32", "from": "/features", "shape": [64]}},
            }
        }
    }
    mapping = load_mappings(write(tmp_path, json.dumps(document), "m.json"), ("clicks",))
    assert mapping["clicks"].result.into == "prediction"
    assert mapping["clicks"].inputs[0].source == parse_path("$.features")
    assert mapping["clicks"].outputs() == ()


def test_every_problem_of_a_file_is_one_line(tmp_path: Path) -> None:
    text = """
colour = "blue"
[topics.payments]
version = "one"
[topics.payments.inputs.A]
datatype = "FP33"
from = "/a"
[topics.payments.inputs.B]
datatype = "FP32"
from = "/b"
fields = ["/c"]
[topics.payments.inputs.C]
datatype = "INT32"
from = "/c"
shape = [0]
default = 1.5
[topics.payments.result]
into = "p"
fields = { s = "P[1]" }
[topics.unconsumed]
model = "mlp"
[topics.unconsumed.inputs.X]
datatype = "BYTES"
fields = ["/a", "a..b"]
shape = [3]
[topics.unconsumed.result.fields]
x = { argmax = "P", labels = [] }
y = "P[one]"
"""
    assert problems_of(tmp_path, text) == [
        "colour: unknown key; expected topics",
        "topics.payments.model: missing; name the model the events feed",
        "topics.payments.version: expected a version number, got 'one'",
        "topics.payments.inputs.A.datatype: expected one of BOOL, UINT8, UINT16, UINT32, "
        "UINT64, INT8, INT16, INT32, INT64, FP16, FP32, FP64, BYTES, got 'FP33'",
        "topics.payments.inputs.B: give either from (one path) or fields (paths gathered)",
        "topics.payments.inputs.C.shape: expected a list of sizes (-1 for any), got [0]",
        "topics.payments.inputs.C.default: 1.5 is not a INT32 value",
        "topics.payments.result: give either into (the event, enriched) or fields (a new "
        "event), not both",
        "topics.unconsumed: not one of WORKER_INPUT_TOPICS (payments); map only the topics "
        "the worker consumes",
        "topics.unconsumed.inputs.X.fields[1]: path 'a..b': cannot read it from '..b' on",
        "topics.unconsumed.inputs.X.shape: [3], but 1 fields are gathered; drop the shape or "
        "make it [1]",
        "topics.unconsumed.result.fields.x.labels: expected a list of strings, got []",
        "topics.unconsumed.result.fields.y: 'P[one]' is neither an event path nor an output",
    ]


@pytest.mark.parametrize(
    ("datatype", "default", "problem"),
    [
        ("INT8", "1000", "1000 is outside the range of INT8 (-128..127)"),
        ("UINT8", "-1", "-1 is outside the range of UINT8 (0..255)"),
        (
            "UINT64",
            "18446744073709551616",
            "18446744073709551616 is outside the range of UINT64 (0..18446744073709551615)",
        ),
        ("FP16", "70000", "70000 is outside the range of FP16 (-65504..65504)"),
        ("FP32", "1e39", "1e+39 is outside the range of FP32 (-3.4028235e+38..3.4028235e+38)"),
        ("FP32", "nan", "nan is outside the range of FP32 (-3.4028235e+38..3.4028235e+38)"),
    ],
)
def test_a_default_its_datatype_cannot_hold_is_refused_at_load(
    tmp_path: Path, datatype: str, default: str, problem: str
) -> None:
    """A default out of its input's range would refuse every event missing the field."""
    text = f"""
[topics.payments]
model = "m"
[topics.payments.inputs.X]
datatype = "{datatype}"
fields = ["/a", "/b"]
default = {default}
"""
    assert problems_of(tmp_path, text) == [
        f"topics.payments.inputs.X.default: {problem}; give a value it can hold"
    ]


@pytest.mark.parametrize(
    ("datatype", "default", "value"),
    [
        ("INT8", "-128", -128),
        ("UINT64", "18446744073709551615", 2**64 - 1),
        ("FP16", "-65504", -65504),
    ],
)
def test_a_default_at_its_datatype_s_limit_loads_and_fills_a_missing_field(
    tmp_path: Path, datatype: str, default: str, value: float
) -> None:
    text = f"""
[topics.payments]
model = "m"
[topics.payments.inputs.X]
datatype = "{datatype}"
from = "/a"
shape = [1]
default = {default}
"""
    mapping = load_mappings(write(tmp_path, text), ("payments",))["payments"]
    request = decode_event(mapping, b"{}", [], Source("payments", 0, 0), DecodeLimits(1024))
    raw = request.infer_request.raw_input_contents[0]
    assert np.frombuffer(raw, DATATYPES[datatype].dtype).tolist() == [value]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("m.ini", "[topics]", "name it .toml (TOML), .json (JSON) or .yaml (YAML)"),
        ("m.yaml", "topics: [unclosed", "not valid YAML: while parsing"),
        ("m.toml", "[topics", "not valid TOML"),
        ("m.json", "[1]", "expected a table of topics"),
        ("m.toml", "", "m.toml: 1 problem:\n  topics: expected a table of input topics"),
    ],
)
def test_a_file_that_cannot_be_read_as_a_mapping_says_so(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_mappings(write(tmp_path, text, name), ("payments",))


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read .*nowhere.toml: No such file"):
        load_mappings(str(tmp_path / "nowhere.toml"), ("payments",))


@pytest.mark.parametrize(
    ("name", "topic", "model"),
    [("payments.toml", "payments", "mlp"), ("readings.json", "readings", "double")],
)
def test_the_examples_load(name: str, topic: str, model: str) -> None:
    examples = Path(__file__).resolve().parents[3] / "examples"
    mapping = load_mappings(str(examples / name), (topic,))[topic]
    assert mapping.model == model


def test_yaml_is_read_as_toml_is(tmp_path: Path) -> None:
    text = """
topics:
  clicks:
    model: mlp
    inputs:
      INPUT0: {datatype: FP32, fields: [/x, /y], default: 0}
    result:
      into: scored
"""
    mapping = load_mappings(write(tmp_path, text, "m.yml"), ("clicks",))["clicks"]
    assert (mapping.model, mapping.inputs[0].shape, mapping.result.into) == (
        "mlp",
        (2,),
        "scored",
    )


def test_yaml_without_pyyaml_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)  # as in an install without the extra
    with pytest.raises(ConfigError, match=r"pip install 'kafka-triton-worker\[yaml\]'"):
        load_mappings(write(tmp_path, "topics: {}", "m.yaml"), ("clicks",))


REGISTRY_TOPIC = """
[topics.clicks]
model = "mlp"
format = "{fmt}"
[topics.clicks.inputs.INPUT0]
datatype = "FP32"
from = "/features"
shape = [64]
"""


def test_a_topic_s_format_is_read_and_an_unknown_one_refused(tmp_path: Path) -> None:
    """format avro and json-schema are registry formats, json (the default) is not; any
    other is a problem line naming the choices."""
    for fmt, registry in (("avro", True), ("json-schema", True), ("json", False)):
        mapping = load_mappings(write(tmp_path, REGISTRY_TOPIC.format(fmt=fmt)), ("clicks",))[
            "clicks"
        ]
        assert (mapping.format, mapping.registry_format) == (fmt, registry)
    assert problems_of(tmp_path, REGISTRY_TOPIC.format(fmt="protobuf"), ("clicks",)) == [
        "topics.clicks.format: expected one of json, avro, json-schema, got 'protobuf'"
    ]


@pytest.mark.parametrize(("fmt", "module"), [("avro", "fastavro"), ("json-schema", "jsonschema")])
def test_a_registry_format_without_its_library_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str, module: str
) -> None:
    """Without the registry extra's library, loading says so in one line, at once."""
    monkeypatch.setitem(sys.modules, module, None)  # as in an install without the extra
    with pytest.raises(ConfigError) as caught:
        load_mappings(write(tmp_path, REGISTRY_TOPIC.format(fmt=fmt)), ("clicks",))
    assert caught.value.message == (
        f"WORKER_MAPPING_FILE: topics.clicks.format: reading {fmt} events needs {module}: "
        "pip install 'kafka-triton-worker[registry]'"
    )
