"""The batch path's admission: check_request and batchable asked once per spec and signature."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from devtools.samples import Tensor, encode_request
from tests.unit.records.test_batch import SPEC
from worker.records.admission import MAX_SIGNATURES, Admissions
from worker.wire import DecodedRequest, DecodeLimits, Source, decode_request
from worker.wire.validation import ModelSpec, TensorSpec, check_request

pytestmark = pytest.mark.unit


def request(rows: int = 1, name: str = "INPUT0", width: int = 4) -> DecodedRequest:
    tensors = [Tensor(name, "FP32", (rows, width), np.ones((rows, width), np.float32))]
    value, headers = encode_request("m", tensors, "json", "r")
    return decode_request(value, headers, Source("t", 0, 0), DecodeLimits(1 << 20))


class Counting:
    """check_request, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, spec: ModelSpec, decoded: DecodedRequest) -> None:
        self.calls += 1
        check_request(spec, decoded)


def test_the_same_signature_is_checked_once() -> None:
    check = Counting()
    admissions = Admissions(check)
    assert admissions.admits(SPEC, request())
    assert admissions.admits(SPEC, request())
    assert check.calls == 1


def test_what_the_checks_read_is_part_of_the_signature() -> None:
    """Another batch dimension, input name or width is asked again, with its own answer."""
    check = Counting()
    admissions = Admissions(check)
    assert admissions.admits(SPEC, request(rows=1))
    assert admissions.admits(SPEC, request(rows=2))
    assert not admissions.admits(SPEC, request(rows=9))  # over max_batch_size
    assert not admissions.admits(SPEC, request(name="OTHER"))
    assert not admissions.admits(SPEC, request(width=3))
    assert check.calls == 5
    assert not admissions.admits(SPEC, request(width=3))  # a no is asked again
    assert check.calls == 6
    assert len(admissions) == 2  # the two yeses


def test_a_new_spec_of_the_model_is_asked_again() -> None:
    """The model reloaded with other inputs: the remembered answer was for the old spec."""
    check = Counting()
    admissions = Admissions(check)
    assert admissions.admits(SPEC, request())
    narrower = dataclasses.replace(SPEC, inputs=(TensorSpec("INPUT0", "FP32", (3,)),))
    assert not admissions.admits(narrower, request())
    assert check.calls == 2


def test_what_could_make_an_answer_large_is_not_remembered() -> None:
    """Outputs asked for more often than the model has them, or parameters of the request's
    own (any names, any number): admitted, not remembered."""
    check = Counting()
    admissions = Admissions(check)
    repeated = request()
    for _ in range(3):
        repeated.infer_request.outputs.add(name="OUTPUT0")
    with_parameters = request()
    with_parameters.infer_request.parameters["x" * 1000].string_param = "y"
    for asked in (repeated, with_parameters, repeated, with_parameters):
        assert admissions.admits(SPEC, asked)
    assert check.calls == 4
    assert len(admissions) == 0


def test_a_request_that_may_not_share_a_batch_is_refused() -> None:
    """batchable's answer: a model that does not batch admits nothing here."""
    unbatched = dataclasses.replace(SPEC, max_batch_size=0)
    single = request()
    single.infer_request.inputs[0].ClearField("shape")
    single.infer_request.inputs[0].shape.extend([4])
    assert not Admissions(check_request).admits(unbatched, single)


def test_the_memory_is_bounded_by_the_oldest_forgotten() -> None:
    """A producer sending ever new signatures: at most MAX_SIGNATURES answers kept."""
    check = Counting()
    admissions = Admissions(check)
    large = dataclasses.replace(SPEC, max_batch_size=4 * MAX_SIGNATURES)
    for rows in range(1, MAX_SIGNATURES + 50):
        assert admissions.admits(large, request(rows=rows))
    assert len(admissions) == MAX_SIGNATURES
    calls = check.calls
    assert admissions.admits(large, request(rows=1))  # among the oldest: forgotten, asked again
    assert check.calls == calls + 1
