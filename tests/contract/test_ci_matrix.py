"""`make test` runs every Python the project claims, and the whole suite on each Kafka client."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: The newest Python the project is tested on (classifiers and the Makefile say the same).
NEWEST_MINOR = 13


def _makefile_var(name: str) -> list[str]:
    found = re.search(rf"^{name} \?=(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert found, f"Makefile lacks {name}"
    return found.group(1).split()


def test_every_claimed_python_runs_the_integration_suite() -> None:
    """requires-python >=3.11: 3.11 (the default venv), 3.12 and 3.13 each run the
    integration tests against the real servers."""
    claimed = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    lowest = int(re.fullmatch(r">=3\.(\d+)", claimed).group(1))  # type: ignore[union-attr]
    whole = {f"3.{lowest}", *_makefile_var("FULL_PYTHONS"), *_makefile_var("CONFLUENT_PYTHONS")}
    assert whole == {f"3.{m}" for m in range(lowest, NEWEST_MINOR + 1)}


def test_each_kafka_client_runs_the_fault_suite() -> None:
    """The fault tests run in the default pass (aiokafka) and in the librdkafka pass; the
    newest Python's pass leaves them out (they are two thirds of a pass's time)."""
    assert '-m "not deploy and not fault"' in _loop("FULL_PYTHONS")
    assert "fault" not in _loop("CONFLUENT_PYTHONS").split("-m", 1)[1].split("$(PYTEST_ARGS)")[0]


#: What the librdkafka pass leaves out: what no worker's Kafka client takes part in.
CONFLUENT_SELECTION = '-m "not unit and not devtools and not deploy and not one_client"'
#: What a test starting a worker, or running a command, on the client under test uses
#: (tests/support).
_WORKER_ON_CLIENT = (
    "settings_for",
    "running_worker",
    "worker_env",
    "WorkerProcess",
    "command_argv",
    "command_env",
)


def test_the_librdkafka_pass_runs_integration_and_fault_tests_on_the_workers() -> None:
    """The pass on librdkafka sets the client for the workers and runs the integration and
    fault tests but those marked one_client (the unit, contract and dev stack tests, and
    tests/deploy, run in the other passes)."""
    assert _makefile_var("CONFLUENT_PYTHONS")
    loop = _loop("CONFLUENT_PYTHONS")
    assert "WORKER_TEST_KAFKA_CLIENT=confluent" in loop
    assert CONFLUENT_SELECTION in loop


def test_a_test_left_out_of_the_librdkafka_pass_starts_no_worker_on_the_client() -> None:
    """A module marked one_client uses none of the helpers that start a worker, or run a
    command, on the client under test (WORKER_TEST_KAFKA_CLIENT)."""
    marked = [
        path
        for path in sorted((ROOT / "tests").glob("*/test_*.py"))
        if re.search(r"^pytestmark = .*pytest\.mark\.one_client", path.read_text(), re.M)
    ]
    assert marked
    for path in marked:
        text = path.read_text()
        assert not [name for name in _WORKER_ON_CLIENT if name in text], path.name


def _loop(variable: str) -> str:
    makefile = (ROOT / "Makefile").read_text()
    return makefile.split(f"for v in $({variable})", 1)[1].split("done", 1)[0]


def test_the_deploy_tests_run_once_in_the_default_pass() -> None:
    """tests/deploy runs in `test-one` (testpaths) and is deselected in every matrix pass."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    options = project["tool"]["pytest"]["ini_options"]
    assert "tests/deploy" in options["testpaths"]
    assert any(marker.startswith("deploy:") for marker in options["markers"])
    assert "not deploy" in _loop("FULL_PYTHONS")
    assert CONFLUENT_SELECTION in _loop("CONFLUENT_PYTHONS")
    assert "-m unit" in _loop("UNIT_PYTHONS")
    test_one = re.search(r"^test-one:(.*)\n\t(.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert test_one and "deploy-tools" in test_one.group(1)
    assert test_one.group(2) == "$(PY) -m pytest $(DURATIONS) $(PYTEST_ARGS)"
