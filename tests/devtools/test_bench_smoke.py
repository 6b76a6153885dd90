"""The benchmark smoke run: every variant runs and reports a throughput (no performance check)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from devtools.bench.command import SMOKE_KEYS, TUNED_SETTINGS
from devtools.devstack.paths import PROJECT_ROOT
from tests.support import KafkaUnderTest, TritonUnderTest

pytestmark = pytest.mark.timeout(540)


def test_smoke_run_reports_every_variant(
    kafka: KafkaUnderTest, triton: TritonUnderTest, tmp_path: Path
) -> None:
    """`bench --smoke` on the session's servers: every variant of the smoke run, the ceiling,
    the common rate."""
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
        timeout=480,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["variants"]) == set(SMOKE_KEYS)
    for name, variant in report["variants"].items():
        assert variant["records_per_s"] > 0, name
    triton_batched = report["variants"]["triton_batched"]
    assert triton_batched["records"] == 300  # rows, one per request of the burst
    assert triton_batched["settings"]["batch"] == "32"
    assert triton_batched["settings"]["in flight"] == "512"
    ceiling = min(report["variants"][k]["records_per_s"] for k in ("kafka", "triton_batched"))
    assert report["ceiling"][1] == ceiling
    target = next(t for t in report["targets"] if "/ the ceiling" in t["name"])
    assert target["value"] == report["variants"]["worker_tuned"]["records_per_s"] / ceiling
    common = report["at_common_rate"]
    assert set(common["points"]) == {
        "worker",
        "worker_tuned",
        "worker_tuned_confluent",
        "triton",
        "triton_batched",
        "kafka",
        "kafka_confluent",
    }
    assert common["offered_per_s"] == report["variants"]["worker_tuned"]["records_per_s"] / 2
    for name, point in common["points"].items():
        assert point["offered_per_s"] == common["offered_per_s"], name
        assert point["achieved_per_s"] > 0 and point["latency_ms"]["p99"] > 0, name
    kafka_p99 = common["points"]["kafka"]["latency_ms"]["p99"]
    for key in ("triton", "triton_batched"):
        expected = kafka_p99 + common["points"][key]["latency_ms"]["p99"]
        assert common["sum_of_parts_p99_ms"][key] == expected
    markdown = (tmp_path / "bench.md").read_text()
    assert "Latency at one common offered rate" in markdown
    assert "sum of parts: Kafka alone p99 + Triton alone, batched p99" in markdown


def test_smoke_run_of_the_tuned_worker_in_each_mode(
    kafka: KafkaUnderTest, triton: TritonUnderTest, tmp_path: Path
) -> None:
    """exactly_once (results read read_committed), key ordering over 20 keys (results matched
    by their x-request-id), audit to a topic of its own: each answers every request."""
    done = subprocess.run(
        [
            sys.executable, "-m", "devtools", "bench", "--smoke",
            "--variants", "worker_eos,worker_key_confluent,worker_audit", "--keys", "20",
            "--bootstrap-servers", kafka.bootstrap_servers, "--triton-url", triton.grpc_address,
            "--out", str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=PROJECT_ROOT,
        timeout=480,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["meta"]["ordering_keys"] == 20
    modes = {
        "worker_eos": {"DELIVERY": "exactly_once"},
        "worker_key_confluent": {"ORDERING": "key", "KAFKA_CLIENT": "confluent"},
        "worker_audit": {"AUDIT": "topic"},
    }
    assert set(report["variants"]) == set(modes)
    for name, variant in report["variants"].items():
        assert variant["records"] == 300, name
        assert variant["records_per_s"] > 0 and variant["latency_ms"]["p99"] > 0, name
        assert variant["settings"] == {**TUNED_SETTINGS, **modes[name]}, name
    assert "requests keyed over 20 keys" in (tmp_path / "bench.md").read_text()


def test_decoupled_variant_reports_responses_and_first_response_times(
    kafka: KafkaUnderTest, triton: TritonUnderTest, tmp_path: Path
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
        timeout=480,
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
