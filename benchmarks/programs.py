"""The benchmarks' C programs, and what domus-bench must be told of a DHT.

``domus-bench`` (cext/programs/bench.c) and ``domus-udp-echo`` (cext/programs/udp_echo.c)
are built by setup.py with the C extensions into ``build/bin/`` of the
source tree; ``make venv`` links them into ``.venv/bin/`` too.

domus-bench talks to one service and does not ask the supervisor where
buckets are: it is given the DHT's id, bucket count and hash, and, when the
DHT is stored on more than one service, the range of buckets the one it
talks to stores (``bench_targets`` works that out from the descriptor).
"""

from __future__ import annotations

import os
import shutil
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM_DIR = os.path.join(ROOT, "build", "bin")


class ProgramMissing(RuntimeError):
    """A C program of the benchmarks is not built."""


def program(name: str) -> str:
    """The path of ``name`` (``domus-bench`` or ``domus-udp-echo``): the
    one built in this tree, else one on $PATH."""
    built = os.path.join(PROGRAM_DIR, name)
    if os.access(built, os.X_OK):
        return built
    found = shutil.which(name)
    if found is not None:
        return found
    raise ProgramMissing(f"{name} is not built: `make venv` (or `python setup.py build_ext "
                         f"--inplace`) builds it into {PROGRAM_DIR}")


def bench_targets(descriptor: dict[str, Any]) -> list[list[str]]:
    """domus-bench's arguments for each storage service of the DHT whose
    descriptor this is (open_dht's answer): ``--service``, ``--dht-id``,
    ``--buckets``, ``--hash`` and, unless the service stores every bucket,
    ``--bucket-range``.  Only a DHT's initial placement can be said as
    ranges: one with buckets moved since is refused."""
    if descriptor.get("storage_moves"):
        raise ValueError(f"DHT {descriptor['name']!r} has buckets moved off their initial "
                         f"placement; domus-bench needs a DHT whose storage services hold "
                         f"ranges of buckets")
    if descriptor.get("buckets") != descriptor.get("initial_buckets"):
        raise ValueError(f"DHT {descriptor['name']!r} was resized; domus-bench needs its "
                         f"initial placement")
    buckets = int(descriptor["buckets"])
    common = ["--dht-id", str(descriptor["id"]), "--buckets", str(buckets),
              "--hash", str(descriptor.get("hash", "xxh3"))]
    targets = []
    first = 0
    for entry in descriptor["storage_services"]:
        count = int(entry["count"])
        if count == 0:
            continue
        arguments = ["--service", entry["address"], *common]
        if count != buckets:
            arguments += ["--bucket-range", f"{first}:{first + count}"]
        targets.append(arguments)
        first += count
    return targets
