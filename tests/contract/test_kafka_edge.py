"""The Kafka client is chosen in one place: only ``worker/kafka/edge.py`` reads
``WORKER_KAFKA_CLIENT``, and only ``worker/kafka/`` imports confluent_kafka, aiokafka or the
edge's client packages (the worker, ``check`` and every command use the chosen client)."""

from __future__ import annotations

import ast
from pathlib import Path

from devtools.layout import PROJECT_ROOT, runtime_modules

#: Where the setting may be compared: the edge that chooses, and the settings that define
#: and check it.
_READS_THE_CLIENT = {"worker/kafka/edge.py", "worker/settings/sections.py"}


def _relative(path: Path) -> str:
    return path.relative_to(PROJECT_ROOT).as_posix()


def _compares_the_client(tree: ast.AST) -> bool:
    """A comparison with ``<something>.kafka_client`` on either side."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(s, ast.Attribute) and s.attr == "kafka_client" for s in sides):
                return True
    return False


def _imported_roots(tree: ast.AST) -> set[str]:
    """The top-level names of the absolute imports of a module."""
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def _outside_kafka() -> list[Path]:
    return [p for p in runtime_modules() if not _relative(p).startswith("worker/kafka/")]


def test_only_the_edge_compares_the_kafka_client_setting() -> None:
    """``kafka_client`` is compared in worker/kafka/edge.py (and the settings) alone:
    delivery, the checks and the commands ask the edge."""
    found = {
        _relative(path)
        for path in runtime_modules()
        if _compares_the_client(ast.parse(path.read_text()))
    }
    assert found - _READS_THE_CLIENT == set()
    assert "worker/kafka/edge.py" in found


def test_the_client_check_finds_a_comparison() -> None:
    """The check above can fail: either side of a comparison is seen."""
    assert _compares_the_client(ast.parse('if settings.kafka.kafka_client == "confluent": pass'))
    assert _compares_the_client(ast.parse('x = "aiokafka" != kafka.kafka_client'))
    assert not _compares_the_client(ast.parse("client = settings.kafka.kafka_client"))


def test_only_the_kafka_edge_imports_confluent_kafka() -> None:
    """No module outside worker/kafka/ imports confluent_kafka, even lazily."""
    offenders = {
        _relative(path)
        for path in _outside_kafka()
        if "confluent_kafka" in _imported_roots(ast.parse(path.read_text()))
    }
    assert offenders == set()


def test_only_the_kafka_edge_imports_aiokafka() -> None:
    """No module outside worker/kafka/ imports aiokafka: Kafka's records, partitions, offsets
    and errors come from worker.kafka.types, the clients from worker/kafka/aiokafka/."""
    offenders = {
        _relative(path)
        for path in _outside_kafka()
        if "aiokafka" in _imported_roots(ast.parse(path.read_text()))
    }
    assert offenders == set()


def _client_packages_imported(tree: ast.AST) -> set[str]:
    """The client packages of the edge (worker.kafka.aiokafka, .rdkafka) a module imports."""
    found: set[str] = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        for name in names:
            for package in ("worker.kafka.aiokafka", "worker.kafka.rdkafka"):
                if name == package or name.startswith(package + "."):
                    found.add(package)
    return found


def test_no_module_outside_the_edge_imports_a_client_module() -> None:
    """Delivery, the checks and the commands (produce, tail, topics, replay) speak the
    edge's protocols (worker.kafka.transactions, .admin, .direct, .types) and take the
    chosen client's parts from worker.kafka.edge: no module outside worker/kafka/ imports
    worker.kafka.aiokafka or worker.kafka.rdkafka (devtools and tests may)."""
    offenders = {
        _relative(path): sorted(found)
        for path in _outside_kafka()
        if (found := _client_packages_imported(ast.parse(path.read_text())))
    }
    assert offenders == {}


def test_the_client_import_check_finds_one() -> None:
    """The check above can fail: both import forms are seen."""
    assert _client_packages_imported(ast.parse("from worker.kafka.aiokafka import clients"))
    assert _client_packages_imported(ast.parse("import worker.kafka.rdkafka.transactions"))
    assert not _client_packages_imported(ast.parse("from worker.kafka import transactions"))
