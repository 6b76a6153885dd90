"""The tree is the data flow: no import cycle, nothing shipped imports devtools, short
functions, the unit tests mirror the tree, and one module keeps the books of a record's
outcome. A module's length follows its concern: none is capped."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from devtools.docs import between
from devtools.layout import (
    FLOW,
    KNOWN_PACKAGE_EDGES,
    LONG_FUNCTIONS,
    MAX_FUNCTION_LINES,
    MIRRORED,
    PROJECT_ROOT,
    TOP_LEVEL,
    UNIT_TESTS,
    UNMIRRORED_TESTS,
    WORKER,
    find_cycle,
    import_graph,
    long_functions,
    module_name,
    module_table_markdown,
    module_under_test,
    package_graph,
    package_of,
    project_modules,
    runtime_modules,
    unit_test_files,
)

HOW_IT_WORKS = PROJECT_ROOT / "docs" / "how-it-works.md"


def _between(marker: str) -> str:
    found = between(HOW_IT_WORKS.read_text(), marker)
    assert found is not None, f"how-it-works.md lacks the {marker} markers"
    return found


def test_no_import_cycle_in_the_worker() -> None:
    """The import graph of worker/ has no cycle."""
    assert find_cycle(import_graph()) is None


def test_no_import_cycle_in_devtools() -> None:
    """Nor has the import graph of worker/ and devtools/ together."""
    assert find_cycle(import_graph(project_modules())) is None


def test_the_cycle_finder_finds_one() -> None:
    """The check above can fail: a graph with a cycle is reported with its path."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]


def test_no_import_cycle_between_packages() -> None:
    """Packages of worker/ and devtools/ (a top-level module counts as one) import one
    another one way only, the known exceptions aside."""
    assert find_cycle(package_graph(import_graph(project_modules()))) is None


def test_the_known_package_edges_are_still_there() -> None:
    """An exception that no longer exists leaves the list, so that the list only shrinks."""
    graph = import_graph(project_modules())
    edges = {(package_of(m), package_of(t)) for m, targets in graph.items() for t in targets}
    assert set(KNOWN_PACKAGE_EDGES) <= edges


def test_the_package_cycle_check_can_fail() -> None:
    """Two packages importing each other are a cycle even when no two modules are."""
    graph = {"worker.a.x": {"worker.b.y"}, "worker.b.z": {"worker.a.w"}}
    assert find_cycle(package_graph(graph)) == ["worker.a", "worker.b", "worker.a"]


def test_no_function_in_the_worker_is_over_60_lines() -> None:
    """Constructors and functions of worker/ read at a glance; the known ones only shrink."""
    found = long_functions(MAX_FUNCTION_LINES)
    assert {name for name in found if name not in LONG_FUNCTIONS} == set()
    assert set(LONG_FUNCTIONS) <= set(found), "a long function got shorter: take it off"


def test_the_worker_is_built_by_a_short_constructor() -> None:
    """Worker.__init__ builds in order in at most 50 lines (the builders do the rest)."""
    assert "worker.app.Worker.__init__" not in long_functions(50)


def test_unit_tests_mirror_the_tree() -> None:
    """tests/unit/<package>/test_<module>.py is named after worker/<package>/<module>.py
    (or the package, or a module and an aspect of it), the known exceptions aside."""
    stray = {
        test.relative_to(UNIT_TESTS).as_posix()
        for test in unit_test_files()
        if module_under_test(test) is None
    }
    assert stray - set(UNMIRRORED_TESTS) == set()
    assert set(UNMIRRORED_TESTS) <= stray, "a known exception is gone: take it off the list"


def test_every_module_of_the_mirrored_packages_has_its_unit_tests() -> None:
    """records/ and delivery/: each module has tests/unit/<package>/test_<module>.py."""
    tested = {module_under_test(test) for test in unit_test_files()}
    for package in MIRRORED:
        modules = {p for p in (WORKER / package).glob("*.py") if p.name != "__init__.py"}
        assert modules, package
        assert {p.relative_to(WORKER).as_posix() for p in modules - tested} == set()


def test_the_mirror_check_names_what_a_test_file_tests() -> None:
    """A module, a module's aspect, a package's face, a private module; else nothing."""
    assert module_under_test(UNIT_TESTS / "records" / "test_steps.py") == (
        WORKER / "records" / "steps.py"
    )
    assert module_under_test(UNIT_TESTS / "delivery" / "test_at_least_once.py") == (
        WORKER / "delivery" / "at_least_once.py"
    )
    assert module_under_test(UNIT_TESTS / "wire" / "test_requests_fuzz.py") == (
        WORKER / "wire" / "requests.py"
    )
    compat = module_under_test(UNIT_TESTS / "kafka" / "aiokafka" / "test_compat.py")
    assert compat == WORKER / "kafka" / "aiokafka" / "_compat.py"
    assert module_under_test(UNIT_TESTS / "kafka" / "rdkafka" / "test_publisher_producer.py") == (
        WORKER / "kafka" / "rdkafka" / "publisher.py"
    )
    assert module_under_test(UNIT_TESTS / "settings" / "test_settings.py") == (
        WORKER / "settings" / "__init__.py"
    )
    assert module_under_test(UNIT_TESTS / "wire" / "test_codec.py") is None


#: What only ``records/steps.py`` may do to a record's outcome (besides where each thing
#: is defined): (what, the text that does it, the modules that define it).
_BOOKKEEPING: tuple[tuple[str, str, set[str]], ...] = (
    # The Schema Registry's breaker counts the registry's answers, not a record's outcome.
    (
        "the circuit breaker's success",
        ".record_success(",
        {"worker/flow/breaker.py", "worker/registry/writers.py"},
    ),
    ("a model's health success", ".succeeded(", set()),
    ("a model's health successes", ".succeeded_many(", set()),
    ("the adaptive limit's sample", ".on_success(", set()),
    ("the adaptive limit's overload", ".on_overload(", set()),
    ("the inference latency", "inference_latency_seconds", {"worker/observability/metrics.py"}),
    ("the results counter", "results_published_total", {"worker/observability/metrics.py"}),
    ("the end-to-end latency", "end_to_end_latency_seconds", {"worker/observability/metrics.py"}),
    ("the batch path's counter", "fast_path_records_total", {"worker/observability/metrics.py"}),
    ("the dead letters counter", "dead_letters_total", {"worker/observability/metrics.py"}),
    ("the retries counter", "retries_total", {"worker/observability/metrics.py"}),
    ("the internal errors counter", "internal_errors_total", {"worker/observability/metrics.py"}),
    ("the internal-error log line", '"internal_error"', set()),
    ("the run of bugs", "InternalErrorGuard(", set()),
)


def test_the_books_of_an_outcome_are_kept_in_the_steps_alone() -> None:
    """Latencies, the limiter, the breakers, the models' health, the counters and the
    internal-error log of a record's outcome are written in worker/records/steps.py only."""
    steps = "worker/records/steps.py"
    for what, text, defined_in in _BOOKKEEPING:
        found = {
            path.relative_to(PROJECT_ROOT).as_posix()
            for path in runtime_modules()
            if text in path.read_text()
        }
        assert steps in found, f"{what}: no longer in the steps?"
        assert found - {steps} - defined_in == set(), what


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
    assert {name for name, _ in FLOW} <= {p.name for p in UNIT_TESTS.iterdir() if p.is_dir()}


def test_the_module_table_is_generated_from_the_tree() -> None:
    """How it works' module table is the one devtools writes from the modules' docstrings."""
    assert _between("module-table") == module_table_markdown()


def _diagram_modules() -> list[tuple[str, str]]:
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
