"""What serving metrics costs: how long a scrape of a service holding many
DHTs (and of the supervisor) takes and how big it is, and put1 throughput
while ``/metrics`` is scraped and while it is not.

    python -m benchmarks.metrics [--dhts 8] [--buckets 256] [--scrapes 50]
                                 [--seconds 4] [--rounds 3] [--interval 1.0]
                                 [--json FILE]

One service and the supervisor, both with ``--metrics``; ``--dhts`` DHTs of
``--buckets`` buckets on the service, 1,000 records each.  A scrape is a
plain HTTP GET of /metrics (urllib, as curl would), timed from the request
to the last byte; the page is rendered on the service's reactor between two
requests, so its time is time the service is not serving.  Then one client
puts for ``--seconds``, in ``--rounds`` rounds taken in turn without and
with a scraper process fetching the service's page every ``--interval``
seconds (Prometheus's default is 15 s; 1 s is fifteen times that);
medians are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

import domus
from domus.ops.deploy import LocalDeployment, free_port_block

SCRAPER = """
import sys, time, urllib.request
url, interval = sys.argv[1], float(sys.argv[2])
while True:
    urllib.request.urlopen(url, timeout=10).read()
    time.sleep(interval)
"""


def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit,
            "machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.platform()}, "
                       "shared with other work"}


def scrape_times(address: str, count: int) -> dict[str, float]:
    url = f"http://{address}/metrics"
    times, size, samples = [], 0, 0
    for _ in range(count):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=10) as page:
            body = page.read()
        times.append(time.perf_counter() - started)
        size = len(body)
    samples = sum(len(family.samples)
                  for family in text_string_to_metric_families(body.decode()))
    times.sort()
    return {"median_ms": statistics.median(times) * 1e3,
            "p95_ms": times[int(0.95 * (len(times) - 1))] * 1e3, "max_ms": times[-1] * 1e3,
            "bytes": size, "samples": samples}


def puts_per_second(dht: Any, seconds: float) -> float:
    done = 0
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        for _ in range(100):
            dht[done] = done
            done += 1
    return done / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dhts", type=int, default=8)
    parser.add_argument("--buckets", type=int, default=256)
    parser.add_argument("--scrapes", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    port = free_port_block(4)
    with tempfile.TemporaryDirectory() as data_dir, \
            LocalDeployment(1, port=port, data_dir=data_dir, metrics_port=port + 2,
                            supervisor_args=["--balance", "manual"]) as deployment, \
            domus.connect(deployment.supervisor_address, timeout=30.0) as cluster:
        for number in range(args.dhts):
            dht = cluster.create_dht(f"bench-{number}", buckets=args.buckets)
            dht.put_many({f"key-{index}": index for index in range(1000)})
        scrapes = {name: scrape_times(deployment.metrics_address(name), args.scrapes)
                   for name in ("s1", "supervisor")}
        target = cluster.create_dht("put1", buckets=args.buckets)
        rates: dict[str, list[float]] = {"not scraped": [], "scraped": []}
        for _round in range(args.rounds):
            rates["not scraped"].append(puts_per_second(target, args.seconds))
            scraper = subprocess.Popen([sys.executable, "-c", SCRAPER,
                                        f"http://{deployment.metrics_address('s1')}/metrics",
                                        str(args.interval)])
            try:
                rates["scraped"].append(puts_per_second(target, args.seconds))
            finally:
                scraper.terminate()
                scraper.wait(10)
    where = machine()
    put1 = {case: statistics.median(values) for case, values in rates.items()}
    print(f"{where['date']}, commit {where['commit']}, {where['machine']}")
    print(f"one service holding {args.dhts} DHTs of {args.buckets} buckets; "
          f"{args.scrapes} scrapes each")
    print(f"{'page':<12} {'median':>9} {'p95':>9} {'max':>9} {'bytes':>8} {'samples':>8}")
    for name, result in scrapes.items():
        print(f"{name:<12} {result['median_ms']:>7.2f}ms {result['p95_ms']:>7.2f}ms "
              f"{result['max_ms']:>7.2f}ms {result['bytes']:>8} {result['samples']:>8}")
    print(f"put1, one client, {args.rounds} rounds of {args.seconds:.0f}s (medians): "
          f"{put1['not scraped']:,.0f} puts/s not scraped, {put1['scraped']:,.0f} puts/s "
          f"scraped every {args.interval:g}s ({put1['scraped'] / put1['not scraped']:.1%})")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": "python -m benchmarks.metrics " + " ".join(sys.argv[1:]),
                       **where, "arguments": vars(args), "scrapes": scrapes,
                       "put1_per_s": put1, "put1_rounds": rates}, out, indent=1)
            out.write("\n")


if __name__ == "__main__":
    main()
