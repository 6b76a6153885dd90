"""A second Kafka with a SASL_SSL listener and ACLs, shared by the modules that need one.

Started the first time a test asks for it, once per session: one node with a PLAINTEXT
listener (whose ANONYMOUS principal is a super user, for admin calls) and a SASL_SSL
listener with SCRAM users (``tests.support.acls``): alice (super user), bob (no ACL,
ever) and carol (no ACL until a test grants some, on that test's own topics and group).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from devtools.devstack.certs import LocalPki, make_pki
from devtools.devstack.kafka import KafkaCluster, KafkaSecurity, ensure_kafka_jars
from tests.support.acls import PASSWORDS


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> LocalPki:
    """A CA, a server certificate for 127.0.0.1, a client certificate, an unrelated CA."""
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def secure_kafka(pki: LocalPki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KafkaCluster]:
    """One Kafka node with a SASL_SSL listener: alice (super user), bob and carol."""
    security = KafkaSecurity(
        keystore_pem=pki.server.bundle,
        truststore_pem=pki.ca_cert,
        scram_users=PASSWORDS,
        super_users=("alice",),
    )
    cluster = KafkaCluster(
        ensure_kafka_jars(log=lambda _: None),
        tmp_path_factory.mktemp("secure-kafka"),
        security=security,
    )
    cluster.start()
    yield cluster
    cluster.stop()
