"""How a service process's allocator treats the large blocks that large
values need.

A PUT or GET of a large value allocates blocks of its size: the frame as
it comes in, the value stored, the reply.  By default glibc's malloc gives
such blocks back to the kernel as soon as they are freed (munmap, or
trimming the top of the heap past twice its mmap threshold), so the next
request of that size faults in and zeroes every page again: page faults
and zeroing were a fifth of the service's time on 1 MiB PUTs.  A service
instead keeps up to ``KEEP_FREE`` bytes of freed memory for the next
request: blocks up to 32 MiB (glibc's highest threshold, above the largest
frame) come from the heap, and the heap is trimmed only once more than
``KEEP_FREE`` bytes at its top are free.  (glibc already moves a freed
block's size to the heap after its first free; this makes it so from the
start, and bounds what is kept.)  docs/operations.md has the numbers.
"""

from __future__ import annotations

import ctypes
import sys

KEEP_FREE = 64 << 20        # bytes of freed memory kept for the next large request
MMAP_THRESHOLD = 32 << 20   # glibc's highest: blocks below come from the heap
_M_TRIM_THRESHOLD = -1      # (glibc's mallopt parameters, malloc.h)
_M_MMAP_THRESHOLD = -3


def keep_large_blocks(keep_free: int = KEEP_FREE) -> bool:
    """Have this process's malloc keep freed large blocks (see the module);
    True if it took the settings, False where there is no glibc mallopt
    (another C library or system: nothing changes)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
            and mallopt(_M_TRIM_THRESHOLD, keep_free) == 1)
