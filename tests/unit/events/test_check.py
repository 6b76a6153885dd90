"""A mapping against its model: every problem one line, and check's rows beside the model."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.checks.mappings import MappingFindings, mapping_rows
from worker.events import TopicMapping, load_mappings
from worker.events.check import mapping_problems
from worker.wire.validation import ModelSpec, TensorSpec

MLP = ModelSpec(
    "mlp",
    "1",
    (TensorSpec("INPUT0", "FP32", (64,)), TensorSpec("MASK", "BOOL", (-1,), optional=True)),
    (TensorSpec("PROBS", "FP32", (10,)), TensorSpec("TEXT", "BYTES", (-1,))),
    64,
)

FITS = """
[topics.a]
model = "mlp"
[topics.a.inputs.INPUT0]
datatype = "FP32"
from = "/features"
shape = [64]
[topics.a.inputs.MASK]
datatype = "BOOL"
from = "/mask"
shape = [-1]
[topics.a.result.fields]
score = "PROBS[9]"
label = { argmax = "PROBS", labels = ["0", "1", "2", "3", "4", "5", "6", "7", "8", "9"] }
text = "TEXT[100]"
"""

MISFITS = """
[topics.a]
model = "mlp"
[topics.a.inputs.INPUT1]
datatype = "FP32"
fields = ["/x"]
[topics.a.inputs.MASK]
datatype = "INT8"
from = "/mask"
shape = [3, 3]
[topics.a.result.fields]
score = "PROBS[10]"
label = { argmax = "PROBS", labels = ["no", "yes"] }
other = "LOGITS"
"""


def mapping(tmp_path: Path, text: str) -> TopicMapping:
    path = tmp_path / "m.toml"
    path.write_text(text)
    return load_mappings(str(path), ("a",))["a"]


def test_a_mapping_that_fits_its_model_has_no_problem(tmp_path: Path) -> None:
    assert mapping_problems(mapping(tmp_path, FITS), MLP) == []


def test_each_misfit_is_one_line_naming_the_mapping_key(tmp_path: Path) -> None:
    assert mapping_problems(mapping(tmp_path, MISFITS), MLP) == [
        "topics.a.inputs.INPUT1: model 'mlp' has no such input; its inputs are INPUT0, MASK",
        "topics.a.inputs.MASK.datatype: INT8, model 'mlp' expects BOOL",
        "topics.a.inputs.MASK.shape: [3, 3], model 'mlp' expects [-1] for one event (-1: any size)",
        "topics.a.inputs: model 'mlp' needs INPUT0, which the mapping does not give",
        "topics.a.result.fields.score: PROBS[10] is past the end of PROBS (10 elements)",
        "topics.a.result.fields.label.labels: 2 labels for the 10 elements of PROBS; give one "
        "label per element",
        "topics.a.result.fields.other: model 'mlp' has no output 'LOGITS'; its outputs are "
        "PROBS, TEXT",
    ]


def test_a_decoupled_model_is_not_mapped(tmp_path: Path) -> None:
    decoupled = ModelSpec("mlp", "1", MLP.inputs, MLP.outputs, 0, decoupled=True)
    problems = mapping_problems(mapping(tmp_path, FITS), decoupled)
    assert problems[-1].startswith("topics.a.model: 'mlp' is decoupled")


@pytest.mark.parametrize(
    ("spec", "unreachable", "outcomes"),
    [
        (MLP, None, ["ok", "ok", "ok"]),
        (None, None, ["fail", "fail", "fail"]),
        (None, "localhost:1: refused", ["skip", "skip", "skip"]),
    ],
)
def test_check_shows_each_mapped_input_beside_the_model_s(
    tmp_path: Path, spec: ModelSpec | None, unreachable: str | None, outcomes: list[str]
) -> None:
    one = mapping(tmp_path, FITS)
    findings = MappingFindings({"a": one}, unreachable=unreachable)
    if spec is not None:
        findings.specs[("mlp", "")] = spec
        findings.problems["a"] = mapping_problems(one, spec)
    else:
        findings.problems["a"] = [] if unreachable else ["topics.a.model: not served"]
    rows = mapping_rows(findings)
    assert [(row.check, row.outcome) for row in rows] == list(
        zip(["mapping a INPUT0", "mapping a MASK", "mapping a result"], outcomes, strict=True)
    )
    expected = "FP32 [64]" if spec is not None else "-"
    assert rows[0].detail.startswith(f"FP32 [64] from $.features -> mlp {expected}")
    assert rows[2].detail.startswith("fields score, label, text")
    assert mapping_rows(None) == []


def test_check_fails_the_row_of_the_input_that_does_not_fit(tmp_path: Path) -> None:
    one = mapping(tmp_path, MISFITS)
    findings = MappingFindings({"a": one}, specs={("mlp", ""): MLP})
    findings.problems["a"] = mapping_problems(one, MLP)
    rows = {row.check: row for row in mapping_rows(findings)}
    assert rows["mapping a MASK"].outcome == "fail"
    assert "expects BOOL" in rows["mapping a MASK"].detail
    assert rows["mapping a inputs"].outcome == "fail"
    assert rows["mapping a inputs"].detail == (
        "topics.a.inputs: model 'mlp' needs INPUT0, which the mapping does not give"
    )
    assert rows["mapping a result"].outcome == "fail"
    assert "needs INPUT0" not in rows["mapping a result"].detail
