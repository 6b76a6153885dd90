"""The shape of ``worker/``: its packages in the order of the data flow, and its import graph.

The module table of docs/how-it-works.md is written from here (``python -m devtools schemas``),
and the contract tests check the tree against it: every package listed in flow order, no import
cycle, nothing in ``worker/`` importing ``devtools``, no runtime module over 400 lines.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parents[1]
WORKER = PROJECT_ROOT / "worker"

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
    ("triton", "the Triton edge: stream pool, micro-batching, shared memory, errors"),
    ("delivery", "when a record is done and what is committed"),
    ("observability", "logs, metrics, health endpoints, records in flight"),
    ("checks", "start-up checks and the check command"),
    ("replay", "the replay command: dead letters back to their source topics"),
    ("commands", "the commands beside run that reach Kafka: produce, topics, tail"),
)
#: Top-level modules of worker/, around the packages.
TOP_LEVEL = ("app", "errors", "audit", "cli", "shutdown")


def module_name(path: Path) -> str:
    """``worker/kafka/intake.py`` -> ``worker.kafka.intake``."""
    parts = list(path.relative_to(PROJECT_ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def runtime_modules() -> Iterator[Path]:
    """Every Python file of the shipped package."""
    yield from sorted(WORKER.rglob("*.py"))


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
            # ``from worker.kafka import intake``: the submodule is imported too.
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] in ("worker", "devtools")}


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports (only names that are modules)."""
    modules = {module_name(path): path for path in runtime_modules()}
    return {
        name: {target for target in imports_of(path) if target in modules and target != name}
        for name, path in modules.items()
    }


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


def module_table_markdown() -> str:
    """The module table: each package in flow order, then the top-level modules."""
    lines = ["| module | owns |", "| --- | --- |"]
    for package, summary in FLOW:
        lines.append(f"| **`worker/{package}/`** | {summary} |")
        for path in sorted((WORKER / package).glob("*.py")):
            if path.name != "__init__.py":
                lines.append(f"| `{path.stem}.py` | {_markdown(first_line(path))} |")
    for name in TOP_LEVEL:
        lines.append(f"| `worker/{name}.py` | {_markdown(first_line(WORKER / f'{name}.py'))} |")
    return "\n".join(lines) + "\n"
