"""The secure Kafka's users, and ACLs granted to them for one test's topics and group.

The secure Kafka (``secure_kafka`` in tests/integration/conftest.py) authenticates users
with SCRAM over SASL_SSL and authorizes them with ACLs: alice is a super user, bob has no
ACL ever, carol has those a test grants her (on that test's own topics and group, so
tests never see each other's). ACLs are created and deleted over the PLAINTEXT listener,
whose ANONYMOUS principal is a super user.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from devtools.devstack.certs import LocalPki
from devtools.devstack.kafka import KafkaCluster
from tests.support.servers import KafkaUnderTest

ALICE_PASSWORD = "alice-Secret-7f3"
BOB_PASSWORD = "bob-Secret-91c"
CAROL_PASSWORD = "carol-Secret-2d8"
PASSWORDS = {"alice": ALICE_PASSWORD, "bob": BOB_PASSWORD, "carol": CAROL_PASSWORD}

#: (resource type, name, operation), e.g. ("TOPIC", "req-x", "READ"), ("GROUP", "g", "DESCRIBE").
Grant = tuple[str, str, str]

#: Bound on the broker listing a change of ACLs.
_VISIBLE_S = 30.0


def sasl_settings(kafka: KafkaCluster, pki: LocalPki, user: str) -> dict[str, str]:
    """Settings (for ``worker_env``) of a worker signed in as ``user`` over SASL_SSL."""
    return {
        "bootstrap_servers": kafka.sasl_bootstrap_servers,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_username": user,
        "sasl_password": PASSWORDS[user],
        "ssl_cafile": str(pki.ca_cert),
    }


def _bindings(user: str, grants: Sequence[Grant], *, as_filters: bool = False) -> list[Any]:
    from confluent_kafka.admin import (
        AclBinding,
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    kind_of = AclBindingFilter if as_filters else AclBinding
    return [
        kind_of(
            ResourceType[kind],
            name,
            ResourcePatternType.LITERAL,
            f"User:{user}",
            "*",
            AclOperation[operation],
            AclPermissionType.ALLOW,
        )
        for kind, name, operation in grants
    ]


def _listed(admin: Any, user: str) -> set[Any]:
    from confluent_kafka.admin import (
        AclBindingFilter,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    # None matches any name and any host; confluent_kafka's annotations say str.
    every = AclBindingFilter(
        ResourceType.ANY,
        None,  # type: ignore[arg-type]
        ResourcePatternType.ANY,
        f"User:{user}",
        None,  # type: ignore[arg-type]
        AclOperation.ANY,
        AclPermissionType.ANY,
    )
    return set(admin.describe_acls(every).result(timeout=_VISIBLE_S))


def _wait_listed(admin: Any, user: str, done: Callable[[set[Any]], bool]) -> None:
    deadline = time.monotonic() + _VISIBLE_S
    while not done(_listed(admin, user)):
        assert time.monotonic() < deadline, f"ACLs of {user} not as asked in {_VISIBLE_S} s"
        time.sleep(0.2)  # polling the broker's ACL cache: nothing to await


def grant(kafka: KafkaUnderTest, user: str, grants: Sequence[Grant]) -> None:
    """Allow ``user`` these operations, and wait until the broker lists them."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    bindings = _bindings(user, grants)
    for future in admin.create_acls(bindings).values():
        future.result(timeout=_VISIBLE_S)
    _wait_listed(admin, user, lambda listed: set(bindings) <= listed)


def revoke(kafka: KafkaUnderTest, user: str, grants: Sequence[Grant]) -> None:
    """Take these operations from ``user``, and wait until the broker no longer lists them."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": kafka.bootstrap_servers})
    bindings = _bindings(user, grants)
    for future in admin.delete_acls(_bindings(user, grants, as_filters=True)).values():
        future.result(timeout=_VISIBLE_S)
    _wait_listed(admin, user, lambda listed: not set(bindings) & listed)
