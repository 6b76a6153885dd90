"""The tree is the data flow: no import cycle, nothing shipped imports devtools, small modules."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from devtools.docs import between
from devtools.layout import (
    FLOW,
    PROJECT_ROOT,
    TOP_LEVEL,
    WORKER,
    find_cycle,
    import_graph,
    module_name,
    module_table_markdown,
    runtime_modules,
)

HOW_IT_WORKS = PROJECT_ROOT / "docs" / "how-it-works.md"


def _between(marker: str) -> str:
    found = between(HOW_IT_WORKS.read_text(), marker)
    assert found is not None, f"how-it-works.md lacks the {marker} markers"
    return found


def test_no_import_cycle_in_the_worker() -> None:
    """The import graph of worker/ has no cycle."""
    assert find_cycle(import_graph()) is None


def test_the_cycle_finder_finds_one() -> None:
    """The check above can fail: a graph with a cycle is reported with its path."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


def test_the_worker_never_imports_devtools() -> None:
    """The shipped package stands alone: no module of worker/ imports devtools."""
    offenders = {
        module: sorted(t for t in targets if t.startswith("devtools"))
        for module, targets in import_graph().items()
    }
    assert {m: t for m, t in offenders.items() if t} == {}
    # import_graph keeps only worker's own modules; ask the source for devtools too.
    for path in runtime_modules():
        assert "devtools" not in path.read_text(), f"{path} mentions devtools"


def test_no_runtime_module_is_over_400_lines() -> None:
    """Each module of worker/ reads in one sitting."""
    sizes = {module_name(p): len(p.read_text().splitlines()) for p in runtime_modules()}
    assert {m: n for m, n in sizes.items() if n > 400} == {}


def test_no_runtime_function_takes_more_than_six_positional_parameters() -> None:
    """Components take what they use, as values: long positional lists do not creep back."""
    long: list[str] = []
    for path in runtime_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names = [a.arg for a in node.args.posonlyargs + node.args.args]
                positional = [n for n in names if n not in ("self", "cls")]
                if len(positional) > 6:
                    long.append(f"{module_name(path)}.{node.name}")
    assert long == []


def test_every_package_is_in_the_flow_and_has_a_public_face() -> None:
    """Each package of worker/ is listed in the flow order and declares its __all__."""
    packages = {p.parent.name for p in WORKER.glob("*/__init__.py")}
    assert packages == {name for name, _ in FLOW}
    for name in packages:
        tree = ast.parse((WORKER / name / "__init__.py").read_text())
        declared = [
            node
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)
        ]
        assert declared, f"worker/{name}/__init__.py has no __all__"
    top = {p.stem for p in WORKER.glob("*.py")} - {"__init__", "__main__"}
    assert top == set(TOP_LEVEL)


def test_unit_tests_mirror_the_packages() -> None:
    """tests/unit has a folder per package of worker/ (checks, delivery, flow, ...)."""
    unit = PROJECT_ROOT / "tests" / "unit"
    assert {name for name, _ in FLOW} <= {p.name for p in unit.iterdir() if p.is_dir()}


def test_the_module_table_is_generated_from_the_tree() -> None:
    """How it works' module table is the one devtools writes from the modules' docstrings."""
    assert _between("module-table") == module_table_markdown()


def _diagram_modules() -> list[str]:
    """``package/module`` and ``package/`` names in the flow diagram, in order of mention."""
    diagram = _between("flow-diagram")
    assert diagram.startswith("```mermaid\nflowchart")
    return re.findall(r"(?<![\w/<])([a-z]+)/([a-z_]*)", diagram.replace("<br/>", " "))


def test_the_flow_diagram_follows_the_flow_order() -> None:
    """The "How it works" diagram names the stages in the order of the packages."""
    first_seen = list(dict.fromkeys(package for package, _ in _diagram_modules()))
    assert first_seen == [name for name, _ in FLOW if name in first_seen]
    assert set(first_seen) >= {"kafka", "flow", "wire", "triton", "delivery"}


def test_every_module_the_flow_diagram_names_exists() -> None:
    """Each ``package/module`` of the diagram is a module of worker/, so a move breaks it."""
    for package, module in _diagram_modules():
        path = WORKER / package / f"{module}.py" if module else WORKER / package
        assert path.exists(), f"{package}/{module}"


def test_the_image_ships_only_the_worker() -> None:
    """The Dockerfile copies worker/ and nothing of the tooling or tests."""
    dockerfile = (PROJECT_ROOT / "Dockerfile").read_text()
    copies = re.findall(r"^COPY (?!--from)(.+)$", dockerfile, re.M)
    sources = {part for line in copies for part in line.split()[:-1]}
    assert sources == {"constraints.txt", "pyproject.toml", "README.md", "worker"}
    ignored = (PROJECT_ROOT / ".dockerignore").read_text().split()
    assert {"devtools", "tests"} <= set(ignored)


def test_the_wheel_holds_only_the_worker() -> None:
    """pyproject packages worker* alone."""
    text = (PROJECT_ROOT / "pyproject.toml").read_text()
    assert 'include = ["worker*"]' in text
    assert Path(PROJECT_ROOT / "devtools" / "__main__.py").exists()
