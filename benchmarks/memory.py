"""Bytes per record of every storage platform and medium, against Redis, in
the same run.

    python -m benchmarks.memory [--records 1000000] [--shapes small,medium,1kb]
                                [--json FILE] [--png FILE]

For each shape of record and each technology (platform x medium), a fresh
local deployment (supervisor + one service process) gets a DHT of that
technology (64 buckets), and ``--records`` records go in with ``put_many``
(batches of 10,000).  Then, per record:

- ``rss``: what the service process's RSS grew by (psutil), from just
  before the first record to just after the last;
- ``counted``: the DHT's ``storage_bytes`` in the service's stats, the
  platform's own count of what it holds: the record trees' arenas
  (``domus-rbt``), Berkeley DB's pages x page size (``domus-bsddb-*``,
  whose RAM pages land in a cache region reserved up front, so RSS does
  not show them all); ``python-dict`` cannot tell;
- ``files``: for disk media, what the DHT's files take once flushed.

Then every record is read back with ``get_many`` and checked.  The
service's CPU time (user + system) per record over the fill and over the
read-back is printed too: what a batch costs the service on each platform
(it moves less than wall time on a shared machine).

Redis gets the same records, byte for byte (each key as Domus encodes it,
each value as msgpack packs it: what a Domus service stores), in a fresh
``redis-server`` of its own on a free loopback port (no persistence),
loaded with MSETs of 10,000 and read back with MGETs; per record: the
growth of its ``used_memory`` (what its allocator counts) and of its RSS,
and its CPU time for the fill and the read-back.

Shapes (key as the client gives it -> bytes stored):
  small   random 64-bit int key (9 bytes), 8 random bytes (10 bytes)
  medium  30-character str key (31 bytes), 100 random bytes (102 bytes)
  1kb     random 64-bit int key (9 bytes), 1,024 random bytes (1,027 bytes)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import psutil

from benchmarks.platforms import _service_stats
from domus.ops.deploy import LocalDeployment, free_port_block
from domus.service.hosted import dht_home
from domus.storage import PLATFORMS
from domus.wire import keys as wire_keys
from domus.wire import values as wire_values

INT64 = 1 << 63
BATCH = 10_000
BUCKETS = 64
TECHNOLOGIES = [(name, medium) for name in
                ("python-dict", "domus-rbt", "domus-bsddb-btree", "domus-bsddb-hash")
                for medium in ("ram", "disk") if medium in PLATFORMS[name].media]
SHAPES: dict[str, tuple[str, Callable[[random.Random, int], tuple[Any, bytes]]]] = {
    "small": ("int key, 8-byte value",
              lambda rng, _n: (rng.getrandbits(64) - INT64, rng.randbytes(8))),
    "medium": ("30-byte str key, 100-byte value",
               lambda rng, n: (f"user:{n:012d}:{rng.getrandbits(48):012x}", rng.randbytes(100))),
    "1kb": ("int key, 1 KB value",
            lambda rng, _n: (rng.getrandbits(64) - INT64, rng.randbytes(1024))),
}


def batches(shape: str, records: int, seed: int = 7) -> Iterator[dict[Any, bytes]]:
    """The records of a shape, BATCH at a time (the same for every store)."""
    make = SHAPES[shape][1]
    rng = random.Random(seed)
    for start in range(0, records, BATCH):
        batch: dict[Any, bytes] = {}
        while len(batch) < min(BATCH, records - start):
            key, value = make(rng, start + len(batch))
            batch[key] = value
        yield batch


def stored_sizes(shape: str) -> tuple[int, int]:
    """The bytes of a record's key and value as a service stores them."""
    key, value = next(iter(next(batches(shape, 1)).items()))
    return len(wire_keys.encode_key(key)), len(wire_values.pack_value(value))


# ------------------------------------------------------------------ Domus
def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def measure_domus(name: str, medium: str, shape: str, records: int) -> dict[str, Any]:
    """One technology, one shape, in a fresh deployment of one service."""
    import domus

    data_dir = tempfile.mkdtemp(prefix="domus-memory-")
    try:
        with LocalDeployment(1, port=free_port_block(2), data_dir=data_dir) as deployment:
            service = psutil.Process(deployment.services["s1"].pid)
            with domus.connect(deployment.supervisor_address) as cluster:
                dht = cluster.create_dht("memory", buckets=BUCKETS, platform=name,
                                         storage=medium)
                dht.put(0, b"warm")             # the data path's first allocations
                dht.delete(0)
                before = service.memory_info().rss
                cpu = _cpu(service)
                started = time.perf_counter()
                for batch in batches(shape, records):
                    dht.put_many(batch)
                seconds = time.perf_counter() - started
                fill_cpu = _cpu(service) - cpu
                rss = service.memory_info().rss - before
                stats = _service_stats(deployment.service_address(0))["dhts"]["memory"]
                if stats["records"] != records:
                    raise RuntimeError(f"{medium} {name}: the service holds "
                                       f"{stats['records']} records, not {records}")
                cpu = _cpu(service)
                for batch in batches(shape, records):
                    if dht.get_many(list(batch)) != batch:
                        raise RuntimeError(f"{medium} {name}: records read back differ")
                read_cpu = _cpu(service) - cpu
                row: dict[str, Any] = {
                    "rss": rss / records,
                    "counted": (stats["storage_bytes"] / records
                                if stats.get("storage_bytes") is not None else None),
                    "fill_s": seconds,
                    "put_many_cpu_ns": fill_cpu / records * 1e9,
                    "get_many_cpu_ns": read_cpu / records * 1e9}
                if medium == "disk":
                    row["files"] = _flushed_files(dht_home(os.path.join(data_dir, "s1"),
                                                           dht.id)) / records
                return row
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _flushed_files(home: str, timeout: float = 30.0) -> int:
    """The size of a disk DHT's files once the service's flushes (every
    second) stop changing it."""
    sizes: list[int] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sizes.append(sum(entry.stat().st_size for entry in os.scandir(home)))
        if len(sizes) >= 4 and len(set(sizes[-3:])) == 1:
            break
        time.sleep(0.5)     # (a benchmark: the flush runs on the service's clock)
    return sizes[-1]


# ------------------------------------------------------------------ Redis
def measure_redis(shape: str, records: int) -> dict[str, Any] | None:
    """The same records in a fresh redis-server: growth of used_memory and
    RSS per record; None if redis-server is not installed."""
    binary = shutil.which("redis-server")
    if binary is None:
        print("redis-server not found (apt-get install redis-server); skipping Redis",
              file=sys.stderr)
        return None
    import redis

    port = free_port_block(1)
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis.Redis(host="127.0.0.1", port=port)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        process = psutil.Process(server.pid)
        info = client.info("memory")
        used, rss = info["used_memory"], process.memory_info().rss
        cpu = _cpu(process)
        for batch in batches(shape, records):
            client.mset({wire_keys.encode_key(key): wire_values.pack_value(value)
                         for key, value in batch.items()})
        fill_cpu = _cpu(process) - cpu
        if client.dbsize() != records:
            raise RuntimeError(f"Redis holds {client.dbsize()} keys, not {records}")
        info = client.info("memory")
        row = {"used_memory": (info["used_memory"] - used) / records,
               "rss": (process.memory_info().rss - rss) / records,
               "version": client.info("server")["redis_version"]}
        cpu = _cpu(process)
        for batch in batches(shape, records):
            stored = [wire_keys.encode_key(key) for key in batch]
            if client.mget(stored) != [wire_values.pack_value(value)
                                       for value in batch.values()]:
                raise RuntimeError("Redis: records read back differ")
        row["put_many_cpu_ns"] = fill_cpu / records * 1e9
        row["get_many_cpu_ns"] = (_cpu(process) - cpu) / records * 1e9
        return row
    finally:
        server.terminate()
        server.wait(10)


# ------------------------------------------------------------------ report
def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        commit += "+changes" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    memory = psutil.virtual_memory().total / 2**30
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit,
            "machine": f"{socket.gethostname()}, {os.cpu_count()} cores, {memory:.0f} GiB, "
                       f"{platform.platform()}, Python {platform.python_version()}"}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def table(result: dict[str, Any]) -> list[str]:
    """The results as the README's table (Markdown)."""
    shapes = result["shapes"]
    head = "| store | " + " | ".join(f"{shape} RSS | {shape} counted" for shape in shapes) + " |"
    lines = [head, "|---|" + "---:|---:|" * len(shapes)]
    for store in result["stores"]:
        cells = []
        for shape in shapes:
            row = result["results"][shape].get(store)
            if row is None:
                cells += ["-", "-"]
            elif store == "redis":
                cells += [_cell(row["rss"]), _cell(row["used_memory"]) + " (used_memory)"]
            else:
                counted = row.get("counted")
                files = row.get("files")
                cells += [_cell(row["rss"]),
                          (_cell(counted) + (" pages" if "bsddb" in store else "")
                           if counted is not None else "-")
                          + (f", {files:,.0f} files" if files is not None else "")]
        lines.append(f"| {store} | " + " | ".join(cells) + " |")
    return lines


def cpu_table(result: dict[str, Any]) -> list[str]:
    """The server's CPU time per record of a batch fill and read-back."""
    shapes = result["shapes"]
    lines = ["| store | " + " | ".join(f"{shape} fill | {shape} read" for shape in shapes)
             + " |", "|---|" + "---:|---:|" * len(shapes)]
    for store in result["stores"]:
        cells = []
        for shape in shapes:
            row = result["results"][shape].get(store) or {}
            cells += [_cell(row.get("put_many_cpu_ns")), _cell(row.get("get_many_cpu_ns"))]
        lines.append(f"| {store} | " + " | ".join(cells) + " |")
    return lines


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = result["shapes"]
    stores = result["stores"]
    figure, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.5), squeeze=False)
    for axis, shape in zip(axes[0], shapes):
        rows = result["results"][shape]
        names = [store for store in stores if store in rows]
        rss = [rows[store]["rss"] for store in names]
        counted = [rows[store].get("used_memory") if store == "redis"
                   else rows[store].get("counted") for store in names]
        positions = range(len(names))
        bars = axis.barh([p + 0.2 for p in positions], rss, height=0.4,
                         label="RSS growth")
        axis.bar_label(bars, fmt="%.0f", fontsize=7, padding=2)
        bars = axis.barh([p - 0.2 for p in positions], [c or 0 for c in counted], height=0.4,
                         label="counted: storage_bytes (arenas, pages); Redis: used_memory")
        axis.bar_label(bars, labels=["-" if c is None else f"{c:.0f}" for c in counted],
                       fontsize=7, padding=2)
        axis.margins(x=0.15)
        axis.set_yticks(list(positions), names, fontsize=8)
        axis.invert_yaxis()
        key, value = result["stored"][shape]
        axis.set_title(f"{shape}: {SHAPES[shape][0]}\n({key} + {value} bytes stored)",
                       fontsize=9)
        axis.set_xlabel("bytes per record")
        axis.grid(axis="x", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
    figure.suptitle(f"bytes per record, {result['records']:,} records per store, each in a "
                    f"fresh process ({result['commit']}, {result['date']})", fontsize=9)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--shapes", default="small,medium,1kb",
                        help="comma-separated, of: " + ", ".join(SHAPES))
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--png", metavar="FILE", help="also plot them")
    args = parser.parse_args(argv)
    shapes = [shape.strip() for shape in args.shapes.split(",")]
    unknown = set(shapes) - set(SHAPES)
    if unknown:
        parser.error(f"unknown shapes {sorted(unknown)}; choose from {list(SHAPES)}")
    stores = [f"{medium} {name}" for name, medium in TECHNOLOGIES] + ["redis"]
    result: dict[str, Any] = {
        "command": "python -m benchmarks.memory " + " ".join(
            sys.argv[1:] if argv is None else argv),
        **machine(), "records": args.records, "buckets": BUCKETS, "shapes": shapes,
        "stores": stores, "stored": {shape: stored_sizes(shape) for shape in shapes},
        "results": {}}
    for shape in shapes:
        rows: dict[str, Any] = {}
        for name, medium in TECHNOLOGIES:
            rows[f"{medium} {name}"] = measure_domus(name, medium, shape, args.records)
            print(f"  {shape} {medium} {name}: {rows[f'{medium} {name}']}", file=sys.stderr)
        redis_row = measure_redis(shape, args.records)
        if redis_row is not None:
            rows["redis"] = redis_row
            result["redis_version"] = redis_row.pop("version")
            print(f"  {shape} redis: {redis_row}", file=sys.stderr)
        result["results"][shape] = rows
    print(f"{result['date']}, commit {result['commit']}, {result['machine']}")
    print(f"bytes per record, {args.records:,} records per store, each store in a fresh "
          f"process (one Domus service, {BUCKETS} buckets; Redis "
          f"{result.get('redis_version', 'not run')}); the machine may be shared, and RSS "
          f"moves with what else the process allocates")
    print("; ".join(f"{shape}: {SHAPES[shape][0]} ({key} + {value} bytes stored)"
                    for shape, (key, value) in result["stored"].items()))
    print("\n".join(table(result)))
    print("RSS: growth of the process's resident memory.  counted: the service's "
          "storage_bytes (record-tree arenas; Berkeley DB pages), Redis's used_memory.  "
          "files: a disk DHT's files once flushed.")
    print("server CPU time (user + system) per record, in ns: the fill (put_many of "
          f"{BATCH:,}; Redis MSET) and the read-back (get_many; Redis MGET)")
    print("\n".join(cpu_table(result)))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump(result, target, indent=1)
    if args.png:
        plot(result, args.png)
        print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
