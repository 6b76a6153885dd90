"""``topics``, ``produce``, ``tail`` and ``replay`` over SASL_SSL, set by the worker's own
variables, on the Kafka client under test.

A Kafka node of this module's own has a SASL_SSL listener with a SCRAM user; the
commands reach it with ``WORKER_SECURITY_PROTOCOL``, ``WORKER_SASL_*`` and
``WORKER_SSL_CAFILE``, as ``run`` does; refused credentials end in one line, exit 2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.devstack.certs import LocalPki, make_pki
from devtools.devstack.kafka import KafkaCluster, KafkaSecurity, ensure_kafka_jars
from tests.integration.test_commands import REQUEST, worker_command
from worker.errors import ExitCode

pytestmark = pytest.mark.timeout(180)

PASSWORD = "carol-Secret-3a9"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    """A CA and a server certificate for 127.0.0.1 (and an unrelated CA)."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def sasl_kafka(pki: LocalPki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """One Kafka node with a SASL_SSL listener and one SCRAM user, carol (super user)."""
    security = KafkaSecurity(
        keystore_pem=pki.server.bundle,
        truststore_pem=pki.ca_cert,
        scram_users={"carol": PASSWORD},
        super_users=("carol",),
    )
    cluster = KafkaCluster(ensure_kafka_jars(), tmp_path_factory.mktemp("kafka"), security=security)
    cluster.start()
    yield cluster
    cluster.stop()


def _env(kafka: KafkaCluster, ca: Path, password: str, unique: str) -> dict[str, str]:
    return {
        "WORKER_BOOTSTRAP_SERVERS": kafka.sasl_bootstrap_servers,
        "WORKER_SECURITY_PROTOCOL": "SASL_SSL",
        "WORKER_SASL_MECHANISM": "SCRAM-SHA-512",
        "WORKER_SASL_USERNAME": "carol",
        "WORKER_SASL_PASSWORD": password,
        "WORKER_SSL_CAFILE": str(ca),
        "WORKER_INPUT_TOPICS": f"in-{unique}",
        "WORKER_OUTPUT_TOPIC": f"out-{unique}",
        "WORKER_DLQ_TOPIC": f"dlq-{unique}",
    }


def test_topics_produce_tail_and_replay_over_sasl_ssl(
    sasl_kafka: KafkaCluster, pki: LocalPki, unique: str
) -> None:
    """Topics created, a request produced, then read back by tail and by a dry-run replay
    (which finds no source topic on it), all authenticated as carol."""
    env = _env(sasl_kafka, pki.ca_cert, PASSWORD, unique)
    created = worker_command(env, "topics", "--partitions", "1")
    assert created.returncode == 0, created.stderr
    sent = worker_command(env, "produce", "--file", "-", stdin=json.dumps(REQUEST))
    assert sent.returncode == 0, sent.stderr
    read = worker_command(
        env | {"WORKER_DLQ_TOPIC": f"in-{unique}"},
        "tail",
        "dead-letters",
        "--wait",
        "30",
        "-n",
        "1",
    )
    assert read.returncode == 0, read.stderr
    assert json.loads(read.stdout)["value"] == REQUEST
    planned = worker_command(env | {"WORKER_DLQ_TOPIC": f"in-{unique}"}, "replay", "--dry-run")
    assert planned.returncode == 0, planned.stderr
    assert "would not send 1: no x-source-topic" in planned.stdout


_PRODUCE = ("produce", "--file", "-", "--topic", "any")
_SASL_REFUSED = "authentication failed for user 'carol'"


@pytest.mark.parametrize(
    ("case", "password", "ca", "says", "command"),
    [
        ("wrong password", "not-the-password", "ca", _SASL_REFUSED, _PRODUCE),
        ("untrusted CA", PASSWORD, "other", "certificate not trusted", _PRODUCE),
        ("replay, wrong password", "not-the-password", "ca", _SASL_REFUSED, ("replay",)),
    ],
    ids=["wrong-password", "untrusted-ca", "replay-wrong-password"],
)
def test_refused_credentials_end_in_one_line_and_exit_2(
    sasl_kafka: KafkaCluster,
    pki: LocalPki,
    unique: str,
    case: str,
    password: str,
    ca: str,
    says: str,
    command: tuple[str, ...],
) -> None:
    """A wrong password or an untrusted CA: `produce` (or `replay`) says so in one line, no
    secret, exit 2."""
    env = _env(sasl_kafka, pki.ca_cert if ca == "ca" else pki.other_ca_cert, password, unique)
    done = worker_command(env, *command, stdin=json.dumps(REQUEST))
    assert done.returncode == ExitCode.CONFIG, f"{case}: {done.stderr}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], f"{case}: {done.stderr}"
    assert password not in done.stderr
