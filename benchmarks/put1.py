"""put1 throughput: Domus against Redis, in the same run.

    python -m benchmarks.put1 [--clients 1,2,4] [--seconds 5] [--insecure]
    python -m benchmarks.put1 --mac-cost 5 [--clients 1] [--seconds 3]

One service (a local deployment: supervisor + 1 service process) and K
client processes, each issuing single put1 requests (a new random 64-bit
int key and a random 64-bit int value, one request per round trip, no
batching) for T seconds.  Then the same against a local ``redis-server``
with redis-py (hiredis parser), one SET per round trip, no pipelining.
Then, for reference, two floors, driven by the same bare Python UDP client
(no Domus code): a minimal Python server holding a dict (the Python floor,
as fast as a Python client and a Python server go here), and
``domus-udp-echo``, a bare C loop doing one ``recvfrom`` and one ``sendto``
per datagram (the C floor: the real floor of a service, which Domus's C
hot path competes with).  Prints each throughput and the ratios, and the
CPU the server process spent per request (psutil) for Domus's service and
the C floor.

put1 measures *clients* more than servers: one request per round trip from
Python processes, so redis-py's cost and Domus's client's cost dominate,
and "Domus / Redis" here mostly compares the two client libraries.  To
compare the servers, saturate each from C: ``python -m benchmarks.capacity``.

Domus runs as deployed by default: with a deployment secret, so every
datagram carries a MAC (domus.wire.auth).  ``--insecure`` runs it without
one; ``--mac-cost N`` measures only Domus, N rounds each way, alternating
(secure, insecure, secure, ...) so that a machine's drift touches both
alike, and prints the MAC's cost as the drop of the median throughput.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psutil

from domus.ops.deploy import LocalDeployment, free_port_block

from .programs import ProgramMissing, program
from .provenance import machine

INT64 = 1 << 63


def _timed_loop(operation: Callable[[int, int], Any], seconds: float,
                seed: int) -> tuple[int, float]:
    """Run ``operation(key, value)`` with fresh random ints for ``seconds``;
    return (operations, elapsed)."""
    generator = random.Random(seed)
    getrandbits = generator.getrandbits
    count = 0
    started = time.perf_counter()
    end = started + seconds
    while True:
        for _ in range(128):
            operation(getrandbits(64) - INT64, getrandbits(64) - INT64)
        count += 128
        if time.perf_counter() >= end:
            break
    return count, time.perf_counter() - started


# ------------------------------------------------------------------ workers
def _domus_worker(supervisor: str, seconds: float, seed: int, barrier: Any, results: Any) -> None:
    import domus

    with domus.connect(supervisor) as cluster:
        dht = cluster.open_dht("put1")
        dht.put(-1, 0)  # warm the channel
        barrier.wait()
        results.put(_timed_loop(dht.put, seconds, seed))


def _redis_worker(port: int, seconds: float, seed: int, barrier: Any, results: Any) -> None:
    import redis

    client = redis.Redis(host="127.0.0.1", port=port)
    client.ping()
    barrier.wait()
    results.put(_timed_loop(client.set, seconds, seed))


_FLOOR = struct.Struct(">QqqI")


def _floor_server(port: int, ready: Any) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", port))
    ready.set()
    store: dict[bytes, bytes] = {}
    while True:
        data, peer = sock.recvfrom(65536)
        store[data[8:16]] = data[16:24]
        sock.sendto(data[:8], peer)


def _floor_worker(port: int, seconds: float, seed: int, barrier: Any, results: Any) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect(("127.0.0.1", port))
    sock.settimeout(1.0)
    pack = _FLOOR.pack
    request_ids = iter(range(1, 1 << 62))

    def put(key: int, value: int) -> None:
        request_id = next(request_ids)
        sock.send(pack(request_id, key, value, 0))
        while sock.recv(65536)[:8] != request_id.to_bytes(8, "big"):
            pass

    barrier.wait()
    results.put(_timed_loop(put, seconds, seed))


def _run_clients(worker: Callable[..., None], target: Any, clients: int,
                 seconds: float, take: Callable[[Any], tuple[int, float]] | None = None,
                 totals: list[tuple[int, float]] | None = None) -> float:
    """Run ``clients`` worker processes; their summed ops/s.  A worker puts
    (count, elapsed) on its results queue, or whatever ``take`` turns into
    that; ``totals`` gets each worker's (count, elapsed)."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(clients)
    results = context.Queue()
    processes = [context.Process(target=worker,
                                 args=(target, seconds, 1000 + index, barrier, results))
                 for index in range(clients)]
    for process in processes:
        process.start()
    results_got = [results.get(timeout=seconds + 60) for _ in processes]
    if take is not None:
        results_taken = [take(result) for result in results_got]
    else:
        results_taken = results_got
    for process in processes:
        process.join(30)
    if totals is not None:
        totals.extend(results_taken)
    return sum(count / elapsed for count, elapsed in results_taken)


# ------------------------------------------------------------------ systems
def _cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _counted(worker: Callable[..., None], target: Any, clients: int, seconds: float,
             server: psutil.Process, cpu: dict[int, float] | None) -> float:
    """``_run_clients``, and into ``cpu[clients]`` the server process's CPU
    microseconds per request meanwhile."""
    totals: list[tuple[int, float]] = []
    before = _cpu_seconds(server)
    rate = _run_clients(worker, target, clients, seconds, totals=totals)
    if cpu is not None:
        cpu[clients] = 1e6 * (_cpu_seconds(server) - before) / max(1, sum(n for n, _ in totals))
    return rate


def measure_domus(clients: list[int], seconds: float, insecure: bool = False,
                  cpu: dict[int, float] | None = None) -> dict[int, float]:
    data_dir = tempfile.mkdtemp(prefix="domus-bench-")
    os.environ.pop("DOMUS_SECRET_FILE", None)       # (an earlier deployment's, gone)
    try:
        with LocalDeployment(1, port=free_port_block(2), data_dir=data_dir,
                             insecure=insecure) as deployment:
            os.environ.update(deployment.environment())   # (workers find its secret)

            with deployment.connect() as cluster:
                cluster.create_dht("put1")
            service = psutil.Process(deployment.services["s1"].pid)
            return {k: _counted(_domus_worker, deployment.supervisor_address, k, seconds,
                                service, cpu) for k in clients}
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def wait_for_redis(port: int, timeout: float = 10.0) -> None:
    """Returns once the redis-server on ``port`` answers PING."""
    import redis

    deadline = time.monotonic() + timeout
    while True:
        try:
            redis.Redis(port=port).ping()
            return
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def measure_redis(clients: list[int], seconds: float) -> dict[int, float] | None:
    server_binary = shutil.which("redis-server")
    if server_binary is None:
        print("redis-server not found (apt-get install redis-server); skipping Redis",
              file=sys.stderr)
        return None
    import redis.utils

    if not redis.utils.HIREDIS_AVAILABLE:
        print("warning: hiredis is not installed; redis-py uses its slower Python parser",
              file=sys.stderr)
    port = free_port_block(1)
    server = subprocess.Popen([server_binary, "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_redis(port)
        return {k: _run_clients(_redis_worker, port, k, seconds) for k in clients}
    finally:
        server.terminate()
        server.wait(10)


def measure_floor(clients: list[int], seconds: float) -> dict[int, float]:
    context = multiprocessing.get_context("fork")
    port = free_port_block(1)
    ready = context.Event()
    server = context.Process(target=_floor_server, args=(port, ready), daemon=True)
    server.start()
    ready.wait(10)
    try:
        return {k: _run_clients(_floor_worker, port, k, seconds) for k in clients}
    finally:
        server.terminate()
        server.join(5)


def measure_c_floor(clients: list[int], seconds: float,
                    cpu: dict[int, float] | None = None) -> dict[int, float] | None:
    """The Python floor's clients against domus-udp-echo (the bare C loop)."""
    try:
        echo = program("domus-udp-echo")
    except ProgramMissing as missing:
        print(f"{missing}; skipping the C floor", file=sys.stderr)
        return None
    server = subprocess.Popen([echo, "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline().rsplit(":", 1)[1])
        process = psutil.Process(server.pid)
        return {k: _counted(_floor_worker, port, k, seconds, process, cpu) for k in clients}
    finally:
        server.terminate()
        server.wait(10)


def mac_cost(clients: list[int], seconds: float, rounds: int, json_path: str | None) -> int:
    """Domus with and without the secret, alternating; the drop of the
    median throughput per client count."""
    import statistics

    runs: dict[str, list[dict[int, float]]] = {"secure": [], "insecure": []}
    load_at_start = [round(load, 2) for load in os.getloadavg()]
    print(f"put1 MAC cost: one service, {rounds} rounds each way, {seconds:.0f} s per point, "
          f"{os.cpu_count()} cores, load average {load_at_start[0]:.1f}", flush=True)
    for round_number in range(rounds):
        for mode in ("secure", "insecure"):
            rates = measure_domus(clients, seconds, insecure=mode == "insecure")
            runs[mode].append(rates)
            print(f"round {round_number + 1} {mode:>8}: " + "  ".join(
                f"K={k} {rate:,.0f}/s" for k, rate in rates.items()), flush=True)
    summary = {}
    for k in clients:
        secure = statistics.median(run[k] for run in runs["secure"])
        insecure = statistics.median(run[k] for run in runs["insecure"])
        summary[k] = {"secure": secure, "insecure": insecure, "drop": 1 - secure / insecure}
        print(f"K={k}: median {secure:,.0f} puts/s with MACs, {insecure:,.0f} without: "
              f"the MAC costs {1 - secure / insecure:.1%}")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as target:
            json.dump({"benchmark": "put1 --mac-cost", **machine(),
                       "load_average_at_start": load_at_start, "rounds": rounds,
                       "seconds": seconds, "runs": runs, "summary": summary}, target, indent=1)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", default="1,2,4", help="client process counts (1,2,4)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds per measurement")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--no-floor", action="store_true", help="leave out both floors")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--insecure", action="store_true", help="run Domus without a "
                        "deployment secret (no MACs on the wire)")
    parser.add_argument("--mac-cost", type=int, metavar="ROUNDS", default=0,
                        help="measure only Domus, ROUNDS times with the secret and ROUNDS "
                        "without, alternating, and print the MAC's cost")
    args = parser.parse_args(argv)
    clients = [int(part) for part in args.clients.split(",")]
    if args.mac_cost:
        return mac_cost(clients, args.seconds, args.mac_cost, args.json)

    print(f"put1, one service, {args.seconds:.0f} s per point, {os.cpu_count()} cores",
          flush=True)
    domus_cpu: dict[int, float] = {}
    c_floor_cpu: dict[int, float] = {}
    results: dict[str, Any] = {"clients": clients, "seconds": args.seconds,
                               "secure": not args.insecure,
                               "domus": measure_domus(clients, args.seconds, args.insecure,
                                                      domus_cpu)}
    results["redis"] = None if args.no_redis else measure_redis(clients, args.seconds)
    results["floor"] = None if args.no_floor else measure_floor(clients, args.seconds)
    results["c_floor"] = None if args.no_floor else measure_c_floor(clients, args.seconds,
                                                                    c_floor_cpu)
    results["service_cpu_us_per_request"] = {"domus": domus_cpu, "c_floor": c_floor_cpu}

    def cell(value: float | None, form: str) -> str:
        return format(value, form) if value else "-"

    print(f"{'K':>3}  {'domus ops/s':>12}  {'redis ops/s':>12}  {'domus/redis':>11}  "
          f"{'floor ops/s':>12}  {'C floor ops/s':>13}  {'domus/C floor':>13}  "
          f"{'service us/req':>14}  {'C floor us/req':>14}")
    for k in clients:
        domus_rate = results["domus"][k]
        redis_rate = results["redis"][k] if results["redis"] else None
        floor_rate = results["floor"][k] if results["floor"] else None
        c_rate = results["c_floor"][k] if results["c_floor"] else None
        print(f"{k:>3}  {domus_rate:>12,.0f}  {cell(redis_rate, ',.0f'):>12}  "
              f"{(f'{domus_rate / redis_rate:.2f}x' if redis_rate else '-'):>11}  "
              f"{cell(floor_rate, ',.0f'):>12}  {cell(c_rate, ',.0f'):>13}  "
              f"{(f'{domus_rate / c_rate:.0%}' if c_rate else '-'):>13}  "
              f"{cell(domus_cpu.get(k), '.1f'):>14}  {cell(c_floor_cpu.get(k), '.1f'):>14}")
    print("put1 compares clients (Python, one request per round trip) more than servers: "
          "see benchmarks.capacity for the servers saturated from C.")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump({**machine(), **results}, target, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
