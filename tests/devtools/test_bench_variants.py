"""The benchmark's variants: which are chosen, each one's settings, environment and keys."""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import pytest

from devtools.bench import quix, report
from devtools.bench.command import (
    EXTRA_KEYS,
    SMOKE_KEYS,
    TUNED_SETTINGS,
    VARIANT_KEYS,
    add_bench_parser,
    chosen,
)
from devtools.bench.measure import ordering_key, result_id
from devtools.bench.runner import Runner, Servers, worker_settings

MODES = {
    "worker_eos": ("DELIVERY", "exactly_once"),
    "worker_key": ("ORDERING", "key"),
    "worker_audit": ("AUDIT", "topic"),
}


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers())
    return parser.parse_args(["bench", "--records", "5", *argv])


def _runner(tmp_path: Path, *argv: str) -> Runner:
    return Runner(_args(*argv), Servers("127.0.0.1:9092", "127.0.0.1:8001"), tmp_path)


def test_every_variant_is_named_in_the_report_and_chosen_by_default() -> None:
    """The variants run in the report's order; the default run has them all, and every
    new key is accepted by --variants alone; --smoke leaves quix and the modes out."""
    assert VARIANT_KEYS == tuple(report.VARIANTS)
    assert chosen(None) == (list(VARIANT_KEYS + EXTRA_KEYS), [])
    for key in ("quix", *MODES, *(f"{m}_confluent" for m in MODES)):
        assert chosen(key) == ([key], [])
    assert chosen(None, smoke=True) == (list(SMOKE_KEYS), [])
    assert not {"quix", *MODES} & set(SMOKE_KEYS)
    assert chosen("worker_eos,nope,worker_key,") == (["worker_eos", "worker_key"], ["nope"])


def test_each_mode_is_the_tuned_worker_plus_its_setting_on_either_client() -> None:
    """worker_eos: the tuned settings and WORKER_DELIVERY=exactly_once; _confluent adds
    the client; the defaults worker has none of the tuned settings."""
    assert worker_settings("worker", TUNED_SETTINGS) == {}
    assert worker_settings("worker_tuned", TUNED_SETTINGS) == TUNED_SETTINGS
    for key, (name, value) in MODES.items():
        assert worker_settings(key, TUNED_SETTINGS) == {**TUNED_SETTINGS, name: value}
        assert worker_settings(f"{key}_confluent", TUNED_SETTINGS) == {
            **TUNED_SETTINGS,
            name: value,
            "KAFKA_CLIENT": "confluent",
        }


def test_a_mode_variant_runs_the_worker_with_its_own_topics_and_transactional_ids(
    tmp_path: Path,
) -> None:
    """exactly_once gets a transactional-id prefix of its own, audit a topic of its own
    (created with the others), the others neither."""
    runner = _runner(tmp_path)
    argv, settings, reported = runner.command("worker_eos_confluent", TUNED_SETTINGS)
    assert argv == [sys.executable, "-m", "worker", "run"]
    assert reported == settings
    env = runner.env("worker_eos_confluent", settings)
    assert env["WORKER_DELIVERY"] == "exactly_once"
    assert env["WORKER_KAFKA_CLIENT"] == "confluent"
    assert env["WORKER_TRANSACTIONAL_ID_PREFIX"] == f"bench-{runner.run_id}-worker_eos_confluent"
    assert env["WORKER_INPUT_TOPICS"] == runner.topics("worker_eos_confluent")[0]
    assert "WORKER_AUDIT_TOPIC" not in env

    _, settings, _ = runner.command("worker_audit", TUNED_SETTINGS)
    env = runner.env("worker_audit", settings)
    assert env["WORKER_AUDIT"] == "topic"
    assert env["WORKER_AUDIT_TOPIC"] == runner.audit_topic("worker_audit")
    assert env["WORKER_AUDIT_TOPIC"] not in runner.topics("worker_audit")
    assert "WORKER_TRANSACTIONAL_ID_PREFIX" not in env

    _, settings, _ = runner.command("worker_tuned", TUNED_SETTINGS)
    env = runner.env("worker_tuned", settings)
    assert not {"WORKER_AUDIT_TOPIC", "WORKER_TRANSACTIONAL_ID_PREFIX", "WORKER_DELIVERY"} & set(
        env
    )
    assert env["WORKER_MAX_IN_FLIGHT"] == TUNED_SETTINGS["MAX_IN_FLIGHT"]


def test_only_the_key_ordering_variants_get_a_bounded_key_space(tmp_path: Path) -> None:
    """--keys 1000 by default, for worker_key and worker_key_confluent (and their common-rate
    runs) alone; --keys 0 keys them by request id as every other variant."""
    runner = _runner(tmp_path)
    assert runner.keys("worker_key") == runner.keys("worker_key_confluent-common") == 1000
    for key in ("worker_tuned", "worker_eos", "quix", "kafka", "naive"):
        assert runner.keys(key) == 0
    assert _runner(tmp_path, "--keys", "0").keys("worker_key") == 0
    assert _runner(tmp_path, "--keys", "16").keys("worker_key_confluent") == 16


def test_ordering_keys_are_bounded_stable_and_spread() -> None:
    """20,000 request ids over 1,000 keys: each id always gets the same key, every key is
    used, none more than three times its share; 0 keys: the id itself."""
    ids = [f"bench-11-{i}" for i in range(20_000)]
    keys = [ordering_key(i, 1000) for i in ids]
    assert keys == [ordering_key(i, 1000) for i in ids]
    counts: dict[bytes, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    assert len(counts) == 1000
    assert max(counts.values()) <= 3 * 20
    assert ordering_key("bench-11-7", 0) == b"bench-11-7"


def test_a_result_is_matched_by_its_request_id_header_else_its_key() -> None:
    """The worker's results carry x-request-id (their key may be shared); a loop's result
    has the request's id as its key and no such header."""
    headers = [("content-type", b"application/json"), ("x-request-id", b"bench-1-2")]
    assert result_id(b"key-17", headers) == b"bench-1-2"
    assert result_id(b"bench-1-3", [("content-type", b"application/json")]) == b"bench-1-3"
    assert result_id(None, []) is None


def test_quix_runs_its_app_with_the_interpreter_of_its_own_virtualenv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The quix variant's argv: the cached virtualenv's python, the app, the servers; the
    virtualenv pins quixstreams 3.28.1 and a confluent-kafka below 2.13."""
    monkeypatch.setenv("DEVSTACK_DIR", str(tmp_path / "devstack"))
    runner = _runner(tmp_path)
    argv, env, reported = runner.command("quix", TUNED_SETTINGS)
    assert argv[:2] == [str(quix.quix_python()), str(quix.APP)]
    assert quix.quix_python().is_relative_to(tmp_path / "devstack" / "cache")
    assert argv[2:] == [
        "--bootstrap", "127.0.0.1:9092", "--triton", "127.0.0.1:8001",
        "--state-dir", str(tmp_path / "quix-state"),
    ]  # fmt: skip
    assert env == {}
    assert reported["library"] == "quixstreams 3.28.1"
    pins = dict(
        line.split("==")
        for line in quix.REQUIREMENTS.read_text().splitlines()
        if line and not line.startswith("#")
    )
    assert pins["quixstreams"] == quix.QUIX_VERSION == "3.28.1"
    major, minor, _ = (int(p) for p in pins["confluent-kafka"].split("."))
    assert (major, minor) < (2, 13)


def test_the_quix_app_imports_only_what_its_virtualenv_has() -> None:
    """Every module quix_app.py imports is the standard library's or pinned for its venv."""
    pinned = {
        line.split("==")[0].lower().replace("-", "_")
        for line in quix.REQUIREMENTS.read_text().splitlines()
        if line and not line.startswith("#")
    }
    tree = ast.parse(quix.APP.read_text())
    imported = {
        (alias.name if isinstance(node, ast.Import) else node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported - sys.stdlib_module_names == {"numpy", "tritonclient", "quixstreams"}
    assert imported - sys.stdlib_module_names <= pinned


def test_the_quix_virtualenv_is_built_once_then_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fake installer at the module seam: the first call builds (venv, pip -r the pins)
    in a partial folder renamed into place, dropping one a dead process left; the second
    finds it and installs nothing."""
    monkeypatch.setenv("DEVSTACK_DIR", str(tmp_path / "devstack"))
    root = quix.quix_python().parents[1]
    # Above the kernel's largest pid (2**22): no process has it.
    stale = root.with_name(f".{root.name}.partial-{2**22 + 1}")
    (stale / "bin").mkdir(parents=True)
    calls: list[list[str]] = []

    def fake_run(argv: list[str], what: str) -> None:
        calls.append(argv)
        if argv[1:3] == ["-m", "venv"]:
            (Path(argv[3]) / "bin").mkdir(parents=True)
            (Path(argv[3]) / "bin" / "python").write_text("")

    monkeypatch.setattr(quix, "_run", fake_run)
    python = quix.ensure_quix(log=lambda _: None)
    assert python == quix.quix_python() and python.exists()
    assert [c[1:3] for c in calls] == [["-m", "venv"], ["-m", "pip"]]
    assert calls[1][-2:] == ["-r", str(quix.REQUIREMENTS)] and "--no-deps" in calls[1]
    assert python.parents[1] == root
    assert not list(root.parent.glob(".*partial*"))
    assert quix.ensure_quix(log=lambda _: None) == python
    assert len(calls) == 2
