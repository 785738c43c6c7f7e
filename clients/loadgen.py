"""A load generator: P client processes run a mix of operations on a DHT for
T seconds, and report throughput and latency percentiles.

    python clients/loadgen.py --dht load --processes 4 --seconds 10 \
        --mix put=50,get=45,delete=5 --keys 100000 --value-size 64
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import sys
import time
from typing import Any

import domus
from domus.errors import DhtExists

OPERATIONS = ("put", "get", "delete", "contains")


def parse_mix(text: str) -> dict[str, int]:
    mix: dict[str, int] = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        if name not in OPERATIONS:
            raise SystemExit(f"loadgen: unknown operation {name!r} in --mix; "
                             f"use {', '.join(OPERATIONS)}")
        mix[name] = int(weight or 1)
    return mix


def worker(args: argparse.Namespace, seed: int, results: Any) -> None:
    generator = random.Random(seed)
    value = b"x" * args.value_size
    names = list(args.mix)
    weights = [args.mix[name] for name in names]
    latencies: list[float] = []
    counts = dict.fromkeys(names, 0)
    with domus.connect(args.supervisor) as cluster:
        dht = cluster.open_dht(args.dht)
        operations = {"put": lambda k: dht.put(k, value), "get": dht.get,
                      "delete": dht.delete, "contains": dht.__contains__}
        end = time.perf_counter() + args.seconds
        while time.perf_counter() < end:
            for name in generator.choices(names, weights, k=64):
                key = generator.randrange(args.keys)
                started = time.perf_counter()
                operations[name](key)
                latencies.append(time.perf_counter() - started)
                counts[name] += 1
    results.put((counts, latencies))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--supervisor", default=None)
    parser.add_argument("--dht", default="load")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--mix", type=parse_mix, default=parse_mix("put=50,get=50"))
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--value-size", type=int, default=64)
    args = parser.parse_args(argv)

    with domus.connect(args.supervisor) as cluster:
        try:
            cluster.create_dht(args.dht)
        except DhtExists:
            pass
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    processes = [context.Process(target=worker, args=(args, seed, results))
                 for seed in range(args.processes)]
    for process in processes:
        process.start()
    totals: dict[str, int] = {}
    latencies: list[float] = []
    for _ in processes:
        counts, samples = results.get()
        for name, count in counts.items():
            totals[name] = totals.get(name, 0) + count
        latencies.extend(samples)
    for process in processes:
        process.join()
    latencies.sort()
    operations = sum(totals.values())

    def percentile(fraction: float) -> float:
        return latencies[min(len(latencies) - 1, int(fraction * len(latencies)))] * 1e6

    breakdown = ", ".join(f"{name} {count:,}" for name, count in totals.items())
    print(f"{operations:,} operations in {args.seconds:.0f}s by {args.processes} processes: "
          f"{operations / args.seconds:,.0f} ops/s  ({breakdown})")
    print(f"latency us: p50 {percentile(0.5):.0f}  p90 {percentile(0.9):.0f}  "
          f"p99 {percentile(0.99):.0f}  max {latencies[-1] * 1e6:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
