"""A decoupled model's responses as results, and the record's key as a sequence id."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from worker.errors import InferenceError, InvalidRequest
from worker.wire import DecodedRequest
from worker.wire.bytes_tensor import deserialize_bytes_tensor, serialize_bytes_tensor
from worker.wire.sequences import apply_sequence, sequence_id_of_key
from worker.wire.streams import concat_responses, each_headers, final_headers


def _token(text: str, final: bool = False) -> Any:
    response = service_pb2.ModelInferResponse(model_name="tokens", model_version="1")
    response.outputs.add(name="text_output", datatype="BYTES", shape=[1])
    response.raw_output_contents.append(serialize_bytes_tensor([text.encode()]))
    response.parameters["triton_final_response"].bool_param = final
    return response


def _rows(values: list[list[float]], name: str = "Y") -> Any:
    response = service_pb2.ModelInferResponse(model_name="m", model_version="1")
    array = np.asarray(values, dtype="<f4")
    response.outputs.add(name=name, datatype="FP32", shape=list(array.shape))
    response.raw_output_contents.append(array.tobytes())
    return response


def _empty_final() -> Any:
    response = service_pb2.ModelInferResponse(model_name="tokens", model_version="1")
    response.parameters["triton_final_response"].bool_param = True
    return response


def test_token_pieces_become_one_bytes_list_in_order() -> None:
    """BYTES [1] pieces and an empty final response: one BYTES [3] output, in order."""
    merged = concat_responses([_token("a"), _token(" b"), _token(" c"), _empty_final()])
    [output] = merged.outputs
    assert (output.name, output.datatype, list(output.shape)) == ("text_output", "BYTES", [3])
    assert deserialize_bytes_tensor(merged.raw_output_contents[0]) == [b"a", b" b", b" c"]
    assert (merged.model_name, merged.model_version) == ("tokens", "1")
    assert "triton_final_response" not in merged.parameters


def test_joined_bytes_make_one_string() -> None:
    """join_bytes: the pieces of a BYTES output become a single element."""
    merged = concat_responses([_token("a"), _token(" b")], join_bytes=True)
    assert list(merged.outputs[0].shape) == [1]
    assert deserialize_bytes_tensor(merged.raw_output_contents[0]) == [b"a b"]


def test_rows_concatenate_along_the_first_dimension() -> None:
    """FP32 [1, 2] and [2, 2] pieces: one [3, 2] output whose bytes are the rows in order."""
    merged = concat_responses([_rows([[1, 2]]), _rows([[3, 4], [5, 6]])])
    assert list(merged.outputs[0].shape) == [3, 2]
    values = np.frombuffer(merged.raw_output_contents[0], dtype="<f4").reshape(3, 2)
    np.testing.assert_array_equal(values, [[1, 2], [3, 4], [5, 6]])


def test_no_response_with_outputs_makes_a_result_without_outputs() -> None:
    """A stream of only the final flag: a response with no outputs, the model's name kept."""
    merged = concat_responses([_empty_final()])
    assert len(merged.outputs) == 0
    assert merged.model_name == "tokens"


def test_pieces_that_disagree_are_an_inference_error() -> None:
    """A piece of another width cannot be concatenated: the output is named."""
    with pytest.raises(InferenceError, match="output 'Y'"):
        concat_responses([_rows([[1, 2]]), _rows([[1, 2, 3]])])


def test_stream_headers_say_the_place_and_the_count() -> None:
    """each: index and final on every result, the count on the last; final: the count."""
    assert dict(each_headers(0, False, 1)) == {
        "x-response-index": b"0",
        "x-response-final": b"false",
    }
    assert dict(each_headers(4, True, 5))["x-response-count"] == b"5"
    assert final_headers(7) == [("x-response-count", b"7")]


def _request(**params: Any) -> DecodedRequest:
    message: Any = service_pb2.ModelInferRequest(model_name="running_sum")
    for name, value in params.items():
        if isinstance(value, bool):
            message.parameters[name].bool_param = value
        elif isinstance(value, int):
            message.parameters[name].int64_param = value
        else:
            message.parameters[name].string_param = value
    return DecodedRequest("r", "running_sum", "", "json", message, False, 0)


def test_a_key_becomes_a_stable_nonzero_63_bit_id() -> None:
    """The same key always gives the same id, different keys differ, 0 never appears."""
    ids = {sequence_id_of_key(f"user-{i}".encode()) for i in range(10_000)}
    assert len(ids) == 10_000
    assert all(0 < i < 2**63 for i in ids)
    assert sequence_id_of_key(b"user-1") == sequence_id_of_key(b"user-1")
    assert sequence_id_of_key(b"") > 0


def test_the_key_and_headers_become_the_sequence_parameters() -> None:
    """Integer ids hash the key; string ids are the key; start and end come from headers."""
    request = _request()
    headers = [("x-sequence-start", b"true"), ("x-sequence-end", b"false")]
    apply_sequence(request, b"user-1", headers, string_ids=False)
    params = request.infer_request.parameters
    assert params["sequence_id"].int64_param == sequence_id_of_key(b"user-1")
    assert params["sequence_start"].bool_param is True
    assert "sequence_end" not in params

    named = _request()
    apply_sequence(named, b"user-1", [("X-Sequence-End", b"TRUE")], string_ids=True)
    assert named.infer_request.parameters["sequence_id"].string_param == "user-1"
    assert named.infer_request.parameters["sequence_end"].bool_param is True


def test_parameters_the_request_carries_win() -> None:
    """A request naming its own sequence_id and start keeps them; no key is needed then."""
    request = _request(sequence_id=42, sequence_start=False)
    apply_sequence(request, None, [("x-sequence-start", b"true")], string_ids=False)
    params = request.infer_request.parameters
    assert params["sequence_id"].int64_param == 42
    assert params["sequence_start"].bool_param is False


@pytest.mark.parametrize(
    ("key", "headers", "string_ids", "says"),
    [
        (None, [], False, "needs a key"),
        (b"\xff\xfe", [], True, "must be UTF-8"),
        (b"k", [("x-sequence-start", b"yes")], False, "expected true or false"),
    ],
)
def test_what_cannot_name_a_sequence_is_an_invalid_request(
    key: bytes | None, headers: list[tuple[str, bytes]], string_ids: bool, says: str
) -> None:
    """No key, a non-UTF-8 key for string ids, a flag that is not true or false."""
    with pytest.raises(InvalidRequest, match=says):
        apply_sequence(_request(), key, headers, string_ids=string_ids)
