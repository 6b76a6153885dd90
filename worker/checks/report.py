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
- Both are asked as the start-up gate of ``run`` asks them (``worker.checks.kafka``),
  and judged by the same rows (``worker.checks.rows``): what ``check`` fails with a fix
  to make, ``run`` refuses to start on.
- Triton: server ready, then every model the worker is told about
  (``WORKER_DEFAULT_MODEL`` and the models named in ``WORKER_MODEL_ALLOWLIST``)
  ready, with metadata the worker's request validation can use; each mapped topic's
  inputs beside its model's (``worker.checks.mappings``).
- The Schema Registry, when one is set: it answers, and each registry-format topic's
  events' and results' subjects are as the start-up gate wants them
  (``worker.checks.registry``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from worker.checks import probes
from worker.checks.kafka import inspect_kafka
from worker.checks.mappings import inspect_mappings, mapping_rows
from worker.checks.registry import registry_rows
from worker.checks.rows import CheckResult, kafka_rows
from worker.errors import CannotRun, ExitCode
from worker.events import load_mappings
from worker.settings import ConfigError, Settings, add_run_arguments, load_settings
from worker.shutdown import run_interruptible
from worker.triton.auth import TritonAuth
from worker.wire.tensors import DATATYPES
from worker.wire.validation import ModelSpec

__all__ = ["CheckResult", "add_check_parser", "kafka_checks", "run_checks", "triton_checks"]


# -- Kafka ---------------------------------------------------------------------------


async def kafka_checks(settings: Settings, timeout_s: float) -> list[CheckResult]:
    """Broker reachable; topics exist with the needed permissions; the group can be joined."""
    try:
        findings = await inspect_kafka(settings, timeout_s)
    except CannotRun as exc:
        return _not_asked(settings, str(exc))
    return kafka_rows(settings, findings)


def _not_asked(settings: Settings, reason: str) -> list[CheckResult]:
    """Kafka could not be asked (no answer, or a refused handshake): its rows are skipped."""
    later = [use.row for use in probes.topics_to_check(settings)]
    later.append(f"consumer group {settings.kafka.group_id}")
    return [
        CheckResult("Kafka reachable", "fail", reason),
        *(CheckResult(name, "skip", "Kafka not reachable with these settings") for name in later),
    ]


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
    """Triton ready; every expected model ready with metadata the worker can use.

    With several endpoints each is probed: Triton is ready when one is (the
    others are named), and a model's row fails when a ready endpoint does not
    serve it or reports other metadata than the first.
    """
    models = expected_models(settings)
    addresses = await probes.triton_addresses(settings)
    per_endpoint = await asyncio.gather(
        *(_endpoint_checks(settings, a, t, models, timeout_s) for a, t in addresses)
    )
    if len(per_endpoint) == 1:
        return per_endpoint[0]
    names = [address for address, _ in addresses]
    ready = [(n, rows) for n, rows in zip(names, per_endpoint, strict=True) if rows[0].ok]
    down = [rows[0].detail for rows in per_endpoint if not rows[0].ok]
    if not ready:
        return [CheckResult("Triton ready", "fail", "; ".join(down)), *per_endpoint[0][1:]]
    detail = f"{len(ready)} of {len(names)} endpoints ready ({ready[0][1][0].detail})"
    results = [CheckResult("Triton ready", "ok", detail + (f"; {'; '.join(down)}" if down else ""))]
    for index, first in enumerate(ready[0][1][1:], start=1):
        rows = [(n, r[index]) for n, r in ready]
        failed = [(n, row) for n, row in rows if not row.ok]
        if failed:
            results.append(
                CheckResult(first.check, "fail", f"{failed[0][0]}: {failed[0][1].detail}")
            )
        elif any(row.detail != first.detail for _, row in rows) and first.check != "models":
            differing = ", ".join(n for n, row in rows if row.detail != first.detail)
            results.append(
                CheckResult(first.check, "fail", f"metadata differs on {differing}: {first.detail}")
            )
        else:
            results.append(first)
    return results


async def _endpoint_checks(
    settings: Settings, address: str, target: probes.Target, models: list[str], timeout_s: float
) -> list[CheckResult]:
    """The rows of one endpoint: server ready, then each model (or what it serves)."""
    auth = TritonAuth(settings.triton)
    client = probes.triton_client(settings, address, target)
    try:
        try:
            ready = await client.is_server_ready(headers=auth.headers(), client_timeout=timeout_s)
            server = await client.get_server_metadata(
                headers=auth.headers(), client_timeout=timeout_s
            )
        except Exception as exc:
            return [
                CheckResult("Triton ready", "fail", f"{address}: {probes.reason(exc)}"),
                *(CheckResult(f"model {m}", "skip", "Triton unreachable") for m in models),
            ]
        if not ready:
            return [
                CheckResult("Triton ready", "fail", f"{address}: not ready"),
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
                results.append(CheckResult(f"model {name}", "fail", probes.reason(exc)))
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
    mappings = None
    if settings.limits.mapping_file is not None:  # a file that cannot be read: exit 2 first
        mappings = load_mappings(settings.limits.mapping_file, settings.topics.input_topics)
    kafka, triton, mapped = await asyncio.gather(
        kafka_checks(settings, timeout_s),
        triton_checks(settings, timeout_s),
        inspect_mappings(settings, timeout_s, mappings),
    )
    rows = [CheckResult("settings valid", "ok", detail), *kafka, *triton]
    schemas = await registry_rows(settings, mapped, timeout_s)
    return rows + mapping_rows(mapped) + schemas


def render(results: Sequence[CheckResult]) -> Table:
    """The report as a rich table: check | result | detail."""
    table = Table(title="worker check")
    table.add_column("check")
    table.add_column("result")
    table.add_column("detail", overflow="fold")
    style = {"ok": "[green]ok[/green]", "fail": "[red]FAIL[/red]", "skip": "[yellow]skip[/yellow]"}
    for result in results:
        detail = f"{result.detail}: {result.fix}" if result.fix else result.detail
        table.add_row(result.check, style[result.outcome], detail)
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
    # The table reports connection failures; the clients' own retries would repeat them
    # as warnings on stderr.
    for name in ("aiokafka", "librdkafka"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        results = run_interruptible(run_checks(settings))
    except ConfigError as exc:  # a file the settings name cannot be read, as `run` says
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.CONFIG
    Console().print(render(results))
    return 0 if all(result.ok for result in results) else 1
