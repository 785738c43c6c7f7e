"""Large values: one Domus service against one redis-server, put/get of
64 KiB to 16 MiB values, one client, one request at a time.

Values over a datagram (60,000 bytes) travel over TCP.  For each size the
same value is put (SET) and read back (GET) under one key, over and over,
for at least ``--seconds`` and ``--min-ops`` times each, Domus and Redis
taking turns in ten rounds (the machine is shared: both see its load); the
median latency of each is reported with the MB/s it makes (MB = 10^6 bytes
of value), and the ratio Domus/Redis (above 1: Domus is faster).  Every value read back is checked,
then held until the next GET's replaces it (``--drop``: let go first; a
process's heap behaves differently, its large blocks given back or not).

Domus: a local deployment (supervisor + one service), secure by default
(every TCP frame authenticated; ``--insecure`` without the secret), a RAM
DHT on ``--platform`` with codec ``--codec`` (msgpack, what users get by
default, or raw), driven by the blocking client or (``--client aio``) the
asyncio one, its requests awaited one at a time on an event loop run for
the while (a latency is the await's own).  Redis: a redis-server started
here on a free port (no persistence), redis-py with hiredis, stopped by
PID.

Memory: the service's RSS before the sizes and after each one, and its peak
(VmHWM, which only grows: sizes run from small to large, so the peak after a
size is that size's peak).  A value that the service holds once stored
costs its size; anything above that in the peak is copies in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil

import domus.aio
from benchmarks.provenance import machine
from domus.ops.deploy import LocalDeployment, free_port_block

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = "64K,256K,1M,4M,10M,16M"
MSGPACK_BIN32_HEADER = 5    # a msgpack bin 32 header: what the default codec adds
CLIENTS = ("blocking", "aio")
ROUNDS = 10                 # Domus and Redis take turns this many times per size


def parse_size(text: str) -> int:
    """``64K``, ``1M``, ``16M`` or a number of bytes."""
    text = text.strip().upper()
    scale = {"K": KIB, "M": MIB}.get(text[-1:], 1)
    number = text[:-1] if scale != 1 else text
    try:
        size = int(float(number) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use 64K, 1M, 16M or "
                                         f"bytes)") from None
    if not 1 <= size <= 16 * MIB:
        raise argparse.ArgumentTypeError(f"size {text!r} is outside 1 byte .. 16M")
    return size


def label(size: int) -> str:
    if size % MIB == 0:
        return f"{size // MIB} MiB"
    if size % KIB == 0:
        return f"{size // KIB} KiB"
    return f"{size} B"


def timed(operation: Callable[[], Any], seconds: float, minimum: int,
          check: Callable[[Any], None], drop: bool = False) -> list[float]:
    """Latencies (s) of ``operation`` run at least ``minimum`` times and
    for at least ``seconds``; ``check`` sees each result.  Each result is
    held until the next one replaces it (as ``value = dht[key]`` in a loop
    holds it), or with ``drop`` let go before the next request."""
    latencies = []
    started = time.perf_counter()
    while len(latencies) < minimum or time.perf_counter() - started < seconds:
        begin = time.perf_counter()
        result = operation()
        latencies.append(time.perf_counter() - begin)
        check(result)
        if drop:
            result = None
    return latencies


async def timed_async(operation: Callable[[], Awaitable[Any]], seconds: float, minimum: int,
                      check: Callable[[Any], None], drop: bool = False) -> list[float]:
    """``timed`` of a coroutine function, on the running loop: each latency
    is that of one ``await operation()``."""
    latencies = []
    started = time.perf_counter()
    while len(latencies) < minimum or time.perf_counter() - started < seconds:
        begin = time.perf_counter()
        result = await operation()
        latencies.append(time.perf_counter() - begin)
        check(result)
        if drop:
            result = None
    return latencies


class AioDomus:
    """The DHT ``name`` through the asyncio client, on an event loop of its
    own that runs only while a batch of requests is timed."""

    def __init__(self, address: str, secret_file: str | None, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.cluster = self.loop.run_until_complete(
            domus.aio.connect(address, timeout=10.0, secret_file=secret_file))
        self.dht = self.loop.run_until_complete(self.cluster.open_dht(name))

    def timed(self, operation: Callable[[], Awaitable[Any]], seconds: float, minimum: int,
              check: Callable[[Any], None], drop: bool = False) -> list[float]:
        return self.loop.run_until_complete(timed_async(operation, seconds, minimum, check,
                                                        drop))

    def close(self) -> None:
        self.loop.run_until_complete(self.cluster.close())
        self.loop.close()


def memory_of(pid: int) -> dict[str, int]:
    """RSS and peak RSS (VmHWM) of process ``pid``, in bytes."""
    rss = psutil.Process(pid).memory_info().rss
    peak = rss
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
    return {"rss": rss, "peak": peak}


class RedisServer:
    """A redis-server of our own on 127.0.0.1 (no persistence)."""

    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit("redis-server not found (Debian: apt-get install redis-server); "
                             "or run with --no-redis")
        import redis
        import redis.utils

        if not redis.utils.HIREDIS_AVAILABLE:
            print("warning: hiredis is not installed; redis-py uses its slower Python parser",
                  file=sys.stderr)
        self.port = free_port_block(1)
        self.process = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--proto-max-bulk-len", str(64 * MIB)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    self.stop()
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()        # (our own server, by its PID)
            self.process.wait(10)


def measure(sizes: list[int], seconds: float, minimum: int, codec: str, platform: str,
            insecure: bool, with_redis: bool, drop: bool = False,
            client: str = "blocking") -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="domus-large-")
    redis_server = RedisServer() if with_redis else None
    aio: AioDomus | None = None
    rows = []
    try:
        with LocalDeployment(1, port=free_port_block(2), data_dir=data_dir,
                             insecure=insecure) as deployment, \
                deployment.connect() as cluster:
            dht = cluster.create_dht("large", buckets=16, storage="ram", platform=platform,
                                     codec=codec)
            service_pid = deployment.services["s1"].pid
            dht.put("warm-up", b"x" * 100_000)      # (opens the TCP connection)
            if client == "aio":
                aio = AioDomus(deployment.supervisor_address, deployment.secret_file, "large")
                aio.timed(lambda: aio.dht.get("warm-up"), 0.0, 1, lambda _r: None)  # (its TCP)
            dht.delete("warm-up")
            before = memory_of(service_pid)
            print(f"service RSS before: {before['rss'] / MIB:.1f} MiB "
                  f"(peak {before['peak'] / MIB:.1f} MiB)", flush=True)
            for size in sizes:
                # The default codec adds a 5-byte header to bytes: a 16 MiB
                # value would be over the 16 MiB limit by 5 bytes.
                value_bytes = size - MSGPACK_BIN32_HEADER if (
                    codec == "msgpack" and size == 16 * MIB) else size
                value = os.urandom(value_bytes)
                key = f"value-{size}"

                def same(result: Any, value: bytes = value) -> None:
                    if result != value:
                        raise SystemExit("a value read back differs from the one stored")

                row: dict[str, Any] = {"size": size, "value_bytes": value_bytes}
                domus_put: list[float] = []
                domus_get: list[float] = []
                redis_put: list[float] = []
                redis_get: list[float] = []
                # Alternate the two in rounds, so that both see the same
                # machine (it is shared: its load moves).
                share, least = seconds / ROUNDS, max(1, -(-minimum // ROUNDS))
                for _round in range(ROUNDS):
                    if aio is not None:
                        domus_put += aio.timed(lambda key=key, value=value, adht=aio.dht:
                                               adht.put(key, value),
                                               share, least, lambda _r: None)
                        domus_get += aio.timed(lambda key=key, adht=aio.dht: adht.getitem(key),
                                               share, least, same, drop)
                    else:
                        domus_put += timed(lambda key=key, value=value: dht.put(key, value),
                                           share, least, lambda _r: None)
                        domus_get += timed(lambda key=key: dht[key], share, least, same, drop)
                    if redis_server is not None:
                        redis_client = redis_server.client
                        redis_put += timed(lambda key=key, value=value, client=redis_client:
                                           client.set(key, value),
                                           share, least, lambda _r: None)
                        redis_get += timed(lambda key=key, client=redis_client: client.get(key),
                                           share, least, same, drop)
                after = memory_of(service_pid)
                row["domus"] = summary(domus_put, domus_get, value_bytes)
                row["service_rss_after"] = after["rss"]
                row["service_peak_rss_after"] = after["peak"]
                if redis_server is not None:
                    row["redis"] = summary(redis_put, redis_get, value_bytes)
                rows.append(row)
                print(line(row), flush=True)
            final = memory_of(service_pid)
    finally:
        if aio is not None:
            aio.close()
        if redis_server is not None:
            redis_server.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    return {"service_rss_before": before["rss"], "service_peak_rss_before": before["peak"],
            "service_rss_end": final["rss"], "rows": rows}


def summary(puts: list[float], gets: list[float], value_bytes: int) -> dict[str, Any]:
    put, get = statistics.median(puts), statistics.median(gets)
    return {"put_ms": round(put * 1e3, 3), "get_ms": round(get * 1e3, 3),
            "put_mb_s": round(value_bytes / put / 1e6, 1),
            "get_mb_s": round(value_bytes / get / 1e6, 1),
            "put_count": len(puts), "get_count": len(gets)}


def line(row: dict[str, Any]) -> str:
    domus = row["domus"]
    text = (f"{label(row['size']):>8}  domus put {domus['put_ms']:8.2f} ms "
            f"{domus['put_mb_s']:7.0f} MB/s  get {domus['get_ms']:8.2f} ms "
            f"{domus['get_mb_s']:7.0f} MB/s")
    redis = row.get("redis")
    if redis:
        text += (f"   redis SET {redis['put_ms']:7.2f} ms {redis['put_mb_s']:6.0f} MB/s  "
                 f"GET {redis['get_ms']:7.2f} ms {redis['get_mb_s']:6.0f} MB/s   "
                 f"domus/redis put {redis['put_ms'] / domus['put_ms']:.2f}x "
                 f"get {redis['get_ms'] / domus['get_ms']:.2f}x")
    text += (f"   service RSS {row['service_rss_after'] / MIB:.0f} MiB "
             f"(peak {row['service_peak_rss_after'] / MIB:.0f})")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES,
                        help=f"value sizes, comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--seconds", type=float, default=3.0,
                        help="time spent on each of put and get, per size and store")
    parser.add_argument("--min-ops", type=int, default=15,
                        help="at least this many puts and gets per size and store")
    parser.add_argument("--codec", choices=("msgpack", "raw"), default="msgpack",
                        help="the DHT's value codec (msgpack: the default)")
    parser.add_argument("--platform", default="python-dict",
                        help="the DHT's storage platform (RAM)")
    parser.add_argument("--insecure", action="store_true",
                        help="Domus without its secret (no frame authentication)")
    parser.add_argument("--no-redis", action="store_true", help="Domus only")
    parser.add_argument("--client", choices=CLIENTS, default="blocking",
                        help="the Domus client driven: the blocking one or the asyncio one "
                             "(aio)")
    parser.add_argument("--drop", action="store_true",
                        help="let each value read go before the next GET (default: hold "
                             "it until the next replaces it, as a loop's variable does)")
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    args = parser.parse_args(argv)
    sizes = [parse_size(text) for text in args.sizes.split(",") if text.strip()]
    provenance = machine()
    print(f"# {provenance['date']}, commit {provenance['commit']}, load "
          f"{provenance['load_average']} (the machine is shared)", flush=True)
    print(f"# {args.client} client, codec {args.codec}, platform {args.platform}, "
          f"{'insecure' if args.insecure else 'secure (frames authenticated)'}"
          f"{', each value read dropped before the next GET' if args.drop else ''}", flush=True)
    results = measure(sizes, args.seconds, args.min_ops, args.codec, args.platform,
                      args.insecure, not args.no_redis, args.drop, args.client)
    results.update(provenance=provenance, client=args.client, codec=args.codec,
                   platform=args.platform,
                   secure=not args.insecure, drop=args.drop, seconds=args.seconds,
                   min_ops=args.min_ops,
                   load_average_after=[round(load, 2) for load in os.getloadavg()])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as output:
            json.dump(results, output, indent=2)
            output.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
