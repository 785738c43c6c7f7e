"""Rebalancing under load: what writers see while buckets move.

    python -m benchmarks.rebalance [--writers 2] [--records 200000] [--lookup D,C,R]
                                   [--big-bucket 500000] [--png FILE] [--json FILE]

1. *Join, drain, resize.*  A 2-service deployment with the balancer on
   (auto, settle 1 s) holds a DHT of ``--records`` records; ``--writers``
   client processes put continuously, looking buckets up by ``--lookup``.
   Two services join; once the balancer has settled, one of the first two
   is drained; once it has settled again, the writers' messages per put are
   measured for 3 s; then the DHT doubles and halves back.  Prints
   throughput per 100 ms, put latency p50/p99/max while buckets move and
   while they do not, bytes moved, the time to settle, the messages per put
   after settling, and how long each resize took; plots throughput and the
   slowest put of every 100 ms (PNG).
2. *One big bucket.*  A bucket of ``--big-bucket`` records moves from one
   service to another while writers put into that very bucket: the pause
   they see is the slowest put during the move.

Writes are checked afterwards: every acknowledged put reads back.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import tempfile
import time
from typing import Any

import domus
from domus.ops.deploy import LocalDeployment, free_port_block
from domus.wire.keys import bucket_of, encode_key

VALUE = "v" * 100
AUTO = ["--balance", "auto", "--balance-settle", "1", "--balance-cooldown", "5",
        "--balance-max-moves", "32"]


def writer(address: str, dht_name: str, keys: list[Any], stop: Any, out: Any,
           index: int, lookup: str | None, marks: list[Any]) -> None:
    """Put ``keys`` round after round until ``stop``; send back (wall time,
    seconds) of every put, the keys acknowledged last, and at each of
    ``marks`` (events, in order) once it is set: (puts so far, messages
    sent so far)."""
    samples: list[tuple[float, float]] = []
    acknowledged: dict[Any, int] = {}
    counted: list[tuple[int, int]] = []
    with domus.connect(address, timeout=30) as cluster:
        dht = cluster.open_dht(dht_name, lookup=lookup)
        number = 0
        while not stop.is_set():
            key = keys[number % len(keys)]
            started = time.perf_counter()
            dht[key] = number
            samples.append((time.time(), time.perf_counter() - started))
            acknowledged[key] = number
            number += 1
            if len(counted) < len(marks) and marks[len(counted)].is_set():
                counted.append((number, dht.stats()["messages"]))
    out.put((index, samples, acknowledged, counted))


def run_writers(address: str, dht_name: str, key_sets: list[list[Any]],
                lookup: str | None = None, marks: int = 0):
    """Start the writers; returns (finish, mark events)."""
    context = multiprocessing.get_context("fork")
    stop, out = context.Event(), context.Queue()
    events = [context.Event() for _ in range(marks)]
    processes = [context.Process(target=writer, args=(address, dht_name, keys, stop, out, i,
                                                      lookup, events))
                 for i, keys in enumerate(key_sets)]
    for process in processes:
        process.start()

    def finish() -> tuple[list[tuple[float, float]], dict[Any, int], list[list[tuple]]]:
        stop.set()
        results = [out.get(timeout=120) for _ in processes]
        for process in processes:
            process.join(60)
        samples = sorted(sample for _i, found, _acked, _counted in results for sample in found)
        acknowledged: dict[Any, int] = {}
        for _i, _samples, acked, _counted in results:
            acknowledged.update(acked)
        return samples, acknowledged, [counted for *_rest, counted in results]

    return finish, events


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))] if ordered else 0.0


def latency(samples: list[tuple[float, float]], inside: list[tuple[float, float]],
            want_inside: bool) -> dict[str, float]:
    chosen = [seconds for at, seconds in samples
              if any(start <= at <= end for start, end in inside) == want_inside]
    return {"puts": len(chosen), "p50_ms": 1e3 * percentile(chosen, 0.5),
            "p99_ms": 1e3 * percentile(chosen, 0.99), "max_ms": 1e3 * max(chosen, default=0)}


def held(cluster: domus.Cluster, name: str) -> dict[str, int]:
    return {entry["name"]: entry["buckets"].get(name, {}).get("storage", 0)
            for entry in cluster.services() if entry["state"] == "up"}


def wait_settled(cluster: domus.Cluster, name: str, timeout: float = 300) -> float:
    """Seconds until the balancer has nothing to do for ``name``."""
    started = time.time()
    while time.time() - started < timeout:
        status = cluster.balancer_status()
        storage_plan = [move for move in cluster.rebalance(name, dry_run=True)
                        if move["role"] == "storage"]
        if not status["doing"] and not storage_plan:
            return time.time() - started
        time.sleep(0.1)
    raise SystemExit("the balancer did not settle")


def join_and_drain(args: argparse.Namespace, data_dir: str) -> dict[str, Any]:
    port = free_port_block(5)
    with LocalDeployment(2, port=port, data_dir=data_dir, heartbeat=0.5,
                         supervisor_args=AUTO) as deployment, \
            deployment.connect(timeout=60) as cluster:
        os.environ.update(deployment.environment())   # (workers find its secret)
        dht = cluster.create_dht("elastic", buckets=256)
        keys = [f"key-{number}" for number in range(args.records)]
        for start in range(0, len(keys), 10_000):
            dht.put_many({key: VALUE for key in keys[start:start + 10_000]})
        key_sets = [keys[index::args.writers] for index in range(args.writers)]
        finish, marks = run_writers(deployment.supervisor_address, "elastic", key_sets,
                                    args.lookup, marks=2)
        begun = time.time()
        time.sleep(3)
        joined_at = time.time()
        for name, offset in (("s3", 3), ("s4", 4)):
            deployment._spawn(name, ["service", "--name", name, "--supervisor",
                                     deployment.supervisor_address, "--listen",
                                     f"127.0.0.1:{port + offset}", "--data-dir",
                                     os.path.join(deployment.data_dir, name),
                                     "--heartbeat", "0.5"])
        deployment.wait_until_up(["s3", "s4"], timeout=60)
        settle = wait_settled(cluster, "elastic")
        settled_at = time.time()
        after_join = held(cluster, "elastic")
        drain_started = time.time()
        drained = cluster.drain_service("s2")
        drain_ended = time.time()
        wait_settled(cluster, "elastic")
        # Messages per put once settled: between two marks 3 s apart.
        marks[0].set()
        time.sleep(3)
        marks[1].set()
        resizes = []
        for count in (512, 256):
            started = time.time()
            answer = cluster.resize_dht("elastic", count)
            resizes.append({"from": answer["from"], "to": count, "start": started - begun,
                            "seconds": time.time() - started})
            time.sleep(2)
        samples, acknowledged, counted = finish()
        moves = [decision for decision in cluster.balancer_status()["decisions"]
                 if decision.get("role") == "storage" and decision.get("records") is not None]
        moved_records = sum(decision["records"] for decision in moves) + drained["records"]
        got = dht.get_many(list(acknowledged))
        lost = sum(1 for key, number in acknowledged.items() if got.get(key) != number)
        moving = [(joined_at, settled_at), (drain_started, drain_ended),
                  *[(begun + resize["start"], begun + resize["start"] + resize["seconds"])
                    for resize in resizes]]
        settled_puts = sum(marked[1][0] - marked[0][0] for marked in counted
                           if len(marked) == 2)
        settled_messages = sum(marked[1][1] - marked[0][1] for marked in counted
                               if len(marked) == 2)
        per_100ms: dict[int, list[float]] = {}
        for at, seconds in samples:
            per_100ms.setdefault(int((at - begun) * 10), []).append(seconds)
        timeline = [{"t": slot / 10, "puts_per_s": 10 * len(values),
                     "max_ms": 1e3 * max(values)} for slot, values in sorted(per_100ms.items())]
        return {
            "records": args.records, "writers": args.writers, "buckets": 256,
            "settle_s": settle, "join_to_settled_s": settled_at - joined_at,
            "drain_s": drain_ended - drain_started, "drain_moves": drained["moves"],
            "storage_after_join": after_join, "storage_after_drain": held(cluster, "elastic"),
            "records_moved": moved_records,
            "bytes_moved": moved_records * (len(encode_key("key-100000")) + len(VALUE) + 2),
            "while_moving": latency(samples, moving, True),
            "while_still": latency(samples, moving, False),
            "puts": len(samples), "acknowledged_checked": len(acknowledged), "lost": lost,
            "lookup": args.lookup, "settled_puts": settled_puts,
            "messages_per_put_settled": settled_messages / settled_puts if settled_puts else None,
            "resizes": resizes,
            "marks": {"join": joined_at - begun, "settled": settled_at - begun,
                      "drain": drain_started - begun, "drained": drain_ended - begun,
                      **{f"{resize['to']} buckets": resize["start"] for resize in resizes}},
            "timeline": timeline,
        }


def big_bucket(args: argparse.Namespace, data_dir: str) -> dict[str, Any]:
    with LocalDeployment(2, port=free_port_block(3), data_dir=data_dir, heartbeat=0.5,
                         supervisor_args=["--balance", "manual"]) as deployment, \
            deployment.connect(timeout=120) as cluster:
        os.environ.update(deployment.environment())   # (workers find its secret)
        dht = cluster.create_dht("big", buckets=2, platform="domus-rbt")
        in_bucket: list[str] = []
        number = 0
        while len(in_bucket) < args.big_bucket:
            key = f"k{number}"
            if bucket_of(encode_key(key), "xxh3", 2) == 0:
                in_bucket.append(key)
            number += 1
        for start in range(0, len(in_bucket), 10_000):
            dht.put_many({key: VALUE for key in in_bucket[start:start + 10_000]})
        source = dht.records_by_service()
        writers_keys = [in_bucket[index:index + 1000] for index in range(0, 1000 * args.writers,
                                                                          1000)]
        finish, _marks = run_writers(deployment.supervisor_address, "big", writers_keys)
        time.sleep(2)
        started = time.time()
        owner = "s1" if source.get("s1") else "s2"
        answer = cluster.move_bucket("big", 0, storage="s2" if owner == "s1" else "s1")
        ended = time.time()
        time.sleep(1)
        samples, acknowledged, _counted = finish()
        got = dht.get_many(list(acknowledged))
        lost = sum(1 for key, value in acknowledged.items() if got.get(key) != value)
        during = [seconds for at, seconds in samples if started <= at <= ended]
        return {"records": answer["records"], "move_s": ended - started,
                "puts_during_move": len(during),
                "pause_ms": 1e3 * max(during, default=0.0),
                "p50_during_ms": 1e3 * percentile(during, 0.5),
                "p50_before_ms": 1e3 * statistics.median(
                    [seconds for at, seconds in samples if at < started] or [0.0]),
                "lost": lost, "writers": args.writers}


def plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = result["timeline"]
    times = [point["t"] for point in timeline]
    figure, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 6))
    top.plot(times, [point["puts_per_s"] for point in timeline], linewidth=0.8)
    top.set_ylabel("puts/s (per 100 ms)")
    bottom.plot(times, [point["max_ms"] for point in timeline], linewidth=0.8, color="tab:red")
    bottom.set_ylabel("slowest put in 100 ms (ms)")
    bottom.set_yscale("log")
    bottom.set_xlabel("seconds")
    for axes in (top, bottom):
        for label, at in result["marks"].items():
            axes.axvline(at, color="grey", linestyle="--", linewidth=0.7)
            if axes is top:
                axes.text(at, axes.get_ylim()[1] * 0.95, label, fontsize=8, rotation=90,
                          va="top")
    top.set_title(f"{result['writers']} writers ({result['lookup']}), {result['records']:,} "
                  f"records: 2 services join a 2-service deployment, one drains, the DHT "
                  f"doubles and halves", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def machine() -> dict[str, Any]:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "commit": commit,
            "machine": f"{platform.node()}, {os.cpu_count()} cores, {platform.platform()}"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--writers", type=int, default=2)
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--big-bucket", type=int, default=500_000)
    parser.add_argument("--lookup", default="D,C,R", help="the writers' lookup strategy "
                        "(default %(default)s)")
    parser.add_argument("--png", metavar="FILE")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as first, tempfile.TemporaryDirectory() as second:
        elastic = join_and_drain(args, first)
        big = big_bucket(args, second)
    where = machine()
    print(f"{where['date']}, commit {where['commit']}, {where['machine']}")
    print(f"join, drain, resize: {args.writers} writers ({args.lookup}), "
          f"{elastic['records']:,} records, 256 buckets, 2 services + 2 joining, then s2 "
          f"drained, then 256 -> 512 -> 256 buckets")
    print(f"  settled {elastic['join_to_settled_s']:.1f} s after the join "
          f"(storage {elastic['storage_after_join']}); drain {elastic['drain_s']:.1f} s "
          f"({elastic['drain_moves']} moves) -> {elastic['storage_after_drain']}")
    print(f"  records moved {elastic['records_moved']:,} (~{elastic['bytes_moved'] / 2**20:.0f} "
          f"MiB); puts {elastic['puts']:,}, acknowledged keys checked "
          f"{elastic['acknowledged_checked']:,}, lost {elastic['lost']}")
    if elastic["messages_per_put_settled"] is not None:
        print(f"  once settled: {elastic['messages_per_put_settled']:.3f} messages per put "
              f"({elastic['settled_puts']:,} puts over 3 s)")
    for resize in elastic["resizes"]:
        print(f"  resize {resize['from']} -> {resize['to']} buckets: {resize['seconds']:.2f} s")
    for label in ("while_moving", "while_still"):
        part = elastic[label]
        print(f"  put latency {label.replace('_', ' ')}: p50 {part['p50_ms']:.2f} ms, "
              f"p99 {part['p99_ms']:.2f} ms, max {part['max_ms']:.1f} ms "
              f"({part['puts']:,} puts)")
    print(f"one big bucket: {big['records']:,} records moved in {big['move_s']:.2f} s while "
          f"{big['writers']} writers put into it: pause (slowest put during the move) "
          f"{big['pause_ms']:.1f} ms; median put {big['p50_during_ms']:.2f} ms during, "
          f"{big['p50_before_ms']:.2f} ms before; lost {big['lost']}")
    if args.png:
        plot(elastic, args.png)
        print(f"plot: {args.png}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump({"command": "python -m benchmarks.rebalance", "arguments": vars(args),
                       **where, "join_and_drain": elastic, "big_bucket": big}, target,
                      indent=1)
    if elastic["lost"] or big["lost"]:
        raise SystemExit("acknowledged writes were lost")


if __name__ == "__main__":
    main()
