"""The test stack uses containers only when asked: an answering Docker engine changes nothing."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from devtools.devstack.containers import docker_available


@pytest.fixture
def answering_engine(tmp_path: Path) -> Iterator[str]:
    """A Unix socket that answers Docker's ``/_ping`` with 200, as a running engine does."""
    path = tmp_path / "docker.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    server.settimeout(10)

    def answer() -> None:
        try:
            while True:
                conn, _ = server.accept()
                with conn:
                    conn.recv(256)
                    conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nOK")
        except OSError:
            return  # closed at teardown

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield f"unix://{path}"
    server.close()
    thread.join(timeout=10)


def test_an_answering_engine_does_not_switch_to_containers(
    answering_engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Docker engine answers at DOCKER_HOST, DEVSTACK_DOCKER unset: local processes still."""
    monkeypatch.setenv("DOCKER_HOST", answering_engine)
    monkeypatch.delenv("DEVSTACK_DOCKER", raising=False)
    assert docker_available() is False


def test_devstack_docker_1_asks_for_containers(monkeypatch: pytest.MonkeyPatch) -> None:
    """DEVSTACK_DOCKER=1 is the one way to run the session stack in containers."""
    monkeypatch.setenv("DEVSTACK_DOCKER", "1")
    assert docker_available() is True
    monkeypatch.setenv("DEVSTACK_DOCKER", "0")
    assert docker_available() is False
