"""docker-compose.yml really run: built, started, scaled, fed from the host, scraped, stopped.

The registry images are swapped for local stand-ins (deploy/compose-test/) and nothing
else; Grafana has none and is the one service not started. The steps run in order on
one project, each a scenario of its own: healthy, two members, four members, 1,000
requests answered, Prometheus's view, the image's other modes, a drain on stop, `down -v`.
promtool checks the Prometheus files first, in the stand-in image.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml
from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from devtools import samples
from devtools.compose.engine import Engine, answers, ensure_engine, exclusive
from devtools.compose.project import ComposeProject
from devtools.compose.standins import STANDINS, build_standins
from devtools.devstack.paths import PROJECT_ROOT, state_home
from devtools.devstack.process import pid_alive
from tests.contract.test_deploy import referenced_metric_names
from tests.deploy.observe import (
    GROUP,
    INPUT_TOPIC,
    KAFKA,
    active_targets,
    committed_and_end_offsets,
    poll,
    series_count,
    shared_assignment,
)
from tests.deploy.rule_tests import rule_tests, workers_up_expr
from tests.support import Collected, Topics, collect, send
from worker.wire import header_value

# Building the stand-ins from nothing and starting the stack take minutes.
pytestmark = pytest.mark.timeout(900)

TOPICS = Topics("inference-requests", "inference-results", "inference-dead-letters", GROUP)
PARTITIONS = 12
#: Partitions of the results and dead-letter topics, as the compose file's topics job makes them.
ANSWER_PARTITIONS = {TOPICS.output: 12, TOPICS.dlq: 3}
PROMETHEUS_IMAGE = next(s.image for s in STANDINS if s.name == "prometheus")
#: The compose file's Schema Registry, as the host reaches it.
REGISTRY = "http://localhost:8081/apis/ccompat/v7"


def _docker(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(["docker", *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _log(line: str) -> None:
    print(f"compose-test: {line}", flush=True)


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    """A Docker engine; one this test started is stopped by its pid at the end."""
    with exclusive():
        engine = ensure_engine(state_home() / "compose-test" / "dockerd.log", log=_log)
        pid = engine.pid
        try:
            yield engine
        finally:
            engine.stop()
            if pid is not None:  # the test leaves no engine of its own behind
                assert not pid_alive(pid) and not answers(engine.host)


@pytest.fixture(scope="module")
def standins(engine: Engine) -> dict[str, str]:
    """The environment of the engine, once every stand-in image (and the worker's) is built."""
    env = engine.env()
    started = time.monotonic()
    worker = ComposeProject(env)
    build_standins(env, log=_log, then={"python": worker.build_worker})
    _log(f"stand-in images and the worker's image ready in {time.monotonic() - started:.0f} s")
    return env


@pytest.fixture(scope="module")
def project(standins: dict[str, str]) -> Iterator[ComposeProject]:
    """The compose project up with two workers, whatever an interrupted run left before."""
    project = ComposeProject(standins)
    project.down()
    try:
        started = time.monotonic()
        project.up()
        project.wait_healthy(workers=2)
        _log(f"every service up and healthy in {time.monotonic() - started:.0f} s")
        yield project
    finally:
        project.down()
        # Images left untagged by rebuilds would fill the engine's disk run after run; the
        # recent ones stay: the worker's build stage is one, and the next build's cache.
        project.docker("image", "prune", "--force", "--filter", "until=24h")


def _answers_by_position(got: Collected) -> dict[tuple[int, int], str]:
    """Input (partition, offset) of every answer read, from its x-source-* headers."""
    positions = {}
    for rid, record in [*got.results.items(), *got.dead_letters.items()]:
        partition = header_value(record.headers, "x-source-partition")
        offset = header_value(record.headers, "x-source-offset")
        assert partition is not None and offset is not None, rid
        positions[(int(partition), int(offset))] = rid
    return positions


async def _read_every_answer() -> Collected:
    """Every result and dead letter there is now, each topic read to its end."""
    got = Collected()
    consumer = AIOKafkaConsumer(bootstrap_servers=KAFKA, enable_auto_commit=False)
    await consumer.start()
    try:
        parts = [TopicPartition(t, p) for t, n in ANSWER_PARTITIONS.items() for p in range(n)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        while any([await consumer.position(tp) < ends[tp] for tp in parts]):
            for records in (await consumer.getmany(timeout_ms=500)).values():
                for record in records:
                    got.add(record, TOPICS.output)
    finally:
        await consumer.stop()
    return got


def test_promtool_accepts_the_config_and_the_rules(standins: dict[str, str]) -> None:
    """`promtool check config` and `check rules` pass on deploy/prometheus/."""
    mount = f"{PROJECT_ROOT / 'deploy' / 'prometheus'}:/etc/prometheus:ro"
    for check in (("config", "prometheus.yml"), ("rules", "alerts.yml")):
        argv = ["run", "--rm", "--entrypoint", "promtool", "-v", mount, PROMETHEUS_IMAGE]
        out = _docker(standins, *argv, "check", check[0], f"/etc/prometheus/{check[1]}")
        assert "SUCCESS" in out, out


def test_alerts_and_workers_up_hold_whatever_the_scrape_job_is_called(
    standins: dict[str, str], tmp_path: Path
) -> None:
    """promtool: WorkerDown, WorkersAbsent and "Workers up" under Operator and annotation jobs."""
    (tmp_path / "rules.test.yml").write_text(yaml.safe_dump(rule_tests(workers_up_expr())))
    mounts = ["-v", f"{PROJECT_ROOT / 'deploy' / 'prometheus'}:/etc/prometheus:ro"]
    mounts += ["-v", f"{tmp_path}:/tests:ro"]
    # As root: the test file is the test's own, not readable by the image's user.
    argv = ["run", "--rm", "--user", "0", "--entrypoint", "promtool", *mounts, PROMETHEUS_IMAGE]
    out = _docker(standins, *argv, "test", "rules", "/tests/rules.test.yml")
    assert "SUCCESS" in out, out


def test_every_service_becomes_healthy(project: ComposeProject) -> None:
    """`up -d --build`: Kafka, Triton, the Schema Registry, Prometheus and two workers
    healthy; the topics job exit 0; the registry's Confluent API answers from the host."""
    states = {s.name: s for s in project.states()}
    by_service = sorted((s.service, s.status, s.health, s.exit_code) for s in states.values())
    assert by_service == [
        ("kafka", "running", "healthy", 0),
        ("prometheus", "running", "healthy", 0),
        ("schema-registry", "running", "healthy", 0),
        ("topics", "exited", None, 0),
        ("triton", "running", "healthy", 0),
        ("worker", "running", "healthy", 0),
        ("worker", "running", "healthy", 0),
    ]

    with urllib.request.urlopen(f"{REGISTRY}/schemas/types", timeout=10) as answer:
        assert set(json.loads(answer.read())) >= {"AVRO", "JSON"}


@pytest.mark.usefixtures("project")
def test_two_workers_share_the_partitions() -> None:
    """The two replicas are the group's two members, six input partitions each."""
    poll(lambda: shared_assignment(2, PARTITIONS), 60, "two members holding 6 partitions each")


def test_scaling_to_four_workers_shares_the_partitions(project: ComposeProject) -> None:
    """`--scale worker=4`: four healthy members of the group, three input partitions each."""
    project.scale_workers(4)
    project.wait_healthy(workers=4, timeout_s=120)
    poll(lambda: shared_assignment(4, PARTITIONS), 90, "four members holding 3 partitions each")


@pytest.mark.usefixtures("project")
def test_requests_from_the_host_are_answered() -> None:
    """1,000 requests produced to localhost:29092: each answered once, bad ones dead-lettered."""
    bad = [r for r in samples.bad_requests() if r.expected_code != "TOO_LARGE"]
    good = samples.good_requests(1000 - len(bad), seed=11)
    asyncio.run(send(KAFKA, INPUT_TOPIC, [*good, *bad]))
    got = asyncio.run(collect(KAFKA, TOPICS, expected=1000, timeout_s=120))
    assert set(got.results) == {r.request_id for r in good}
    codes = {rid: header_value(r.headers, "x-error-code") for rid, r in got.dead_letters.items()}
    assert codes == {r.request_id: (r.expected_code or "").encode() for r in bad}
    assert got.duplicates == 0


def _targets_up() -> dict[str, int] | None:
    up: dict[str, int] = {}
    for target in active_targets():
        if target["health"] == "up":
            up[target["labels"]["job"]] = up.get(target["labels"]["job"], 0) + 1
    return up if up == {"worker": 4, "triton": 1} else None


@pytest.mark.usefixtures("project")
def test_prometheus_scrapes_every_worker_and_triton() -> None:
    """Prometheus has the four workers (found through Docker's DNS) and Triton as targets up."""
    poll(_targets_up, 60, "4 worker targets and Triton up")


@pytest.mark.usefixtures("project")
def test_every_queried_metric_has_a_series() -> None:
    """Each worker_* and nv_* name the dashboard and the alert rules query has a series."""
    names = sorted(referenced_metric_names())
    absent: list[str] = []

    def complete() -> bool | None:
        absent[:] = [name for name in names if series_count(name) == 0]
        return True if not absent else None

    try:
        poll(complete, 60, "a series of every queried metric")
    except AssertionError:
        raise AssertionError(f"no series in Prometheus of {absent}") from None


def test_the_image_runs_librdkafka_and_tracing(project: ComposeProject) -> None:
    """The image checks the stack through librdkafka, and builds OpenTelemetry tracing."""
    run = ("run", "--rm", "-T", "--no-deps")
    # `check` exits 0 only when every row passes (compose() raises otherwise): Kafka, the
    # topics and the group asked through librdkafka's admin API, Triton and its models.
    report = project.compose(*run, "-e", "WORKER_KAFKA_CLIENT=confluent", "worker", "check")
    assert "inference-requests" in report and "fail" not in report.lower(), report
    code = (
        "import os; from worker.settings import load_settings; "
        "from worker.observability.tracing import build_tracing; "
        "print(type(build_tracing({'OTEL_TRACES_EXPORTER': 'otlp'}, load_settings(os.environ)))"
        ".__name__)"
    )
    printed = project.compose(*run, "--entrypoint", "python", "worker", "-c", code)
    assert printed.strip().splitlines()[-1] == "OtelTracing"


def test_stopping_the_workers_drains_them(project: ComposeProject) -> None:
    """`stop worker` mid-stream: each exits 0; every record taken is answered and committed."""
    rng = np.random.default_rng(5)
    slow = [samples.faulty_request(rng, f"drain-{i}", delay_ms=40) for i in range(1000)]
    asyncio.run(send(KAFKA, INPUT_TOPIC, slow))
    # Mid-stream: some of the slow requests answered, not all of them.
    at_stop = asyncio.run(collect(KAFKA, TOPICS, expected=1050, timeout_s=60))
    project.compose("stop", "worker", timeout_s=180)
    workers = [s for s in project.states() if s.service == "worker"]
    assert [(s.status, s.exit_code) for s in workers] == [("exited", 0)] * 4
    assert len(at_stop) < 2000, "the stop came after every request was answered"

    got = asyncio.run(_read_every_answer())
    committed, ends = committed_and_end_offsets()
    answered = _answers_by_position(got)
    expected = {(p, o) for p, end in committed.items() for o in range(end)}
    assert got.duplicates == 0
    assert set(answered) == expected, "answered records differ from the committed ones"
    assert set(ends) == set(range(PARTITIONS))


def test_down_removes_everything(project: ComposeProject) -> None:
    """`down -v` leaves no container, network or volume of the project behind."""
    project.down()
    assert project.leftovers() == {"containers": [], "networks": [], "volumes": []}
