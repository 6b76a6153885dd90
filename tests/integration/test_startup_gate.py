"""The first minutes: an ordinary mistake of configuration or environment ends in one line.

Each test runs ``python -m worker run`` as a process against real servers (the session's
Kafka and Triton, and the secure Kafka with SASL_SSL and ACLs), on the client that
WORKER_TEST_KAFKA_CLIENT names, and checks its exit code, that its output is one error
line besides its JSON log lines (no traceback, no raw librdkafka line, no warning about
an unclosed client), and that it ended within a bound. ``check`` is asked the same
question and must fail the same row, with the same thing to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from devtools.devstack.certs import LocalPki
from devtools.devstack.kafka import KafkaCluster
from devtools.devstack.process import free_port
from tests.support import (
    KafkaUnderTest,
    Topics,
    TritonUnderTest,
    create,
    run_to_exit,
    settings_for,
    spawn_worker,
    wait_exit,
    wait_logged,
    worker_env,
)
from tests.support.acls import ALICE_PASSWORD, CAROL_PASSWORD, Grant, grant, revoke, sasl_settings
from worker.app import Worker
from worker.checks.report import kafka_checks
from worker.checks.rows import CheckResult
from worker.errors import CannotRun

pytestmark = pytest.mark.timeout(180)

#: Bound on a refused start: the gate asks once, and the worker exits.
REFUSAL_BOUND_S = 30.0
#: WORKER_KAFKA_STARTUP_TIMEOUT_S of the tests where Kafka cannot be reached.
STARTUP_WAIT_S = 3.0
#: Bound on a worker's end once the broker refuses it its group while it runs: a
#: heartbeat (aiokafka), or the rejoin after the session timeout (librdkafka), refused.
RUNNING_REFUSAL_BOUND_S = 40.0
SESSION_TIMEOUT_MS = 6000
#: Each librdkafka refusal is repeated this often: enough to catch an exit that races the
#: client's threads again (seen at 1 in 50 to 150 starts), few enough to take seconds.
_REPEATS = 7


async def _refused(env: dict[str, str], tmp_path: Path, bound_s: float = REFUSAL_BOUND_S) -> Any:
    return await asyncio.to_thread(run_to_exit, env, tmp_path / "worker.log", bound_s)


def _failed(rows: list[CheckResult]) -> dict[str, str]:
    return {row.check: f"{row.detail} ({row.fix})" for row in rows if row.outcome == "fail"}


def _carol_grants(topics: Topics) -> list[Grant]:
    """What the worker needs: Read on its input topic and group, Write on its outputs."""
    return [
        ("TOPIC", topics.input, "READ"),
        ("TOPIC", topics.output, "WRITE"),
        ("TOPIC", topics.dlq, "WRITE"),
        ("GROUP", topics.group, "READ"),
    ]


# -- topics --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("missing", "row", "setting"),
    [
        ("input", "input topic", "WORKER_INPUT_TOPICS"),
        ("output", "output topic", "WORKER_OUTPUT_TOPIC"),
    ],
)
async def test_missing_topic_is_refused_at_start(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    unique: str,
    tmp_path: Path,
    missing: str,
    row: str,
    setting: str,
) -> None:
    """A topic not created (auto-creation is off): exit 2, one line naming it and its setting."""
    topics = Topics.fresh(unique)
    absent = getattr(topics, missing)
    await kafka.create_topics([t for t in (topics.input, topics.output, topics.dlq) if t != absent])

    exited = await _refused(worker_env(kafka, triton, topics), tmp_path)

    assert exited.code == 2, exited.lines[-20:]
    line = exited.error_line()
    assert f"{row} {absent}: does not exist (create it, or correct {setting})" in line
    rows = await kafka_checks(settings_for(kafka, triton, topics), 10.0)
    assert _failed(rows) == {f"{row} {absent}": f"does not exist (create it, or correct {setting})"}


# -- Kafka not reachable -------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "reason"),
    [("closed port", "connection refused"), ("unresolvable host", "host name not resolved")],
)
async def test_unreachable_kafka_exits_5_after_the_bounded_wait(
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    unique: str,
    tmp_path: Path,
    case: str,
    reason: str,
) -> None:
    """Nothing answers at the bootstrap address: tried again for the bounded wait, then exit 5
    and one line naming the address and the setting."""
    address = f"127.0.0.1:{free_port()}" if case == "closed port" else "kafka.invalid:9092"
    topics = Topics.fresh(unique)
    extra = {"bootstrap_servers": address, "kafka_startup_timeout_s": str(STARTUP_WAIT_S)}

    exited = await _refused(worker_env(kafka, triton, topics, **extra), tmp_path)

    assert exited.code == 5, exited.lines[-20:]
    line = exited.error_line()
    assert f"Kafka at {address} not reachable within {STARTUP_WAIT_S:g} s ({reason})" in line
    assert "check WORKER_BOOTSTRAP_SERVERS" in line
    assert "kafka_not_answering" in exited.events()  # it waited, and said so once
    rows = await kafka_checks(settings_for(kafka, triton, topics, **extra), STARTUP_WAIT_S)
    assert f"not reachable within {STARTUP_WAIT_S:g} s ({reason})" in rows[0].detail


# -- the security protocol against the listener's ---------------------------------------


@pytest.mark.parametrize(
    ("case", "listener", "protocol", "expected"),
    [
        ("SASL over TLS to a plaintext listener", "PLAINTEXT", "SASL_SSL", "PLAINTEXT"),
        ("SASL to a plaintext listener", "PLAINTEXT", "SASL_PLAINTEXT", "PLAINTEXT"),
        ("TLS to a plaintext listener", "PLAINTEXT", "SSL", "PLAINTEXT"),
        ("plaintext to a SASL_SSL listener", "SASL_SSL", "PLAINTEXT", "SASL_SSL"),
    ],
)
async def test_security_protocol_the_listener_does_not_speak(
    secure_kafka: KafkaCluster,
    triton: TritonUnderTest,
    pki: LocalPki,
    unique: str,
    tmp_path: Path,
    case: str,
    listener: str,
    protocol: str,
    expected: str,
) -> None:
    """The client's security protocol is not the listener's: exit 2 and one line naming
    WORKER_SECURITY_PROTOCOL and what the listener speaks."""
    topics = Topics.fresh(unique)
    await create(secure_kafka, topics)
    extra = sasl_settings(secure_kafka, pki, "alice")
    extra["security_protocol"] = protocol
    if listener == "PLAINTEXT":
        extra["bootstrap_servers"] = secure_kafka.bootstrap_servers
    if not protocol.startswith("SASL_"):
        for name in ("sasl_mechanism", "sasl_username", "sasl_password"):
            del extra[name]
    if protocol not in ("SSL", "SASL_SSL"):
        del extra["ssl_cafile"]

    exited = await _refused(worker_env(secure_kafka, triton, topics, **extra), tmp_path)

    assert exited.code == 2, f"{case}: {exited.lines[-20:]}"
    line = exited.error_line()
    assert f"is a {expected} listener" in line, case
    assert f"WORKER_SECURITY_PROTOCOL is {protocol}: set WORKER_SECURITY_PROTOCOL to" in line
    assert ALICE_PASSWORD not in "\n".join(exited.lines)
    rows = await kafka_checks(settings_for(secure_kafka, triton, topics, **extra), 10.0)
    assert rows[0].outcome == "fail" and f"is a {expected} listener" in rows[0].detail, case


# -- ACLs ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("withheld", "row", "expected"),
    [
        ("group", "consumer group", "no read permission on the group: cannot join it"),
        ("output", "output topic", "1 partitions, but no write permission"),
        ("dlq", "dead-letter topic", "1 partitions, but no write permission"),
    ],
)
async def test_permission_the_worker_lacks_is_refused_at_start(
    secure_kafka: KafkaCluster,
    triton: TritonUnderTest,
    pki: LocalPki,
    unique: str,
    tmp_path: Path,
    withheld: str,
    row: str,
    expected: str,
) -> None:
    """carol may Describe but not Read the group, or not Write an output: exit 2 at start
    and one line saying which grant is missing, before any record is taken."""
    topics = Topics.fresh(unique)
    await create(secure_kafka, topics)
    name = getattr(topics, withheld)
    operation = "READ" if withheld == "group" else "WRITE"
    kind = "GROUP" if withheld == "group" else "TOPIC"
    grants = [g for g in _carol_grants(topics) if g[1] != name] + [(kind, name, "DESCRIBE")]
    await asyncio.to_thread(grant, secure_kafka, "carol", grants)
    extra = sasl_settings(secure_kafka, pki, "carol")

    exited = await _refused(worker_env(secure_kafka, triton, topics, **extra), tmp_path)

    assert exited.code == 2, exited.lines[-20:]
    line = exited.error_line()
    fix = f"grant user 'carol' {operation.title()} on it"
    assert f"{row} {name}: {expected} ({fix})" in line
    assert CAROL_PASSWORD not in "\n".join(exited.lines)
    rows = await kafka_checks(settings_for(secure_kafka, triton, topics, **extra), 10.0)
    assert _failed(rows) == {f"{row} {name}": f"{expected} ({fix})"}


async def test_group_refused_while_running_ends_the_worker(
    secure_kafka: KafkaCluster, triton: TritonUnderTest, pki: LocalPki, unique: str, tmp_path: Path
) -> None:
    """The group's Read ACL is withdrawn from a running worker: it ends with one line and
    exit 2 instead of trying to join forever."""
    topics = Topics.fresh(unique)
    await create(secure_kafka, topics)
    grants = _carol_grants(topics)
    await asyncio.to_thread(grant, secure_kafka, "carol", grants)
    extra = {
        **sasl_settings(secure_kafka, pki, "carol"),
        "session_timeout_ms": str(SESSION_TIMEOUT_MS),
    }
    log_path = tmp_path / "worker.log"
    process = spawn_worker(worker_env(secure_kafka, triton, topics, **extra), log_path)
    try:
        await wait_logged(process, log_path, "partitions_assigned")  # a member of the group
    except BaseException:
        process.kill()
        process.wait()
        raise
    await asyncio.to_thread(revoke, secure_kafka, "carol", [("GROUP", topics.group, "READ")])
    withdrawn = time.monotonic()

    exited = await asyncio.to_thread(
        wait_exit, process, log_path, RUNNING_REFUSAL_BOUND_S, withdrawn
    )

    assert exited.code == 2, exited.lines[-20:]
    line = exited.error_line()
    assert f"Kafka refused consumer group {topics.group!r} to the worker" in line
    assert "grant its principal Describe and Read on the group" in line


# -- librdkafka's clients at exit ---------------------------------------------------------


def _librdkafka_threads() -> set[int]:
    """The ids of this process's librdkafka threads (librdkafka names them ``rdk:...``)."""
    found = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if (task / "comm").read_text().startswith("rdk:"):
                found.add(int(task.name))
    return found


def _refusals(kafka: KafkaCluster, pki: LocalPki) -> dict[str, tuple[dict[str, str], str]]:
    """Settings the secure Kafka refuses at start-up, each with what its line says."""
    alice = sasl_settings(kafka, pki, "alice")
    return {
        "wrong password": ({**alice, "sasl_password": "not-the-password"}, "authentication"),
        "untrusted CA": ({**alice, "ssl_cafile": str(pki.other_ca_cert)}, "not trusted"),
        "missing ACL": (sasl_settings(kafka, pki, "bob"), "not authorized to describe it"),
    }


async def test_a_refused_start_leaves_no_librdkafka_client_behind(
    secure_kafka: KafkaCluster, triton: TritonUnderTest, pki: LocalPki, unique: str
) -> None:
    """A wrong password refused by the start-up gate on librdkafka: once the worker's run has
    ended, none of its librdkafka clients' threads is left (the admin client's went on
    retrying the handshake while the process exited, which crashed it now and then)."""
    topics = Topics.fresh(unique)
    extra, expected = _refusals(secure_kafka, pki)["wrong password"]
    settings = settings_for(secure_kafka, triton, topics, kafka_client="confluent", **extra)
    before = _librdkafka_threads()

    with pytest.raises(CannotRun, match=expected):
        await Worker(settings).run()

    assert _librdkafka_threads() <= before


async def test_refused_starts_on_librdkafka_exit_with_their_code_every_time(
    secure_kafka: KafkaCluster, triton: TritonUnderTest, pki: LocalPki, unique: str, tmp_path: Path
) -> None:
    """21 starts refused on librdkafka (wrong password, untrusted CA, missing ACL), four at a
    time: each exits 2 with its one line, none by a signal (1 in 50-150 ended by SIGSEGV)."""
    topics = Topics.fresh(unique)
    await create(secure_kafka, topics)
    cases = list(_refusals(secure_kafka, pki).items()) * _REPEATS
    at_once = asyncio.Semaphore(4)

    async def refused(index: int, extra: dict[str, str]) -> Any:
        env = worker_env(secure_kafka, triton, topics, kafka_client="confluent", **extra)
        async with at_once:
            log_path = tmp_path / f"worker-{index}.log"
            return await asyncio.to_thread(run_to_exit, env, log_path, REFUSAL_BOUND_S)

    runs = [refused(i, extra) for i, (_, (extra, _)) in enumerate(cases)]
    exits = await asyncio.gather(*runs)

    codes = [exited.code for exited in exits]
    assert codes == [2] * len(cases), codes
    for (case, (_, expected)), exited in zip(cases, exits, strict=True):
        assert expected in exited.error_line(), case
