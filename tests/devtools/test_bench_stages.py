"""The profile's bookkeeping: each py-spy stack in the stage of its innermost recognised frame."""

from __future__ import annotations

from devtools.bench import stages
from devtools.bench.stages import Profile

RAW = "\n".join(
    [
        # A result being encoded inside the fast path: encoding, not bookkeeping.
        "python;run (worker/app.py:10);answer (worker/fastpath.py:80);"
        "encode_result (worker/wire/results.py:40) 30",
        # msgspec is C: the innermost Python frame is the worker's decoder.
        "python;run (worker/app.py:10);decode (worker/wire/requests.py:12) 20",
        "python;_run (asyncio/events.py:80);send (aiokafka/producer/producer.py:400) 10",
        "python;_run (asyncio/events.py:80);_fetch (aiokafka/consumer/fetcher.py:300) 15",
        "python;_run (asyncio/events.py:80);send (aiokafka/conn.py:500) 5",
        "python;_run (asyncio/events.py:80);infer (tritonclient/grpc/aio/__init__.py:9) 10",
        "python;_run (asyncio/events.py:80);done_many (worker/flow/window.py:33) 8",
        "python;run_forever (asyncio/base_events.py:600) 2",
        # Native frames: a thread waiting is idle; a collector's pass is its own stage.
        "python;Thread.run (threading.py:982);epoll_wait (libc.so.6) 20",
        "python;_work (worker/kafka/rdkafka/threads.py:49);PyThread_acquire_lock_timed (q.c:1);"
        "pthread_cond_timedwait (libc.so.6);0x7ff1 (libc.so.6) 5",
        "python;_run (asyncio/events.py:80);decode (worker/wire/requests.py:12);"
        "gc_collect_main (libpython3.11.so.1.0) 4",
        "python;_run (asyncio/events.py:80);encode (worker/wire/batch_results.py:9) 1",
        "python;<module> (somewhere/else.py:1) 0",
        "not a sample line",
    ]
)


def test_stacks_go_to_the_stage_of_their_innermost_recognised_frame() -> None:
    counts = stages.read_raw(RAW)
    assert counts == {
        "idle": 25,
        "garbage collection": 4,
        "result encoding": 31,
        "decode and validate": 20,
        "Kafka out": 10,
        "Kafka in": 15,
        "Kafka connection I/O": 5,
        "gRPC (Triton client)": 10,
        "bookkeeping (window, offsets, dispatch, metrics, logs)": 8,
        "event loop": 2,
        "other": 0,
    }
    assert stages.classify(["a (x.py:1)", "b (y.py:2)"]) == "other"
    assert set(counts) <= {*stages.STAGES, stages.IDLE}


def test_a_stage_costs_its_share_of_the_samples_times_the_cpu_per_record() -> None:
    """Encoding holds 31 of the 105 samples of threads running (the 25 of a thread waiting
    left out), at 0.21 CPU s per 1,000 records: 62 ms per 1,000."""
    profile = Profile("fast path", {}, 5000.0, 0.21, dict(stages.read_raw(RAW)))
    assert profile.running == 105
    assert round(profile.ms_per_1k("result encoding"), 6) == 62.0
    assert Profile("empty", {}, 0.0, 0.2).ms_per_1k("Kafka in") == 0.0
    text = stages.markdown([profile])
    assert "| result encoding | 62.0 (30%) |" in text
    assert "| **all (CPU s per 1,000 records; records/s)** | 0.210; 5,000/s |" in text
    assert stages.markdown(None) == ""
