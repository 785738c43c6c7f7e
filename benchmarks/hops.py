"""Service-level hops of distributed lookups, per routing graph and algorithm.

    python -m benchmarks.hops [--services 8] [--samples 2000] [--moved 0]
                              [--seed 2024] [--png FILE] [--json FILE]

For every bucket count B = 256, 512, ..., 65,536, the buckets are shared out
among ``--services`` services as contiguous ranges (domus.placement.assignment, equal
weights); with ``--moved F``, a fraction F of the buckets are then moved, one
at a time, to random services, so services route scattered ranges.  The same
``--samples`` random (start bucket, target bucket) pairs (fixed seed) are
routed with ``RoutingGraph.route`` through chord and through de Bruijn graphs
of degree 2 and 4, with each routing algorithm.  Printed per B, graph and
algorithm: mean and max hops (a lookup that starts at the target's service
takes 0), the proven bound, and the time one next_bucket call takes in
microseconds (every hop replayed, best of three passes; Python, in-process:
the routing decision alone, no network).
Every max is checked against the bound (exit status 1 if one is over).
``--png`` plots mean hops against B (needs matplotlib); ``--json`` writes
the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any

from domus.placement.assignment import proportional_counts
from domus.placement.bucketmap import BucketMap
from domus.routing import BruijnGraph, ChordGraph, RoutingGraph, local_ranges

BUCKET_COUNTS = [1 << bits for bits in range(8, 17)]


def graphs(bucket_count: int) -> dict[str, RoutingGraph]:
    return {"chord": ChordGraph(bucket_count), "bruijn-2": BruijnGraph(bucket_count, 2),
            "bruijn-4": BruijnGraph(bucket_count, 4)}


def layout(bucket_count: int, services: int, moved: float,
           rng: random.Random) -> tuple[list[int], dict[int, list[tuple[int, int]]]]:
    """The owner of every bucket, and each owner's local ranges."""
    counts = proportional_counts(bucket_count, [1] * services)
    bucket_map: BucketMap[int] = BucketMap.from_counts(counts, list(range(services)))
    for _ in range(round(moved * bucket_count)):
        bucket = rng.randrange(bucket_count)
        bucket_map.assign(bucket, bucket + 1, rng.randrange(services))
    owners = bucket_map.dense()
    return owners, {owner: local_ranges(bucket_map, owner) for owner in bucket_map.owners()}


def measure(services: int, samples: int, moved: float, seed: int) -> list[dict[str, Any]]:
    rows = []
    for bucket_count in BUCKET_COUNTS:
        rng = random.Random(seed + bucket_count)
        owners, local = layout(bucket_count, services, moved, rng)

        def local_of(bucket: int, owners: list[int] = owners,
                     local: dict[int, list[tuple[int, int]]] = local) -> list[tuple[int, int]]:
            return local[owners[bucket]]

        pairs = [(rng.randrange(bucket_count), rng.randrange(bucket_count))
                 for _ in range(samples)]
        for graph_name, graph in graphs(bucket_count).items():
            for algorithm in graph.algorithms:
                chains = [(graph.route(local_of, start, target, algorithm), target)
                          for start, target in pairs]
                hops = [len(chain) - 1 for chain, _target in chains]
                rows.append({
                    "buckets": bucket_count, "graph": graph_name, "algorithm": algorithm,
                    "mean_hops": sum(hops) / samples, "max_hops": max(hops),
                    "bound": graph.hop_bound(),
                    "us_per_hop": time_per_hop(graph, algorithm, local_of, chains),
                })
    return rows


def time_per_hop(graph: RoutingGraph, algorithm: str, local_of: Any,
                 chains: list[tuple[list[int], int]]) -> float | None:
    """Microseconds per next_bucket call, replaying every hop of ``chains``
    (best of three passes); None if no lookup took a hop."""
    hops = [(local_of(bucket), target, bucket)
            for chain, target in chains for bucket in chain[:-1]]
    if not hops:
        return None
    next_bucket = graph.next_bucket
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for local, target, bucket in hops:
            next_bucket(local, target, algorithm, bucket)
        best = min(best, time.perf_counter() - started)
    return best / len(hops) * 1e6


def report(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'B':>6}  {'graph':<9} {'algorithm':<12} {'mean':>6} {'max':>4} {'bound':>5} "
             f"{'us/hop':>7}"]
    for row in rows:
        per_hop = "-" if row["us_per_hop"] is None else f"{row['us_per_hop']:.1f}"
        over = "  OVER THE BOUND" if row["max_hops"] > row["bound"] else ""
        lines.append(f"{row['buckets']:>6}  {row['graph']:<9} {row['algorithm']:<12} "
                     f"{row['mean_hops']:>6.2f} {row['max_hops']:>4} {row['bound']:>5} "
                     f"{per_hop:>7}{over}")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    """Mean hops against B, one line per graph and algorithm; False if
    matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        series.setdefault(f"{row['graph']} {row['algorithm']}", []).append(
            (row["buckets"], row["mean_hops"]))
    for label, points in series.items():
        axes.plot([b for b, _ in points], [h for _, h in points], marker="o", label=label)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("buckets (B)")
    axes.set_ylabel("mean service-level hops")
    axes.set_title(title)
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=8, help="routing services")
    parser.add_argument("--samples", type=int, default=2000,
                        help="(start, target) pairs per bucket count")
    parser.add_argument("--moved", type=float, default=0.0,
                        help="fraction of buckets moved to random services afterwards")
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--png", type=Path, help="plot mean hops against B to this file")
    parser.add_argument("--json", type=Path, help="write the numbers to this file")
    arguments = parser.parse_args(argv)
    if arguments.services < 1 or arguments.samples < 1 or not 0 <= arguments.moved <= 1:
        parser.error("--services and --samples must be >= 1, --moved within [0, 1]")
    rows = measure(arguments.services, arguments.samples, arguments.moved, arguments.seed)
    title = (f"{arguments.services} services, {arguments.samples} lookups per B"
             + (f", {arguments.moved:.0%} of buckets moved" if arguments.moved else ""))
    print(f"{title}, seed {arguments.seed}, Python {platform.python_version()}")
    print(report(rows))
    if arguments.png is not None:
        if plot(rows, arguments.png, title):
            print(f"plot: {arguments.png}")
        else:
            print("matplotlib is not installed: no plot (pip install matplotlib)")
    if arguments.json is not None:
        arguments.json.parent.mkdir(parents=True, exist_ok=True)
        arguments.json.write_text(json.dumps({
            "command": "python -m benchmarks.hops " + " ".join(sys.argv[1:] if argv is None
                                                               else argv),
            "services": arguments.services, "samples": arguments.samples,
            "moved": arguments.moved, "seed": arguments.seed,
            "python": platform.python_version(), "rows": rows,
        }, indent=1) + "\n")
    return 0 if all(row["max_hops"] <= row["bound"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
