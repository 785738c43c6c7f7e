"""put1 and get throughput, and bytes per record, of every storage platform
and medium, in the same run.

    python -m benchmarks.platforms [--clients 4] [--seconds 5] [--records 100000]

One service (a local deployment: supervisor + 1 service process) and one
DHT per technology.  For each: K client processes issue single put1
requests (random 64-bit int key and value, one request per round trip) for
T seconds, then single gets of the keys they stored, in the same order,
for T seconds.  Then
``--records`` records (int key, 8-byte value) go into a fresh DHT of that
technology with put_many, and the bytes per record are measured one of three
ways, which the table names:

- ``rss``: what the service process's RSS grew by (RAM python-dict and
  domus-rbt);
- ``files``: what the DHT's files take on disk after a flush (disk media);
- ``pages``: the DHT's ``storage_bytes`` in the service's stats, Berkeley DB's
  pages x page size (RAM Berkeley DB, whose pages land in a cache region
  reserved up front, so RSS does not show them one by one).

Prints a table and the ratio the storage issue sets a target for: disk
domus-bsddb-btree put1 / ram python-dict put1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import socket
import sys
import tempfile
import time
from typing import Any

import psutil

from benchmarks.put1 import INT64, _run_clients
from domus.ops.deploy import LocalDeployment, free_port_block
from domus.service.hosted import dht_home
from domus.storage import PLATFORMS
from domus.wire import address as addresses
from domus.wire import protocol as wire

TECHNOLOGIES = [(platform, medium) for platform in
                ("python-dict", "domus-rbt", "domus-bsddb-btree", "domus-bsddb-hash")
                for medium in ("ram", "disk") if medium in PLATFORMS[platform].media]


def _name(platform: str, medium: str) -> str:
    return f"bench-{platform}-{medium}"


def _keys(seed: int) -> Any:
    generator = random.Random(seed)
    while True:
        yield generator.getrandbits(64) - INT64, generator.getrandbits(64) - INT64


def _timed(operation: Any, seconds: float, seed: int) -> tuple[int, float]:
    pairs = _keys(seed)
    count = 0
    started = time.perf_counter()
    end = started + seconds
    while True:
        for _ in range(64):
            operation(*next(pairs))
        count += 64
        if time.perf_counter() >= end:
            break
    return count, time.perf_counter() - started


def _service_stats(address: str) -> dict[str, Any]:
    """A service's own stats (OP_STATS over UDP; asked again if lost)."""
    host, port = addresses.parse(address)
    request = wire.request_header(wire.OP_STATS, 1, random.getrandbits(63))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2.0)
        for _attempt in range(5):
            sock.sendto(request, (host, port))
            try:
                reply = sock.recv(65536)
            except TimeoutError:
                continue
            if reply[2] != wire.ST_OK:
                raise RuntimeError(f"service {address} refused its stats: {reply[8:]!r}")
            return wire.unpack(reply[wire.REPLY_HEADER_SIZE:])
    raise RuntimeError(f"service {address} did not answer OP_STATS")


def _put_worker(target: Any, seconds: float, seed: int, barrier: Any, results: Any) -> None:
    import domus

    supervisor, name = target
    with domus.connect(supervisor) as cluster:
        dht = cluster.open_dht(name)
        barrier.wait()
        results.put(_timed(dht.put, seconds, seed))


def measure(clients: int, seconds: float, records: int) -> dict[str, dict[str, float]]:
    data_dir = tempfile.mkdtemp(prefix="domus-bench-")
    results: dict[str, dict[str, float]] = {}
    try:
        with LocalDeployment(1, port=free_port_block(2), data_dir=data_dir) as deployment:
            os.environ.update(deployment.environment())   # (workers find its secret)

            service = psutil.Process(deployment.services["s1"].pid)
            with deployment.connect() as cluster:
                for platform, medium in TECHNOLOGIES:
                    name = _name(platform, medium)
                    cluster.create_dht(name, platform=platform, storage=medium)
                    target = (deployment.supervisor_address, name)
                    put = _run_clients(_put_worker, target, clients, seconds)
                    get = _run_clients(_get_seeded_worker, target, clients, seconds)
                    sized = cluster.create_dht(name + "-size", platform=platform, storage=medium)
                    before = service.memory_info().rss
                    rng = random.Random(7)
                    for start in range(0, records, 10_000):
                        sized.put_many({rng.getrandbits(64) - INT64: rng.randbytes(8)
                                        for _ in range(min(10_000, records - start))})
                    size: float | None
                    if medium == "disk":
                        method = "files"
                        time.sleep(2.5)                       # the service flushes every second
                        home = dht_home(os.path.join(data_dir, "s1"), sized.id)
                        size = sum(entry.stat().st_size for entry in os.scandir(home))
                    elif platform.startswith("domus-bsddb"):
                        # Pages land in a cache region reserved when the DHT
                        # was created: RSS does not show them one by one, the
                        # service's count of the DHT's pages does.
                        method = "pages"
                        stats = _service_stats(deployment.service_address(0))
                        size = stats["dhts"][name + "-size"].get("storage_bytes")
                    else:
                        method = "rss"
                        size = service.memory_info().rss - before
                    results[f"{medium} {platform}"] = {
                        "put1": put, "get": get,
                        "bytes_per_record": None if size is None else size / records,
                        "bytes_method": method}
                    print(f"  {medium} {platform}: put1 {put:,.0f}/s get {get:,.0f}/s",
                          file=sys.stderr)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    return results


def _get_seeded_worker(target: Any, seconds: float, seed: int, barrier: Any,
                       results: Any) -> None:
    """Gets of the keys the put worker with the same seed stored, in the
    order it stored them (a get past the last of them misses; it costs the
    service the same lookup)."""
    import domus

    supervisor, name = target
    with domus.connect(supervisor) as cluster:
        dht = cluster.open_dht(name)
        barrier.wait()
        results.put(_timed(lambda key, _value: dht.get(key), seconds, seed))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--records", type=int, default=100_000)
    parser.add_argument("--json", help="also write the results as JSON")
    args = parser.parse_args(argv)
    results = measure(args.clients, args.seconds, args.records)
    print(f"one service, K = {args.clients} clients, {args.seconds:g} s per point, "
          f"{os.cpu_count()} cores")
    print(f"{'technology':>26} {'put1 ops/s':>12} {'get ops/s':>12} {'bytes/record':>13}  "
          f"measured by")
    for name, row in results.items():
        size = row["bytes_per_record"]
        print(f"{name:>26} {row['put1']:>12,.0f} {row['get']:>12,.0f} "
              + (f"{size:>13,.0f}" if size is not None else f"{'n/a':>13}")
              + f"  {row['bytes_method']}")
    print("bytes/record measured by: rss = service RSS growth, files = the DHT's files "
          "after a flush, pages = Berkeley DB pages x page size (service stats)")
    base = results["ram python-dict"]
    disk = results["disk domus-bsddb-btree"]
    ratio = disk["put1"] / base["put1"]
    print(f"disk domus-bsddb-btree / ram python-dict: put1 {ratio:.2f}, "
          f"get {disk['get'] / base['get']:.2f} (target >= 0.9 for put1)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump({"command": "python -m benchmarks.platforms " + " ".join(
                sys.argv[1:] if argv is None else argv), "results": results}, target, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
