"""put1 throughput of each lookup strategy, relative to direct (D).

    python -m benchmarks.strategies [--services 4] [--buckets 1024]
        [--clients 2] [--seconds 3] [--rounds 3] [--routing chord] [--json FILE]

A local deployment of S services (routing and storage on all of them) and
one DHT of B buckets.  For each point (a strategy and a cache size), K
client processes open the DHT with that strategy, warm up for a second
(filling the cache as a long-running job's would be), then issue single
put1 requests (random 64-bit int key and value, one request per round trip)
for T seconds.  The points are measured in turn, R rounds over (so that a
machine whose speed drifts, such as a shared VM, slows every point alike),
and each point's median round is kept.  Prints each point's throughput,
its ratio to D, and what the lookups cost: the share of requests the cache
answered and the mean messages per request (1 = straight to the storage
service).

The issue's target: C,R with a 50% cache reaches at least 50% of D.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from typing import Any

from benchmarks.put1 import _run_clients, _timed_loop
from domus.ops.deploy import LocalDeployment, free_port_block

POINTS = [("D", None), ("D,C,R", 0.5), ("C,R", 0.5), ("C,R", 0.25), ("R", None)]
DHT = "strategies"
WARM_UP = 1.0


def _worker(target: tuple[str, str, float | None], seconds: float, seed: int, barrier: Any,
            results: Any) -> None:
    import domus

    supervisor, strategy, cache = target
    with domus.connect(supervisor) as cluster:
        dht = cluster.open_dht(DHT, lookup=strategy, cache=cache)
        _timed_loop(dht.put, WARM_UP, seed + 7_000)
        warm = dht.stats()
        barrier.wait()
        count, elapsed = _timed_loop(dht.put, seconds, seed)
        results.put((count, elapsed, _costs(warm, dht.stats())))


def _costs(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Requests, cache hits and messages during the timed part."""
    def totals(stats: dict[str, Any]) -> tuple[int, int, float]:
        methods = stats["lookups"].values()
        served = sum(method["hits"] + method["distributed"] for method in methods)
        messages = sum(method["mean_hops"] * (method["hits"] + method["distributed"])
                       for method in methods)
        cached = stats["lookups"].get("C", {}).get("hits", 0)
        return served, cached, messages

    served, cached, messages = (a - b for a, b in zip(totals(after), totals(before)))
    return {"requests": served, "cache_hits": cached, "messages": messages}


def measure(services: int, buckets: int, clients: int, seconds: float, rounds: int,
            routing: str) -> list[dict[str, Any]]:

    data_dir = tempfile.mkdtemp(prefix="domus-bench-")
    runs: list[list[tuple[float, dict[str, float]]]] = [[] for _ in POINTS]
    try:
        with LocalDeployment(services, port=free_port_block(services + 1),
                             data_dir=data_dir) as deployment:
            os.environ.update(deployment.environment())   # (workers find its secret)
            with deployment.connect() as cluster:
                cluster.create_dht(DHT, buckets=buckets, routing=routing)
            for round_ in range(1, rounds + 1):
                for index, (strategy, cache) in enumerate(POINTS):
                    rate, costs = _run(deployment.supervisor_address, strategy, cache,
                                       clients, seconds)
                    runs[index].append((rate, costs))
                    print(f"  round {round_}: {strategy:<6} cache {cache or '-':<5} "
                          f"{rate:>10,.0f} ops/s", flush=True)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    points = []
    for (strategy, cache), measured in zip(POINTS, runs):
        rate, costs = sorted(measured, key=lambda run: run[0])[len(measured) // 2]
        points.append({"strategy": strategy, "cache": cache, "ops_per_s": rate,
                       "rounds": [run[0] for run in measured], **costs})
    return points


def _run(supervisor: str, strategy: str, cache: float | None, clients: int,
         seconds: float) -> tuple[float, dict[str, float]]:
    collected: list[dict[str, float]] = []

    def keep(worker_result: Any) -> Any:
        count, elapsed, costs = worker_result
        collected.append(costs)
        return count, elapsed

    rate = _run_clients(_worker, (supervisor, strategy, cache), clients, seconds,
                        take=keep)
    requests = sum(costs["requests"] for costs in collected) or 1
    return rate, {"cache_hit_share": sum(costs["cache_hits"] for costs in collected) / requests,
                  "messages_per_request": sum(costs["messages"] for costs in collected)
                  / requests}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=4)
    parser.add_argument("--buckets", type=int, default=1024)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0, help="per point and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--routing", default="chord", choices=["chord", "bruijn"])
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = parser.parse_args(argv)

    print(f"put1 by lookup strategy: {args.services} services, {args.buckets} buckets, "
          f"{args.routing}, {args.clients} clients, {args.seconds:.0f} s per point x "
          f"{args.rounds} rounds, {os.cpu_count()} cores", flush=True)
    points = measure(args.services, args.buckets, args.clients, args.seconds, args.rounds,
                     args.routing)
    direct = points[0]["ops_per_s"]
    print(f"{'strategy':<8} {'cache':>5} {'ops/s':>10} {'vs D':>6} {'cache hits':>10} "
          f"{'msgs/req':>8}")
    for point in points:
        point["vs_direct"] = point["ops_per_s"] / direct
        cache = f"{point['cache']:.0%}" if point["cache"] else "-"
        print(f"{point['strategy']:<8} {cache:>5} {point['ops_per_s']:>10,.0f} "
              f"{point['vs_direct']:>6.0%} {point['cache_hit_share']:>10.0%} "
              f"{point['messages_per_request']:>8.2f}")
    target = next(point for point in points
                  if point["strategy"] == "C,R" and point["cache"] == 0.5)
    print(f"C,R at 50% cache / D = {target['vs_direct']:.2f} (target: at least 0.50)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump({"services": args.services, "buckets": args.buckets,
                       "clients": args.clients, "seconds": args.seconds,
                       "rounds": args.rounds,
                       "routing": args.routing, "points": points}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
