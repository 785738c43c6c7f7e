"""put_many / get_many throughput against a local deployment.

    python -m benchmarks.batches [--services 3] [--records 100000] [--repeat 3]

Small records (int key, short str value) and large ones (2 KB values) are
written with put_many and read back with get_many, in one call each; every
value read back is checked.  Prints keys/s, best of ``repeat`` runs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from domus.ops.deploy import LocalDeployment, free_port_block


def best_rate(operation: Callable[[], Any], count: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        operation()
        best = min(best, time.perf_counter() - started)
    return count / best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=3)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--large", type=int, default=20_000, help="records of 2 KB")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)

    data_dir = tempfile.mkdtemp(prefix="domus-bench-")
    try:
        with LocalDeployment(args.services, port=free_port_block(args.services + 1),
                             data_dir=data_dir) as deployment, \
                deployment.connect() as cluster:
            os.environ.update(deployment.environment())   # (workers find its secret)
            dht = cluster.create_dht("batches")
            print(f"{args.services} services, best of {args.repeat} runs")
            for label, records in (
                    (f"{args.records:,} small records", {i: f"v{i}" for i in range(args.records)}),
                    (f"{args.large:,} records of 2 KB",
                     {-i - 1: "x" * 2048 for i in range(args.large)})):
                put_rate = best_rate(lambda records=records: dht.put_many(records),
                                     len(records), args.repeat)
                get_rate = best_rate(lambda records=records: dht.get_many(records),
                                     len(records), args.repeat)
                if dht.get_many(records) != records:
                    raise SystemExit(f"get_many returned wrong values for {label}")
                print(f"{label:>26}: put_many {put_rate:>10,.0f} keys/s   "
                      f"get_many {get_rate:>10,.0f} keys/s")
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
