"""glibc's mmap threshold, pinned: a large buffer freed goes back to the system even after
another of its size was freed before it (without the pin, glibc raises the threshold and
serves the next from the heap, where it stays resident once freed)."""

from __future__ import annotations

import os
import subprocess
import sys

from worker.allocator import ENVIRONMENT_OVERRIDE

#: In a fresh interpreter: free one 1.5 MiB buffer, then allocate another; print whether
#: pinned and how many mapped chunks (mallinfo2's hblks) the second one added.
_PROBE = """
import ctypes, sys
from worker.allocator import pin_mmap_threshold
pinned = pin_mmap_threshold() if sys.argv[1] == "pin" else False
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
        "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallinfo2.restype = Mallinfo2
size = 3 << 19
libc.free(libc.malloc(size))
before = libc.mallinfo2().hblks
second = libc.malloc(size)
print(pinned, libc.mallinfo2().hblks - before)
libc.free(second)
"""


def _second_buffer(mode: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if k != ENVIRONMENT_OVERRIDE} | (env or {}),
    )
    return done.stdout.strip()


def test_without_the_pin_the_second_large_buffer_comes_from_the_heap() -> None:
    assert _second_buffer("plain") == "False 0"


def test_with_the_pin_the_second_large_buffer_has_its_own_mapping() -> None:
    assert _second_buffer("pin") == "True 1"


def test_a_threshold_set_by_the_operator_is_left_to_glibc() -> None:
    assert _second_buffer("pin", {ENVIRONMENT_OVERRIDE: str(4 << 20)}) == "False 0"
