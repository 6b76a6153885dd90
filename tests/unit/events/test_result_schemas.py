"""A registry-format topic's result schema: derived from the mapping, the model and the
events' schema; a subject's schema accepts it or says why not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from worker.events.json_result_schema import accepts_json, json_result_schema
from worker.events.mapping import load_mappings
from worker.events.result_schemas import accepts_avro, avro_result_schema, result_subject
from worker.wire.validation import ModelSpec, TensorSpec

MLP = ModelSpec(
    "mlp",
    "1",
    (TensorSpec("INPUT0", "FP32", (64,)),),
    (TensorSpec("PROBS", "FP32", (10,)),),
    max_batch_size=8,
)
EVENTS: dict[str, Any] = {
    "type": "record",
    "name": "Payment",
    "namespace": "com.example",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "kind", "type": {"type": "enum", "name": "Kind", "symbols": ["A", "B"]}},
        {"name": "features", "type": {"type": "array", "items": "float"}},
    ],
}
MAPPING = """
[topics.payments]
model = "mlp"
format = "avro"
[topics.payments.inputs.INPUT0]
datatype = "FP32"
from = "/features"
shape = [64]
[topics.payments.result]
{result}
"""


def mapping_of(tmp_path: Path, result: str) -> Any:
    path = tmp_path / "m.toml"
    path.write_text(MAPPING.format(result=result))
    return load_mappings(str(path), ("payments",))["payments"]


def test_fields_are_typed_from_the_events_schema_and_the_model(tmp_path: Path) -> None:
    """Copied fields nullable of the events' type (an enum as a string), an output an
    array of its datatype, an element a scalar, an argmax a nullable string."""
    mapping = mapping_of(
        tmp_path,
        'fields = { id = "/id", kind = "/kind", probs = "PROBS", score = "PROBS[1]", '
        'label = { argmax = "PROBS", labels = ["a","b","c","d","e","f","g","h","i","j"] } }',
    )
    schema, problems = avro_result_schema(mapping, MLP, EVENTS)
    assert problems == []
    assert schema == {
        "type": "record",
        "name": "payments_result",
        "namespace": "kafka_triton_worker",
        "fields": [
            {"name": "id", "type": ["null", "string"], "default": None},
            {"name": "kind", "type": ["null", "string"], "default": None},
            {"name": "probs", "type": {"type": "array", "items": "float"}},
            {"name": "score", "type": "float"},
            {"name": "label", "type": ["null", "string"], "default": None},
        ],
    }
    assert accepts_avro(schema, schema) == []
    assert result_subject(mapping, "scores") == "scores-value"


def test_into_adds_a_record_of_the_outputs_to_the_events_schema(tmp_path: Path) -> None:
    """The events' fields as they are, then the outputs' record under the field named."""
    mapping = mapping_of(tmp_path, 'into = "scored"\nname = "com.example.Scored"\n'
                         'subject = "topic-record"')  # fmt: skip
    schema, problems = avro_result_schema(mapping, MLP, EVENTS)
    assert problems == [] and schema is not None
    assert (schema["namespace"], schema["name"]) == ("com.example", "Scored")
    assert schema["fields"][:3] == EVENTS["fields"]
    assert schema["fields"][3]["type"]["fields"] == [
        {"name": "PROBS", "type": {"type": "array", "items": "float"}}
    ]
    assert result_subject(mapping, "scores") == "scores-com.example.Scored"


def test_a_copied_field_needs_the_events_schema(tmp_path: Path) -> None:
    """No schema under the events' subject, or no such field in it: a problem each."""
    mapping = mapping_of(tmp_path, 'fields = { id = "/id", other = "/nope" }')
    assert avro_result_schema(mapping, MLP, EVENTS)[1] == [
        "topics.payments.result.fields.other: the events' schema has no $.nope"
    ]
    _, problems = avro_result_schema(mapping, MLP, None)
    assert problems[0].startswith(
        "topics.payments.result.fields.id: copies $.id from the events, whose schema is typed "
        "by their subject, which has none yet"
    )


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"drop": "score"}, "it has no field 'score', which the mapping writes"),
        (
            {"type": ("score", "int")},
            """its field 'score' is "int", which does not take the mapping's "float\"""",
        ),
        (
            {"add": {"name": "region", "type": "string"}},
            "its field 'region' has no default and the mapping does not write it",
        ),
    ],
)
def test_a_subject_schema_that_cannot_write_the_result_says_why(
    tmp_path: Path, change: dict[str, Any], problem: str
) -> None:
    """A field missing, of a type that does not take the values, or one more without a
    default: refused; a wider type (double for float) or one more with a default: taken."""
    mapping = mapping_of(tmp_path, 'fields = { id = "/id", score = "PROBS[1]" }')
    derived, _ = avro_result_schema(mapping, MLP, EVENTS)
    assert derived is not None
    theirs = {**derived, "fields": [dict(f) for f in derived["fields"]]}
    if "drop" in change:
        theirs["fields"] = [f for f in theirs["fields"] if f["name"] != change["drop"]]
    if "type" in change:
        name, kind = change["type"]
        next(f for f in theirs["fields"] if f["name"] == name)["type"] = kind
    if "add" in change:
        theirs["fields"].append(change["add"])
    assert accepts_avro(theirs, derived) == [problem]
    wider = {**derived, "fields": [dict(f) for f in derived["fields"]]}
    wider["fields"][1]["type"] = "double"
    wider["fields"].append({"name": "region", "type": "string", "default": "eu"})
    assert accepts_avro(wider, derived) == []


def test_json_schema_results_and_their_acceptance(tmp_path: Path) -> None:
    """The JSON Schema of fields: copied ones from the events' schema, outputs by type; a
    subject's schema that requires more, or is closed to a field, is refused."""
    mapping = mapping_of(tmp_path, 'fields = { id = "/id", score = "PROBS[1]" }')
    events = {"type": "object", "properties": {"id": {"type": "string"}}}
    schema, problems = json_result_schema(mapping, MLP, events)
    assert problems == [] and schema is not None
    assert schema["properties"] == {
        "id": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "score": {"type": ["number", "null"]},
    }
    assert accepts_json(schema, schema) == []
    closed = {"type": "object", "properties": {"id": {}}, "additionalProperties": False}
    assert accepts_json(closed, schema) == ["it has no property 'score' and takes no other"]
    stricter = {**schema, "required": ["id", "score", "region"]}
    assert accepts_json(stricter, schema) == [
        "it requires 'region', which the mapping does not write"
    ]
