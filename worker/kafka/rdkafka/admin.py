"""The broker questions of ``check``, the start-up gate and the commands on librdkafka's
admin API (``WORKER_KAFKA_CLIENT=confluent``): the worker's own TLS and SASL configuration
asks them (``worker.kafka.admin.Admin``).

The answers take the shapes of the aiokafka path's (``worker/kafka/aiokafka/admin.py``):
the cluster and each topic with its error code and the operations this principal may
perform as a bit field (``AclOperation`` codes are Kafka's), and the group with its
error code, state, members and operations. Topics are described, never created.

librdkafka reports a refused TLS handshake or SASL authentication, and every broker
being down, through its error callback (served by ``poll``), not through the request,
which waits for a broker until it times out: a call ends as soon as one is reported,
``refusal`` holding a refused handshake (a configuration error) and ``no_answer`` the
first report of a broker that could not be asked (down, or another security protocol);
the calls raise them as ``Refused`` and ``Unanswered``.

``close`` destroys the client before it returns: its librdkafka threads go on retrying a
refused handshake otherwise, until the process exit frees what they use under them.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from aiokafka.errors import for_code
from confluent_kafka import KafkaError, KafkaException, TopicCollection
from confluent_kafka.admin import AdminClient, NewTopic

from worker.flow.bounded import CLOSE_TIMEOUT_S
from worker.flow.retry import Backoff
from worker.kafka.admin import Refused, Unanswered, who
from worker.kafka.rdkafka import config as rdkafka_config
from worker.kafka.rdkafka import log as rdkafka_log
from worker.kafka.rdkafka.threads import in_thread, teardown
from worker.settings import KafkaAuthSettings, KafkaSettings

__all__ = ["NOT_REPORTED", "RdAdmin", "refusal_message"]

#: The operations field's value when the broker did not report them (as on the wire).
NOT_REPORTED = -(2**31)
#: librdkafka's codes of a refused handshake: authentication, TLS.
_REFUSALS = (KafkaError._AUTHENTICATION, KafkaError._SSL)
#: Codes of a broker that could not be asked (refused, unresolved, closed the connection).
_UNANSWERED = (KafkaError._TRANSPORT, KafkaError._RESOLVE)
#: How long one poll for the error callback waits.
_POLL_S = 0.05
#: Waits between tries of a group lookup answered with a retriable error.
_RETRY = Backoff(first_s=0.1, max_s=1.0)


def _bits(operations: Sequence[Any] | None) -> int:
    if not operations:
        return NOT_REPORTED
    return sum(1 << int(op.value) for op in operations)


def _code(exc: BaseException) -> int:
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return int(exc.args[0].code())
    raise exc


def refusal_message(error: KafkaError, where: str, who: str, mechanism: str | None) -> str:
    """One line for a refused handshake, naming the setting to look at."""
    text = error.str().split(" (after ", 1)[0]
    if error.code() == KafkaError._SSL:
        if "certificate verify failed" in text:
            return f"{where}: TLS certificate not trusted ({text}); check WORKER_SSL_CAFILE"
        return f"{where}: TLS handshake failed ({text}); check the WORKER_SSL_* files"
    return f"{where}: SASL {mechanism} authentication failed for {who}: {text}"


class RdAdmin:
    """One librdkafka admin client with the worker's settings (``Admin``); ``close`` when
    done."""

    @classmethod
    async def open(cls, kafka: KafkaSettings, auth: KafkaAuthSettings, timeout_s: float) -> RdAdmin:
        """The client (a broker is reached by its first call; ConfigError for a TLS file
        librdkafka cannot load)."""
        return cls(kafka, auth, timeout_s)

    def __init__(self, kafka: KafkaSettings, auth: KafkaAuthSettings, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._auth = auth
        self.where = f"Kafka {kafka.bootstrap_servers}"
        self.refusal: KafkaError | None = None
        self.no_answer: KafkaError | None = None
        self._all_down = False
        #: Held by a poll and by the destruction: the client is never destroyed mid-poll.
        self._lock = threading.Lock()

        def on_error(error: KafkaError) -> None:  # called from poll(), on a thread
            code = error.code()
            if code in _REFUSALS and self.refusal is None:
                self.refusal = error
            elif code in _UNANSWERED and self.no_answer is None:
                self.no_answer = error
            elif code == KafkaError._ALL_BROKERS_DOWN:
                # Not on one broker's failure: another bootstrap server may still answer.
                self._all_down = True

        config = {
            "bootstrap.servers": kafka.bootstrap_servers,
            "client.id": f"{kafka.client_id}-admin",
            "socket.timeout.ms": int(timeout_s * 1000),
            **rdkafka_config.security_config(auth),
            "logger": rdkafka_log.RdLogger(),
            "error_cb": on_error,
        }
        try:
            self._admin = AdminClient(config)
        except KafkaException as exc:  # a TLS file librdkafka cannot load
            raise rdkafka_config.config_refused(exc.args[0].str()) from None

    async def _result(self, future: Future[Any]) -> Any:
        """The admin call's result (KafkaException with its error); Refused with the first
        refusal, Unanswered once every broker is down or the call timed out, as librdkafka
        reports them meanwhile (its error callback is served by ``poll``)."""
        call = asyncio.wrap_future(future)
        try:
            while not call.done():
                await in_thread(self._poll)
                if not call.done() and (self.refusal is not None or self._all_down):
                    self._interrupted(None)
            try:
                return call.result()
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if isinstance(error, KafkaError) and error.code() == KafkaError._TIMED_OUT:
                    self._interrupted(error)
                raise
        finally:
            # Abandoned (interrupted, or the caller's timeout): librdkafka's later answer
            # is dropped rather than left unretrieved.
            call.cancel()

    def _interrupted(self, error: KafkaError | None) -> None:
        """Raise what ended a call early: a refused handshake, or no broker answering."""
        if self.refusal is not None:
            mechanism = self._auth.sasl_mechanism
            raise Refused(refusal_message(self.refusal, self.where, who(self._auth), mechanism))
        reported = self.no_answer or error or KafkaError(KafkaError._ALL_BROKERS_DOWN)
        raise Unanswered(reported.str().split(" (after ", 1)[0])

    async def create_topics(
        self, names: Sequence[str], *, partitions: int, replication: int
    ) -> list[tuple[str, int, str | None]]:
        """Create the topics; per topic (name, error code, message)."""
        futures = self._admin.create_topics(
            [NewTopic(name, partitions, replication) for name in names],
            request_timeout=self._timeout_s,
        )
        answers: list[tuple[str, int, str | None]] = []
        for name in names:
            try:
                await self._result(futures[name])
            except KafkaException as exc:
                error = exc.args[0]
                answers.append((name, _code(exc), error.str() if error else None))
                continue
            answers.append((name, 0, None))
        return answers

    async def describe_topics(self, topics: Sequence[str]) -> dict[str, Any]:
        """Brokers, cluster id, and each topic's error code, partitions and operations."""
        try:
            cluster = await self._result(
                self._admin.describe_cluster(request_timeout=self._timeout_s)
            )
        except KafkaException as exc:
            raise Unanswered(str(exc.args[0].str() if exc.args else exc)) from None
        names = sorted(set(topics))
        futures = self._admin.describe_topics(
            TopicCollection(names),
            include_authorized_operations=True,
            request_timeout=self._timeout_s,
        )
        described = []
        for name in names:
            try:
                topic = await self._result(futures[name])
            except KafkaException as exc:
                described.append({"topic": name, "error_code": _code(exc), "partitions": []})
                continue
            described.append(
                {
                    "topic": name,
                    "error_code": 0,
                    "partitions": [
                        {"partition": p.id, "leader": p.leader.id if p.leader else -1}
                        for p in topic.partitions
                    ],
                    "topic_authorized_operations": _bits(topic.authorized_operations),
                }
            )
        return {
            "brokers": [{"node_id": n.id, "host": n.host, "port": n.port} for n in cluster.nodes],
            "cluster_id": cluster.cluster_id,
            "topics": described,
        }

    async def describe_group(self, group_id: str) -> dict[str, Any]:
        """The group's error code, protocol type, state, members and operations."""
        # A fresh cluster answers "coordinator loading" while it creates the offsets
        # topic: retriable errors are tried again (the caller bounds the total time).
        failures = 0
        while True:
            futures = self._admin.describe_consumer_groups(
                [group_id], include_authorized_operations=True, request_timeout=self._timeout_s
            )
            try:
                group = await self._result(futures[group_id])
                break
            except KafkaException as exc:
                code = _code(exc)
                # Kafka's own retriable flag per code (librdkafka's flag is not set on these).
                if code <= 0 or not for_code(code).retriable:
                    return {"error_code": code, "members": []}
            failures += 1
            await asyncio.sleep(_RETRY.delay_s(failures))
        return {
            "error_code": 0,
            # librdkafka says only whether the group is a simple one (no protocol type).
            "protocol_type": "" if group.is_simple_consumer_group else "consumer",
            "state": group.state.name.title() if group.state is not None else "Dead",
            "members": list(group.members),
            "authorized_operations": _bits(group.authorized_operations),
        }

    def _poll(self) -> None:
        with self._lock:
            if self._admin is not None:
                self._admin.poll(_POLL_S)

    def _destroy(self) -> None:
        with self._lock:
            # The last reference (librdkafka's admin client has no close): its destruction
            # joins the client's threads, here rather than whenever the collector gets to it.
            self._admin = None  # type: ignore[assignment]

    async def close(self) -> None:
        """Destroy the client; its librdkafka threads have ended when this returns (bounded)."""
        await teardown(self._destroy, "admin", CLOSE_TIMEOUT_S)
