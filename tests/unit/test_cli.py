"""The command line refuses bad configuration at start-up: exit code 2, one line naming it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.worker import env_without_settings

_REQUIRED = {
    "WORKER_INPUT_TOPICS": "requests",
    "WORKER_OUTPUT_TOPIC": "results",
    "WORKER_DLQ_TOPIC": "dead-letters",
}


def _run(env: dict[str, str], *args: str, command: str = "run") -> subprocess.CompletedProcess[str]:
    clean = env_without_settings()
    return subprocess.run(
        [sys.executable, "-m", "worker", command, *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(
    ("env", "args", "named"),
    [
        ({**_REQUIRED, "WORKER_MAX_IN_FLIGHT": "abc"}, (), "WORKER_MAX_IN_FLIGHT"),
        ({**_REQUIRED, "WORKER_MAX_INFLIGHT": "8"}, (), "WORKER_MAX_INFLIGHT"),
        ({**_REQUIRED, "WORKER_TRITON_URL": "http://x"}, (), "WORKER_TRITON_URL"),
        ({"WORKER_OUTPUT_TOPIC": "r", "WORKER_DLQ_TOPIC": "d"}, (), "WORKER_INPUT_TOPICS"),
        (_REQUIRED, ("--max-in-flight", "0"), "--max-in-flight"),
        (_REQUIRED, ("--no-such-flag",), "--no-such-flag"),
        ({**_REQUIRED, "WORKER_GROUP_PROTOCOL": "consumer"}, (), "WORKER_GROUP_PROTOCOL"),
        (
            {
                **_REQUIRED,
                "WORKER_KAFKA_CLIENT": "confluent",
                "WORKER_MAX_POLL_INTERVAL_MS": "1000",
                "WORKER_SESSION_TIMEOUT_MS": "6000",
            },
            (),
            "WORKER_MAX_POLL_INTERVAL_MS",
        ),
    ],
)
def test_invalid_configuration_exits_2_with_one_line(
    env: dict[str, str], args: tuple[str, ...], named: str
) -> None:
    """An invalid value, an unknown variable or flag, a missing setting: exit 2, one line."""
    done = _run(env, *args)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert named in lines[0]
    assert done.stdout == ""


def test_flags_win_over_environment_at_start_up() -> None:
    """A valid flag overrides an invalid env value, so only the env-only setting is judged."""
    done = _run(
        {**_REQUIRED, "WORKER_MAX_IN_FLIGHT": "abc"}, "--max-in-flight", "4", "--metrics-port", "-1"
    )
    assert done.returncode == 2
    assert "--metrics-port" in done.stderr
    assert "WORKER_MAX_IN_FLIGHT" not in done.stderr


@pytest.mark.parametrize("client", ["aiokafka", "confluent"])
@pytest.mark.parametrize(
    ("command", "cafile"),
    [("check", "missing"), ("check", "not PEM"), ("run", "not PEM")],
)
def test_a_ca_file_the_client_cannot_use_is_one_line(
    tmp_path: Path, client: str, command: str, cafile: str
) -> None:
    """A WORKER_SSL_CAFILE that is missing, or no certificate: exit 2 and one line naming it,
    from ``check`` as from ``run``, on either client (no Kafka is asked)."""
    path = tmp_path / "ca.pem"
    if cafile == "not PEM":
        path.write_text("not a certificate\n")
    env = {
        **_REQUIRED,
        "WORKER_KAFKA_CLIENT": client,
        "WORKER_SECURITY_PROTOCOL": "SSL",
        "WORKER_SSL_CAFILE": str(path),
        "WORKER_METRICS_PORT": "0",
        "WORKER_LOG_FORMAT": "json",
    }
    done = _run(env, command=command)
    assert done.returncode == 2, done.stderr
    plain = [line for line in done.stderr.splitlines() if not line.startswith("{")]
    assert len(plain) == 1 and plain[0].startswith("error: WORKER_SSL_CAFILE"), done.stderr
    assert "Traceback" not in done.stderr
