"""Client CPU per operation: what one Domus client process spends itself.

    python -m benchmarks.client_cpu [--operations 20000] [--batch 10000]

One service (a local deployment: supervisor + 1 service process) and this
process as the only client.  Single puts and gets of random 64-bit int keys
(one request per round trip), then put_many and get_many of ``batch`` keys
(int key, short str value).  Prints the client's CPU time (user and system,
from getrusage: the service's is not counted) per operation or per key, and
the wall time, best of ``repeat`` runs.  Set DOMUS_PURE_PYTHON=1 to measure
the pure-Python code paths.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from domus.client import codec
from domus.ops.deploy import LocalDeployment, free_port_block


def measure(operation: Callable[[], Any], count: int, repeat: int) -> tuple[float, ...]:
    """Best of ``repeat``: (CPU, user, system, wall) in µs per item."""
    best = (float("inf"), 0.0, 0.0, 0.0)
    for _ in range(repeat):
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        operation()
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
        user = after.ru_utime - before.ru_utime
        system = after.ru_stime - before.ru_stime
        best = min(best, tuple(seconds / count * 1e6 for seconds in
                               (user + system, user, system, wall)))
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--operations", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    data_dir = tempfile.mkdtemp(prefix="domus-bench-")
    try:
        with LocalDeployment(1, port=free_port_block(2), data_dir=data_dir) as deployment, \
                deployment.connect() as cluster:
            os.environ.update(deployment.environment())   # (workers find its secret)
            dht = cluster.create_dht("client_cpu")
            generator = random.Random(1)
            keys = [generator.getrandbits(64) - (1 << 63) for _ in range(args.operations)]
            records = {key * 7919 - 10**9: f"v{key}" for key in range(args.batch)}
            dht.put(-1, 0)  # warm the channel

            def puts() -> None:
                for key in keys:
                    dht.put(key, key)

            def gets() -> None:
                for key in keys:
                    dht.get(key)

            print(f"one service, one client, codec: {codec.IMPLEMENTATION}, best of "
                  f"{args.repeat}", flush=True)
            for label, operation, count, unit in (
                    ("put", puts, len(keys), "op"), ("get", gets, len(keys), "op"),
                    (f"put_many of {args.batch:,}", lambda: dht.put_many(records),
                     len(records), "key"),
                    (f"get_many of {args.batch:,}", lambda: dht.get_many(records),
                     len(records), "key")):
                cpu, user, system, wall = measure(operation, count, args.repeat)
                print(f"{label:>20}: client CPU {cpu:6.2f} µs/{unit} (user {user:5.2f}, "
                      f"system {system:5.2f}), wall {wall:6.2f} µs/{unit}")
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
