"""The benchmark smoke run: every variant runs and reports a throughput (no performance check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from devtools.bench.command import VARIANT_KEYS
from devtools.devstack.paths import PROJECT_ROOT

pytestmark = pytest.mark.timeout(300)


def test_smoke_run_reports_every_variant(kafka: Any, triton: Any, tmp_path: Path) -> None:
    """`bench --smoke` against the session's servers writes a JSON with all six variants."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "devtools",
            "bench",
            "--smoke",
            "--bootstrap-servers",
            kafka.bootstrap_servers,
            "--triton-url",
            triton.grpc_address,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["variants"]) == set(VARIANT_KEYS)
    for name, variant in report["variants"].items():
        assert variant["records_per_s"] > 0, name
    assert (tmp_path / "bench.md").exists()


def test_decoupled_variant_reports_responses_and_first_response_times(
    kafka: Any, triton: Any, tmp_path: Path
) -> None:
    """`bench --variants decoupled`: Triton alone and the worker in both modes, all measured."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "devtools",
            "bench",
            "--variants",
            "decoupled",
            "--records",
            "200",
            "--bootstrap-servers",
            kafka.bootstrap_servers,
            "--triton-url",
            triton.grpc_address,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    points = json.loads((tmp_path / "bench.json").read_text())["extras"]["decoupled"]
    assert [p["label"] for p in points] == [
        "Triton alone (stream pool)",
        "worker, WORKER_STREAM_OUTPUT=each",
        "worker, WORKER_STREAM_OUTPUT=final",
    ]
    for point in points:
        assert point["requests"] == 200 and point["tokens"] == 16
        assert point["responses_per_s"] > 0 and 0 < point["first_p50_ms"] <= point["first_p99_ms"]
    assert "Decoupled `tokens` model" in (tmp_path / "bench.md").read_text()
