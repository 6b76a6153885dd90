"""The steps: admission, encoding, and the one set of books both paths keep.

The breakers, the model health and the limiter are ``spec_set`` fakes where a test
counts the calls made to them (a real one does not say how often it was told), the
real ones elsewhere; the metrics are real. The batch forms are checked against the
per-record ones: a batch of n is booked as n records.
"""

from __future__ import annotations

from unittest import mock

import pytest
import structlog
from tritonclient.grpc import service_pb2

from tests.unit.records.fakes import good_record, record, sample, settings, steps_for
from worker import errors
from worker.audit import AUDIT_EVENT
from worker.flow.breaker import CircuitBreaker
from worker.flow.holds import NOT_LISTED, Listing, ModelGate
from worker.flow.limiter import AdaptiveLimiter
from worker.flow.model_health import ModelHealth
from worker.flow.retry import Budget
from worker.observability import Metrics
from worker.records.refusals import record_bytes
from worker.records.steps import FALLBACK_REASONS, Steps
from worker.wire import Source

pytestmark = pytest.mark.timeout(10)

MODEL = ("double", "")


def counted() -> tuple[Steps, Metrics, mock.Mock, mock.Mock, mock.Mock]:
    """Steps whose breaker, model health and limiter record their calls."""
    metrics = Metrics(version="test")
    breaker = mock.create_autospec(CircuitBreaker, instance=True, spec_set=True)
    health = mock.create_autospec(ModelHealth, instance=True, spec_set=True)
    limiter = mock.create_autospec(AdaptiveLimiter, instance=True, spec_set=True)
    steps = steps_for(metrics=metrics, breaker=breaker, health=health, limiter=limiter)
    return steps, metrics, breaker, health, limiter


def latency_count(metrics: Metrics) -> float:
    return sample(metrics, "worker_inference_latency_seconds_count", model="double")


def test_a_micro_batch_is_booked_as_its_records() -> None:
    """inferred_many(n): n latencies and n limiter samples (in one update each), as n
    per-record inferences; the breaker told once, the model's health n successes at once."""
    single, single_metrics, s_breaker, s_health, s_limiter = counted()
    for _ in range(3):
        single.inferred("double", 0.25)
        single.answered(MODEL, False)
    batch, batch_metrics, b_breaker, b_health, b_limiter = counted()
    batch.inferred_many(MODEL, 0.25, 3)
    assert latency_count(single_metrics) == latency_count(batch_metrics) == 3
    assert s_limiter.on_success.call_args_list == [((0.25, 1),)] * 3
    assert b_limiter.on_success.call_args_list == [((0.25, 3),)]
    assert s_health.succeeded.call_count == 3
    b_health.succeeded_many.assert_called_once_with(MODEL, 3)
    assert (s_breaker.record_success.call_count, b_breaker.record_success.call_count) == (3, 1)


def test_a_call_answered_outside_an_inference_resets_only_the_breaker() -> None:
    """A model lookup (no model given) counts for Triton, not for the model's health."""
    steps, _, breaker, health, _ = counted()
    steps.answered(None, False)
    steps.answered(MODEL, True)
    assert breaker.record_success.call_count == 2
    health.succeeded.assert_called_once_with(MODEL, True)


async def test_the_retrier_reports_its_successes_to_the_steps() -> None:
    """A call the retrier runs succeeds: the steps' books record it (breaker, health)."""
    steps, _, breaker, health, _ = counted()
    health.admit.return_value = (0.0, False)

    async def call(_: float) -> str:
        return "answer"

    assert await steps.retrier.run(MODEL, Budget.lasting(5), call) == "answer"
    health.succeeded.assert_called_once_with(MODEL, False)
    assert breaker.record_success.call_count == 1


@pytest.mark.parametrize(
    ("failure", "lowered"),
    [
        (errors.TritonOverloaded("queue full"), True),
        (errors.TritonTimeout("late"), True),
        (errors.InferenceError("model raised"), False),
        (RuntimeError("bug"), False),
    ],
)
def test_only_an_overload_or_a_timeout_lowers_the_limit(
    failure: BaseException, lowered: bool
) -> None:
    """overloaded(exc): the limiter hears of Triton overloaded or late, nothing else."""
    steps, _, _, _, limiter = counted()
    steps.overloaded(failure)
    assert limiter.on_overload.called is lowered


def test_results_of_a_group_are_counted_per_model_and_end_a_run_of_bugs() -> None:
    """published_many: end-to-end latencies and results per record, the batch count; the
    run of internal errors starts again."""
    metrics = Metrics(version="test")
    steps = steps_for(settings(max_consecutive_internal_errors="2"), metrics=metrics)

    class Answered:
        def __init__(self, offset: int) -> None:
            self.record = good_record(offset)
            self.request = steps.decode(self.record.value, self.record.headers, Source("in", 0, 0))

    with structlog.testing.capture_logs():
        steps.internal_failure(RuntimeError("bug"))
        steps.published_many([Answered(1), Answered(2)])
        steps.internal_failure(RuntimeError("bug"))  # one in a row again, not two
    assert sample(metrics, "worker_results_published_total", model="double") == 2
    assert sample(metrics, "worker_end_to_end_latency_seconds_count") == 2
    assert sample(metrics, "worker_fast_path_records_total") == 2
    steps.published_many([])
    assert sample(metrics, "worker_fast_path_records_total") == 2


async def test_a_result_is_booked_alike_on_either_path() -> None:
    """ended (per-record path) and published_many (batch path) book a result the same: one
    result of its model, one end-to-end latency; the batch count only on the batch path."""
    books = []
    for path in ("single", "batch"):
        metrics = Metrics(version="test")
        steps = steps_for(metrics=metrics)
        rec = good_record()
        request = steps.decode(rec.value, rec.headers, Source.of(rec))
        if path == "single":
            await steps.ended(
                rec, request, error=None, served_version="1", started=0.0, counted=False
            )
        else:
            steps.published_many([mock.Mock(record=rec, request=request)])
        books.append(
            (
                sample(metrics, "worker_results_published_total", model="double"),
                sample(metrics, "worker_end_to_end_latency_seconds_count"),
            )
        )
        fast = sample(metrics, "worker_fast_path_records_total")
        assert fast == (1 if path == "batch" else 0)
    assert books == [(1, 1), (1, 1)]


def test_bugs_in_a_row_stop_the_worker_at_the_limit() -> None:
    """internal_failure: logged and counted each time; TooManyInternalErrors at the limit."""
    metrics = Metrics(version="test")
    steps = steps_for(settings(max_consecutive_internal_errors="2"), metrics=metrics)
    with structlog.testing.capture_logs() as logs:
        steps.internal_failure(KeyError("a"))
        with pytest.raises(errors.TooManyInternalErrors):
            steps.internal_failure(KeyError("b"))
    assert [e["event"] for e in logs] == ["internal_error", "internal_error"]
    assert sample(metrics, "worker_internal_errors_total") == 2


async def test_an_ended_record_is_counted_audited_and_timed() -> None:
    """ended: a result counted for its model (unless a stream counted it), a dead letter
    by its code; each audited and its end-to-end latency observed."""
    metrics = Metrics(version="test")
    s = settings(audit="log")
    steps = steps_for(s, metrics=metrics)
    rec = good_record()
    request = steps.decode(rec.value, rec.headers, Source.of(rec))
    common = {"served_version": "1", "started": 0.0}
    with structlog.testing.capture_logs() as logs:
        await steps.ended(rec, request, error=None, counted=False, **common)  # type: ignore[arg-type]
        await steps.ended(rec, request, error=None, counted=True, **common)  # type: ignore[arg-type]
        failed = errors.DecodeError("bad")
        await steps.ended(rec, None, error=failed, counted=False, **common)  # type: ignore[arg-type]
    assert sample(metrics, "worker_results_published_total", model="double") == 1
    assert sample(metrics, "worker_dead_letters_total", code="DECODE_ERROR") == 1
    assert sample(metrics, "worker_end_to_end_latency_seconds_count") == 3
    audited = [e["outcome"] for e in logs if e["event"] == AUDIT_EVENT]
    assert steps.audits and audited == ["result", "result", "dead_letter"]


def test_admission_decodes_allows_and_checks() -> None:
    """decode: a request or a WorkerError; allow: the allowlist; check: the model's spec."""
    steps = steps_for(settings(model_allowlist="in=other"))
    rec = good_record()
    request = steps.decode(rec.value, rec.headers, Source.of(rec))
    assert (request.model_name, request.request_id) == ("double", "r1")
    with pytest.raises(errors.DecodeError):
        steps.decode(b"{not json", [], Source.of(rec))
    with pytest.raises(errors.Forbidden):
        steps.allow("in", "double")
    steps.allow("elsewhere", "double")


def double_response(width: int = 1) -> service_pb2.ModelInferResponse:
    """Model double's answer of ``width`` FP32 values (1.0), version 3."""
    response = service_pb2.ModelInferResponse(model_name="double", model_version="3")
    response.outputs.add(name="OUTPUT0", datatype="FP32", shape=[width])
    response.raw_output_contents.append(b"\x00\x00\x80\x3f" * width)
    return response


def test_a_response_is_encoded_with_the_result_headers_and_bounded() -> None:
    """encode: the value and the result headers (request id, source); over the limit,
    OUTPUT_TOO_LARGE."""
    response = double_response()
    rec = good_record()
    steps = steps_for()
    request = steps.decode(rec.value, rec.headers, Source.of(rec))
    value, headers = steps.encode(request, response, rec, Source.of(rec), [("x-e", b"1")])
    found = dict(headers)
    assert b"OUTPUT0" in value
    assert (found["x-request-id"], found["x-model-version"]) == (b"r1", b"3")
    assert (found["x-source-offset"], found["x-e"]) == (b"7", b"1")
    small = steps_for(settings(max_output_bytes="8"))
    with pytest.raises(errors.OutputTooLarge):
        small.encode(request, response, rec, Source.of(rec))


def test_a_result_as_large_as_one_the_topic_refused_lately_is_not_sent() -> None:
    """encode: once the output topic refused a result for its size, a result at least as
    large (key, value and headers) is OUTPUT_TOO_LARGE at once, naming the refused size and
    what to raise; a smaller one is encoded."""
    response = double_response(100)
    rec = good_record()
    steps = steps_for()
    request = steps.decode(rec.value, rec.headers, Source.of(rec))
    value, headers = steps.encode(request, response, rec, Source.of(rec))
    size = record_bytes(rec.key, value, headers)
    steps.refusals.refused(rec.key, value, [*headers, ("pad", b"")])  # one record larger
    assert steps.encode(request, response, rec, Source.of(rec))[0] == value
    steps.refusals.refused(rec.key, value, headers)
    with pytest.raises(errors.OutputTooLarge) as raised:
        steps.encode(request, response, rec, Source.of(rec))
    assert f"is {size} bytes with its key and headers" in raised.value.message
    assert f"refused one of {size} bytes" in raised.value.message
    assert "max.message.bytes" in raised.value.message


def test_a_ceiling_compares_whole_results_not_values() -> None:
    """encode: a result refused with the same value as this one but a longer key sets a
    ceiling this result stays under (encoded); the same result with that key is not."""
    response = double_response(100)
    rec = good_record(key=b"k" * 20)
    steps = steps_for()
    request = steps.decode(rec.value, rec.headers, Source.of(rec))
    value, headers = steps.encode(request, response, rec, Source.of(rec))
    steps.refusals.refused(b"k" * 40, value, headers)
    assert steps.encode(request, response, rec, Source.of(rec))[0] == value
    with pytest.raises(errors.OutputTooLarge):
        steps.encode(request, response, good_record(key=b"k" * 40), Source.of(rec))


def test_a_dead_letter_names_the_group_and_is_logged() -> None:
    """dead_letter: the dead-letter headers with the group; one dead_letter log line."""
    steps = steps_for(settings(group_id="g1"))
    rec = record(b"x", headers=[("mine", b"kept")])
    with structlog.testing.capture_logs() as logs:
        headers = dict(steps.dead_letter(rec.headers, errors.DecodeError("bad"), Source.of(rec), 1))
    assert (headers["x-consumer-group"], headers["mine"]) == (b"g1", b"kept")
    assert [(e["event"], e["code"]) for e in logs] == [("dead_letter", "DECODE_ERROR")]


def test_a_plain_dead_letter_drops_the_records_headers_and_counts_the_bug() -> None:
    """plain_dead_letter: INTERNAL_ERROR, the worker's headers only; counted, logged."""
    metrics = Metrics(version="test")
    steps = steps_for(metrics=metrics)
    with structlog.testing.capture_logs() as logs:
        error, headers = steps.plain_dead_letter(TypeError("boom"), Source("in", 0, 7))
    assert error.code == "INTERNAL_ERROR" and "mine" not in dict(headers)
    assert [e["event"] for e in logs] == ["dead_letter_failed"]
    assert sample(metrics, "worker_internal_errors_total") == 1


async def test_a_model_held_or_failing_is_not_serving() -> None:
    """serving: False while the model is being reloaded or its failure-rate breaker is open."""

    async def no(*_: str) -> bool:
        return False

    async def unlisted(*_: str) -> Listing:
        return NOT_LISTED

    gate = ModelGate(seen_ready=lambda *_: True, listed=unlisted, ready=no)
    health = ModelHealth.from_settings(settings().retry)
    steps = steps_for(gate=gate, health=health)
    assert steps.serving(*MODEL)
    await gate.should_hold(*MODEL)
    assert not steps.serving(*MODEL)
    for _ in range(10):
        health.failed(("other", ""), errors.InferenceError("bad"), False)
    assert not steps.serving("other", "")


def test_the_batch_paths_fallback_counters_exist_from_its_start() -> None:
    """fallback_counters: one series per reason, at 0 as soon as the batch path is built."""
    metrics = Metrics(version="test")
    steps_for(metrics=metrics).fallback_counters()
    assert [
        sample(metrics, "worker_fast_path_fallbacks_total", reason=r) for r in FALLBACK_REASONS
    ] == [0.0] * len(FALLBACK_REASONS)
    assert (
        metrics.registry.get_sample_value(
            "worker_fast_path_fallbacks_total", {"reason": "inference"}
        )
        == 0.0
    )
