"""put1 and get throughput of every storage platform and medium, in the
same run.

    python -m benchmarks.platforms [--clients 4] [--seconds 5]
                                   [--technologies "ram domus-rbt,ram python-dict"]

One service (a local deployment: supervisor + 1 service process) and one
DHT per technology.  For each: K client processes issue single put1
requests (random 64-bit int key and value, one request per round trip) for
T seconds, then single gets of the keys they stored, in the same order,
for T seconds.  The service's CPU time (user + system) over each phase,
divided by the requests it answered, is printed beside the throughput: on a
shared machine it moves less than the throughput does.

Prints a table and the ratio the storage issue sets a target for: disk
domus-bsddb-btree put1 / ram python-dict put1.  Bytes per record are
``benchmarks.memory``'s.
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
from benchmarks.rebalance import machine
from domus.ops.deploy import LocalDeployment, free_port_block
from domus.storage import PLATFORMS
from domus.wire import address as addresses
from domus.wire import auth, secret
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
    """A service's own stats (OP_STATS over UDP; asked again if lost),
    sealed with the deployment's secret when there is one (DOMUS_SECRET_FILE)."""
    host, port = addresses.parse(address)
    keys = secret.keys()
    request = wire.request_header(wire.OP_STATS, 1, random.getrandbits(63))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(2.0)
        for _attempt in range(5):
            sealed = request if keys is None else auth.seal_request(keys.data, request)
            sock.sendto(sealed, (host, port))
            try:
                reply: bytes | None = sock.recv(65536)
            except TimeoutError:
                continue
            if keys is not None:
                reply = auth.open_reply(keys.data, reply, request[8:16], sealed[-12:-8])
                if reply is None:
                    raise RuntimeError(f"service {address}'s stats reply does not carry "
                                       f"the deployment secret's MAC")
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


def measure(clients: int, seconds: float,
            technologies: list[tuple[str, str]] | None = None) -> dict[str, dict[str, float]]:
    data_dir = tempfile.mkdtemp(prefix="domus-bench-")
    results: dict[str, dict[str, float]] = {}
    try:
        with LocalDeployment(1, port=free_port_block(2), data_dir=data_dir) as deployment:
            os.environ.update(deployment.environment())   # (workers find its secret)

            service = psutil.Process(deployment.services["s1"].pid)
            address = deployment.service_address(0)
            with deployment.connect() as cluster:
                for platform, medium in technologies or TECHNOLOGIES:
                    name = _name(platform, medium)
                    cluster.create_dht(name, platform=platform, storage=medium)
                    target = (deployment.supervisor_address, name)
                    row: dict[str, float] = {}
                    for phase, worker in (("put1", _put_worker), ("get", _get_seeded_worker)):
                        cpu, requests = _service_work(service, address)
                        row[phase] = _run_clients(worker, target, clients, seconds)
                        cpu_after, requests_after = _service_work(service, address)
                        row[f"{phase}_service_us"] = \
                            1e6 * (cpu_after - cpu) / max(1, requests_after - requests - 1)
                    results[f"{medium} {platform}"] = row
                    print(f"  {medium} {platform}: put1 {row['put1']:,.0f}/s get "
                          f"{row['get']:,.0f}/s", file=sys.stderr)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)
    return results


def _service_work(service: psutil.Process, address: str) -> tuple[float, int]:
    """The service's CPU seconds so far and the requests it has answered
    (the STATS request that asks is one of them)."""
    times = service.cpu_times()
    return times.user + times.system, _service_stats(address)["requests"]


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
    parser.add_argument("--technologies", metavar="LIST",
                        help="comma-separated 'medium platform' pairs (default: all)")
    parser.add_argument("--json", help="also write the results as JSON")
    args = parser.parse_args(argv)
    chosen = None
    if args.technologies:
        chosen = [tuple(item.split()[::-1]) for item in args.technologies.split(",")]
        unknown = [" ".join(item[::-1]) for item in chosen if item not in TECHNOLOGIES]
        if unknown:
            parser.error(f"unknown technologies {unknown}; choose from "
                         f"{[f'{medium} {name}' for name, medium in TECHNOLOGIES]}")
    results = measure(args.clients, args.seconds, chosen)  # type: ignore[arg-type]
    where = machine()
    print(f"{where['date']}, commit {where['commit']}, {where['machine']}")
    print(f"one service, K = {args.clients} clients, {args.seconds:g} s per point "
          f"(the machine may be shared: compare within one run)")
    print(f"{'technology':>26} {'put1 ops/s':>12} {'get ops/s':>12} {'service us/put1':>16} "
          f"{'service us/get':>15}")
    for name, row in results.items():
        print(f"{name:>26} {row['put1']:>12,.0f} {row['get']:>12,.0f} "
              f"{row['put1_service_us']:>16.2f} {row['get_service_us']:>15.2f}")
    base = results.get("ram python-dict")
    disk = results.get("disk domus-bsddb-btree")
    if base and disk:
        print(f"disk domus-bsddb-btree / ram python-dict: put1 {disk['put1'] / base['put1']:.2f}, "
              f"get {disk['get'] / base['get']:.2f} (target >= 0.9 for put1)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump({"command": "python -m benchmarks.platforms " + " ".join(
                sys.argv[1:] if argv is None else argv), **where, "results": results},
                target, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
