"""Overload: what one service serves when offered more than it can.

    python -m benchmarks.overload [--seconds 5] [--batch 32] [--loads 0.5,1,1.5,2]
                                  [--generators 2] [--insecure]

One service (a local deployment: supervisor + 1 service process, pinned to
CPU 0) and load generator processes pinned to CPU 1.  The workload is
GET_MANY of ``--batch`` keys per datagram (records of a DHT on that
service): a request the C path serves whole, costly enough per datagram
that a Python generator can offer twice what the service sustains.

First the **peak**: each generator keeps 64 requests in flight (a closed
loop) for the given seconds; the service's served requests/s is the peak.
Then, for each load L, the generators send **open-loop** at L x peak
requests/s (each request at its scheduled time, whatever came back), and
follow the clients' rules: a request not answered in 0.25 s is sent again
(the same bytes), the wait doubling; a BUSY answer is backed off (10 ms
doubling to 0.5 s, jittered) and sent again; at the deadline (5 s since
its scheduled time) a request fails, as ServiceBusy if it ever got BUSY,
else as a timeout-only failure (ServiceUnavailable).  Latency is from the
scheduled time to the OK reply (so a queue in the generator counts).
Each load runs twice: with load shedding (the service's default,
``--shed-after 0.1``) and without (``--shed-after 0``).

Prints, per load and mode: offered/s, served/s (OK replies during the
window) and its share of the peak, p50 and p99 latency, failures (busy,
timeout-only).  The machine is shared with other work: the output says so,
with the load average.  Raw JSON: benchmarks/results/overload.json.
"""

from __future__ import annotations

import argparse
import heapq
import json
import multiprocessing
import os
import random
import select
import shutil
import socket
import tempfile
import time
from typing import Any

from domus.ops.deploy import LocalDeployment, free_port_block
from domus.wire import auth, secret
from domus.wire import protocol as wire
from domus.wire.keys import bucket_of, encode_key

from .provenance import machine

RECORDS = 20_000
BODIES = 512
FIRST_TIMEOUT = 0.25
DEADLINE = 5.0
WINDOW = 64            # requests in flight per generator when measuring the peak
SERVICE_CPU, GENERATOR_CPU = 0, 1


def busy_backoff(tries: int, reply: bytes) -> float:
    # (domus.client.transport.busy_backoff, without importing the client)
    base = min(wire.BUSY_BACKOFF * 2 ** min(tries - 1, 16), wire.BUSY_BACKOFF_MAX)
    return max(base, wire.busy_retry_after(reply)) * random.uniform(0.5, 1.5)


def _pin(cpu: int) -> None:
    try:
        os.sched_setaffinity(0, {cpu % os.cpu_count()})
    except (AttributeError, OSError):
        pass


class Generator:
    """One load generator's socket, requests and bookkeeping."""

    def __init__(self, address: tuple[str, int], key: bytes | None, bodies: list[bytes],
                 seed: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.sock.connect(address)
        self.sock.setblocking(False)
        self.key = key
        self.bodies = bodies
        self.ids = seed << 24
        # request id -> [scheduled at, timeout, busy answers, timer generation]
        self.pending: dict[int, list[Any]] = {}
        self.timers: list[tuple[float, int, int]] = []      # (when, request id, generation)
        self.latencies: list[float] = []
        self.served = self.busy = self.failed_busy = self.failed_timeout = 0
        self.sends = 0

    def send(self, request_id: int) -> None:
        body = self.bodies[request_id % len(self.bodies)]
        message = body[:4] + request_id.to_bytes(4, "big") + body[8:]
        if self.key is not None:
            message = auth.seal_request(self.key, message)
        try:
            self.sock.send(message)
        except (BlockingIOError, ConnectionRefusedError):
            pass                            # (the retry timer sends it again)
        self.sends += 1

    def start(self, scheduled: float, now: float) -> None:
        self.ids = (self.ids + 1) & 0xFFFFFFFF
        request_id = self.ids
        self.pending[request_id] = [scheduled, FIRST_TIMEOUT, 0, 0]
        heapq.heappush(self.timers, (now + FIRST_TIMEOUT, request_id, 0))
        self.send(request_id)

    def receive(self, now: float, window_end: float) -> int:
        """Take every reply waiting; how many requests were answered."""
        answered = 0
        while True:
            try:
                data = self.sock.recv(65536)
            except (BlockingIOError, ConnectionRefusedError):
                return answered
            request_id = int.from_bytes(data[4:8], "big")
            entry = self.pending.get(request_id)
            if entry is None:
                continue                    # (a late reply to a retried request)
            if data[2] == wire.ST_BUSY:
                self.busy += 1
                entry[2] += 1
                pause = busy_backoff(entry[2], data)
                if now + pause - entry[0] >= DEADLINE:
                    del self.pending[request_id]
                    self.failed_busy += 1
                    answered += 1
                    continue
                entry[3] += 1
                entry[1] = FIRST_TIMEOUT
                heapq.heappush(self.timers, (now + pause, request_id, -entry[3]))
                continue
            del self.pending[request_id]
            answered += 1
            if data[2] == wire.ST_OK and now < window_end:
                self.served += 1
                self.latencies.append(now - entry[0])

    def expire(self, now: float) -> int:
        """Retry or fail what is due; how many requests failed."""
        failed = 0
        timers = self.timers
        while timers and timers[0][0] <= now:
            _when, request_id, generation = heapq.heappop(timers)
            entry = self.pending.get(request_id)
            if entry is None or abs(generation) != entry[3]:
                continue                    # (answered, or a newer timer rules)
            if generation >= 0 and now - entry[0] >= DEADLINE:
                del self.pending[request_id]
                if entry[2]:
                    self.failed_busy += 1
                else:
                    self.failed_timeout += 1
                failed += 1
                continue
            if generation >= 0:
                entry[1] = min(entry[1] * 2, DEADLINE)
            entry[3] += 1
            heapq.heappush(timers, (now + entry[1], request_id, entry[3]))
            self.send(request_id)
        return failed

    def wait(self, until: float) -> None:
        timeout = max(0.0, min(until, self.timers[0][0] if self.timers else until)
                      - time.perf_counter())
        if timeout > 0:
            select.select([self.sock], [], [], min(timeout, 0.002))


def _generate(address: tuple[str, int], key: bytes | None, bodies: list[bytes], rate: float,
              seconds: float, start_at: float, seed: int, results: Any) -> None:
    """Open loop at ``rate`` requests/s (0: closed loop, WINDOW in flight)."""
    _pin(GENERATOR_CPU)
    random.seed(seed)
    generator = Generator(address, key, bodies, seed)
    while time.perf_counter() < start_at:
        time.sleep(0.001)
    end = start_at + seconds
    interval = 1.0 / rate if rate else 0.0
    next_at = start_at
    while True:
        now = time.perf_counter()
        if now >= end and (not generator.pending or now >= end + DEADLINE + 1):
            break
        if now < end:
            if rate:
                while next_at <= now and next_at < end:
                    generator.start(next_at, now)
                    next_at += interval
            else:
                while len(generator.pending) < WINDOW:
                    generator.start(now, now)
        generator.receive(now, end)
        generator.expire(now)
        generator.wait(min(next_at, end) if rate and now < end else now + 0.002)
    generator.latencies.sort()
    results.put({"served": generator.served, "busy": generator.busy,
                 "failed_busy": generator.failed_busy,
                 "failed_timeout": generator.failed_timeout, "sends": generator.sends,
                 "latencies": generator.latencies[::max(1, len(generator.latencies) // 20000)]})


def percentile(values: list[float], fraction: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(fraction * len(values)))]


def run_load(address: tuple[str, int], key: bytes | None, bodies: list[bytes], rate: float,
             seconds: float, generators: int) -> dict[str, Any]:
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    start_at = time.perf_counter() + 0.5
    processes = [context.Process(target=_generate, args=(
        address, key, bodies, rate / generators if rate else 0.0, seconds, start_at,
        index + 1, results)) for index in range(generators)]
    for process in processes:
        process.start()
    parts = [results.get(timeout=seconds + DEADLINE + 60) for _ in processes]
    for process in processes:
        process.join(10)
    latencies = sorted(value for part in parts for value in part["latencies"])
    served = sum(part["served"] for part in parts)
    return {"offered_per_s": round(rate), "served_per_s": round(served / seconds),
            "p50_ms": round(percentile(latencies, 0.50) * 1000, 2),
            "p99_ms": round(percentile(latencies, 0.99) * 1000, 2),
            "busy_answers": sum(part["busy"] for part in parts),
            "failed_busy": sum(part["failed_busy"] for part in parts),
            "failed_timeout_only": sum(part["failed_timeout"] for part in parts),
            "datagrams_sent": sum(part["sends"] for part in parts)}


def start(data_dir: str, insecure: bool, shed_after: float) -> LocalDeployment:
    port = free_port_block(2)
    deployment = LocalDeployment(1, port=port, data_dir=data_dir, insecure=insecure,
                                 service_args=["--cpus", str(SERVICE_CPU),
                                               "--shed-after", str(shed_after)])
    return deployment.start()


def workload(deployment: LocalDeployment, batch: int) -> tuple[tuple[str, int], list[bytes]]:
    with deployment.connect() as cluster:
        dht = cluster.create_dht("overload", buckets=16)
        for first in range(0, RECORDS, 5000):
            dht.put_many({f"key-{n}": n for n in range(first, min(first + 5000, RECORDS))})
        dht_id, hash_name, count = dht.id, dht.descriptor["hash"], dht.bucket_count
    rng = random.Random(7)
    bodies = []
    for _ in range(BODIES):
        keys = [encode_key(f"key-{rng.randrange(RECORDS)}") for _ in range(batch)]
        bodies.append(wire.encode_get_many(0, rng.getrandbits(63), dht_id,
                                           [(bucket_of(key, hash_name, count), key)
                                            for key in keys]))
    host, service_port = deployment.service_address(0).split(":")
    return (host, int(service_port)), bodies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overload",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--batch", type=int, default=32, help="keys per GET_MANY")
    parser.add_argument("--loads", default="0.5,1,1.5,2")
    parser.add_argument("--generators", type=int, default=2)
    parser.add_argument("--insecure", action="store_true")
    parser.add_argument("--output", default=os.path.join(os.path.dirname(__file__), "results",
                                                         "overload.json"))
    args = parser.parse_args(argv)
    loads = [float(load) for load in args.loads.split(",")]
    about = machine()
    print(f"overload: {about['date']}, commit {about['commit']}, {about['machine']}")
    print(f"the machine is SHARED with other work: load average {about['load_average']} "
          f"at the start; service on CPU {SERVICE_CPU}, {args.generators} generators on CPU "
          f"{GENERATOR_CPU}; GET_MANY of {args.batch} keys, "
          f"{'insecure' if args.insecure else 'secure (MACs)'}")
    runs: dict[str, Any] = {"about": about, "batch": args.batch, "seconds": args.seconds,
                            "insecure": args.insecure, "modes": {}}
    peak = None
    for mode, shed_after in (("shedding", 0.1), ("no shedding", 0.0)):
        data_dir = tempfile.mkdtemp(prefix="domus-overload-")
        deployment = start(data_dir, args.insecure, shed_after)
        try:
            key = None if args.insecure else secret.keys(deployment.secret_file).data
            address, bodies = workload(deployment, args.batch)
            if peak is None:
                measured = run_load(address, key, bodies, 0.0, args.seconds, args.generators)
                peak = measured["served_per_s"]
                runs["peak"] = measured
                print(f"peak (closed loop, {WINDOW} in flight per generator): "
                      f"{peak:,} requests/s ({peak * args.batch:,} keys/s), "
                      f"p50 {measured['p50_ms']} ms, p99 {measured['p99_ms']} ms")
                print(f"{'mode':<12} {'load':>5} {'offered/s':>10} {'served/s':>10} "
                      f"{'of peak':>8} {'p50 ms':>8} {'p99 ms':>8} {'BUSY':>8} "
                      f"{'fail busy':>9} {'fail t/o':>8}")
            rows = runs["modes"][mode] = []
            for load in loads:
                result = run_load(address, key, bodies, load * peak, args.seconds,
                                  args.generators)
                result["load"] = load
                result["of_peak"] = round(result["served_per_s"] / peak, 3)
                rows.append(result)
                print(f"{mode:<12} {load:>5} {result['offered_per_s']:>10,} "
                      f"{result['served_per_s']:>10,} {result['of_peak']:>8.0%} "
                      f"{result['p50_ms']:>8} {result['p99_ms']:>8} "
                      f"{result['busy_answers']:>8,} {result['failed_busy']:>9,} "
                      f"{result['failed_timeout_only']:>8,}")
        finally:
            deployment.stop()
            shutil.rmtree(data_dir, ignore_errors=True)
    runs["load_average_after"] = [round(load, 2) for load in os.getloadavg()]
    print(f"load average at the end: {runs['load_average_after']}")
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w", encoding="utf-8") as out:
        json.dump(runs, out, indent=2)
    print(f"raw results: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
