"""Pieces of the seeded chaos soak: traffic, producers, the outcome collector, worker processes.

The soak itself (tests/fault/test_soak.py) wires them together and holds the oracle.
Every random choice comes from the soak's seed, so a failing run replays with SOAK_SEED.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import random
import signal
import sys
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import confluent_kafka
import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import ConsumerRecord, TopicPartition

from devtools import samples
from devtools.devstack.process import tail
from devtools.samples import Tensor, encode_request
from tests.support import Topics, mlp_reference, result_outputs

_T = TypeVar("_T")
MODELS = ("double", "mlp", "echo_bytes")
_CONTENT_TYPES = {
    "json": b"application/json",
    "binary": b"application/octet-stream",
    "protobuf": b"application/x-protobuf",
}
_BAD = {s.request_id.removeprefix("bad-"): s for s in samples.bad_requests()}
# Hostile kinds: every bad sample, plus two a librdkafka producer can send.
HOSTILE_KINDS = (*sorted(_BAD), "null-record", "header-not-utf8")
_UTF8_BOM = b"\xef\xbb\xbf"


# -- traffic -------------------------------------------------------------------------


@dataclass(slots=True)
class Sent:
    """One produced record and what must become of it."""

    rid: str
    partition: int
    kind: str
    expected_code: str | None = None  # the dead-letter code of a hostile record
    model: str | None = None
    encoding: str | None = None
    tensors: list[Tensor] | None = None  # inputs, to check the result's values


@dataclass(frozen=True, slots=True)
class Produced:
    sent: Sent
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


def make_record(
    rng: np.random.Generator, partition: int, seq: int, *, librdkafka: bool
) -> Produced:
    """Record ``seq`` of a partition: mostly good requests, about 5 % hostile ones.

    Good ones cycle over every model and encoding, with 1 to 3 rows, and some legal
    oddities (model named in a header, a UTF-8 BOM before JSON, null and repeated
    header values). Null records and null header values only go through librdkafka
    (aiokafka refuses to send them).
    """
    rid = f"p{partition}-s{seq}"
    key = rid.encode()
    draw = rng.random()
    if draw < 0.05:
        kinds = HOSTILE_KINDS if librdkafka else [k for k in HOSTILE_KINDS if k != "null-record"]
        kind = str(kinds[int(rng.integers(len(kinds)))])
        return _hostile(rng, rid, partition, kind, key)
    model = MODELS[int(rng.integers(len(MODELS)))]
    encoding = samples.ENCODINGS[int(rng.integers(len(samples.ENCODINGS)))]
    rows = int(rng.integers(1, 4))
    tensors = {
        "double": samples.double_inputs,
        "mlp": samples.mlp_inputs,
        "echo_bytes": samples.echo_bytes_inputs,
    }[model](rng, rows)
    kind = "plain"
    oddity = rng.random()
    if oddity < 0.05:
        kind = "model-in-header"
    elif oddity < 0.08:
        kind, encoding = "bom-json", "json"
    elif oddity < 0.12 and librdkafka:
        kind = "odd-headers"
    value, headers = encode_request(
        model, tensors, encoding, rid, model_in_header=kind == "model-in-header"
    )
    out_headers: list[tuple[str, bytes | None]] = list(headers)
    if kind == "bom-json":
        value = _UTF8_BOM + value
    if kind == "odd-headers":
        out_headers += ODD_HEADERS
    sent = Sent(rid, partition, kind, None, model, encoding, tensors)
    return Produced(sent, key, value, out_headers)


#: Passed through to the result as they came: a null value and a repeated name.
ODD_HEADERS: list[tuple[str, bytes | None]] = [
    ("x-trace", None),
    ("x-trace", b"1"),
    ("x-trace", b"2"),
]


def _hostile(rng: np.random.Generator, rid: str, partition: int, kind: str, key: bytes) -> Produced:
    tag = [("x-request-id", rid.encode())]
    if kind == "null-record":
        return Produced(Sent(rid, partition, kind, "DECODE_ERROR"), None, None, list(tag))
    if kind == "header-not-utf8":
        value, headers = encode_request("double", samples.double_inputs(rng), "json", rid)
        bad: list[tuple[str, bytes | None]] = [*headers, ("x-model-name", b"\xff\xfe"), *tag]
        return Produced(Sent(rid, partition, kind, "DECODE_ERROR"), key, value, bad)
    sample = _BAD[kind]
    headers_: list[tuple[str, bytes | None]] = [
        (k, v) for k, v in sample.headers if k != "x-request-id"
    ]
    sent = Sent(rid, partition, kind, sample.expected_code)
    return Produced(sent, key, sample.value, [*headers_, *tag])


@dataclass(frozen=True, slots=True)
class MlpCheck:
    """An ``mlp`` result to compare with the reference, computed later for many rows at once."""

    rid: str
    rows: np.ndarray[Any, Any]
    probs: np.ndarray[Any, Any]


def check_result(
    sent: Sent, record: ConsumerRecord[bytes, bytes], deferred: list[MlpCheck]
) -> str | None:
    """Why a result record is wrong for what was sent, or None when it is right.

    ``mlp`` values are checked later (``check_mlp``): the reference costs a few ms a call.
    """
    assert sent.tensors is not None and sent.model is not None and sent.encoding is not None
    headers = record.headers
    content_type = first_header(headers, "content-type")
    if content_type != _CONTENT_TYPES[sent.encoding]:
        return f"content-type {content_type!r} for a {sent.encoding} request"
    if first_header(headers, "x-model-name") != sent.model.encode():
        return f"x-model-name {first_header(headers, 'x-model-name')!r}, sent {sent.model}"
    if sent.kind == "odd-headers":
        passed = [(k, v) for k, v in headers if k == "x-trace"]
        if passed != ODD_HEADERS:
            return f"headers not passed through as sent: {passed}"
    outputs = result_outputs(record)
    values = sent.tensors[0].values
    if sent.model == "echo_bytes":
        want = [str(v).upper() for v in values]
        got = outputs.get("TEXT_UPPER")
        return None if got == want else f"TEXT_UPPER {got} != {want}"
    rows = np.asarray(values, dtype=np.float32)
    name = "OUTPUT0" if sent.model == "double" else "PROBS"
    got_array = np.asarray(outputs.get(name, []), dtype=np.float64)
    width = rows.shape[1] if sent.model == "double" else 10
    if got_array.size != rows.shape[0] * width:
        return f"{name} has {got_array.size} values for {rows.shape[0]} rows"
    got_array = got_array.reshape(rows.shape[0], width)
    if sent.model == "mlp":
        deferred.append(MlpCheck(sent.rid, rows, got_array))
        return None
    return None if np.allclose(got_array, rows * 2, rtol=1e-6) else f"{name} is not 2 x INPUT0"


def check_mlp(checks: list[MlpCheck]) -> list[str]:
    """The ``mlp`` results that differ from the reference computed here."""
    if not checks:
        return []
    expected = mlp_reference(np.concatenate([c.rows for c in checks]))
    wrong, row = [], 0
    for check in checks:
        rows = len(check.rows)
        if not np.allclose(check.probs, expected[row : row + rows], rtol=1e-5, atol=1e-7):
            wrong.append(f"{check.rid} (mlp): PROBS differ from the reference")
        row += rows
    return wrong


def first_header(headers: Any, name: str) -> bytes | None:
    """The first value of a header (a record's own headers come before those the worker adds)."""
    for key, value in headers:
        if key == name:
            return value if value is None else bytes(value)
    return None


# -- the ledger of what the broker accepted ----------------------------------------------


@dataclass(slots=True)
class Ledger:
    """Records as produced (by request id) and every delivery report."""

    sent: dict[str, Sent] = field(default_factory=dict)
    # (request id, partition, offset) for each record the broker acknowledged.
    acked: list[tuple[str, int, int]] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (request id, error)

    def delivered(self, rid: str, partition: int, offset: int) -> None:
        self.acked.append((rid, partition, offset))  # list.append: safe from flush's thread

    def refused(self, rid: str, error: str) -> None:
        self.failed.append((rid, error))

    def accepted(self) -> dict[tuple[int, int], str]:
        """(partition, offset) → request id of every acknowledged record."""
        return {(p, o): rid for rid, p, o in self.acked}


class Pace:
    """How many records a lane should have produced by now, at ``rate_per_s``."""

    def __init__(self, rate_per_s: float) -> None:
        self._rate = rate_per_s
        self._started = time.monotonic()

    def due(self, produced: int, burst: int = 200) -> int:
        return max(0, min(burst, int((time.monotonic() - self._started) * self._rate) - produced))


_TICK_S = 0.02


async def _tick(stop: asyncio.Event) -> None:
    # The producers' pacing: one tick, or less if the soak ends meanwhile.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), _TICK_S)


class ConfluentLane:
    """One partition fed by a librdkafka producer (acks=all, idempotent, its own codec)."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partition: int,
        compression: str,
        seed: int,
        ledger: Ledger,
        rate_per_s: float,
    ) -> None:
        self.topic, self.partition, self.compression = topic, partition, compression
        self.produced = 0
        self._rng = np.random.default_rng([seed, partition])
        self._ledger = ledger
        self._rate = rate_per_s
        self._producer = confluent_kafka.Producer(
            {
                "bootstrap.servers": bootstrap,
                "acks": "all",
                "enable.idempotence": True,
                "compression.type": compression,
                "linger.ms": 10,
                # Longer than any broker restart of the soak: librdkafka retries until then.
                "message.timeout.ms": 120_000,
            },
            logger=logging.getLogger(f"soak.librdkafka.p{partition}"),
        )

    def _report(self, rid: str, err: Any, msg: Any) -> None:
        if err is not None:
            self._ledger.refused(rid, str(err))
        else:
            self._ledger.delivered(rid, msg.partition(), msg.offset())

    async def run(self, stop: asyncio.Event) -> None:
        pace = Pace(self._rate)
        while not stop.is_set():
            for _ in range(pace.due(self.produced)):
                record = make_record(self._rng, self.partition, self.produced, librdkafka=True)
                headers: list[tuple[str, str | bytes | None]] = list(record.headers)
                try:
                    self._producer.produce(
                        self.topic,
                        value=record.value,
                        key=record.key,
                        headers=headers,
                        partition=self.partition,
                        on_delivery=functools.partial(self._report, record.sent.rid),
                    )
                except BufferError:
                    break  # librdkafka's queue is full (broker down): next tick
                self._ledger.sent[record.sent.rid] = record.sent
                self.produced += 1
            self._producer.poll(0)
            await _tick(stop)
        # Flushed a second at a time, so that a cancelled soak leaves no thread behind for long.
        deadline = time.monotonic() + 150
        while (left := len(self._producer)) and time.monotonic() < deadline:
            await asyncio.to_thread(self._producer.flush, 1.0)
        assert left == 0, f"p{self.partition}: {left} records without a delivery report"


class AiokafkaLane:
    """One partition fed by an aiokafka producer (acks=all, idempotent, its own codec)."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        partition: int,
        compression: str,
        seed: int,
        ledger: Ledger,
        rate_per_s: float,
    ) -> None:
        self.topic, self.partition, self.compression = topic, partition, compression
        self.produced = 0
        self._bootstrap = bootstrap
        self._rng = np.random.default_rng([seed, partition])
        self._ledger = ledger
        self._rate = rate_per_s

    async def run(self, stop: asyncio.Event) -> None:
        producer = AIOKafkaProducer(
            bootstrap_servers=self._bootstrap,
            acks="all",
            enable_idempotence=True,
            compression_type=self.compression,
            linger_ms=10,
            request_timeout_ms=120_000,
        )
        await producer.start()
        pending: list[asyncio.Future[Any]] = []
        try:
            pace = Pace(self._rate)
            while not stop.is_set():
                for _ in range(pace.due(self.produced)):
                    record = make_record(self._rng, self.partition, self.produced, librdkafka=False)
                    rid = record.sent.rid
                    self._ledger.sent[rid] = record.sent
                    self.produced += 1
                    try:
                        future = await producer.send(
                            self.topic,
                            record.value,
                            key=record.key,
                            headers=[(k, v or b"") for k, v in record.headers],
                            partition=self.partition,
                        )
                    except KafkaError as exc:
                        self._ledger.refused(rid, repr(exc))
                        continue
                    future.add_done_callback(lambda f, rid=rid: self._report(rid, f))
                    pending.append(future)
                await _tick(stop)
            await producer.flush()
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            await producer.stop()

    def _report(self, rid: str, future: asyncio.Future[Any]) -> None:
        if future.cancelled():
            self._ledger.refused(rid, "cancelled")
        elif (exc := future.exception()) is not None:
            self._ledger.refused(rid, repr(exc))
        else:
            meta = future.result()
            self._ledger.delivered(rid, meta.partition, meta.offset)


# -- outcomes --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Outcome:
    """One result or dead letter as read from the broker."""

    source: tuple[int, int]  # input (partition, offset)
    rid: str
    code: str | None  # None for a result
    appended_ms: int  # the broker's LogAppendTime


class Tripwire:
    """The first unexpected failure (a worker exiting by itself, a server dying) ends the soak."""

    def __init__(self, context: Callable[[], str]) -> None:
        self._failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._context = context

    def trip(self, message: str) -> None:
        if not self._failed.done():
            self._failed.set_exception(AssertionError(message))

    def check(self) -> None:
        if self._failed.done():
            self._failed.result()

    async def guard(self, step: Awaitable[_T], timeout_s: float, what: str) -> _T:
        """Await ``step``; fail at once on a trip, or after ``timeout_s`` saying ``what``."""
        task = asyncio.ensure_future(step)
        waiting: set[asyncio.Future[Any]] = {task, self._failed}
        done, _ = await asyncio.wait(
            waiting, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        self.check()
        raise AssertionError(f"{what}: not done within {timeout_s:.0f} s\n{self._context()}")


class Collector:
    """Reads results and dead letters (read_committed), once per (topic, partition, offset)."""

    def __init__(self, bootstrap: str, topics: Topics, ledger: Ledger) -> None:
        self._bootstrap = bootstrap
        self._topics = topics
        self._ledger = ledger
        self.outcomes: list[Outcome] = []
        self.by_source: dict[tuple[int, int], list[Outcome]] = {}
        self.problems: list[str] = []
        self.mlp_checks: list[MlpCheck] = []
        self._seen: set[tuple[str, int, int]] = set()
        self._changed = asyncio.Event()
        self._positions: dict[TopicPartition, int] = {}

    async def run(self, stop: asyncio.Event) -> None:
        consumer = AIOKafkaConsumer(
            self._topics.output,
            self._topics.dlq,
            bootstrap_servers=self._bootstrap,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            isolation_level="read_committed",
            max_partition_fetch_bytes=4 << 20,
        )
        await consumer.start()
        try:
            while not stop.is_set():
                batch = await consumer.getmany(timeout_ms=200)
                for tp, records in batch.items():
                    for record in records:
                        self._take(record)
                    self._positions[tp] = records[-1].offset + 1
                if batch:
                    self._changed.set()
        finally:
            await consumer.stop()

    def _take(self, record: ConsumerRecord[bytes, bytes]) -> None:
        position = (record.topic, record.partition, record.offset)
        if position in self._seen:
            return
        self._seen.add(position)
        headers = record.headers
        try:
            source = (
                int(first_header(headers, "x-source-partition") or b""),
                int(first_header(headers, "x-source-offset") or b""),
            )
        except ValueError:
            self.problems.append(f"{position}: no x-source-partition/offset")
            return
        rid = (first_header(headers, "x-request-id") or b"").decode(errors="replace")
        is_result = record.topic == self._topics.output
        code = None if is_result else (first_header(headers, "x-error-code") or b"?").decode()
        outcome = Outcome(source, rid, code, record.timestamp)
        self.outcomes.append(outcome)
        self.by_source.setdefault(source, []).append(outcome)
        sent = self._ledger.sent.get(rid)
        if sent is None:
            self.problems.append(f"{position}: request id {rid!r} was never sent")
        elif is_result and sent.expected_code is not None:
            self.problems.append(f"{rid} ({sent.kind}): a result, expected {sent.expected_code}")
        elif is_result:
            wrong = check_result(sent, record, self.mlp_checks)
            if wrong:
                self.problems.append(f"{rid} ({sent.kind}, {sent.encoding}): {wrong}")
        elif code != sent.expected_code:
            message = (first_header(headers, "x-error-message") or b"").decode(errors="replace")
            want = sent.expected_code or "a result"
            self.problems.append(f"{rid} ({sent.kind}): dead letter {code}, want {want}: {message}")

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, re-checked after every batch read."""
        while not predicate():
            self._changed.clear()
            await self._changed.wait()

    def read_up_to(self, ends: Mapping[TopicPartition, int]) -> bool:
        """True once every partition was read up to its end offset in ``ends``."""
        return all(self._positions.get(tp, 0) >= end for tp, end in ends.items() if end > 0)


# -- worker processes ----------------------------------------------------------------------


class WorkerProcess:
    """``python -m worker run`` as a child process; an exit nobody asked for trips the soak."""

    def __init__(self, name: str, env: Mapping[str, str], log_path: Path, port: int) -> None:
        self.name, self.log_path, self.port = name, log_path, port
        self._env = env
        self.expected_exit: int | None = None  # set just before a signal is sent
        self.returncode: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._exited: asyncio.Task[int] | None = None

    async def start(self, tripwire: Tripwire) -> None:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("WORKER_")}
        full_env.update(self._env)
        with self.log_path.open("wb") as log:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "worker",
                "run",
                env=full_env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )
        self._exited = asyncio.create_task(self._proc.wait())

        def on_exit(task: asyncio.Task[int]) -> None:
            if task.cancelled():
                return
            self.returncode = task.result()
            if self.expected_exit is None:
                tripwire.trip(
                    f"worker {self.name} exited with {self.returncode} by itself; "
                    f"last lines of its log:\n{tail(self.log_path, 40)}"
                )

        self._exited.add_done_callback(on_exit)

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def signal(self, signum: signal.Signals) -> None:
        """Send a signal the schedule chose; the exit it should cause is then expected."""
        assert self._proc is not None
        self.expected_exit = -signal.SIGKILL if signum == signal.SIGKILL else 0
        self._proc.send_signal(signum)

    async def wait(self) -> int:
        assert self._exited is not None
        return await asyncio.shield(self._exited)

    async def ready(self) -> dict[str, Any] | None:
        """The /readyz body when the worker answers 200, else None."""
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        except OSError:
            return None
        try:
            writer.write(b"GET /readyz HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
            await writer.drain()
            response = await asyncio.wait_for(reader.read(), 5)
        except (OSError, TimeoutError):
            return None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        head, _, body = response.partition(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            return None
        doc: dict[str, Any] = json.loads(body)
        return doc

    async def wait_fully_ready(self) -> None:
        """Until /readyz is 200 and no model is held (polled: another process's state)."""
        while True:
            doc = await self.ready()
            if doc is not None and "models_not_ready" not in doc.get("detail", {}):
                return
            await asyncio.sleep(0.1)  # polling another process's endpoint: nothing to await

    async def reap(self) -> None:
        """Clean-up: SIGKILL a worker still running when the soak ends early, and reap it."""
        if self._proc is None or self._exited is None:
            return
        if self._proc.returncode is None:
            self.expected_exit = -signal.SIGKILL
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(self._exited), 30)


# -- the schedule ------------------------------------------------------------------------


FAULT_KINDS = (
    "worker_kill",
    "worker_stop",
    "triton_restart",
    "triton_kill",
    "model_reload",
    "broker_restart",
)


@dataclass(frozen=True, slots=True)
class Fault:
    """One scheduled fault: quiet time before it, its kind, how long the thing stays down."""

    gap_s: float
    kind: str
    down_s: float
    model: str


def schedule(seed: int) -> Iterator[Fault]:
    """Rounds of every fault kind in a seeded order, with seeded gaps and down times."""
    rng = random.Random(seed)
    while True:
        kinds = list(FAULT_KINDS)
        rng.shuffle(kinds)
        for kind in kinds:
            yield Fault(
                gap_s=round(rng.uniform(1.5, 4.0), 2),
                kind=kind,
                down_s=round(rng.uniform(0.0, 2.0), 2),
                model=rng.choice(MODELS),
            )


def triton_model_call(http_address: str, model: str, action: str) -> None:
    """POST /v2/repository/models/NAME/{load,unload} (Triton runs with explicit control)."""
    request = urllib.request.Request(
        f"http://{http_address}/v2/repository/models/{model}/{action}",
        data=b"{}",
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200, f"{action} {model}: HTTP {response.status}"


def triton_model_ready(http_address: str, model: str) -> bool:
    try:
        url = f"http://{http_address}/v2/models/{model}/ready"
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False
