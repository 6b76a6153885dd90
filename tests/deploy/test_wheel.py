"""The package as users install it: the wheel in a fresh virtualenv, without extras, then
with each extra, every command run through its console script against the local stack.

The development virtualenv has every extra installed; this one has only what
``pip install kafka-triton-worker[...]`` brings, so a module importing an optional
package where it should not fails here.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support import KafkaUnderTest, Topics, TritonUnderTest, collect, create, headers_dict

pytestmark = pytest.mark.timeout(600)

ROOT = Path(__file__).resolve().parents[2]
#: Bound on one command of the installed package (a run waits for its answers longer).
COMMAND_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Venv:
    """A virtualenv of its own, with the project's wheel installed into it."""

    path: Path
    wheel: Path

    @property
    def script(self) -> str:
        return str(self.path / "bin" / "kafka-triton-worker")

    def pip_install(self, extras: str = "") -> None:
        """Install the wheel (with ``extras``, e.g. ``[confluent]``), pinned as in development."""
        target = f"{self.wheel}{extras}"
        python = str(self.path / "bin" / "python")
        _run(
            [python, "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"), target],
            cwd=self.path,
        )

    def has(self, module: str) -> bool:
        probe = (
            f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
        )
        return subprocess.run([str(self.path / "bin" / "python"), "-c", probe]).returncode == 0


def _run(argv: list[str], cwd: Path, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a command to its end; it must exit 0."""
    done = _try(argv, cwd, **kwargs)
    assert done.returncode == 0, f"{' '.join(argv)}: exit {done.returncode}\n{done.stderr}"
    return done


def _try(argv: list[str], cwd: Path, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run a command to its end, whatever its exit code."""
    return subprocess.run(
        argv, cwd=cwd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, **kwargs
    )


def _spawn(argv: list[str], env: Mapping[str, str], cwd: Path, log_path: Path) -> Any:
    """A long-running command, its output in ``log_path``."""
    with log_path.open("wb") as log:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Venv]:
    """The wheel built from this checkout, installed into a new virtualenv with no extra."""
    home = tmp_path_factory.mktemp("clean-venv")
    _run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(home), str(ROOT)],
        cwd=home,
    )
    (wheel,) = home.glob("kafka_triton_worker-*.whl")
    _run([sys.executable, "-m", "venv", str(home / "venv")], cwd=home)
    env = Venv(home / "venv", wheel)
    env.pip_install()
    yield env


def _env(
    kafka: KafkaUnderTest, triton: TritonUnderTest, topics: Topics, **extra: str
) -> dict[str, str]:
    """The process environment of a user's shell: only their WORKER_* settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("WORKER_", "OTEL_"))}
    base.pop("PYTHONPATH", None)
    return base | {
        "WORKER_BOOTSTRAP_SERVERS": kafka.bootstrap_servers,
        "WORKER_TRITON_URL": triton.grpc_address,
        "WORKER_INPUT_TOPICS": topics.input,
        "WORKER_OUTPUT_TOPIC": topics.output,
        "WORKER_DLQ_TOPIC": topics.dlq,
        "WORKER_GROUP_ID": topics.group,
        "WORKER_METRICS_PORT": "0",
        "WORKER_COMMIT_INTERVAL_MS": "100",
        **extra,
    }


def _requests(tag: str) -> str:
    """NDJSON: one request for ``double``, and one naming an input the model does not have."""
    good = {
        "id": f"good-{tag}",
        "model_name": "double",
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 2], "data": [1.5, -2.0]}],
    }
    bad = {
        "id": f"bad-{tag}",
        "model_name": "double",
        "inputs": [{"name": "NOPE", "datatype": "FP32", "shape": [1, 1], "data": [0.0]}],
    }
    return f"{json.dumps(good)}\n{json.dumps(bad)}\n"


async def _answer_through_the_package(
    venv: Venv,
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    topics: Topics,
    env: Mapping[str, str],
    tmp: Path,
) -> str:
    """check, produce, run until both requests are answered, SIGTERM: the worker's log."""
    await create(kafka, topics)
    checked = await asyncio.to_thread(_try, [venv.script, "check"], tmp, env=env)
    assert checked.returncode == 0, f"check failed:\n{checked.stdout}\n{checked.stderr}"
    produce = [venv.script, "produce", "--topic", topics.input, "--file", "-"]
    produce += ["--bootstrap-servers", kafka.bootstrap_servers]
    await asyncio.to_thread(_run, produce, tmp, env=env, input=_requests(topics.group))
    log_path = tmp / f"{topics.group}.log"
    proc = _spawn([venv.script, "run"], env, tmp, log_path)
    try:
        got = await collect(kafka.bootstrap_servers, topics, expected=2)
    finally:
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, 60)
    text = log_path.read_text()
    assert code == 0, f"the worker exited {code}:\n{text}"
    result = json.loads(got.results[f"good-{topics.group}"].value)
    assert result["outputs"][0]["data"] == [3.0, -4.0]
    dead = headers_dict(got.dead_letters[f"bad-{topics.group}"].headers)
    assert dead["x-error-code"] == b"INVALID_REQUEST"
    assert "Traceback" not in text
    return text


async def test_the_base_install_runs_every_command(
    venv: Venv, kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """No extra: check, produce, run (a result and a dead letter), replay --dry-run."""
    assert not venv.has("confluent_kafka") and not venv.has("opentelemetry")
    topics = Topics.fresh(f"base-{unique}")
    env = _env(kafka, triton, topics)
    await _answer_through_the_package(venv, kafka, triton, topics, env, tmp_path)
    replay = _run([venv.script, "replay", "--dry-run"], cwd=tmp_path, env=env)
    assert "1 of 1 dead" in replay.stdout and "INVALID_REQUEST" in replay.stdout, replay.stdout


#: What needs an extra: the module it installs, and the setting that needs it ({tmp}: the
#: test's directory, which holds a YAML mapping file).
NEEDS_AN_EXTRA = {
    "confluent": ("confluent_kafka", "WORKER_KAFKA_CLIENT", "confluent"),
    "yaml": ("yaml", "WORKER_MAPPING_FILE", "{tmp}/mapping.yaml"),
    "registry": ("fastavro", "WORKER_MAPPING_FILE", "{tmp}/avro.toml"),
}


@pytest.mark.parametrize("extra", sorted(NEEDS_AN_EXTRA))
def test_the_base_install_refuses_what_needs_an_extra_in_one_line(
    venv: Venv,
    kafka: KafkaUnderTest,
    triton: TritonUnderTest,
    unique: str,
    tmp_path: Path,
    extra: str,
) -> None:
    """No extra, WORKER_KAFKA_CLIENT=confluent, a YAML mapping file (TOML and JSON need
    none) or a topic of Avro events: ``run`` and ``check`` exit 2 at once, with one line
    naming the extra."""
    module, setting, value = NEEDS_AN_EXTRA[extra]
    assert not venv.has(module)
    (tmp_path / "mapping.yaml").write_text("topics: {}\n")
    (tmp_path / "avro.toml").write_text('[topics.payments]\nmodel = "mlp"\nformat = "avro"\n')
    env = _env(kafka, triton, Topics.fresh(unique), **{setting: value.format(tmp=tmp_path)})
    started = time.monotonic()
    for command in ("run", "check"):
        done = subprocess.run(
            [venv.script, command],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
        )
        assert done.returncode == 2, done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and f"kafka-triton-worker[{extra}]" in lines[0], done.stderr
    assert time.monotonic() - started < COMMAND_TIMEOUT_S


async def test_the_confluent_extra_runs_the_worker_on_librdkafka(
    venv: Venv, kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """With [confluent]: check and run on librdkafka, at-least-once then exactly-once."""
    venv.pip_install("[confluent]")
    assert venv.has("confluent_kafka")
    for delivery in ("at_least_once", "exactly_once"):
        topics = Topics.fresh(f"rd-{delivery[:5]}-{unique}")
        env = _env(kafka, triton, topics, WORKER_KAFKA_CLIENT="confluent", WORKER_DELIVERY=delivery)
        text = await _answer_through_the_package(venv, kafka, triton, topics, env, tmp_path)
        assert "%3|" not in text and "%4|" not in text


async def test_the_otel_extra_traces_each_record(
    venv: Venv, kafka: KafkaUnderTest, triton: TritonUnderTest, unique: str, tmp_path: Path
) -> None:
    """With [otel] and OTEL_TRACES_EXPORTER=console: a record's spans are printed."""
    venv.pip_install("[otel]")
    assert venv.has("opentelemetry.sdk")
    topics = Topics.fresh(f"otel-{unique}")
    env = _env(
        kafka, triton, topics, OTEL_TRACES_EXPORTER="console", OTEL_SERVICE_NAME="wheel-test"
    )
    text = await _answer_through_the_package(venv, kafka, triton, topics, env, tmp_path)
    assert '"name": "infer double"' in text, text[-2000:]
