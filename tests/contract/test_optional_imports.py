"""The base install imports no optional package: only the modules of the code path that
needs an extra import it, and nothing else imports those modules at import time."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: The packages each extra brings, absent from ``pip install kafka-triton-worker``.
OPTIONAL = ("confluent_kafka", "opentelemetry")

#: The modules that may import an optional package at import time: the code path that
#: needs it imports them when (and only when) it runs.
NEEDS_AN_EXTRA = {
    "worker.kafka.rdkafka.admin",
    "worker.kafka.rdkafka.direct",
    "worker.kafka.rdkafka.intake",
    "worker.kafka.rdkafka.publisher",
    "worker.kafka.rdkafka.transactions",
    "worker.kafka.rdkafka.types",
    "worker.observability._otel",
}

#: Imports every module of ``worker`` with the optional packages made unimportable, and
#: prints the modules that failed.
_PROBE = """
import importlib, importlib.abc, json, pkgutil, sys

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {optional}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None

sys.meta_path.insert(0, Absent())
import worker

failed = {{}}
for info in pkgutil.walk_packages(worker.__path__, "worker."):
    if info.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(info.name)
    except ImportError as exc:
        failed[info.name] = str(exc)
print(json.dumps(failed))
"""


def test_only_the_modules_of_an_extra_import_it() -> None:
    """Every module imports without the extras but those of the extras' own code paths."""
    probe = _PROBE.format(optional=set(OPTIONAL))
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    failed = json.loads(done.stdout)
    assert set(failed) == NEEDS_AN_EXTRA, failed
    for module, error in failed.items():
        assert any(package in error for package in OPTIONAL), (module, error)
