"""put_many in big batches into one service, against Redis pipelines.

    python -m benchmarks.put_many [--records 200000] [--batch 10000] [--repeat 3]

One service (a local deployment: supervisor + 1 service process) and one
client writing ``records`` records (int key, short str value) with
``dht.put_many`` in batches of ``batch`` keys, then reading them back with
``dht.get_many`` in the same batches (every value checked).  Then the same
records against a local ``redis-server`` with redis-py (hiredis parser)
pipelines of the same batch size (``transaction=False``: SETs, then GETs).
Prints keys/s (best of ``repeat`` runs) and the ratios.

Set DOMUS_PURE_PYTHON=1 to measure the pure-Python code paths (no C hot
path in the client or the service).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
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


def batches(records: dict[int, str], size: int) -> list[dict[int, str]]:
    items = list(records.items())
    return [dict(items[start:start + size]) for start in range(0, len(items), size)]


def measure_domus(records: dict[int, str], size: int, repeat: int) -> dict[str, float]:
    data_dir = tempfile.mkdtemp(prefix="domus-bench-")
    parts = batches(records, size)
    try:
        with LocalDeployment(1, port=free_port_block(2), data_dir=data_dir) as deployment, \
                deployment.connect() as cluster:
            os.environ.update(deployment.environment())   # (workers find its secret)
            dht = cluster.create_dht("put_many")

            def put_all() -> None:
                for part in parts:
                    dht.put_many(part)

            def get_all() -> None:
                for part in parts:
                    dht.get_many(part)

            put_rate = best_rate(put_all, len(records), repeat)
            get_rate = best_rate(get_all, len(records), repeat)
            for part in parts:
                if dht.get_many(part) != part:
                    raise SystemExit("domus: get_many returned wrong values")
            return {"put": put_rate, "get": get_rate}
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def measure_redis(records: dict[int, str], size: int, repeat: int) -> dict[str, float] | None:
    server_binary = shutil.which("redis-server")
    if server_binary is None:
        print("redis-server not found; skipping Redis", file=sys.stderr)
        return None
    import redis
    import redis.utils

    if not redis.utils.HIREDIS_AVAILABLE:
        print("warning: hiredis is not installed; redis-py uses its slower Python parser",
              file=sys.stderr)
    port = free_port_block(1)
    server = subprocess.Popen([server_binary, "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        parts = batches(records, size)

        def put_all() -> None:
            for part in parts:
                pipe = client.pipeline(transaction=False)
                for key, value in part.items():
                    pipe.set(key, value)
                pipe.execute()

        def get_all() -> list[Any]:
            got = []
            for part in parts:
                pipe = client.pipeline(transaction=False)
                for key in part:
                    pipe.get(key)
                got.append(pipe.execute())
            return got

        put_rate = best_rate(put_all, len(records), repeat)
        get_rate = best_rate(get_all, len(records), repeat)
        for part, values in zip(parts, get_all()):
            if [value.decode() for value in values] != list(part.values()):
                raise SystemExit("redis: pipeline returned wrong values")
        return {"put": put_rate, "get": get_rate}
    finally:
        server.terminate()
        server.wait(10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)

    records = {key * 7919 - 10**9: f"v{key}" for key in range(args.records)}
    pure = os.environ.get("DOMUS_PURE_PYTHON") == "1"
    print(f"{args.records:,} records in batches of {args.batch:,}, one service, best of "
          f"{args.repeat}{' (pure Python paths)' if pure else ''}", flush=True)
    results: dict[str, Any] = {"records": args.records, "batch": args.batch,
                               "pure_python": pure,
                               "domus": measure_domus(records, args.batch, args.repeat)}
    results["redis"] = None if args.no_redis else measure_redis(records, args.batch,
                                                                   args.repeat)
    for operation, label in (("put", "put_many / pipelined SET"),
                             ("get", "get_many / pipelined GET")):
        domus_rate = results["domus"][operation]
        line = f"{label:>26}: domus {domus_rate:>10,.0f} keys/s"
        if results["redis"]:
            redis_rate = results["redis"][operation]
            line += (f"   redis {redis_rate:>10,.0f} keys/s"
                     f"   domus/redis {domus_rate / redis_rate:.2f}x")
        print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump(results, target, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
