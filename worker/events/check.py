"""A mapping against its model's metadata: each problem as one line, each input as a row.

Pure: the caller asks Triton for the model (``worker.checks.mappings``). What is checked
is what every event of the topic would otherwise fail on: the inputs' names, datatypes and
shapes (one event's, against the model's without its batch dimension), the model inputs
the mapping does not give, and the outputs the result reads (an element past a fixed
size, more labels or fewer than an output's elements).
"""

from __future__ import annotations

from worker.events.mapping import Argmax, InputMap, OutputRef, TopicMapping
from worker.wire.validation import ModelSpec, TensorSpec

__all__ = ["describe_input", "mapping_problems"]


def _shape_fits(mapped: tuple[int, ...], model: tuple[int, ...]) -> bool:
    if len(mapped) != len(model):
        return False
    # A dimension of any size in the model takes any; one in the mapping must be any too.
    return all(want == -1 or want == got for got, want in zip(mapped, model, strict=True))


def _input_problems(where: str, given: InputMap, tensor: TensorSpec, model: str) -> list[str]:
    problems = []
    if given.datatype != tensor.datatype:
        problems.append(
            f"{where}.datatype: {given.datatype}, model {model!r} expects {tensor.datatype}"
        )
    if not _shape_fits(given.shape, tensor.shape):
        problems.append(
            f"{where}.shape: {list(given.shape)}, model {model!r} expects "
            f"{list(tensor.shape)} for one event (-1: any size)"
        )
    return problems


def _fixed_size(tensor: TensorSpec) -> int | None:
    size = 1
    for dim in tensor.shape:
        if dim < 0:
            return None
        size *= dim
    return size


def mapping_problems(mapping: TopicMapping, spec: ModelSpec) -> list[str]:
    """Every way ``mapping`` does not fit ``spec``, one line each (none: it fits)."""
    where, model = f"topics.{mapping.topic}", spec.name
    problems: list[str] = []
    given = {one.name for one in mapping.inputs}
    for one in mapping.inputs:
        tensor = spec.input(one.name)
        if tensor is None:
            inputs = ", ".join(t.name for t in spec.inputs)
            problems.append(
                f"{where}.inputs.{one.name}: model {model!r} has no such input; its inputs "
                f"are {inputs}"
            )
            continue
        problems += _input_problems(f"{where}.inputs.{one.name}", one, tensor, model)
    missing = [t.name for t in spec.inputs if not t.optional and t.name not in given]
    if missing:
        problems.append(
            f"{where}.inputs: model {model!r} needs {', '.join(missing)}, which the mapping "
            "does not give"
        )
    outputs = {tensor.name: tensor for tensor in spec.outputs}
    for name, source in mapping.result.fields:
        if not isinstance(source, OutputRef | Argmax):
            continue
        field = f"{where}.result.fields.{name}"
        tensor = outputs.get(source.output)
        if tensor is None:
            names = ", ".join(outputs)
            problems.append(
                f"{field}: model {model!r} has no output {source.output!r}; its outputs are {names}"
            )
            continue
        size = _fixed_size(tensor)
        if size is None:
            continue
        if isinstance(source, OutputRef) and source.index is not None and source.index >= size:
            problems.append(
                f"{field}: {source} is past the end of {source.output} ({size} elements)"
            )
        if isinstance(source, Argmax) and len(source.labels) != size:
            problems.append(
                f"{field}.labels: {len(source.labels)} labels for the {size} elements of "
                f"{source.output}; give one label per element"
            )
    if spec.decoupled:
        problems.append(
            f"{where}.model: {model!r} is decoupled (any number of responses per request); "
            "map events to a model of one response per request"
        )
    return problems


def describe_input(one: InputMap) -> str:
    """``FP32 [3] from $.amount, $.age, $.hour`` (default 0)."""
    paths = ", ".join(str(path) for path in one.fields) if one.fields else str(one.source)
    default = f" (default {one.default!r})" if one.default is not None else ""
    return f"{one.datatype} {list(one.shape)} from {paths}{default}"
