"""The worker fed by a second, independent Kafka client: librdkafka (``confluent-kafka``).

aiokafka writes the records of every other test. Producers in the field are mostly
librdkafka, Java or Go clients, whose records may be legal and still unlike aiokafka's:
other codecs, null keys with null values, null header values, aborted transactions,
records far over 1 MiB. Each scenario asserts its exact outcome (a result with correct
values, or a dead letter with its code and bytes), that the worker still runs, and that
the next good request on the same partition is answered. Records are identified by the
offset the producer's delivery report gave them (``x-source-offset`` on every answer).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from aiokafka import AIOKafkaClient, AIOKafkaConsumer
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.memory_records import MemoryRecords
from aiokafka.structs import ConsumerRecord, TopicPartition
from confluent_kafka import Consumer, KafkaError, Message, Producer

from devtools.samples import ENCODINGS, Tensor, double_inputs, encode_request, mlp_inputs
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    mlp_reference,
    result_outputs,
    running_worker,
    send_raw_headers,
    settings_for,
)
from tests.support.worker import kafka_client_under_test
from worker.app import Worker
from worker.wire import header_value

pytestmark = pytest.mark.timeout(180)

Headers = list[tuple[str, bytes | None]]
#: A record as ``send_raw_headers`` writes it: key, value, headers with raw keys.
RawRecord = tuple[bytes | None, bytes | None, list[tuple[bytes, bytes | None]]]
MiB = 1024 * 1024
#: A topic's max.message.bytes that takes the large records of these scenarios.
LARGE_TOPIC = {"max.message.bytes": str(4 * MiB)}
#: librdkafka refuses to send a record over its message.max.bytes (default 1,000,000).
LARGE_PRODUCER = {"message.max.bytes": str(5 * MiB)}
#: Record batch attribute bits 0-2, by librdkafka compression.type.
CODEC_IDS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}


# -- producing with librdkafka ------------------------------------------------------


@dataclass(frozen=True)
class Out:
    """One record to produce: value, key, headers (each may be null)."""

    value: bytes | None
    key: bytes | None = None
    headers: Headers = field(default_factory=list)


def _delivery_collector(offsets: list[int], failures: list[str], index: int) -> Any:
    def delivered(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            failures.append(f"record {index}: {err}")
        elif (offset := msg.offset()) is None:
            failures.append(f"record {index}: delivered without an offset")
        else:
            offsets[index] = offset

    return delivered


def _produce_sync(
    bootstrap: str, topic: str, records: Sequence[Out], config: dict[str, Any]
) -> list[int]:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "acks": "all", "enable.idempotence": True, **config}
    )
    offsets = [-1] * len(records)
    failures: list[str] = []
    for i, record in enumerate(records):
        producer.produce(
            topic,
            value=record.value,
            key=record.key,
            headers=list(record.headers) or None,
            partition=0,
            on_delivery=_delivery_collector(offsets, failures, i),
        )
        producer.poll(0)
    assert producer.flush(30) == 0, "librdkafka did not deliver every record in 30 s"
    assert failures == [], failures
    return offsets


async def produce(
    bootstrap: str, topic: str, records: Sequence[Out], config: Mapping[str, str] | None = None
) -> list[int]:
    """Produce with librdkafka (extra producer ``config``) to partition 0; each record's offset."""
    return await asyncio.to_thread(_produce_sync, bootstrap, topic, records, dict(config or {}))


def _transactions_sync(
    bootstrap: str, topic: str, transactions: Sequence[tuple[Sequence[Out], bool]], txn_id: str
) -> list[list[int]]:
    producer = Producer(
        {"bootstrap.servers": bootstrap, "transactional.id": txn_id, "linger.ms": 5}
    )
    producer.init_transactions(30)
    placed: list[list[int]] = []
    failures: list[str] = []
    for records, commit in transactions:
        offsets = [-1] * len(records)
        producer.begin_transaction()
        for i, record in enumerate(records):
            producer.produce(
                topic,
                value=record.value,
                key=record.key,
                headers=list(record.headers) or None,
                partition=0,
                on_delivery=_delivery_collector(offsets, failures, i),
            )
        # Flushed first, so that an aborted transaction's records are in the log
        # (and must be skipped by a read_committed reader), not purged unsent.
        assert producer.flush(30) == 0
        if commit:
            producer.commit_transaction(30)
        else:
            producer.abort_transaction(30)
        placed.append(offsets)
    assert failures == [], failures
    return placed


# -- requests and their expected results --------------------------------------------


@dataclass(frozen=True)
class Good:
    """A valid request and the output it must produce."""

    out: Out
    request_id: str
    output: str
    expected: np.ndarray[Any, Any]


def good(
    rng: np.random.Generator,
    request_id: str,
    *,
    model: str = "double",
    encoding: str = "json",
    headers: Headers | None = None,
    key: bytes | None = None,
) -> Good:
    tensors = mlp_inputs(rng) if model == "mlp" else double_inputs(rng)
    value, encoding_headers = encode_request(model, tensors, encoding, request_id)  # type: ignore[arg-type]
    return Good(
        Out(
            value,
            request_id.encode() if key is None else key,
            [*encoding_headers, ("x-request-id", request_id.encode()), *(headers or [])],
        ),
        request_id,
        *_expected(model, tensors),
    )


def _expected(model: str, tensors: list[Tensor]) -> tuple[str, np.ndarray[Any, Any]]:
    values = np.asarray(tensors[0].values, dtype=np.float32)
    if model == "mlp":
        return "PROBS", mlp_reference(values)
    return "OUTPUT0", values * 2


def double_json_without_id(rng: np.random.Generator) -> bytes:
    """A JSON request for ``double`` with no body ``id`` (the header x-request-id counts)."""
    tensor = double_inputs(rng)[0]
    doc = {
        "model_name": "double",
        "inputs": [
            {
                "name": "INPUT0",
                "shape": list(tensor.shape),
                "datatype": "FP32",
                "data": tensor.json_data(),
            }
        ],
    }
    return json.dumps(doc).encode()


# -- reading what the worker wrote ---------------------------------------------------


class Answers:
    """Every result and dead letter, by the input offset they answer (``x-source-offset``)."""

    def __init__(self, kafka: KafkaUnderTest, topics: Topics) -> None:
        self._kafka = kafka
        self._topics = topics
        self.results: dict[int, list[ConsumerRecord[bytes, bytes]]] = {}
        self.dead_letters: dict[int, list[ConsumerRecord[bytes, bytes]]] = {}
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka.bootstrap_servers,
            enable_auto_commit=False,
            isolation_level="read_committed",
            max_partition_fetch_bytes=8 * MiB,
        )
        self._tps = [TopicPartition(topics.output, 0), TopicPartition(topics.dlq, 0)]

    async def __aenter__(self) -> Answers:
        self._consumer.assign(self._tps)
        await self._consumer.start()
        await self._consumer.seek_to_beginning(*self._tps)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self._consumer.stop()

    async def through(self, last_offset: int, timeout_s: float = 60.0) -> None:
        """Wait until the worker committed past ``last_offset``, then read every answer.

        An offset is committed only once its answer is acknowledged, so after the
        commit every answer to offsets up to ``last_offset`` is in the topics.
        """
        tp = TopicPartition(self._topics.input, 0)
        deadline = time.monotonic() + timeout_s
        while (await self._kafka.committed_offsets(self._topics.group)).get(tp, -1) <= last_offset:
            assert time.monotonic() < deadline, f"worker did not commit past {last_offset}"
            await asyncio.sleep(0.1)  # polling the broker's group coordinator: nothing to await
        ends = await self._consumer.end_offsets(self._tps)
        while [tp for tp, end in ends.items() if await self._consumer.position(tp) < end]:
            assert time.monotonic() < deadline, "answers not readable in time"
            for tp_records in (await self._consumer.getmany(timeout_ms=500)).values():
                for record in tp_records:
                    offset = int(header_value(record.headers, "x-source-offset") or b"-1")
                    target = (
                        self.results if record.topic == self._topics.output else self.dead_letters
                    )
                    target.setdefault(offset, []).append(record)

    def count(self, offset: int) -> int:
        return len(self.results.get(offset, [])) + len(self.dead_letters.get(offset, []))

    def result(self, offset: int) -> ConsumerRecord[bytes, bytes]:
        assert offset not in self.dead_letters, _describe(self.dead_letters[offset][0])
        records = self.results.get(offset, [])
        assert len(records) == 1, f"offset {offset}: {len(records)} results"
        return records[0]

    def dead_letter(self, offset: int, code: str) -> ConsumerRecord[bytes, bytes]:
        assert offset not in self.results, f"offset {offset} got a result"
        records = self.dead_letters.get(offset, [])
        assert len(records) == 1, f"offset {offset}: {len(records)} dead letters"
        assert header_value(records[0].headers, "x-error-code") == code.encode(), _describe(
            records[0]
        )
        return records[0]

    def report(self, scenario: str, offsets: Sequence[int]) -> None:
        """One row of the reliability page's table (visible with ``pytest -s``)."""
        lost = sum(1 for o in offsets if self.count(o) == 0)
        duplicated = sum(max(0, self.count(o) - 1) for o in offsets)
        codes = sorted(
            {
                (header_value(r.headers, "x-error-code") or b"?").decode()
                for o in offsets
                for r in self.dead_letters.get(o, [])
            }
        )
        dead = sum(len(self.dead_letters.get(o, [])) for o in offsets)
        dead_text = f"{dead} ({', '.join(codes)})" if dead else "0"
        print(
            f"\nRELIABILITY | {scenario} | {len(offsets)} | {lost} | {duplicated} | "
            f"{dead_text} | - |"
        )


def _describe(record: ConsumerRecord[bytes, bytes]) -> str:
    return f"{record.topic}@{record.offset} headers={record.headers}"


def assert_result(
    answers: Answers, offset: int, request: Good, *, rtol: float = 1e-5
) -> ConsumerRecord[bytes, bytes]:
    """The offset got one result: the request's id, key and correct output values."""
    record = answers.result(offset)
    assert header_value(record.headers, "x-request-id") == request.request_id.encode()
    assert record.key == request.out.key
    got = np.asarray(result_outputs(record)[request.output], dtype=np.float64)
    np.testing.assert_allclose(
        got.reshape(request.expected.shape), request.expected, rtol=rtol, err_msg=request.request_id
    )
    return record


def assert_running(worker: Worker) -> None:
    """The worker still consumes, reaches Triton and has its breaker closed."""
    ready, detail = worker.readiness()
    assert ready, detail


def omitted_count(worker: Worker) -> float:
    value = worker.metrics.registry.get_sample_value("worker_dead_letter_values_omitted_total")
    return value or 0.0


# -- the broker's record batches as stored ---------------------------------------------


@dataclass(frozen=True)
class Batch:
    compression: int
    first_offset: int
    last_offset: int
    control: bool


async def stored_batches(bootstrap: str, topic: str) -> list[Batch]:
    """The record batches of partition 0 as the broker stores them (a raw Fetch request).

    Consumers hand out records, not batches; the batch attributes (its codec) are
    only visible in the fetched bytes. The topic's compression.type is ``producer``
    (the default), so the broker keeps each producer's codec.
    """
    client = AIOKafkaClient(bootstrap_servers=bootstrap)
    await client.bootstrap()
    try:
        await client.add_topic(topic)
        leader = client.cluster.leader_for_partition(TopicPartition(topic, 0))
        batches: list[Batch] = []
        offset = 0
        while True:
            request = FetchRequest(100, 1, 64 * MiB, 0, [(topic, [(0, offset, 64 * MiB)])])
            response = await client.send(leader, request)
            ((_, partitions),) = response.topics
            ((_, error_code, highwater, *rest),) = partitions
            assert error_code == 0, f"fetch {topic}: error {error_code}"
            records = MemoryRecords(bytes(rest[-1]))
            assert records.has_next() or offset >= highwater, f"{topic}@{offset}: no whole batch"
            while records.has_next():
                batch = records.next_batch()
                assert batch is not None
                batches.append(
                    Batch(
                        batch.compression_type,
                        batch.base_offset,
                        batch.base_offset + batch.last_offset_delta,
                        bool(batch.is_control_batch),
                    )
                )
            if not batches or batches[-1].last_offset + 1 >= highwater:
                return batches
            offset = batches[-1].last_offset + 1
    finally:
        await client.close()


def batch_of(batches: Sequence[Batch], offset: int) -> Batch:
    return next(b for b in batches if b.first_offset <= offset <= b.last_offset)


# -- the scenarios ---------------------------------------------------------------


async def test_librdkafka_codecs_null_records_headers_bom_and_transactions(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """librdkafka traffic on default topics: every codec, null record, odd headers, BOM, aborts."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.output, topics.dlq], partitions=1)
    bootstrap = kafka.bootstrap_servers
    rng = np.random.default_rng(2024)
    async with (
        running_worker(settings_for(kafka, triton, topics)) as worker,
        Answers(kafka, topics) as answers,
    ):
        # 1. Batches of six records compressed with each codec a producer may use.
        for codec in CODEC_IDS:
            requests = [
                good(rng, f"{codec}-{i}", model="mlp", encoding=ENCODINGS[i % 3]) for i in range(6)
            ]
            offsets = await produce(
                bootstrap,
                topics.input,
                [r.out for r in requests],
                {"compression.type": codec, "linger.ms": "200"},
            )
            follow = good(rng, f"{codec}-next")
            (follow_offset,) = await produce(bootstrap, topics.input, [follow.out])
            await answers.through(follow_offset)
            for offset, request in zip(offsets, requests, strict=True):
                assert_result(answers, offset, request)
            assert_result(answers, follow_offset, follow)
            assert_running(worker)
            batches = await stored_batches(bootstrap, topics.input)
            held = [batch_of(batches, offset) for offset in offsets]
            assert {b.compression for b in held} == {CODEC_IDS[codec]}, (codec, held)
            assert any(b.last_offset > b.first_offset for b in held), f"{codec}: one per batch"
            answers.report(
                f"librdkafka batches compressed with {codec} (6 records, mixed encodings, `mlp`)",
                offsets,
            )

        # 2. A record with null key and null value.
        trace: Headers = [("trace-id", b"null-record")]
        null_offset, next_offset = await produce(
            bootstrap,
            topics.input,
            [Out(None, None, trace), (follow := good(rng, "null-next")).out],
        )
        await answers.through(next_offset)
        letter = answers.dead_letter(null_offset, "DECODE_ERROR")
        assert letter.value == b""
        assert letter.key is None
        assert ("trace-id", b"null-record") in letter.headers
        assert b"neither key nor value" in (header_value(letter.headers, "x-error-message") or b"")
        assert header_value(letter.headers, "x-source-offset") == str(null_offset).encode()
        assert_result(answers, next_offset, follow)
        assert_running(worker)
        answers.report("record with null key and null value (librdkafka)", [null_offset])

        # 5. Null header values, repeated names, and headers that are not UTF-8.
        odd = good(
            rng,
            "odd-headers",
            headers=[("x-null", None), ("x-trace", b"one"), ("x-trace", b"two"), ("x-empty", b"")],
        )
        bad_name = good(rng, "bad-model-name", headers=[("x-model-name", b"dou\xffble")])
        bad_type = good(rng, "bad-content-type")
        bad_type_out = Out(
            bad_type.out.value,
            bad_type.out.key,
            [("content-type", b"application/js\xc3on")]
            + [h for h in bad_type.out.headers if h[0] != "content-type"],
        )
        bad_id_out = Out(
            double_json_without_id(rng),
            b"bad-request-id",
            [("content-type", b"application/json"), ("x-request-id", b"req-\xfe\xff")],
        )
        cases: list[tuple[Out, str | None]] = [
            (odd.out, None),
            (bad_name.out, "x-model-name"),
            (bad_type_out, "content-type"),
            (bad_id_out, "x-request-id"),
        ]
        sequence: list[Out] = []
        follows: list[Good] = []
        for i, (out, _) in enumerate(cases):
            follows.append(good(rng, f"headers-next-{i}"))
            sequence += [out, follows[-1].out]
        placed = await produce(bootstrap, topics.input, sequence)
        await answers.through(placed[-1])
        case_offsets = placed[0::2]
        for (out, named), offset, follow_offset, nxt in zip(
            cases, case_offsets, placed[1::2], follows, strict=True
        ):
            assert_result(answers, follow_offset, nxt)
            if named is None:
                continue
            letter = answers.dead_letter(offset, "DECODE_ERROR")
            message = header_value(letter.headers, "x-error-message") or b""
            assert f"header {named}".encode() in message, message
            assert letter.value == out.value
            assert letter.key == out.key
            for header in out.headers:
                assert header in letter.headers, header
        result = assert_result(answers, case_offsets[0], odd)
        assert ("x-null", None) in result.headers
        assert ("x-empty", b"") in result.headers
        assert [v for k, v in result.headers if k == "x-trace"] == [b"one", b"two"]
        assert_running(worker)
        answers.report("header values null, header names repeated (librdkafka)", case_offsets[:1])
        answers.report(
            "header not UTF-8 in x-model-name, content-type, x-request-id (librdkafka)",
            case_offsets[1:],
        )

        # 7. A JSON request that starts with a UTF-8 byte order mark.
        bom = good(rng, "bom")
        bom_out = Out(b"\xef\xbb\xbf" + (bom.out.value or b""), bom.out.key, bom.out.headers)
        bom_offset, next_offset = await produce(
            bootstrap, topics.input, [bom_out, (follow := good(rng, "bom-next")).out]
        )
        await answers.through(next_offset)
        assert_result(answers, bom_offset, bom)
        assert_result(answers, next_offset, follow)
        assert_running(worker)
        answers.report("JSON request starting with a UTF-8 BOM (librdkafka)", [bom_offset])

        # 4. A transactional producer; the second and fourth transactions are aborted.
        plan = [True, False, True, False, True]
        txns = [[good(rng, f"txn-{t}-{i}") for i in range(3)] for t in range(len(plan))]
        placed_txns = await asyncio.to_thread(
            _transactions_sync,
            bootstrap,
            topics.input,
            [([r.out for r in txn], commit) for txn, commit in zip(txns, plan, strict=True)],
            f"txn-{unique}",
        )
        (next_offset,) = await produce(
            bootstrap, topics.input, [(follow := good(rng, "txn-next")).out]
        )
        await answers.through(next_offset)
        committed: list[int] = []
        aborted_ids: set[bytes] = set()
        for txn, commit, offsets in zip(txns, plan, placed_txns, strict=True):
            for request, offset in zip(txn, offsets, strict=True):
                assert offset >= 0, request.request_id
                if commit:
                    assert_result(answers, offset, request)
                    committed.append(offset)
                else:
                    assert answers.count(offset) == 0, f"aborted {request.request_id} answered"
                    aborted_ids.add(request.request_id.encode())
        every_answer = [
            r for rs in (*answers.results.values(), *answers.dead_letters.values()) for r in rs
        ]
        assert not aborted_ids & {header_value(r.headers, "x-request-id") for r in every_answer}
        # The aborted records were written to the log, each transaction closed by a marker.
        markers = [b for b in await stored_batches(bootstrap, topics.input) if b.control]
        assert len(markers) == len(plan), markers
        assert_result(answers, next_offset, follow)
        assert_running(worker)
        answers.report(
            "librdkafka transactions, 3 committed and 2 aborted (aborted records: 0 answered)",
            committed,
        )


def _raw(out: Out, extra: Sequence[tuple[bytes, bytes | None]] = ()) -> RawRecord:
    """``out`` as ``send_raw_headers`` writes it, with ``extra`` raw headers."""
    return out.key, out.value, [*((k.encode(), v) for k, v in out.headers), *extra]


async def test_header_key_not_utf8_is_a_dead_letter_and_the_partition_goes_on(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """A header key that is not UTF-8 (legal on the wire): a DECODE_ERROR dead letter with
    value and key intact, the next record answered, on either client."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.output, topics.dlq], partitions=1)
    rng = np.random.default_rng(2031)
    # Records before it: the worker's code reading headers has run often enough for
    # Python to specialise it (a specialised call let confluent-kafka's error slip past).
    before = [good(rng, f"before-odd-header-key-{i}") for i in range(16)]
    odd, follow = good(rng, "odd-header-key"), good(rng, "after-odd-header-key")
    async with (
        running_worker(settings_for(kafka, triton, topics)) as worker,
        Answers(kafka, topics) as answers,
    ):
        *before_offsets, odd_offset, follow_offset = await send_raw_headers(
            kafka.bootstrap_servers,
            topics.input,
            0,
            [
                *(_raw(request.out) for request in before),
                _raw(odd.out, [(b"x-\xff\xfe", b"odd key")]),
                _raw(follow.out),
            ],
        )
        await answers.through(follow_offset)
        for offset, request in zip(before_offsets, before, strict=True):
            assert_result(answers, offset, request)
        letter = answers.dead_letter(odd_offset, "DECODE_ERROR")
        message = header_value(letter.headers, "x-error-message") or b""
        assert b"header key b'x-\\xff\\xfe' is not valid UTF-8" in message, message
        assert (letter.value, letter.key) == (odd.out.value, odd.out.key)
        if kafka_client_under_test() == "aiokafka":
            # Every header is kept; the odd key as UTF-8 can carry it (U+FFFD per bad byte).
            assert ("x-\ufffd\ufffd", b"odd key") in letter.headers
            assert all(header in letter.headers for header in odd.out.headers)
        else:
            # confluent-kafka reads no header of such a record: only the key that failed.
            assert ("x-\ufffd\ufffd", None) in letter.headers
        assert_result(answers, follow_offset, follow)
        assert_running(worker)
        answers.report("header key not UTF-8", [odd_offset])


async def test_worker_zstd_output_is_zstd_and_readable_by_both_clients(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """WORKER_COMPRESSION_TYPE=zstd: answers are stored as zstd batches; both clients read them."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.output, topics.dlq], partitions=1)
    bootstrap = kafka.bootstrap_servers
    rng = np.random.default_rng(77)
    requests = [good(rng, f"zstd-{i}", encoding=ENCODINGS[i % 3]) for i in range(8)]
    bad = Out(b'{"inputs": [', b"zstd-bad", [("x-request-id", b"zstd-bad")])
    settings = settings_for(kafka, triton, topics, compression_type="zstd")
    async with running_worker(settings) as worker, Answers(kafka, topics) as answers:
        offsets = await produce(bootstrap, topics.input, [r.out for r in requests] + [bad])
        (next_offset,) = await produce(
            bootstrap, topics.input, [(follow := good(rng, "zstd-next")).out]
        )
        await answers.through(next_offset)
        for offset, request in zip(offsets[:-1], requests, strict=True):
            assert_result(answers, offset, request)
        letter = answers.dead_letter(offsets[-1], "DECODE_ERROR")
        assert letter.value == bad.value
        assert_result(answers, next_offset, follow)
        assert_running(worker)
        answers.report("worker's own batches zstd (WORKER_COMPRESSION_TYPE=zstd)", offsets)

    for topic in (topics.output, topics.dlq):
        batches = [b for b in await stored_batches(bootstrap, topic) if not b.control]
        assert batches, topic
        assert {b.compression for b in batches} == {CODEC_IDS["zstd"]}, (topic, batches)

    # librdkafka decodes the worker's zstd batches to the same bytes aiokafka read.
    seen = await asyncio.to_thread(_consume_all, bootstrap, [topics.output, topics.dlq], unique)
    expected = {
        (r.topic, r.offset): (r.key, r.value)
        for rs in (*answers.results.values(), *answers.dead_letters.values())
        for r in rs
    }
    assert seen == expected


def _consume_all(
    bootstrap: str, topic_names: list[str], group: str
) -> dict[tuple[str | None, int | None], tuple[bytes | None, bytes | None]]:
    from confluent_kafka import TopicPartition as ConfluentTopicPartition

    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"confluent-{group}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
        }
    )
    try:
        ends = {
            t: consumer.get_watermark_offsets(ConfluentTopicPartition(t, 0), 10)[1]
            for t in topic_names
        }
        consumer.assign([ConfluentTopicPartition(t, 0, 0) for t in topic_names])
        seen: dict[tuple[str | None, int | None], tuple[bytes | None, bytes | None]] = {}
        deadline = time.monotonic() + 30
        while any(sum(1 for (t, _) in seen if t == name) < end for name, end in ends.items()):
            assert time.monotonic() < deadline, f"librdkafka read {len(seen)} of {ends}"
            for msg in consumer.consume(100, timeout=0.5):
                assert msg.error() is None, msg.error()
                seen[(msg.topic(), msg.offset())] = (msg.key(), msg.value())
        return seen
    finally:
        consumer.close()


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
async def test_large_dead_letter_kept_whole_when_the_dlq_allows_it(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, delivery: str
) -> None:
    """A 1.5 MiB value on a 4 MiB topic, over a 1 MiB request limit (TOO_LARGE, half a MiB
    over it): its dead letter (4 MiB DLQ) keeps every byte, in both delivery modes. Before,
    the producers' own limit was the larger of the request and result limits plus 64 KiB:
    librdkafka's refused the dead letter, which was written without its value."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input, topics.dlq], partitions=1, configs=LARGE_TOPIC)
    await kafka.create_topics([topics.output], partitions=1)
    bootstrap = kafka.bootstrap_servers
    rng = np.random.default_rng(5)
    big = _large_invalid_request(rng, "large-kept")
    settings = settings_for(kafka, triton, topics, delivery=delivery, max_request_bytes="1MiB")
    async with (
        running_worker(settings) as worker,
        Answers(kafka, topics) as answers,
    ):
        big_offset, next_offset = await produce(
            bootstrap,
            topics.input,
            [big, (follow := good(rng, "large-next")).out],
            LARGE_PRODUCER,
        )
        await answers.through(next_offset)
        letter = answers.dead_letter(big_offset, "TOO_LARGE")
        assert letter.value == big.value
        assert letter.key == big.key
        for header in big.headers:
            assert header in letter.headers
        assert header_value(letter.headers, "x-value-omitted") is None
        assert omitted_count(worker) == 0
        assert_result(answers, next_offset, follow)
        assert_running(worker)
        answers.report(
            f"1.5 MiB value over a 1 MiB request limit, DLQ max.message.bytes 4 MiB, {delivery} "
            "(kept whole)",
            [big_offset],
        )


async def test_oversized_dead_letters_lose_value_then_key_when_the_dlq_is_smaller(
    kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str
) -> None:
    """Default 1 MiB DLQ: a 1.5 MiB value and a 1 MiB key are dead-lettered without them."""
    topics = Topics.fresh(unique)
    await kafka.create_topics([topics.input], partitions=1, configs=LARGE_TOPIC)
    await kafka.create_topics([topics.output, topics.dlq], partitions=1)
    bootstrap = kafka.bootstrap_servers
    rng = np.random.default_rng(6)
    big = _large_invalid_request(rng, "large-omitted")
    async with (
        running_worker(settings_for(kafka, triton, topics)) as worker,
        Answers(kafka, topics) as answers,
    ):
        # A small dead letter and a result first, so that the worker's producer has
        # written to both partitions before the broker refuses anything on them.
        small_bad = Out(b'{"inputs": [', b"small-bad", [("x-request-id", b"small-bad")])
        small_offset, next_offset = await produce(
            bootstrap, topics.input, [small_bad, (follow := good(rng, "small-next")).out]
        )
        await answers.through(next_offset)
        assert answers.dead_letter(small_offset, "DECODE_ERROR").value == small_bad.value
        assert_result(answers, next_offset, follow)

        # 3b. The dead letter of a 1.5 MiB value does not fit the DLQ: value omitted.
        big_offset, next_offset = await produce(
            bootstrap,
            topics.input,
            [big, (follow := good(rng, "omitted-next")).out],
            LARGE_PRODUCER,
        )
        await answers.through(next_offset)
        letter = answers.dead_letter(big_offset, "DECODE_ERROR")
        assert big.value is not None
        assert letter.value == b""
        assert letter.key == big.key
        assert header_value(letter.headers, "x-value-omitted") == b"true"
        assert (
            header_value(letter.headers, "x-original-value-bytes") == str(len(big.value)).encode()
        )
        assert (
            header_value(letter.headers, "x-original-value-sha256")
            == hashlib.sha256(big.value).hexdigest().encode()
        )
        assert header_value(letter.headers, "x-key-omitted") is None
        for header in big.headers:
            assert header in letter.headers
        assert omitted_count(worker) == 1
        assert_result(answers, next_offset, follow)
        assert_running(worker)
        answers.report(
            "1.5 MiB invalid value, DLQ max.message.bytes 1 MiB (dead letter without its value)",
            [big_offset],
        )

        # 6. A 1 MiB key on a small valid request: its result cannot fit the output topic.
        keyed = good(rng, "one-mib-key", key=bytes(rng.integers(0, 256, MiB, dtype=np.uint8)))
        keyed_offset, next_offset = await produce(
            bootstrap,
            topics.input,
            [keyed.out, (follow := good(rng, "key-next")).out],
            LARGE_PRODUCER,
        )
        await answers.through(next_offset)
        assert keyed.out.key is not None and keyed.out.value is not None
        letter = answers.dead_letter(keyed_offset, "OUTPUT_TOO_LARGE")
        message = header_value(letter.headers, "x-error-message") or b""
        assert f"{MiB}-byte key".encode() in message, message
        # Nor does its dead letter fit the 1 MiB DLQ: written without value and key.
        assert letter.value == b""
        assert letter.key is None
        expected_headers = {
            "x-value-omitted": b"true",
            "x-original-value-bytes": str(len(keyed.out.value)).encode(),
            "x-original-value-sha256": hashlib.sha256(keyed.out.value).hexdigest().encode(),
            "x-key-omitted": b"true",
            "x-original-key-bytes": str(MiB).encode(),
            "x-original-key-sha256": hashlib.sha256(keyed.out.key).hexdigest().encode(),
        }
        for name, value in expected_headers.items():
            assert header_value(letter.headers, name) == value, name
        assert header_value(letter.headers, "x-request-id") == b"one-mib-key"
        assert omitted_count(worker) == 2
        assert_result(answers, next_offset, follow)
        assert_running(worker)
        answers.report(
            "1 MiB key, default 1 MiB output and DLQ (OUTPUT_TOO_LARGE, written without value "
            "and key)",
            [keyed_offset],
        )


def _large_invalid_request(rng: np.random.Generator, request_id: str) -> Out:
    """A 1.5 MiB value that claims to be JSON and is not (random bytes after a brace)."""
    value = b"{" + bytes(rng.integers(0, 256, 3 * MiB // 2, dtype=np.uint8))
    return Out(
        value,
        request_id.encode(),
        [("content-type", b"application/json"), ("x-request-id", request_id.encode())],
    )
