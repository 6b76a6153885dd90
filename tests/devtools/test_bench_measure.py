"""How the benchmark reads a server's CPU: Triton's model stubs are processes of their own."""

from __future__ import annotations

import subprocess
import sys

from devtools.bench.measure import cpu_s, tree_cpu_s

#: A child that spends this much CPU, says so, then waits for its stdin to close.
_CHILD_CPU_S = 0.3
_CHILD = f"""
import sys, time
started = time.process_time()
while time.process_time() - started < {_CHILD_CPU_S}:
    pass
print("spent", flush=True)
sys.stdin.read()
"""
#: A parent that starts the child on its own stdin and stdout and waits for it.
_PARENT = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {_CHILD!r}])"


def test_a_servers_cpu_counts_its_children_alive() -> None:
    """The child's CPU counts in its parent's tree, not in the parent's own."""
    with subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    ) as parent:
        assert parent.stdin is not None and parent.stdout is not None
        with parent.stdin:
            assert parent.stdout.readline() == b"spent\n"
            own, tree = cpu_s(parent.pid), tree_cpu_s(parent.pid)
        parent.wait(10)
    assert own < _CHILD_CPU_S
    assert tree >= own + _CHILD_CPU_S * 0.9


def test_an_unknown_server_counts_nothing() -> None:
    assert tree_cpu_s(None) == 0.0
