"""Where a benchmark's numbers come from: date, commit, machine, load."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from typing import Any


def machine() -> dict[str, Any]:
    """The date, the commit measured (``-dirty`` after it when tracked files
    differ from it), the machine and its load average
    (this machine is shared by other work: a high load makes slow numbers)."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        # (run on a tree with changes not committed: the commit alone does
        # not say what ran)
        if subprocess.run(["git", "diff-index", "--quiet", "HEAD", "--"],
                          capture_output=True).returncode == 1:
            commit += "-dirty"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit,
            "machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.platform()}",
            "load_average": [round(load, 2) for load in os.getloadavg()],
            "command": " ".join(["python -m", _module(sys.argv[0]), *sys.argv[1:]])
                       if sys.argv and sys.argv[0] else ""}


def _module(path: str) -> str:
    """The module ``python -m`` ran, from its file's path:
    benchmarks/put1.py is benchmarks.put1, benchmarks/scalability/__main__.py
    is benchmarks.scalability."""
    parts = path.removesuffix(".py").split("/")
    if parts[-1] == "__main__":
        parts = parts[:-1]
    return ".".join(parts[-2:])
