"""What copies cost, and how long writes wait when a service dies.

    python -m benchmarks.replication [--services 4] [--clients 1,4] [--seconds 4]
                                     [--rounds 3] [--json FILE]

1. *Throughput.*  One deployment of ``--services`` services and a RAM DHT
   (64 buckets per service) for each ``replicas`` of 1, 2 and 3; for each
   number of client processes in ``--clients``, ``--rounds`` rounds, each
   measuring the three DHTs in turn: put1 (one put of a new int key per
   round trip) for ``--seconds``, then get of those keys.  Prints the
   median puts and gets per second, and the median of each round's ratio
   to replicas=1 (the DHTs are measured side by side, so that a machine
   whose speed drifts, as a shared VM's does, moves all three alike).
2. *The failover window.*  A replicas=2 DHT on a fresh deployment; 4
   writer processes put continuously, noting when each put was sent and
   when it was acknowledged; one service is killed with SIGKILL.  The
   window is from the kill to the first acknowledgement, of a put sent
   once the killed service was gone, on a bucket it was the primary of; the
   longest any write waited, on any bucket (one the victim was the backup
   of waits too, until the supervisor takes the dead backup off it), and
   on the victim's own.  Every acknowledged put is read back.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import tempfile
import time
from typing import Any

import domus
from domus.ops.deploy import LocalDeployment, free_port_block
from domus.placement import layout
from domus.wire.keys import bucket_of, encode_key

from .provenance import machine

SUPERVISOR_ARGS = ["--balance", "manual"]


def _put_worker(address: str, name: str, seconds: float, index: int, barrier: Any,
                out: Any) -> None:
    with domus.connect(address, timeout=15) as cluster:
        dht = cluster.open_dht(name)
        dht[-1 - index] = 0
        barrier.wait()
        count = 0
        started = time.perf_counter()
        deadline = started + seconds
        base = index << 40
        while time.perf_counter() < deadline:
            for offset in range(64):
                dht[base + count + offset] = count
            count += 64
        puts = count / (time.perf_counter() - started)
        started = time.perf_counter()
        for key in range(base, base + count):
            dht[key]
        gets = count / (time.perf_counter() - started)
    out.put((puts, gets))


def throughput(address: str, name: str, clients: int, seconds: float) -> dict[str, float]:
    context = multiprocessing.get_context("fork")
    barrier, out = context.Barrier(clients), context.Queue()
    processes = [context.Process(target=_put_worker, args=(address, name, seconds, index,
                                                           barrier, out))
                 for index in range(clients)]
    for process in processes:
        process.start()
    results = [out.get(timeout=seconds * 20 + 60) for _ in processes]
    for process in processes:
        process.join(60)
    return {"put_per_s": sum(puts for puts, _gets in results),
            "get_per_s": sum(gets for _puts, gets in results)}


def _writer(address: str, name: str, index: int, stop: Any, out: Any) -> None:
    sent: list[tuple[int, float, float]] = []     # key, sent at, acknowledged at
    errors = 0
    with domus.connect(address, timeout=15) as cluster:
        dht = cluster.open_dht(name)
        number = 0
        while not stop.is_set():
            key = (index << 40) + number
            at = time.time()
            try:
                dht[key] = number
            except domus.errors.DomusError:
                errors += 1
            else:
                sent.append((key, at, time.time()))
            number += 1
    out.put((sent, errors))


def failover(services: int, data_dir: str) -> dict[str, Any]:
    port = free_port_block(services + 1)
    with LocalDeployment(services, port=port, data_dir=data_dir, heartbeat=0.5,
                         supervisor_args=SUPERVISOR_ARGS) as deployment, \
            deployment.connect(timeout=15) as cluster:
        os.environ.update(deployment.environment())   # (workers find its secret)
        dht = cluster.create_dht("window", buckets=64 * services, replicas=2)
        context = multiprocessing.get_context("fork")
        stop, out = context.Event(), context.Queue()
        writers = [context.Process(target=_writer, args=(deployment.supervisor_address,
                                                         "window", index, stop, out))
                   for index in range(4)]
        for writer in writers:
            writer.start()
        time.sleep(2)
        victim = "s2"
        primaries = set(layout.buckets_in(layout.ranges_of(
            layout.owners(cluster.dht_info("window"), "storage"), victim)))
        killed_at = time.time()
        deployment.kill_service(victim, signal.SIGKILL)     # (and reaps it)
        # A put sent after killed_at, before the signal took, may have been
        # answered by the victim itself: what counts as sent after the kill
        # is sent once the victim was gone.
        dead_at = time.time()
        time.sleep(4)
        stop.set()
        results = [out.get(timeout=120) for _ in writers]
        for writer in writers:
            writer.join(60)
        acknowledged = [entry for found, _errors in results for entry in found]
        on_victim = [(key, at, acked) for key, at, acked in acknowledged
                     if bucket_of(encode_key(key), "xxh3", dht.bucket_count) in primaries]
        waited = [acked - max(at, killed_at) for key, at, acked in on_victim if acked >= killed_at]
        # (a put to a bucket the victim was the *backup* of waits too: its
        # primary waits for the dead backup's answer until the supervisor
        # takes the backup off the bucket)
        waited_any = [acked - max(at, killed_at) for _key, at, acked in acknowledged
                      if acked >= killed_at]
        after = [acked for _key, at, acked in on_victim if at >= dead_at]
        got = dht.get_many([key for key, _at, _acked in acknowledged])
        lost = sum(1 for key, _at, _acked in acknowledged if key not in got)
        return {"victim": victim, "buckets_it_was_primary_of": len(primaries),
                "window_s": (min(after) - killed_at) if after else None,
                "longest_wait_s": max(waited, default=0.0),
                "longest_wait_any_s": max(waited_any, default=0.0),
                "puts": len(acknowledged), "errors": sum(errors for _f, errors in results),
                "lost": lost}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=4)
    parser.add_argument("--clients", default="1,4")
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    client_counts = [int(part) for part in args.clients.split(",")]
    where = machine()
    print(f"{where['date']}, commit {where['commit']}, {where['machine']}")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as data_dir:
        port = free_port_block(args.services + 1)
        with LocalDeployment(args.services, port=port, data_dir=data_dir, heartbeat=0.5,
                             supervisor_args=SUPERVISOR_ARGS) as deployment, \
                deployment.connect(timeout=15) as cluster:
            os.environ.update(deployment.environment())   # (workers find its secret)
            for copies in (1, 2, 3):
                cluster.create_dht(f"r{copies}", buckets=64 * args.services, replicas=copies)
            for clients in client_counts:
                rounds = [{copies: throughput(deployment.supervisor_address, f"r{copies}",
                                              clients, args.seconds)
                           for copies in (1, 2, 3)} for _ in range(args.rounds)]
                for copies in (1, 2, 3):
                    rows.append({
                        "replicas": copies, "clients": clients,
                        "put_per_s": statistics.median(one[copies]["put_per_s"]
                                                       for one in rounds),
                        "get_per_s": statistics.median(one[copies]["get_per_s"]
                                                       for one in rounds),
                        "put_ratio": statistics.median(one[copies]["put_per_s"]
                                                       / one[1]["put_per_s"] for one in rounds),
                        "get_ratio": statistics.median(one[copies]["get_per_s"]
                                                       / one[1]["get_per_s"] for one in rounds),
                        "rounds": [one[copies] for one in rounds]})
    print(f"throughput: {args.services} services, RAM DHTs, put1 then get, "
          f"{args.seconds:g} s each, medians of {args.rounds} rounds")
    print(f"  {'replicas':>8} {'clients':>7} {'puts/s':>10} {'ratio':>6} {'gets/s':>10} "
          f"{'ratio':>6}")
    for row in sorted(rows, key=lambda row: (row["replicas"], row["clients"])):
        print(f"  {row['replicas']:>8} {row['clients']:>7} {row['put_per_s']:>10,.0f} "
              f"{row['put_ratio']:>6.2f} {row['get_per_s']:>10,.0f} {row['get_ratio']:>6.2f}")
    with tempfile.TemporaryDirectory() as data_dir:
        window = failover(args.services, data_dir)
    print(f"failover: replicas=2, 4 writers, {window['victim']} (the primary of "
          f"{window['buckets_it_was_primary_of']} buckets) killed with SIGKILL")
    print(f"  writes to its buckets resumed {window['window_s']:.2f} s after the kill; the "
          f"longest any write waited: {window['longest_wait_any_s']:.2f} s (on the buckets it "
          f"was the primary of: {window['longest_wait_s']:.2f} s); {window['puts']:,} "
          f"puts acknowledged, {window['errors']} errors, {window['lost']} lost")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump({"command": "python -m benchmarks.replication", "arguments": vars(args),
                       **where, "throughput": rows, "failover": window}, target, indent=1)
    if window["lost"]:
        raise SystemExit("acknowledged writes were lost")


if __name__ == "__main__":
    main()
