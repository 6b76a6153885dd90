"""Checking a decoded request against the model's inputs, outputs and batching.

Triton would refuse a mismatched request too, but only after a round trip
and with a message about its own internals; checking here names the field
of the user's request that is wrong and keeps bad records off the streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tritonclient.grpc import model_config_pb2

from worker.errors import InvalidRequest

if TYPE_CHECKING:
    from worker.wire import DecodedRequest

__all__ = ["ModelSpec", "TensorSpec", "check_request"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One model input or output: shape without the batch dimension, -1 for any size."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False
    is_shape_tensor: bool = False


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """What a model accepts, as reported by Triton's metadata and config."""

    name: str
    version: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    #: Decoupled (model_transaction_policy): any number of responses per request.
    decoupled: bool = False
    #: Has a sequence batcher: keeps state per sequence (correlation) id.
    sequence: bool = False
    #: The sequence batcher takes string correlation ids (else 64-bit integers).
    string_sequence_ids: bool = False

    @classmethod
    def from_triton(cls, metadata: Any, config: Any) -> ModelSpec:
        """Build from a ModelMetadataResponse and a ModelConfigResponse (protobuf)."""
        model_config = config.config
        max_batch_size = int(model_config.max_batch_size)
        config_inputs = {tensor.name: tensor for tensor in model_config.input}

        def spec(tensor: Any, is_input: bool) -> TensorSpec:
            dims = tuple(int(dim) for dim in tensor.shape)
            # Metadata shapes of batching models start with the batch dim (-1).
            if max_batch_size > 0 and dims:
                dims = dims[1:]
            configured = config_inputs.get(tensor.name) if is_input else None
            return TensorSpec(
                name=tensor.name,
                datatype=tensor.datatype,
                shape=dims,
                optional=bool(configured.optional) if configured is not None else False,
                is_shape_tensor=(
                    bool(configured.is_shape_tensor) if configured is not None else False
                ),
            )

        versions = sorted(metadata.versions, key=lambda v: (len(v), v))
        return cls(
            name=metadata.name,
            version=versions[-1] if versions else "",
            inputs=tuple(spec(tensor, True) for tensor in metadata.inputs),
            outputs=tuple(spec(tensor, False) for tensor in metadata.outputs),
            max_batch_size=max_batch_size,
            decoupled=bool(model_config.model_transaction_policy.decoupled),
            sequence=model_config.HasField("sequence_batching"),
            string_sequence_ids=_string_sequence_ids(model_config),
        )

    def input(self, name: str) -> TensorSpec | None:
        """The input called `name`, if the model has one."""
        return next((tensor for tensor in self.inputs if tensor.name == name), None)


def _string_sequence_ids(model_config: Any) -> bool:
    """True when the sequence batcher's correlation-id control is a string."""
    corrid = model_config_pb2.ModelSequenceBatching.Control.CONTROL_SEQUENCE_CORRID
    return any(
        control.kind == corrid and control.data_type == model_config_pb2.TYPE_STRING
        for control_input in model_config.sequence_batching.control_input
        for control in control_input.control
    )


def _dims_match(expected: Sequence[int], actual: Sequence[int]) -> bool:
    if len(expected) != len(actual):
        return False
    return all(want == -1 or want == got for want, got in zip(expected, actual, strict=True))


def _names(tensors: Sequence[TensorSpec]) -> str:
    return ", ".join(tensor.name for tensor in tensors) or "(none)"


def _check_shape(spec: ModelSpec, tensor: TensorSpec, shape: list[int], where: str) -> int | None:
    """Check one input's shape; return its batch size (None when not batching)."""
    label = f"{where} {tensor.name!r}"
    if spec.max_batch_size <= 0 or tensor.is_shape_tensor:
        if not tensor.is_shape_tensor and not _dims_match(tensor.shape, shape):
            raise InvalidRequest(
                f"{label}: shape {shape}, model {spec.name!r} expects {list(tensor.shape)}"
            )
        return None
    expected = [-1, *tensor.shape]
    if len(shape) != len(expected) or not _dims_match(tensor.shape, shape[1:]):
        raise InvalidRequest(
            f"{label}: shape {shape}, model {spec.name!r} expects {expected} "
            f"(a batch dimension of 1..{spec.max_batch_size}, then {list(tensor.shape)})"
        )
    batch = shape[0]
    if not 1 <= batch <= spec.max_batch_size:
        raise InvalidRequest(
            f"{label}: batch dimension {batch}, "
            f"model {spec.name!r} accepts 1..{spec.max_batch_size}"
        )
    return batch


def check_request(spec: ModelSpec, request: DecodedRequest) -> None:
    """Raise InvalidRequest naming the first input or output that does not fit the model."""
    infer_request = request.infer_request
    seen: set[str] = set()
    batch_sizes: dict[str, int] = {}
    for i, given in enumerate(infer_request.inputs):
        where = f"inputs[{i}]"
        tensor = spec.input(given.name)
        if tensor is None:
            raise InvalidRequest(
                f"{where}: model {spec.name!r} has no input {given.name!r}; "
                f"its inputs are {_names(spec.inputs)}"
            )
        if given.name in seen:
            raise InvalidRequest(f"{where}: input {given.name!r} is given more than once")
        seen.add(given.name)
        if given.datatype != tensor.datatype:
            raise InvalidRequest(
                f"{where} {given.name!r}: datatype {given.datatype}, "
                f"model {spec.name!r} expects {tensor.datatype}"
            )
        batch = _check_shape(spec, tensor, [int(dim) for dim in given.shape], where)
        if batch is not None:
            batch_sizes[f"{where} {given.name!r}"] = batch
    missing = [t.name for t in spec.inputs if not t.optional and t.name not in seen]
    if missing:
        raise InvalidRequest(
            f"inputs: model {spec.name!r} needs input(s) {', '.join(missing)}, "
            f"which the request lacks"
        )
    if len(set(batch_sizes.values())) > 1:
        detail = ", ".join(f"{label} has {batch}" for label, batch in batch_sizes.items())
        raise InvalidRequest(f"inputs: batch dimensions differ ({detail}); they must be equal")
    output_names = {tensor.name for tensor in spec.outputs}
    for i, requested in enumerate(infer_request.outputs):
        if requested.name not in output_names:
            raise InvalidRequest(
                f"outputs[{i}]: model {spec.name!r} has no output {requested.name!r}; "
                f"its outputs are {_names(spec.outputs)}"
            )
