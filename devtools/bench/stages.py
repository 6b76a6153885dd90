"""Where the worker's CPU per record goes: py-spy samples of a draining worker, by stage.

``profile``: one tuned worker drains a backlog twice, with the per-record path
(``WORKER_FAST_PATH=false``) and with the fast path; once a tenth of the backlog
is answered, ``py-spy record --native --format raw`` samples it for a few seconds.
Each sample's stack is put in the stage of its innermost recognised frame
(``classify``), and a stage's CPU per 1,000 records is its share of the samples
times the worker's own CPU per 1,000 records over the drain. The native frames say
two things the Python ones cannot: a thread waiting (gRPC's completion-queue poller in
``epoll_wait``, librdkafka's calling threads on their queue, a thread waiting for the
GIL) is idle, not running, and is left out; and the
cyclic garbage collector's passes are a stage of their own, not a part of whichever
frame allocated when one ran.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["STAGES", "Profile", "classify", "markdown", "profile", "read_raw"]

#: Stages in the order of a record's way through the worker.
STAGES = (
    "Kafka in",
    "decode and validate",
    "micro-batching",
    "gRPC (Triton client)",
    "result encoding",
    "Kafka out",
    "Kafka connection I/O",
    "bookkeeping (window, offsets, dispatch, metrics, logs)",
    "garbage collection",
    "event loop",
    "other",
)
#: Samples of a thread waiting, not running: left out of every share.
IDLE = "idle"
#: Native frames of a thread waiting (for I/O, a timer, a queue, a lock or the GIL).
_WAITING = (
    "epoll_wait ", "epoll_pwait ", "epoll_pwait2 ", "poll ", "ppoll ", "select ",
    "pthread_cond_wait ", "pthread_cond_timedwait ", "pthread_cond_clockwait ",
    "sem_wait ", "sem_timedwait ", "sem_clockwait ", "take_gil ", "PyThread_acquire_lock_timed ",
)  # fmt: skip

#: (substring of a frame, stage), tried in order on each frame from the innermost out.
_RULES: tuple[tuple[str, str], ...] = (
    ("worker/wire/results", "result encoding"),
    ("worker/wire/batch_results", "result encoding"),
    ("encode_result", "result encoding"),
    ("worker/wire/", "decode and validate"),
    ("msgspec", "decode and validate"),
    ("worker/triton/batching", "micro-batching"),
    ("worker/triton/merging", "micro-batching"),
    ("worker/kafka/publisher", "Kafka out"),
    ("worker/kafka/rdkafka/publisher", "Kafka out"),
    ("aiokafka/producer", "Kafka out"),
    ("worker/kafka/aiokafka/intake", "Kafka in"),
    ("worker/kafka/feed", "Kafka in"),
    ("worker/kafka/rdkafka/intake", "Kafka in"),
    # The worker's own aiokafka modules (transactions, _compat) are not the library's I/O.
    ("worker/kafka/aiokafka/", "bookkeeping (window, offsets, dispatch, metrics, logs)"),
    ("aiokafka/consumer", "Kafka in"),
    ("aiokafka/conn", "Kafka connection I/O"),
    ("aiokafka/client", "Kafka connection I/O"),
    ("aiokafka/", "Kafka connection I/O"),
    ("confluent_kafka/aio/producer", "Kafka out"),
    ("confluent_kafka", "Kafka in"),
    ("tritonclient", "gRPC (Triton client)"),
    ("grpc", "gRPC (Triton client)"),
    ("worker/triton/", "gRPC (Triton client)"),
    ("prometheus_client", "bookkeeping (window, offsets, dispatch, metrics, logs)"),
    ("structlog", "bookkeeping (window, offsets, dispatch, metrics, logs)"),
    ("worker/", "bookkeeping (window, offsets, dispatch, metrics, logs)"),
    ("asyncio", "event loop"),
    ("uvloop", "event loop"),
    ("selectors", "event loop"),
)


def classify(frames: Sequence[str]) -> str:
    """The stage of one stack (outermost frame first): its innermost recognised frame's;
    ``IDLE`` for a thread waiting, garbage collection for a collector's pass."""
    python = max((i for i, frame in enumerate(frames) if ".py:" in frame), default=-1)
    if any(frame.startswith(_WAITING) for frame in frames[python + 1 :]):
        return IDLE
    if any(frame.startswith(("gc_collect", "_PyGC_Collect")) for frame in frames):
        return "garbage collection"
    for frame in reversed(frames):
        for needle, stage in _RULES:
            if needle in frame:
                return stage
    return "other"


def read_raw(text: str) -> Counter[str]:
    """Samples per stage from py-spy's raw (collapsed) output: ``a;b;c COUNT`` per line."""
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        counts[classify(stack.split(";"))] += int(count)
    return counts


@dataclass(frozen=True, slots=True)
class Profile:
    """One profiled drain: its throughput and CPU, and the samples per stage."""

    label: str
    settings: dict[str, str]
    records_per_s: float
    cpu_s_per_1k: float
    samples: dict[str, int] = field(default_factory=dict)

    @property
    def running(self) -> int:
        """Samples of threads running (idle ones left out)."""
        return sum(n for stage, n in self.samples.items() if stage != IDLE)

    def ms_per_1k(self, stage: str) -> float:
        """CPU ms per 1,000 records in ``stage``: its share of the running samples times
        the CPU."""
        total = self.running
        return self.samples.get(stage, 0) / total * self.cpu_s_per_1k * 1000 if total else 0.0


def _py_spy() -> str:
    found = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(found).exists():
        raise RuntimeError("py-spy is not installed (it comes with the bench extra)")
    return found


async def profile(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    model: str,
    records: int,
    base: Mapping[str, str],
    seconds: int = 6,
) -> list[Profile]:
    """The per-record path, then the fast path, each profiled while it drains ``records``."""
    return [
        await _profiled_drain(
            bootstrap,
            triton_url,
            out_dir,
            label=label,
            model=model,
            records=records,
            settings={**base, "FAST_PATH": fast},
            seconds=seconds,
        )
        for label, fast in (("per-record path", "false"), ("fast path", "true"))
    ]


async def _profiled_drain(
    bootstrap: str,
    triton_url: str,
    out_dir: Path,
    *,
    label: str,
    model: str,
    records: int,
    settings: dict[str, str],
    seconds: int,
) -> Profile:
    """One drain, with py-spy attached once a tenth of ``records`` is answered."""
    from devtools.bench import extras

    name = f"profile-{settings['FAST_PATH']}"
    raw = out_dir / f"{name}.txt"
    raw.unlink(missing_ok=True)
    spies: list[asyncio.subprocess.Process] = []
    log = (out_dir / f"{name}-py-spy.log").open("wb")

    async def on_sample(pid: int, done: int) -> None:
        if not spies and done >= records // 10:
            spies.append(
                await asyncio.create_subprocess_exec(
                    _py_spy(), "record", "--native", "--format", "raw", "-r", "100",
                    "-d", str(seconds), "-o", str(raw), "--pid", str(pid),
                    stdout=log, stderr=asyncio.subprocess.STDOUT,
                )
            )  # fmt: skip

    try:
        drained = await extras.drain(
            bootstrap,
            triton_url,
            out_dir,
            label=name,
            model=model,
            backlog=records,
            settings=settings,
            sample_s=0.5,
            on_sample=on_sample,
        )
        for spy in spies:
            await spy.wait()
    finally:
        log.close()
    if not raw.exists():
        raise RuntimeError(f"py-spy wrote no samples (see {name}-py-spy.log)")
    text = raw.read_text()
    return Profile(
        label, settings, drained.records_per_s, drained.cpu_s_per_1k, dict(read_raw(text))
    )


def markdown(profiles: Sequence[Profile] | None) -> str:
    """CPU ms per 1,000 records by stage, one column per profiled drain."""
    if not profiles:
        return ""
    head = " | ".join(p.label for p in profiles)
    lines = [
        "",
        "Where the CPU per record goes (py-spy --native, samples by innermost recognised "
        "frame; threads waiting left out), CPU ms per 1,000 records (share of the running "
        "samples):",
        "",
        f"| stage | {head} |",
        "| --- |" + " ---: |" * len(profiles),
    ]
    for stage in STAGES:
        cells = []
        for p in profiles:
            total = p.running or 1
            cells.append(f"{p.ms_per_1k(stage):.1f} ({p.samples.get(stage, 0) / total:.0%})")
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    lines.append(
        "| **all (CPU s per 1,000 records; records/s)** | "
        + " | ".join(f"{p.cpu_s_per_1k:.3f}; {p.records_per_s:,.0f}/s" for p in profiles)
        + " |"
    )
    return "\n".join(lines) + "\n"
