"""Checking decoded requests against a model's inputs, outputs and batching."""

from __future__ import annotations

from typing import Any

import pytest
from tritonclient.grpc import model_config_pb2, service_pb2

from worker.errors import InvalidRequest
from worker.wire import DecodedRequest
from worker.wire.validation import ModelSpec, TensorSpec, check_request


def batching_spec() -> ModelSpec:
    """A model like Triton's `simple`: two [16] INT32 inputs, max_batch_size 8."""
    metadata = service_pb2.ModelMetadataResponse(name="simple", versions=["1", "10", "2"])
    for name in ("INPUT0", "INPUT1"):
        metadata.inputs.add(name=name, datatype="INT32", shape=[-1, 16])
    metadata.outputs.add(name="OUTPUT0", datatype="INT32", shape=[-1, 16])
    config = service_pb2.ModelConfigResponse()
    config.config.name = "simple"
    config.config.max_batch_size = 8
    config.config.input.add(name="INPUT0", data_type=model_config_pb2.TYPE_INT32, dims=[16])
    config.config.input.add(
        name="INPUT1", data_type=model_config_pb2.TYPE_INT32, dims=[16], optional=True
    )
    return ModelSpec.from_triton(metadata, config)


def fixed_spec() -> ModelSpec:
    """A non-batching model with a wildcard dim: IMAGE FP32 [3, -1, -1]."""
    return ModelSpec(
        name="fixed",
        version="1",
        inputs=(TensorSpec("IMAGE", "FP32", (3, -1, -1)),),
        outputs=(TensorSpec("SCORES", "FP32", (10,)),),
        max_batch_size=0,
    )


def request_with(
    inputs: list[tuple[str, str, list[int]]], outputs: tuple[str, ...] = ()
) -> DecodedRequest:
    """A decoded request with the given inputs (no data needed for these checks)."""
    message: Any = service_pb2.ModelInferRequest(model_name="m")
    for name, datatype, shape in inputs:
        message.inputs.add(name=name, datatype=datatype, shape=shape)
    for name in outputs:
        message.outputs.add(name=name)
    return DecodedRequest("r", "m", "", "json", message, False, 0)


def message_of(spec: ModelSpec, request: DecodedRequest) -> str:
    """The InvalidRequest message check_request raises."""
    with pytest.raises(InvalidRequest) as caught:
        check_request(spec, request)
    return caught.value.message


def test_from_triton_strips_batch_dim_and_reads_flags() -> None:
    """Metadata shapes lose the batch -1; optional comes from the config; latest version."""
    spec = batching_spec()
    assert spec == ModelSpec(
        name="simple",
        version="10",
        inputs=(
            TensorSpec("INPUT0", "INT32", (16,)),
            TensorSpec("INPUT1", "INT32", (16,), optional=True),
        ),
        outputs=(TensorSpec("OUTPUT0", "INT32", (16,)),),
        max_batch_size=8,
    )


def test_matching_request_passes() -> None:
    """Right names, datatypes, batch and dims raise nothing."""
    check_request(
        batching_spec(),
        request_with([("INPUT0", "INT32", [2, 16]), ("INPUT1", "INT32", [2, 16])], ("OUTPUT0",)),
    )
    check_request(fixed_spec(), request_with([("IMAGE", "FP32", [3, 224, 100])]))


def test_optional_input_may_be_omitted() -> None:
    """An input marked optional in the config need not be sent."""
    check_request(batching_spec(), request_with([("INPUT0", "INT32", [1, 16])]))


def test_unknown_input_lists_the_model_inputs() -> None:
    """A name the model lacks is reported with the names it has."""
    message = message_of(batching_spec(), request_with([("INPUT9", "INT32", [1, 16])]))
    assert (
        message == "inputs[0]: model 'simple' has no input 'INPUT9'; its inputs are INPUT0, INPUT1"
    )


def test_missing_required_input() -> None:
    """A required input that is absent is named."""
    message = message_of(batching_spec(), request_with([("INPUT1", "INT32", [1, 16])]))
    assert message == "inputs: model 'simple' needs input(s) INPUT0, which the request lacks"


def test_wrong_datatype() -> None:
    """A datatype differing from the model's is reported with both."""
    message = message_of(batching_spec(), request_with([("INPUT0", "FP32", [1, 16])]))
    assert message == "inputs[0] 'INPUT0': datatype FP32, model 'simple' expects INT32"


def test_wrong_dims_with_batching() -> None:
    """Dims after the batch dim must match the model's."""
    message = message_of(batching_spec(), request_with([("INPUT0", "INT32", [1, 15])]))
    assert message == (
        "inputs[0] 'INPUT0': shape [1, 15], model 'simple' expects [-1, 16] "
        "(a batch dimension of 1..8, then [16])"
    )


def test_missing_batch_dim() -> None:
    """A batching model needs the leading batch dimension."""
    message = message_of(batching_spec(), request_with([("INPUT0", "INT32", [16])]))
    assert "shape [16], model 'simple' expects [-1, 16]" in message


@pytest.mark.parametrize("batch", [0, 9])
def test_batch_outside_range(batch: int) -> None:
    """The batch dim must be between 1 and max_batch_size."""
    message = message_of(batching_spec(), request_with([("INPUT0", "INT32", [batch, 16])]))
    assert message == (f"inputs[0] 'INPUT0': batch dimension {batch}, model 'simple' accepts 1..8")


def test_batch_dims_must_agree() -> None:
    """All inputs of one request share the batch size."""
    message = message_of(
        batching_spec(),
        request_with([("INPUT0", "INT32", [2, 16]), ("INPUT1", "INT32", [3, 16])]),
    )
    assert message.startswith("inputs: batch dimensions differ")


def test_non_batching_shape_must_match_fully() -> None:
    """Without batching the whole shape is compared; -1 matches any size."""
    message = message_of(fixed_spec(), request_with([("IMAGE", "FP32", [1, 3, 224, 224])]))
    assert message == "inputs[0] 'IMAGE': shape [1, 3, 224, 224], model 'fixed' expects [3, -1, -1]"


def test_duplicate_input() -> None:
    """The same input twice is refused."""
    request = request_with([("IMAGE", "FP32", [3, 1, 1]), ("IMAGE", "FP32", [3, 1, 1])])
    assert message_of(fixed_spec(), request) == "inputs[1]: input 'IMAGE' is given more than once"


def test_unknown_requested_output() -> None:
    """Requesting an output the model lacks names it and the model's outputs."""
    request = request_with([("IMAGE", "FP32", [3, 1, 1])], ("PROBS",))
    assert message_of(fixed_spec(), request) == (
        "outputs[0]: model 'fixed' has no output 'PROBS'; its outputs are SCORES"
    )


def _config_spec(config: Any) -> ModelSpec:
    metadata = service_pb2.ModelMetadataResponse(name="m", versions=["1"])
    metadata.inputs.add(name="X", datatype="INT32", shape=[1])
    return ModelSpec.from_triton(metadata, service_pb2.ModelConfigResponse(config=config))


def test_from_triton_reads_decoupled_and_sequence_batching() -> None:
    """The configuration says decoupled, sequence batcher, and the correlation id's type."""
    control = model_config_pb2.ModelSequenceBatching.Control
    plain = _config_spec(model_config_pb2.ModelConfig(name="m"))
    assert (plain.decoupled, plain.sequence, plain.string_sequence_ids) == (False, False, False)

    decoupled = model_config_pb2.ModelConfig(name="m")
    decoupled.model_transaction_policy.decoupled = True
    assert _config_spec(decoupled).decoupled

    numbered = model_config_pb2.ModelConfig(name="m")
    numbered.sequence_batching.max_sequence_idle_microseconds = 1000
    spec = _config_spec(numbered)
    assert (spec.sequence, spec.string_sequence_ids) == (True, False)

    named = model_config_pb2.ModelConfig(name="m")
    corrid = named.sequence_batching.control_input.add(name="CORRID")
    corrid.control.add(kind=control.CONTROL_SEQUENCE_CORRID, data_type=model_config_pb2.TYPE_STRING)
    spec = _config_spec(named)
    assert (spec.sequence, spec.string_sequence_ids) == (True, True)
