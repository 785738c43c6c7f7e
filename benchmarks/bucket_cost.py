"""What opening a DHT's buckets costs one service: the time (one reactor
turn: the service answers nothing meanwhile) and the memory, per storage
platform and bucket count.  The supervisor's BUCKETS_PER_SERVICE (the most
buckets of a DHT one service is given) follows from these.

    python -m benchmarks.bucket_cost [--out benchmarks/results/bucket_cost.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import psutil

from benchmarks import provenance
from domus.service.handler import RequestHandler

CASES = [("python-dict", "ram", count) for count in (16384, 65536, 262144)] + [
    ("domus-bsddb-btree", "disk", count) for count in (1024, 2048, 4096)]


def measure(platform: str, storage: str, count: int) -> dict[str, float]:
    process = psutil.Process()
    with tempfile.TemporaryDirectory() as data_dir:
        before = process.memory_info().rss
        handler = RequestHandler("s1", data_dir=data_dir)
        services = [{"name": "s1", "address": "127.0.0.1:1", "count": count}]
        descriptor = {"id": 1, "name": "cost", "buckets": count, "hash": "xxh3",
                      "storage": storage, "platform": platform, "routing": "chord",
                      "lookup": "D", "state": "active", "routing_services": services,
                      "storage_services": services}
        started = time.perf_counter()
        handler.assign(descriptor)
        seconds = time.perf_counter() - started
        grown = process.memory_info().rss - before
        handler.close()
    return {"platform": platform, "storage": storage, "buckets": count,
            "seconds": round(seconds, 3), "rss_mib": round(grown / 2**20, 1),
            "us_per_bucket": round(seconds / count * 1e6, 1),
            "kib_per_bucket": round(grown / count / 1024, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    results = []
    for platform, storage, count in CASES:
        row = measure(platform, storage, count)
        results.append(row)
        print(f"{platform:18} {storage:4} {count:>7} buckets: {row['seconds']:7.2f} s "
              f"{row['rss_mib']:7.1f} MiB  ({row['us_per_bucket']} us, "
              f"{row['kib_per_bucket']} KiB a bucket)", flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as target:
            json.dump({**provenance.machine(), "command": "python -m benchmarks.bucket_cost",
                       "results": results}, target, indent=1)


if __name__ == "__main__":
    main()
