"""The process's allocator: large buffers go back to the system when they are freed.

glibc serves an allocation of 128 KiB or more with a mapping of its own, returned to the
system on free, but it raises that threshold to the size of each such buffer freed (up to
32 MiB). After the first large record (librdkafka decompresses a 1.5 MiB record into one
buffer, and the worker copies it once), every buffer of that size comes from the heap's
arenas, one per librdkafka thread, and freed there it stays resident: under a backlog
with such records now and then a worker on librdkafka held 80-100 MiB more than one
without them, though it freed everything. Pinning the threshold at its default stops that
rise, at the cost of a mapping per large buffer (a few per fetch).
"""

from __future__ import annotations

import ctypes
import os
import sys

#: glibc's ``mallopt`` parameter for the mmap threshold (``M_MMAP_THRESHOLD``).
M_MMAP_THRESHOLD = -3
#: glibc's default threshold: a buffer from this size up gets its own mapping.
MMAP_THRESHOLD_BYTES = 128 * 1024
#: Set by an operator, glibc reads it itself at start (and adjusts nothing dynamically).
ENVIRONMENT_OVERRIDE = "MALLOC_MMAP_THRESHOLD_"


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at its default, unless ``MALLOC_MMAP_THRESHOLD_`` sets
    one; True when pinned here (False on other C libraries and platforms)."""
    if not sys.platform.startswith("linux") or ENVIRONMENT_OVERRIDE in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    pinned: int = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
    return pinned == 1
