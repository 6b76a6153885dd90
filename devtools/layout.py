"""The shape of ``worker/``: its packages in the order of the data flow, and its import graph.

The module table of docs/how-it-works.md is written from here (``python -m devtools schemas``),
and the contract tests check the tree against it: every package listed in flow order, no import
cycle between modules nor between packages (of ``worker/`` and ``devtools/``), nothing in
``worker/`` importing ``devtools``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
WORKER = PROJECT_ROOT / "worker"
DEVTOOLS = PROJECT_ROOT / "devtools"

#: The packages of worker/, top to bottom in the order a record meets them.
FLOW = (
    ("settings", "the settings, read once at start-up"),
    ("kafka", "in: the consumer and the fetch loop; out: the producer; client options"),
    ("flow", "flow control: in-flight window, ordering turns, breakers, model holds, retries"),
    (
        "records",
        "the path of a record between the stages: a path chosen per record, one set of steps",
    ),
    ("wire", "bytes and headers to inference requests and back; the schemas' types"),
    ("events", "plain events in and out: a topic's mapping to a model's inputs and results"),
    (
        "registry",
        "the Schema Registry edge: Avro and JSON Schema events by their writers' schemas",
    ),
    ("triton", "the Triton edge: stream pool, micro-batching, shared memory, errors"),
    ("delivery", "when a record is done and what is committed"),
    ("observability", "logs, metrics, health endpoints, records in flight"),
    ("checks", "start-up checks and the check command"),
    ("replay", "the replay command: dead letters back to their source topics"),
    ("commands", "the commands beside run that reach Kafka: produce, topics, tail"),
)
#: Top-level modules of worker/, around the packages.
TOP_LEVEL = ("app", "errors", "audit", "cli", "shutdown", "allocator")

#: Package dependencies known to run the wrong way, each with why and what removes it. The
#: package-cycle check leaves them out; a contract test fails once one is gone, so that the
#: list only ever shrinks.
KNOWN_PACKAGE_EDGES: dict[tuple[str, str], str] = {}

#: Functions of ``worker/`` longer than the contract's 60 lines, each with why; only shrinks.
LONG_FUNCTIONS: dict[str, str] = {}
#: The longest function or constructor the contract lets ``worker/`` have.
MAX_FUNCTION_LINES = 60

UNIT_TESTS = PROJECT_ROOT / "tests" / "unit"
#: Packages of ``worker/`` whose every module has its unit tests, in
#: ``tests/unit/<package>/test_<module>.py``.
MIRRORED = ("records", "delivery")
#: Unit test files named after no module of their package, each with why; only shrinks.
UNMIRRORED_TESTS = {
    "test_soak_oracle.py": (
        "the chaos soak's own judgement (tests/support/soak/: its oracle, schedule and "
        "traffic), which is test code, not a module of worker/"
    ),
    "test_security.py": (
        "the security posture across packages (both edges' TLS and SASL options, secrets "
        "kept out of messages, the model allowlist, the tensor limits), as one page tells it"
    ),
}


def module_name(path: Path) -> str:
    """``worker/kafka/feed.py`` -> ``worker.kafka.feed``."""
    parts = list(path.relative_to(PROJECT_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_modules() -> Iterator[Path]:
    """Every Python file of the shipped package."""
    yield from sorted(WORKER.rglob("*.py"))


def project_modules() -> Iterator[Path]:
    """Every Python file of ``worker/`` and ``devtools/``."""
    yield from runtime_modules()
    yield from sorted(DEVTOOLS.rglob("*.py"))


def first_line(path: Path) -> str:
    """The first line of a module's docstring."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0].rstrip(".") if doc.strip() else ""


def imports_of(path: Path) -> set[str]:
    """The modules of this project that ``path`` imports (absolute names)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # ``from worker.kafka import feed``: the submodule is imported too.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in ("worker", "devtools")}


def import_graph(paths: Iterable[Path] | None = None) -> dict[str, set[str]]:
    """Module -> the project modules it imports (only names that are modules), of
    ``paths`` (by default the shipped package's)."""
    modules = {module_name(path): path for path in (paths or runtime_modules())}
    return {
        name: {target for target in imports_of(path) if target in modules and target != name}
        for name, path in modules.items()
    }


def package_of(module: str) -> str:
    """The unit a module belongs to: its package under ``worker/`` or ``devtools/``
    (``worker.kafka.feed`` -> ``worker.kafka``); a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import, without ``KNOWN_PACKAGE_EDGES``."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module)
        found = packages.setdefault(source, set())
        for target in targets:
            edge = (source, package_of(target))
            if edge[1] != source and edge not in KNOWN_PACKAGE_EDGES:
                found.add(edge[1])
    return packages


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as a list of modules ending where it starts, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            # A package's __init__ importing its own modules is not a cycle through them.
            if target.startswith(node + "."):
                continue
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def _markdown(docstring_text: str) -> str:
    """reStructuredText literals (double backticks) as Markdown code."""
    return docstring_text.replace("``", "`")


def _module_rows(package: Path, prefix: str = "") -> list[str]:
    """A row per module of ``package`` (its ``__init__`` aside), ``prefix`` before its name."""
    return [
        f"| `{prefix}{path.stem}.py` | {_markdown(first_line(path))} |"
        for path in sorted(package.glob("*.py"))
        if path.name != "__init__.py"
    ]


def module_table_markdown() -> str:
    """The module table: each package in flow order (its modules, then each subpackage's),
    then the top-level modules."""
    lines = ["| module | owns |", "| --- | --- |"]
    for package, summary in FLOW:
        lines.append(f"| **`worker/{package}/`** | {summary} |")
        lines.extend(_module_rows(WORKER / package))
        for sub in sorted(p.parent for p in (WORKER / package).glob("*/__init__.py")):
            lines.append(f"| **`{sub.name}/`** | {_markdown(first_line(sub / '__init__.py'))} |")
            lines.extend(_module_rows(sub, prefix=f"{sub.name}/"))
    for name in TOP_LEVEL:
        lines.append(f"| `worker/{name}.py` | {_markdown(first_line(WORKER / f'{name}.py'))} |")
    return "\n".join(lines) + "\n"


def long_functions(limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Functions and methods of ``worker/`` over ``limit`` lines: qualified name -> lines."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}.{child.name}")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                lines = child.end_lineno - child.lineno + 1
                if lines > limit:
                    found[f"{prefix}.{child.name}"] = lines
                visit(child, f"{prefix}.{child.name}")

    for path in runtime_modules():
        visit(ast.parse(path.read_text()), module_name(path))
    return found


def module_under_test(test: Path) -> Path | None:
    """The module of ``worker/`` a unit test file is named after, or None.

    ``tests/unit/<package>/test_<module>.py`` (``_compat.py``: ``test_compat.py``) or
    ``test_<module>_<aspect>.py`` names ``worker/<package>/<module>.py``;
    ``test_<package>.py`` names the package itself (tests through its public face).
    """
    folder = test.parent.relative_to(UNIT_TESTS)
    package = WORKER / folder
    name = test.stem.removeprefix("test_")
    if folder.parts and name == folder.name:
        return package / "__init__.py"
    modules = [p for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")]
    for module in sorted(modules, key=lambda p: -len(p.stem)):
        stem = module.stem.lstrip("_")
        if name == stem or name.startswith(f"{stem}_"):
            return module
    return None


def unit_test_files() -> Iterator[Path]:
    """Every ``test_*.py`` of ``tests/unit``."""
    yield from sorted(UNIT_TESTS.rglob("test_*.py"))
