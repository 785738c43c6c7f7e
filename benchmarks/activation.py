"""Deactivating and activating a RAM DHT: how long each takes and how much
memory the services give back.

    python -m benchmarks.activation [--records 100000] [--value-bytes 480]
                                    [--services 3] [--json FILE]

For each RAM platform: a DHT on a fresh local deployment, filled with
``--records`` records, then deactivated (records saved to the services'
data dirs, memory freed) and activated (records loaded); every record is
checked afterwards.  RSS is the sum over the services.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import psutil

import domus
from domus.ops.deploy import LocalDeployment, free_port_block
from domus.storage import PLATFORMS

BATCH = 5000


def services_rss(deployment: LocalDeployment) -> int:
    return sum(psutil.Process(process.pid).memory_info().rss
               for process in deployment.services.values())


def measure(cluster: domus.Cluster, deployment: LocalDeployment, platform: str, records: int,
            value_bytes: int) -> dict[str, float]:
    dht = cluster.create_dht(f"bench-{platform}", platform=platform, storage="ram")
    items = [(f"key-{number}", number.to_bytes(8, "big") * (value_bytes // 8))
             for number in range(records)]
    for start in range(0, records, BATCH):
        dht.put_many(items[start:start + BATCH])
    filled = services_rss(deployment)
    started = time.perf_counter()
    cluster.deactivate_dht(dht.name)
    deactivate = time.perf_counter() - started
    emptied = services_rss(deployment)
    started = time.perf_counter()
    cluster.activate_dht(dht.name)
    activate = time.perf_counter() - started
    found: dict = {}
    for start in range(0, records, BATCH):
        found.update(dht.get_many([key for key, _value in items[start:start + BATCH]]))
    if found != dict(items):
        raise SystemExit(f"{platform}: records differ after activation")
    cluster.destroy_dht(dht.name)
    return {"deactivate_s": deactivate, "activate_s": activate,
            "rss_filled_mib": filled / 2**20, "rss_inactive_mib": emptied / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--value-bytes", type=int, default=480)
    parser.add_argument("--services", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    platforms = sorted(name for name, platform in PLATFORMS.items() if "ram" in platform.media)
    results = {}
    for platform in platforms:   # a fresh deployment each: RSS starts from the same place
        with tempfile.TemporaryDirectory() as data_dir, \
                LocalDeployment(args.services, port=free_port_block(args.services + 1),
                                data_dir=data_dir) as deployment, \
                deployment.connect(timeout=30.0) as cluster:
            os.environ.update(deployment.environment())   # (workers find its secret)
            results[platform] = measure(cluster, deployment, platform, args.records,
                                        args.value_bytes)
    print(f"{args.records} records of {args.value_bytes} bytes on {args.services} services "
          f"(RSS summed over the services)")
    print(f"{'platform':<20} {'deactivate':>11} {'activate':>9} {'RSS filled':>11} "
          f"{'RSS inactive':>13}")
    for platform, result in results.items():
        print(f"{platform:<20} {result['deactivate_s']:>10.2f}s {result['activate_s']:>8.2f}s "
              f"{result['rss_filled_mib']:>7.0f} MiB {result['rss_inactive_mib']:>9.0f} MiB")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump({"command": "python -m benchmarks.activation", "arguments": vars(args),
                       "results": results}, target, indent=1)


if __name__ == "__main__":
    main()
