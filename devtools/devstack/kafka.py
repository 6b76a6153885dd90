"""A real Apache Kafka broker (KRaft) as local processes: one node or a cluster.

The jars of ``org.apache.kafka:kafka_2.13`` are resolved from Maven Central by
Maven once, into the devstack cache, and reused by later runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.structs import TopicPartition

from devtools.devstack.paths import cache_dir
from devtools.devstack.process import ManagedProcess, StartupError, free_port, stop_all

KAFKA_VERSION = "4.4.0"
LOG4J_VERSION = "2.24.3"
_HERE = Path(__file__).resolve().parent
_T = TypeVar("_T")


def run_sync(factory: Callable[[], Coroutine[Any, Any, _T]]) -> _T:
    """Run a coroutine to completion from sync code, even inside a running loop.

    Inside a loop (an async test calling a sync helper) it runs on a thread of
    its own, so the caller's loop is never re-entered.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(factory())
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="devstack-sync")
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def java_binary() -> str:
    """The ``java`` of ``JAVA_HOME`` if set, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise StartupError("java not found: install Java 17+ or set JAVA_HOME")
    return found


def ensure_kafka_jars(log: Callable[[str], None] = print) -> Path:
    """Resolve the broker's jars with Maven into the cache (once); return the folder."""
    target = cache_dir() / f"kafka-{KAFKA_VERSION}" / "jars"
    if (target / f"kafka_2.13-{KAFKA_VERSION}.jar").exists():
        return target
    mvn = shutil.which("mvn")
    if mvn is None:
        raise StartupError("mvn not found: Maven is needed once to fetch the Kafka jars")
    log(f"fetching Apache Kafka {KAFKA_VERSION} jars from Maven Central (once)...")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        pom = Path(tmp) / "pom.xml"
        pom.write_text(
            (_HERE / "kafka-pom.xml")
            .read_text()
            .replace("@KAFKA_VERSION@", KAFKA_VERSION)
            .replace("@LOG4J_VERSION@", LOG4J_VERSION)
        )
        staging = Path(tmp) / "jars"
        cmd = [
            mvn,
            "-B",
            "-q",
            "-f",
            str(pom),
            "org.apache.maven.plugins:maven-dependency-plugin:3.6.1:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={staging}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise StartupError(f"maven could not fetch the Kafka jars:\n{done.stdout[-3000:]}")
        # Rename into place only when complete, so an interrupted fetch is retried.
        staging.rename(target)
    return target


class KafkaAdmin:
    """Admin helpers over ``bootstrap_servers`` (async; the tests and the demo call them)."""

    @property
    def bootstrap_servers(self) -> str:
        raise NotImplementedError

    #: Replication factor for new topics.
    default_replication: int = 1

    async def create_topics(
        self,
        names: Sequence[str],
        partitions: int = 1,
        replication: int | None = None,
        configs: Mapping[str, str] | None = None,
    ) -> None:
        """Create topics (with topic-level ``configs``); wait until every partition has a leader."""
        rf = replication or self.default_replication
        new = [NewTopic(n, partitions, rf, topic_configs=dict(configs or {})) for n in names]
        await _with_admin(self.bootstrap_servers, lambda a: a.create_topics(new))
        await self.wait_for_leaders(names)

    async def wait_for_leaders(self, names: Sequence[str], timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            meta = await self.describe_topics(names)
            if all(p["leader"] >= 0 for t in meta for p in t["partitions"]) and len(meta) == len(
                names
            ):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"topics {list(names)} have no leader after {timeout_s}s")
            await asyncio.sleep(0.1)

    async def describe_topics(self, names: Sequence[str]) -> list[dict[str, Any]]:
        topics: list[dict[str, Any]] = await _with_admin(
            self.bootstrap_servers, lambda a: a.describe_topics(list(names))
        )
        return [t for t in topics if t.get("error_code", 0) == 0]

    async def leader(self, topic: str, partition: int, timeout_s: float = 30.0) -> int:
        """Node id of the partition's leader, waited for up to ``timeout_s`` (-1 when none by then).

        Each call may be answered by a different broker, and brokers learn of a
        leader at slightly different moments: one that has not yet heard of a new
        topic's leader (or of a moved one) answers "none" for a moment.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            for item in await self.describe_topics([topic]):
                for p in item["partitions"]:
                    if p["partition"] == partition and p["leader"] >= 0:
                        return int(p["leader"])
            if time.monotonic() > deadline:
                return -1
            await asyncio.sleep(0.1)

    async def committed_offsets(self, group_id: str) -> dict[TopicPartition, int]:
        """Committed offset of each partition for a consumer group."""
        offsets = await _with_admin(
            self.bootstrap_servers, lambda a: a.list_consumer_group_offsets(group_id)
        )
        return {tp: meta.offset for tp, meta in offsets.items()}


@dataclass(frozen=True)
class KafkaSecurity:
    """A SASL_SSL listener (SCRAM users, PEM certificates) beside the PLAINTEXT one, with ACLs.

    The PLAINTEXT listener stays for admin and inter-broker use; its principal
    (ANONYMOUS) and ``super_users`` bypass ACLs. Every other user needs ACLs,
    and none are granted: a user outside ``super_users`` is refused every topic.
    """

    keystore_pem: Path  # the broker's PKCS#8 private key then its certificate, one file
    truststore_pem: Path  # CA certificates the broker trusts (for client certificates)
    scram_users: Mapping[str, str]  # user name -> password, SCRAM-SHA-256 and -512
    super_users: tuple[str, ...] = ()
    client_auth: str = "none"  # "required": clients must present a certificate too

    def properties(self) -> dict[str, str]:
        """The broker settings this adds."""
        jaas = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        supers = ";".join(f"User:{name}" for name in ("ANONYMOUS", *self.super_users))
        return {
            "sasl.enabled.mechanisms": "SCRAM-SHA-256,SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config": jaas,
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": jaas,
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(self.keystore_pem),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(self.truststore_pem),
            "ssl.client.auth": self.client_auth,
            "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
            "allow.everyone.if.no.acl.found": "false",
            "super.users": supers,
        }

    def scram_format_args(self) -> list[str]:
        """``--add-scram`` arguments of ``StorageTool format`` for every user."""
        args: list[str] = []
        for name, password in self.scram_users.items():
            for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
                args += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
        return args


@dataclass
class KafkaNode:
    """One KRaft node acting as both broker and controller."""

    node_id: int
    broker_port: int
    controller_port: int
    workdir: Path
    security: KafkaSecurity | None = None
    sasl_port: int = 0

    @property
    def sasl_address(self) -> str:
        """``host:port`` of the SASL_SSL listener (with ``security`` only)."""
        return f"127.0.0.1:{self.sasl_port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.broker_port}"

    @property
    def data_dir(self) -> Path:
        return self.workdir / f"node-{self.node_id}" / "data"

    @property
    def config_path(self) -> Path:
        return self.workdir / f"node-{self.node_id}" / "server.properties"

    @property
    def log_path(self) -> Path:
        return self.workdir / f"node-{self.node_id}" / "server.log"

    def properties(self, voters: str, cluster_size: int) -> str:
        """The node's ``server.properties``."""
        replicas = min(3, cluster_size)
        lines = {
            "process.roles": "broker,controller",
            "node.id": str(self.node_id),
            "controller.quorum.voters": voters,
            "listeners": (
                f"PLAINTEXT://127.0.0.1:{self.broker_port},"
                f"CONTROLLER://127.0.0.1:{self.controller_port}"
            ),
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.broker_port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.data_dir),
            "num.partitions": "1",
            "default.replication.factor": str(replicas),
            "min.insync.replicas": "1",
            "auto.create.topics.enable": "false",
            "offsets.topic.replication.factor": str(replicas),
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": str(replicas),
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": str(replicas),
            "group.initial.rebalance.delay.ms": "0",
            # The default 128 MiB dedupe buffer is allocated eagerly; 1 MiB per
            # cleaner thread is the floor.
            "log.cleaner.dedupe.buffer.size": str(4 * 1024 * 1024),
            "num.network.threads": "2",
            "num.io.threads": "2",
        }
        if self.security is not None:
            lines["listeners"] += f",SASL_SSL://127.0.0.1:{self.sasl_port}"
            lines["advertised.listeners"] += f",SASL_SSL://127.0.0.1:{self.sasl_port}"
            lines["listener.security.protocol.map"] += ",SASL_SSL:SASL_SSL"
            lines.update(self.security.properties())
        return "".join(f"{key}={value}\n" for key, value in lines.items())

    def process(self, jars: Path) -> ManagedProcess:
        argv = [
            java_binary(),
            "-Xmx384m",
            "-Xms64m",
            "-XX:+UseSerialGC",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={_HERE / 'kafka-log4j2.xml'}",
            "-cp",
            f"{jars}/*",
            "kafka.Kafka",
            str(self.config_path),
        ]
        return ManagedProcess(f"kafka-{self.node_id}", argv, self.log_path)


class KafkaCluster(KafkaAdmin):
    """``nodes`` KRaft nodes on 127.0.0.1 with free ports and data in ``workdir``."""

    def __init__(
        self, jars: Path, workdir: Path, nodes: int = 1, security: KafkaSecurity | None = None
    ) -> None:
        if nodes < 1:
            raise ValueError("a cluster needs at least one node")
        self.jars = jars
        self.workdir = workdir
        self.security = security
        self.nodes = [
            KafkaNode(
                node_id=i + 1,
                broker_port=free_port(),
                controller_port=free_port(),
                workdir=workdir,
                security=security,
                sasl_port=free_port() if security is not None else 0,
            )
            for i in range(nodes)
        ]
        self.cluster_id = ""
        self.default_replication = min(3, nodes)
        self._procs: dict[int, ManagedProcess] = {}

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(node.address for node in self.nodes)

    @property
    def sasl_bootstrap_servers(self) -> str:
        """Bootstrap addresses of the SASL_SSL listeners (a cluster with ``security``)."""
        if self.security is None:
            raise ValueError("this cluster has no SASL_SSL listener")
        return ",".join(node.sasl_address for node in self.nodes)

    def node(self, node_id: int) -> KafkaNode:
        """The node of that id (KeyError otherwise: a StopIteration would hang a caller
        awaiting this from a thread, as a future cannot carry it)."""
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(f"no node {node_id} in this cluster")

    # -- lifecycle -------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> float:
        """Format storage (first time), start every node, wait until all serve; return seconds."""
        started = time.monotonic()
        self._format()
        for node in self.nodes:
            self._spawn(node)
        self._wait_ready(self.nodes, timeout_s)
        return time.monotonic() - started

    def stop(self) -> None:
        """Stop every node: SIGTERM, then SIGKILL after a timeout. Idempotent."""
        stop_all(list(self._procs.values()))

    def stop_node(self, node_id: int, timeout_s: float = 20.0) -> None:
        proc = self._procs.get(node_id)
        if proc is not None:
            proc.stop(timeout_s)

    def kill_node(self, node_id: int) -> None:
        proc = self._procs.get(node_id)
        if proc is not None:
            proc.kill()

    def start_node(self, node_id: int, timeout_s: float = 90.0) -> float:
        """Start a stopped node again (same ports, same data) and wait until it serves."""
        started = time.monotonic()
        node = self.node(node_id)
        self._spawn(node)
        self._wait_ready([node], timeout_s)
        return time.monotonic() - started

    def running_nodes(self) -> list[int]:
        return [nid for nid, proc in self._procs.items() if proc.running()]

    def _format(self) -> None:
        if self.cluster_id:
            return
        java = java_binary()
        cp = f"{self.jars}/*"
        self.cluster_id = (
            subprocess.run(
                [java, "-cp", cp, "kafka.tools.StorageTool", "random-uuid"],
                capture_output=True,
                text=True,
                check=True,
            )
            .stdout.strip()
            .splitlines()[-1]
        )
        voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in self.nodes)
        for node in self.nodes:
            node.data_dir.mkdir(parents=True, exist_ok=True)
            node.config_path.write_text(node.properties(voters, len(self.nodes)))
            done = subprocess.run(
                [
                    java,
                    "-cp",
                    cp,
                    "kafka.tools.StorageTool",
                    "format",
                    "-t",
                    self.cluster_id,
                    "-c",
                    str(node.config_path),
                    *(self.security.scram_format_args() if self.security else []),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                raise StartupError(f"kafka storage format failed:\n{done.stdout}{done.stderr}")

    def _spawn(self, node: KafkaNode) -> None:
        proc = self._procs.get(node.node_id) or node.process(self.jars)
        self._procs[node.node_id] = proc
        proc.start()

    def _wait_ready(self, nodes: Sequence[KafkaNode], timeout_s: float) -> None:
        """Ready means a real Kafka API call answered by each node, and all brokers registered."""
        want = {n.node_id for n in self.nodes if self._procs[n.node_id].running()}
        for node in nodes:

            def probe(node: KafkaNode = node) -> bool:
                brokers = run_sync(lambda: _registered_brokers(node.address))
                return want <= brokers

            self._procs[node.node_id].wait_ready(probe, timeout_s)

    # -- state for `dev up` / `dev down` ----------------------------------

    def to_state(self) -> dict[str, Any]:
        return {
            "jars": str(self.jars),
            "workdir": str(self.workdir),
            "cluster_id": self.cluster_id,
            "nodes": [
                {
                    "node_id": n.node_id,
                    "broker_port": n.broker_port,
                    "controller_port": n.controller_port,
                    "pid": self._procs[n.node_id].pid if n.node_id in self._procs else None,
                }
                for n in self.nodes
            ],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> KafkaCluster:
        cluster = cls.__new__(cls)
        cluster.jars = Path(state["jars"])
        cluster.workdir = Path(state["workdir"])
        cluster.cluster_id = state["cluster_id"]
        cluster.default_replication = min(3, len(state["nodes"]))
        cluster.nodes = []
        cluster._procs = {}
        for item in state["nodes"]:
            node = KafkaNode(
                item["node_id"], item["broker_port"], item["controller_port"], cluster.workdir
            )
            cluster.nodes.append(node)
            proc = node.process(cluster.jars)
            proc.pid = item["pid"]
            cluster._procs[node.node_id] = proc
        return cluster


async def _with_admin(bootstrap: str, call: Callable[[AIOKafkaAdminClient], Awaitable[_T]]) -> _T:
    client = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await client.start()
    try:
        return await call(client)
    finally:
        await client.close()


async def _registered_brokers(address: str) -> set[int]:
    # While a node boots, aiokafka logs every refused connection; the probe expects them.
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        cluster = await _with_admin(address, lambda a: a.describe_cluster())
    finally:
        quiet.setLevel(level)
    return {int(b["node_id"]) for b in cluster["brokers"]}
