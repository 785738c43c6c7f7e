"""domus.service.allocator: a service process keeps freed large blocks for
the next large request (up to KEEP_FREE), where a process left as glibc
starts gives a lone large block back to the kernel when it is freed.  Each
case runs in a fresh process, so no earlier allocation has moved glibc's
own thresholds."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

PROGRAM = """
import sys
from domus.service import allocator

def rss():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096

if sys.argv[1] == "keep":
    assert allocator.keep_large_blocks()
before = rss()
block = b"\\x01" * (20 << 20)          # every page touched
del block
print(rss() - before)
"""


def kept_after_free(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True,
                          text=True, check=True, timeout=60)
    return int(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or "libc.so" not in (ctypes.util.find_library("c") or ""),
                    reason="glibc's malloc only")
def test_a_service_process_keeps_a_freed_large_block_and_a_plain_one_does_not():
    assert kept_after_free("keep") >= 19 << 20
    assert kept_after_free("plain") < 4 << 20
