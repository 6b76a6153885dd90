"""``check``: can a worker with these settings run here? Settings, Kafka and Triton, one table.

Nothing is written and no group is joined, so ``check`` is safe against a live system:

- Topics and permissions come from one Metadata request (v8) asking for the
  operations the client may perform on each topic: READ on the input topics,
  WRITE on the output and dead-letter topics. Producing a test record would put
  it in front of real consumers; a transaction aborted afterwards is still
  visible to ``read_uncommitted`` consumers. The request also refuses to create
  topics, which a plain metadata request would do on a broker with
  ``auto.create.topics.enable``.
- The group is described (DescribeGroups with authorized operations: READ is what
  joining needs), not joined: a throwaway member would rebalance every running worker.
- Triton: server ready, then every model the worker is told about
  (``WORKER_DEFAULT_MODEL`` and the models named in ``WORKER_MODEL_ALLOWLIST``)
  ready, with metadata the worker's request validation can use.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError, for_code
from aiokafka.protocol.admin import DescribeGroupsResponse_v3
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String
from rich.console import Console
from rich.table import Table

from worker.errors import ExitCode
from worker.kafka.options import kafka_client_kwargs
from worker.settings import ConfigError, Settings, add_run_arguments, load_settings
from worker.triton.auth import TritonAuth, triton_client_kwargs
from worker.wire.tensors import DATATYPES
from worker.wire.validation import ModelSpec

Outcome = Literal["ok", "fail", "skip"]

#: Kafka's AclOperation codes, as bit positions of an "authorized operations" field.
_READ, _WRITE = 3, 4
#: The field's value when the broker did not report the operations.
_NOT_REPORTED = -(2**31)
#: Kafka error codes the checks explain in words.
_KAFKA_ERRORS = {
    3: "does not exist",
    5: "has partitions without a leader",
    29: "not authorized to describe it",
    30: "not authorized to describe the group",
}


@dataclass(frozen=True, slots=True)
class CheckResult:
    """One line of the report."""

    check: str
    outcome: Outcome
    detail: str

    @property
    def ok(self) -> bool:
        """False only for a failure; a skipped check failed through another one."""
        return self.outcome != "fail"


# -- requests asking for authorized operations (aiokafka's admin calls do not) ---------


class _MetadataResponseV8(Response):  # type: ignore[misc]  # aiokafka is untyped
    API_KEY = 3
    API_VERSION = 8
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "brokers",
            Array(
                ("node_id", Int32),
                ("host", String("utf-8")),
                ("port", Int32),
                ("rack", String("utf-8")),
            ),
        ),
        ("cluster_id", String("utf-8")),
        ("controller_id", Int32),
        (
            "topics",
            Array(
                ("error_code", Int16),
                ("topic", String("utf-8")),
                ("is_internal", Boolean),
                (
                    "partitions",
                    Array(
                        ("error_code", Int16),
                        ("partition", Int32),
                        ("leader", Int32),
                        ("leader_epoch", Int32),
                        ("replicas", Array(Int32)),
                        ("isr", Array(Int32)),
                        ("offline_replicas", Array(Int32)),
                    ),
                ),
                ("topic_authorized_operations", Int32),
            ),
        ),
        ("cluster_authorized_operations", Int32),
    )


class _MetadataRequestV8(RequestStruct):  # type: ignore[misc]
    API_KEY = 3
    API_VERSION = 8
    RESPONSE_TYPE = _MetadataResponseV8
    SCHEMA = Schema(
        ("topics", Array(String("utf-8"))),
        ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
    )


class _TopicPermissionsRequest(Request[_MetadataRequestV8]):  # type: ignore[misc]
    API_KEY = 3

    def __init__(self, topics: Sequence[str]) -> None:
        self._topics = list(topics)

    def build(self, request_struct_class: type[_MetadataRequestV8]) -> _MetadataRequestV8:
        return request_struct_class(self._topics, False, False, True)


class _DescribeGroupsRequestV3(RequestStruct):  # type: ignore[misc]
    # aiokafka's own v3 struct parses the answer as v2, which drops the operations.
    API_KEY = 15
    API_VERSION = 3
    RESPONSE_TYPE = DescribeGroupsResponse_v3
    SCHEMA = Schema(("groups", Array(String("utf-8"))), ("include_authorized_operations", Boolean))


class _GroupPermissionsRequest(Request[_DescribeGroupsRequestV3]):  # type: ignore[misc]
    API_KEY = 15

    def __init__(self, group_id: str) -> None:
        self._group_id = group_id

    def build(
        self, request_struct_class: type[_DescribeGroupsRequestV3]
    ) -> _DescribeGroupsRequestV3:
        return request_struct_class([self._group_id], True)


def _may(operations: int, operation: int) -> bool | None:
    """Whether the bit field allows ``operation``; None when the broker did not say."""
    if operations == _NOT_REPORTED:
        return None
    return bool(operations & (1 << operation))


def _reason(exc: BaseException) -> str:
    """The first line of an error, named by its type unless the message already is."""
    name = type(exc).__name__
    lines = str(exc).strip().splitlines()
    if not lines:
        return name
    return lines[0] if lines[0].startswith(name) else f"{name}: {lines[0]}"


# -- Kafka ---------------------------------------------------------------------------


def _topics_to_check(settings: Settings) -> list[tuple[str, str, int]]:
    """(row name, topic, operation needed) for every topic the worker uses."""
    rows = [(f"input topic {t}", t, _READ) for t in settings.topics.input_topics]
    rows.append(
        (f"output topic {settings.topics.output_topic}", settings.topics.output_topic, _WRITE)
    )
    rows.append(
        (f"dead-letter topic {settings.topics.dlq_topic}", settings.topics.dlq_topic, _WRITE)
    )
    if settings.ops.audit in ("topic", "both") and settings.ops.audit_topic is not None:
        rows.append((f"audit topic {settings.ops.audit_topic}", settings.ops.audit_topic, _WRITE))
    return rows


def _topic_result(name: str, topic: dict[str, Any] | None, operation: int) -> CheckResult:
    if topic is None:
        return CheckResult(name, "fail", "not in the broker's answer")
    code = int(topic["error_code"])
    if code:
        return CheckResult(name, "fail", _KAFKA_ERRORS.get(code, f"Kafka error code {code}"))
    partitions = topic["partitions"]
    leaderless = sorted(p["partition"] for p in partitions if p["leader"] < 0)
    if leaderless:
        return CheckResult(name, "fail", f"partitions without a leader: {leaderless}")
    verb = "read" if operation == _READ else "write"
    allowed = _may(int(topic["topic_authorized_operations"]), operation)
    if allowed is False:
        return CheckResult(name, "fail", f"{len(partitions)} partitions, but no {verb} permission")
    permission = f"may {verb}" if allowed else f"{verb} permission not reported"
    return CheckResult(name, "ok", f"{len(partitions)} partitions, {permission}")


async def _describe_group(admin: AIOKafkaAdminClient, group_id: str) -> dict[str, Any]:
    # The first group lookup on a fresh cluster creates the offsets topic and answers
    # "coordinator not available" meanwhile; retriable errors are retried (the caller
    # bounds the total time).
    backoff_s = 0.1
    while True:
        try:
            node = await admin.find_coordinator(group_id)
            response = await admin._client.send(node, _GroupPermissionsRequest(group_id))
        except KafkaError as exc:
            if not exc.retriable:
                raise
            await asyncio.sleep(backoff_s)
            backoff_s = min(backoff_s * 2, 1.0)
            continue
        group: dict[str, Any] = response.to_object()["groups"][0]
        code = int(group["error_code"])
        if not code or not for_code(code).retriable:
            return group
        await asyncio.sleep(backoff_s)  # e.g. the coordinator is still loading the group
        backoff_s = min(backoff_s * 2, 1.0)


async def _group_result(admin: AIOKafkaAdminClient, group_id: str) -> CheckResult:
    name = f"consumer group {group_id}"
    group = await _describe_group(admin, group_id)
    code = int(group["error_code"])
    if code:
        return CheckResult(name, "fail", _KAFKA_ERRORS.get(code, f"Kafka error code {code}"))
    if group["protocol_type"] not in ("", "consumer"):
        kind = group["protocol_type"]
        return CheckResult(name, "fail", f"the group id is used by a {kind!r} group")
    if _may(int(group["authorized_operations"]), _READ) is False:
        return CheckResult(name, "fail", "no read permission on the group: cannot join it")
    members = len(group["members"])
    state = "no members yet" if group["state"] in ("Dead", "Empty") else group["state"]
    return CheckResult(name, "ok", f"{state}, {members} members; may join (not joined)")


async def kafka_checks(settings: Settings, timeout_s: float) -> list[CheckResult]:
    """Broker reachable; topics exist with the needed permissions; the group can be joined."""
    topics = _topics_to_check(settings)
    later = [name for name, _, _ in topics] + [f"consumer group {settings.kafka.group_id}"]
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.kafka.bootstrap_servers,
        client_id=f"{settings.kafka.client_id}-check",
        request_timeout_ms=int(timeout_s * 1000),
        **kafka_client_kwargs(settings.kafka_auth),
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            request = _TopicPermissionsRequest(sorted({topic for _, topic, _ in topics}))
            client = admin._client  # the admin API has no metadata call that can say "may"
            metadata = (await client.send(client.get_random_node(), request)).to_object()
    except Exception as exc:
        await admin.close()
        reason = f"{settings.kafka.bootstrap_servers}: {_reason(exc)}"
        return [
            CheckResult("Kafka reachable", "fail", reason),
            *(CheckResult(name, "skip", "Kafka unreachable") for name in later),
        ]
    try:
        brokers = len(metadata["brokers"])
        results = [
            CheckResult(
                "Kafka reachable",
                "ok",
                f"{brokers} broker(s), cluster {metadata['cluster_id']}",
            )
        ]
        by_name = {t["topic"]: t for t in metadata["topics"]}
        results += [_topic_result(name, by_name.get(t), op) for name, t, op in topics]
        try:
            async with asyncio.timeout(timeout_s):
                results.append(await _group_result(admin, settings.kafka.group_id))
        except Exception as exc:
            results.append(CheckResult(later[-1], "fail", _reason(exc)))
        return results
    finally:
        await admin.close()


# -- Triton --------------------------------------------------------------------------


def expected_models(settings: Settings) -> list[str]:
    """The models a worker with these settings is told about, in a stable order."""
    names = [settings.limits.default_model] if settings.limits.default_model else []
    for _, models in settings.limits.model_allowlist:
        names += [m for m in models if m != "*"]
    return list(dict.fromkeys(names))


def _describe_spec(spec: ModelSpec) -> str:
    inputs = ", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in spec.inputs)
    batch = f"max batch {spec.max_batch_size}" if spec.max_batch_size else "no batching"
    return f"version {spec.version or '-'}; inputs {inputs}; {batch}"


async def _model_result(client: Any, name: str, auth: TritonAuth, timeout_s: float) -> CheckResult:
    row = f"model {name}"
    if not await client.is_model_ready(name, headers=auth.headers(), client_timeout=timeout_s):
        return CheckResult(row, "fail", "not ready: Triton does not serve it")
    metadata = await client.get_model_metadata(
        name, headers=auth.headers(), client_timeout=timeout_s
    )
    config = await client.get_model_config(name, headers=auth.headers(), client_timeout=timeout_s)
    try:
        spec = ModelSpec.from_triton(metadata, config)
    except Exception as exc:
        return CheckResult(row, "fail", f"metadata the worker cannot use: {exc}")
    unknown = sorted({t.datatype for t in spec.inputs + spec.outputs} - set(DATATYPES))
    if unknown:
        return CheckResult(row, "fail", f"datatypes the worker does not support: {unknown}")
    return CheckResult(row, "ok", f"ready; {_describe_spec(spec)}")


async def triton_checks(settings: Settings, timeout_s: float) -> list[CheckResult]:
    """Server ready; every expected model ready with metadata the worker can use."""
    from tritonclient.grpc.aio import InferenceServerClient

    models = expected_models(settings)
    auth = TritonAuth(settings.triton)
    client = InferenceServerClient(
        settings.triton.triton_url, **triton_client_kwargs(settings.triton)
    )
    try:
        try:
            ready = await client.is_server_ready(headers=auth.headers(), client_timeout=timeout_s)
            server = await client.get_server_metadata(
                headers=auth.headers(), client_timeout=timeout_s
            )
        except Exception as exc:
            return [
                CheckResult(
                    "Triton ready", "fail", f"{settings.triton.triton_url}: {_reason(exc)}"
                ),
                *(CheckResult(f"model {m}", "skip", "Triton unreachable") for m in models),
            ]
        if not ready:
            return [
                CheckResult("Triton ready", "fail", f"{settings.triton.triton_url}: not ready"),
                *(CheckResult(f"model {m}", "skip", "Triton not ready") for m in models),
            ]
        results = [CheckResult("Triton ready", "ok", f"{server.name} {server.version}")]
        if not models:
            index = await client.get_model_repository_index(
                headers=auth.headers(), client_timeout=timeout_s
            )
            served = sorted(m.name for m in index.models if m.state == "READY")
            detail = f"none configured (requests name theirs); ready: {', '.join(served) or '-'}"
            return [*results, CheckResult("models", "ok", detail)]
        for name in models:
            try:
                results.append(await _model_result(client, name, auth, timeout_s))
            except Exception as exc:
                results.append(CheckResult(f"model {name}", "fail", _reason(exc)))
        return results
    finally:
        await client.close()


# -- the command ---------------------------------------------------------------------


async def run_checks(settings: Settings, timeout_s: float = 10.0) -> list[CheckResult]:
    """Every check, Kafka and Triton side by side; the settings row first."""
    detail = (
        f"group {settings.kafka.group_id}; {len(settings.topics.input_topics)} input topic(s); "
        f"Kafka {settings.kafka.bootstrap_servers} ({settings.kafka_auth.security_protocol}); "
        f"Triton {settings.triton.triton_url}"
    )
    kafka, triton = await asyncio.gather(
        kafka_checks(settings, timeout_s), triton_checks(settings, timeout_s)
    )
    return [CheckResult("settings valid", "ok", detail), *kafka, *triton]


def render(results: Sequence[CheckResult]) -> Table:
    """The report as a rich table: check | result | detail."""
    table = Table(title="worker check")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    style = {"ok": "[green]ok[/green]", "fail": "[red]FAIL[/red]", "skip": "[yellow]skip[/yellow]"}
    for result in results:
        table.add_row(result.check, style[result.outcome], result.detail)
    return table


def add_check_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``check``; it takes the same WORKER_* variables and flags as ``run``."""
    # "+" as the only prefix makes every `--flag` an ordinary argument here, so the
    # flags reach `load_settings` untouched and get exactly `run`'s checks and errors.
    check = commands.add_parser(
        "check",
        help="check settings, Kafka topics and group, Triton and models; change nothing",
        prefix_chars="+",
        add_help=False,
    )
    check.add_argument("settings", nargs="*")
    check.set_defaults(handler=run_check)


def run_check(args: argparse.Namespace) -> int:
    """``check``: 0 when every check passes, 1 when one fails, 2 for invalid settings."""
    if "-h" in args.settings or "--help" in args.settings:
        helper = argparse.ArgumentParser(
            prog="kafka-triton-worker check",
            description="Check that a worker with these settings can run: Kafka topics, "
            "permissions and group, Triton and its models. Nothing is written.",
        )
        add_run_arguments(helper)
        helper.print_help()
        return 0
    try:
        settings = load_settings(os.environ, args.settings, isatty=sys.stderr.isatty())
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    # The table reports connection failures; aiokafka's own retries would repeat them
    # as warnings on stderr.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    results = asyncio.run(run_checks(settings))
    Console().print(render(results))
    return 0 if all(result.ok for result in results) else 1
