"""The soak's verdict: what became of every acknowledged record, and the figures of its row."""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tests.support.soak.avro import AVRO_ENCODING, AVRO_VERSIONS, check_avro_results
from tests.support.soak.chaos import Applied, Chaos
from tests.support.soak.checks import check_mlp
from tests.support.soak.events import EVENT_ENCODINGS
from tests.support.soak.lanes import Ledger
from tests.support.soak.outcomes import Collector, Outcome
from tests.support.soak.schedule import FAULT_KINDS, FIRST_KINDS
from tests.support.soak.traffic import Sent

Source = tuple[int, int]  # input (partition, offset)
_FAULT_NAMES = {
    "worker_kill": "worker kills",
    "worker_stop": "worker stops",
    "triton_restart": "Triton restarts",
    "triton_kill": "Triton kills",
    "endpoint_kill": "endpoint kills",
    "model_reload": "model reloads",
    "broker_restart": "broker restarts",
    "registry_restart": "registry restarts",
}


@dataclass(frozen=True)
class Figures:
    """One run's row of the README's soak table."""

    requests: int
    unanswered: int
    duplicates: int
    duplicate_bound: int
    dead_letters: int
    faults: Counter[str]
    worst_stall_s: float
    rss_growth_mib: float
    triton_deaths: int  # Tritons that died by themselves (started again by the soak)

    def faults_text(self) -> str:
        planned = ", ".join(f"{self.faults[k]} {_FAULT_NAMES[k]}" for k in FAULT_KINDS)
        return f"{planned}; {self.triton_deaths} Triton deaths unplanned"

    def summary(self) -> str:
        return (
            f"acked {self.requests}, unanswered {self.unanswered}, duplicates {self.duplicates} "
            f"(bound {self.duplicate_bound}), dead letters {self.dead_letters}; "
            f"{self.faults_text()}; worst stall {self.worst_stall_s:.1f} s; "
            f"RSS growth {self.rss_growth_mib:.1f} MiB"
        )

    def row(self, mode: str, client: str, seed: int, soak_s: float) -> str:
        """The line the README's table takes (printed with a RELIABILITY prefix)."""
        return (
            f"SOAK-ROW | `{mode}`, {client} (seed {seed}, {soak_s:.0f} s) | {self.requests} | "
            f"{self.unanswered} | {self.duplicates} (bound {self.duplicate_bound}) | "
            f"{self.dead_letters} | {self.faults_text()} | {self.worst_stall_s:.1f} s | "
            f"{self.rss_growth_mib:.0f} MiB |"
        )


def appended_between(stamps: Sequence[int], low_ms: int, high_ms: int) -> int:
    """How many of the sorted ``stamps`` lie in [low_ms, high_ms]."""
    return bisect.bisect_right(stamps, high_ms) - bisect.bisect_left(stamps, low_ms)


def duplicate_bound(
    stamps: Sequence[int], disturbances_ms: Sequence[int], window: int, since_commit_ms: int
) -> list[int]:
    """What at_least_once may redo after each disturbance that takes a member's partitions
    without a commit (a SIGKILL; a broker restart longer than the session): the records in
    flight (at most the window) plus those finished since the last commit (at most what the
    broker appended in one commit interval, plus the commit's round trip, before it)."""
    return [window + appended_between(stamps, at - since_commit_ms, at) for at in disturbances_ms]


def duplicates_by_fault(
    by_source: Mapping[Source, list[Outcome]], applied: Sequence[Applied]
) -> Counter[str]:
    """Each outcome after a record's first, counted under the latest fault before it."""
    starts = [a.started_wall_ms for a in applied]
    counts: Counter[str] = Counter()
    for found in by_source.values():
        for outcome in sorted(found, key=lambda o: o.appended_ms)[1:]:
            index = bisect.bisect_right(starts, outcome.appended_ms) - 1
            counts[applied[index].fault.kind if index >= 0 else "none"] += 1
    return counts


def describe(sources: Sequence[Source], accepted: Mapping[Source, str]) -> str:
    """A few records by partition, offset and request id, for a failure message."""
    return ", ".join(f"p{p}@{o} ({accepted[(p, o)]})" for p, o in sources[:10])


def expected_dead(ledger: Ledger, accepted: Mapping[Source, str]) -> set[Source]:
    """The records that must be dead letters: hostile ones, unknown models, results too large
    (not those a result may answer as well: each of their outcomes is judged as it is read)."""
    return {
        s
        for s, rid in accepted.items()
        if ledger.sent[rid].expected_code and not ledger.sent[rid].result_allowed
    }


def sequence_steps(ledger: Ledger, accepted: Mapping[Source, str]) -> dict[str, list[Source]]:
    """Each ``running_sum`` sequence's acknowledged steps, in order."""
    steps: dict[str, list[tuple[int, Source]]] = {}
    for source, rid in accepted.items():
        sent = ledger.sent[rid]
        if sent.sequence is not None:
            steps.setdefault(sent.sequence, []).append((sent.step, source))
    return {key: [s for _, s in sorted(found)] for key, found in steps.items()}


def sequence_problems(
    ledger: Ledger,
    accepted: Mapping[Source, str],
    by_source: Mapping[Source, list[Outcome]],
    windows: Sequence[tuple[int, int]],
) -> tuple[list[str], int, int]:
    """Sequences no fault touched must have every sum right and no dead letter.

    A sequence is touched when a disturbance (a fault until the worker answered again, or
    the final hand-over) overlaps the time from its first step's production to its last
    outcome (a redone step's included). Touched ones may lose their state in Triton (a
    restart, a reload, a failover, an idle drop: INFERENCE_ERROR, which the collector
    allows them) or see a step twice (the model's state is at-least-once), so only their
    outcomes' codes are checked. Returns the problems and the untouched and touched counts.
    """
    problems: list[str] = []
    untouched = touched = 0
    for key, sources in sequence_steps(ledger, accepted).items():
        outcomes = [o for s in sources for o in by_source.get(s, [])]
        if not outcomes:
            continue  # unanswered: reported as lost
        first_ms = min(ledger.sent[accepted[s]].produced_ms for s in sources)
        last_ms = max(o.appended_ms for o in outcomes)
        if any(start <= last_ms and first_ms <= end for start, end in windows):
            touched += 1
            continue
        untouched += 1
        for source in sources:
            sent = ledger.sent[accepted[source]]
            problems += _wrong_steps(key, sent, by_source.get(source, []))
    return problems, untouched, touched


def held_windows(chaos: Chaos) -> list[tuple[int, int]]:
    """When a worker held a request for a version Triton retired (up to 5 s, once per
    worker and version state, before its MODEL_NOT_FOUND), from its workers' logs.

    Under ``exactly_once`` a held record keeps its partition's commit behind it, and a
    record holds its window slot until its transaction commits: the partition's slots
    fill and its next records wait for the hold, so a sequence's next step may come
    after Triton's idle limit (5 s) and find its state dropped. That is a disturbance
    as a fault is (a second's slack after it, for the partition to catch up)."""
    windows = []
    for worker in chaos.workers:
        if not worker.log_path.exists():
            continue
        for line in worker.log_path.read_text(errors="replace").splitlines():
            if '"model_version_retired"' not in line:
                continue
            event = json.loads(line)
            ended_ms = int(datetime.fromisoformat(event["timestamp"]).timestamp() * 1000)
            windows.append((ended_ms - int(event["held_s"] * 1000), ended_ms + 1000))
    return windows


def _wrong_steps(key: str, sent: Sent, found: list[Outcome]) -> list[str]:
    return [
        f"sequence {key} step {sent.step} ({sent.rid}): "
        + (f"dead letter {o.code}" if o.code else f"SUM {o.total}, want {sent.expected_sum}")
        + " with no fault about"
        for o in found
        if o.code is not None or o.total != sent.expected_sum
    ]


@dataclass(frozen=True)
class Run:
    """Everything a finished run left for the oracle."""

    seed: int
    delivery: str
    ledger: Ledger
    collector: Collector
    chaos: Chaos
    committed: Mapping[int, int]  # input partition → committed offset after the final stop
    input_ends: Mapping[int, int]
    #: An Avro result's value decoded through the registry (confluent-kafka's deserializer).
    read_avro: Callable[[bytes], Any]


@dataclass(frozen=True)
class Limits:
    """The bounds a run is held to."""

    window: int  # WORKER_MAX_IN_FLIGHT
    since_commit_ms: int  # one commit interval and the commit's round trip
    rss_growth_mib: float


def judge(run: Run, figures: Figures, limits: Limits) -> None:
    """Every check of the soak, on the run and on its figures (``measure``)."""
    mode = run.delivery
    client_seed = f"seed {run.seed}, {mode}"
    _check_answers(run)
    if mode == "exactly_once":
        assert figures.duplicates == 0, f"{client_seed}: {figures.duplicates} duplicates"
    else:
        assert figures.duplicates <= figures.duplicate_bound, f"{client_seed}: {figures.summary()}"
    assert run.committed == run.input_ends, (
        f"{client_seed}: committed {dict(run.committed)} != ends {dict(run.input_ends)}"
    )
    exits = {w.name: (w.expected_exit, w.returncode) for w in run.chaos.workers}
    assert all(want == got for want, got in exits.values()), f"{client_seed}: exits {exits}"
    assert set(FIRST_KINDS[mode]) <= set(figures.faults), f"{client_seed}: {figures.faults}"
    assert figures.rss_growth_mib <= limits.rss_growth_mib, f"{client_seed}: {figures.summary()}"
    run.chaos.tripwire.check()


def measure(run: Run, limits: Limits) -> Figures:
    """The run's figures: its row of the README's table."""
    by_source, accepted = run.collector.by_source, run.ledger.accepted()
    stamps = sorted(o.appended_ms for o in run.collector.outcomes)
    applied = run.chaos.applied
    restarts = [a.started_wall_ms for a in applied if a.fault.kind == "broker_restart"]
    bound = duplicate_bound(
        stamps, [*run.chaos.kills_wall_ms, *restarts], limits.window, limits.since_commit_ms
    )
    growths = [w.rss_growth for w in run.chaos.workers if w.rss_growth is not None]
    progress = run.chaos.progress
    return Figures(
        requests=len(accepted),
        unanswered=sum(1 for s in accepted if s not in by_source),
        duplicates=sum(len(found) - 1 for found in by_source.values()),
        duplicate_bound=sum(bound) if run.delivery == "at_least_once" else 0,
        dead_letters=sum(1 for found in by_source.values() if any(o.code for o in found)),
        faults=Counter(a.fault.kind for a in applied),
        worst_stall_s=progress.worst_stall_s if progress is not None else 0.0,
        rss_growth_mib=max(growths, default=0) / 2**20,
        triton_deaths=len(run.chaos.servers.deaths),
    )


def _check_answers(run: Run) -> None:
    """Every acknowledged record answered, rightly, and nothing else answered."""
    ledger, collector, seed = run.ledger, run.collector, run.seed
    accepted, by_source = ledger.accepted(), collector.by_source
    assert ledger.failed == [], f"seed {seed}: deliveries refused: {ledger.failed[:10]}"
    assert len(accepted) == len(ledger.sent), f"seed {seed}: records without an ack"
    lost = sorted(s for s in accepted if s not in by_source)
    assert not lost, f"seed {seed}: {len(lost)} records lost, e.g. {describe(lost, accepted)}"
    unknown = sorted(set(by_source) - set(accepted))
    assert not unknown, f"seed {seed}: outcomes for records never acked: {unknown[:10]}"
    mismatched = [
        (s, o.rid) for s, found in by_source.items() for o in found if o.rid != accepted[s]
    ]
    assert not mismatched, f"seed {seed}: outcomes naming another request: {mismatched[:10]}"
    problems = list(collector.problems)
    problems += check_avro_results(collector.avro_results, run.read_avro, collector.mlp_checks)
    problems += check_mlp(collector.mlp_checks)
    # A Triton that died by itself lost its sequences from the moment it died (noticed
    # within the supervisor's half-second poll) until the worker has it back in rotation
    # (within its half-second probe, with room for a loaded machine).
    deaths = [(d.seen_wall_ms - 1000, d.back_wall_ms + 3000) for d in run.chaos.servers.deaths]
    holds = held_windows(run.chaos) if run.delivery == "exactly_once" else []
    wrong_sequences, untouched, touched = sequence_problems(
        ledger, accepted, by_source, [*run.chaos.windows, *deaths, *holds]
    )
    print(f"SOAK seed {seed}: sequences untouched by faults {untouched}, touched {touched}")
    mapped = _answered_kinds(ledger, accepted, by_source, EVENT_ENCODINGS)
    avro = _answered_kinds(ledger, accepted, by_source, (AVRO_ENCODING,))
    print(f"SOAK seed {seed}: mapped events {_listed(mapped, lump_dead=True)}")
    print(f"SOAK seed {seed}: Avro events {_listed(avro, lump_dead=False)}")
    problems += wrong_sequences
    problems += _cut_short_problems(run)
    assert not problems, f"seed {seed}: {len(problems)} wrong outcomes, e.g.\n" + "\n".join(
        problems[:15]
    )
    # Both versions of the Avro events' schema answered: the producer moved on partway.
    versions = set(AVRO_VERSIONS.values())
    assert versions <= {kind for kind, _ in avro}, f"seed {seed}: Avro events {dict(avro)}"
    dead = {s for s, found in by_source.items() if any(o.code for o in found)}
    dead_plain = {
        s
        for s in dead
        if ledger.sent[accepted[s]].sequence is None and not ledger.sent[accepted[s]].result_allowed
    }
    want = expected_dead(ledger, accepted)
    assert dead_plain == want, (
        f"seed {seed}: dead letters {len(dead_plain)} != expected {len(want)}: "
        f"unexpected {describe(sorted(dead_plain - want), accepted)}; "
        f"missing {describe(sorted(want - dead_plain), accepted)}"
    )


def _answered_kinds(
    ledger: Ledger,
    accepted: Mapping[Source, str],
    by_source: Mapping[Source, list[Outcome]],
    encodings: Sequence[str],
) -> Counter[tuple[str, str | None]]:
    """How many events of ``encodings`` of each (kind, expected code) were answered (the
    oracle checked each answer)."""
    kinds: Counter[tuple[str, str | None]] = Counter()
    for source, rid in accepted.items():
        sent = ledger.sent[rid]
        if sent.encoding in encodings and source in by_source:
            kinds[(sent.kind, sent.expected_code)] += 1
    return kinds


def _listed(kinds: Counter[tuple[str, str | None]], *, lump_dead: bool) -> str:
    """The counts, the dead letters as one (``lump_dead``) or each kind with its code."""
    shown: Counter[str] = Counter()
    for (kind, code), count in kinds.items():
        if code is None:
            shown[kind] += count
        else:
            shown["dead letters" if lump_dead else f"{kind} ({code})"] += count
    return ", ".join(f"{shown[k]} {k}" for k in sorted(shown)) or "none"


def _cut_short_problems(run: Run) -> list[str]:
    """A token stream answered with only its first tokens is allowed only when a Triton died
    by itself about then: Triton 2.51 crashing amid decoupled responses can end a stream
    early without an error (noticed within the supervisor's half-second poll)."""
    deaths = [(d.seen_wall_ms - 2000, d.back_wall_ms) for d in run.chaos.servers.deaths]
    cut = run.collector.cut_short
    if cut:
        print(f"SOAK seed {run.seed}: token streams cut short by a Triton crash: {len(cut)}")
    return [
        f"{rid} (tokens): only the first tokens, answered at {_faults_about(run.chaos, ms)}"
        for rid, ms in cut
        if not any(start <= ms <= end for start, end in deaths)
    ]


def _faults_about(chaos: Chaos, wall_ms: int, around_ms: int = 15_000) -> str:
    """When (seconds into the run) and the faults applied within ``around_ms`` of it."""
    near = [
        f"{a.fault.kind}{' ' + a.fault.model if a.fault.kind == 'model_reload' else ''} "
        f"t={(a.started_wall_ms - chaos.t0_wall_ms) / 1000:.1f}-"
        f"{(a.ended_wall_ms - chaos.t0_wall_ms) / 1000:.1f}s"
        for a in chaos.applied
        if a.started_wall_ms - around_ms <= wall_ms <= a.ended_wall_ms + around_ms
    ]
    return f"t={(wall_ms - chaos.t0_wall_ms) / 1000:.1f}s; faults about then: {near or 'none'}"
