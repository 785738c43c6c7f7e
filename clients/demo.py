"""The `make demo` workload: a local deployment, a DHT, and a job of several
client processes that put records one by one and read every one back.

    python clients/demo.py [--services 3] [--clients 4] [--records 200000]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import domus
from domus.ops.cli import format_status
from domus.ops.deploy import LocalDeployment, free_port_block


def record(key: int) -> dict[str, Any]:
    """The value the demo stores under ``key`` (and expects back)."""
    return {"id": key, "square": key * key, "tag": f"record-{key}"}


def worker(supervisor: str, first: int, count: int, phase: Any, progress: Any,
           failures: Any) -> None:
    """Put keys first..first+count one by one, wait for the go to read, then
    get each one back and check it."""
    with domus.connect(supervisor) as cluster:
        dht = cluster.open_dht("demo")
        for offset in range(count):
            dht[first + offset] = record(first + offset)
            if offset & 255 == 255:
                with progress.get_lock():
                    progress.value += 256
        with progress.get_lock():
            progress.value += count & 255
        phase.wait()  # every client has finished putting
        phase.wait()  # the parent has reset the progress counter
        wrong = 0
        for offset in range(count):
            if dht.get(first + offset) != record(first + offset):
                wrong += 1
            if offset & 255 == 255:
                with progress.get_lock():
                    progress.value += 256
        with progress.get_lock():
            progress.value += count & 255
            failures.value += wrong


def show_progress(label: str, progress: Any, total: int, started: float, done: bool,
                  last: list[float]) -> None:
    """Redraw the bar on a terminal; print a line per quarter otherwise."""
    value = progress.value
    elapsed = max(time.perf_counter() - started, 1e-9)
    fraction = min(value / total, 1.0)
    if sys.stdout.isatty():
        width = 30
        filled = int(width * fraction)
        bar = "#" * filled + "." * (width - filled)
        print(f"\r  {label:<4} [{bar}] {fraction:6.1%} {value:>9,}/{total:,}  "
              f"{value / elapsed:>9,.0f} ops/s", end="\n" if done else "", flush=True)
    elif done or fraction >= last[0] + 0.25:
        last[0] = fraction
        print(f"  {label:<4} {fraction:6.1%} {value:>9,}/{total:,}  "
              f"{value / elapsed:>9,.0f} ops/s", flush=True)


def run_phase(label: str, progress: Any, total: int, processes: list[Any]) -> float:
    started = time.perf_counter()
    last = [0.0]
    while progress.value < total:
        if any(p.exitcode not in (None, 0) for p in processes):
            raise RuntimeError(f"a client process failed during the {label} phase")
        show_progress(label, progress, total, started, False, last)
        time.sleep(0.1)
    elapsed = time.perf_counter() - started
    show_progress(label, progress, total, started, True, last)
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--records", type=int, default=200_000)
    args = parser.parse_args(argv)

    data_dir = tempfile.mkdtemp(prefix="domus-demo-")
    port = free_port_block(args.services + 1)
    print(f"Starting a local Domus deployment: a supervisor on 127.0.0.1:{port} and "
          f"{args.services} services (separate processes)...", flush=True)
    deployment = LocalDeployment(args.services, port=port, data_dir=data_dir)
    try:
        deployment.start()
        # Its clients find the deployment's secret as any job does.
        os.environ.update(deployment.environment())
        print(f"Its secret: {deployment.secret_file} (mode 0600; only processes given it "
              f"may use the deployment).", flush=True)
        with domus.connect(deployment.supervisor_address) as cluster:
            dht = cluster.create_dht("demo")
            print(f"Created DHT 'demo': {dht.bucket_count} buckets over "
                  f"{args.services} services, ram/python-dict, lookup D.\n", flush=True)
            context = multiprocessing.get_context("fork")
            phase = context.Barrier(args.clients + 1)
            progress = context.Value("q", 0)
            failures = context.Value("q", 0)
            share = args.records // args.clients
            counts = [share + (1 if i < args.records % args.clients else 0)
                      for i in range(args.clients)]
            firsts = [sum(counts[:i]) for i in range(args.clients)]
            processes = [context.Process(target=worker, args=(
                deployment.supervisor_address, firsts[i], counts[i], phase, progress, failures))
                for i in range(args.clients)]
            print(f"{args.clients} client processes, {args.records:,} puts then "
                  f"{args.records:,} gets, one request per record:", flush=True)
            for process in processes:
                process.start()
            put_seconds = run_phase("put", progress, args.records, processes)
            phase.wait()
            progress.value = 0
            phase.wait()
            get_seconds = run_phase("get", progress, args.records, processes)
            for process in processes:
                process.join(60)
            failed = [p.exitcode for p in processes if p.exitcode != 0]

            print(f"\nputs: {args.records:,} in {put_seconds:.2f}s = "
                  f"{args.records / put_seconds:,.0f} puts/s")
            print(f"gets: {args.records:,} in {get_seconds:.2f}s = "
                  f"{args.records / get_seconds:,.0f} gets/s, "
                  f"{args.records - failures.value:,} checked correct, "
                  f"{failures.value:,} wrong")
            shares = dht.records_by_service()
            total = sum(shares.values())
            print("\nrecords per service:")
            for name, records in sorted(shares.items()):
                print(f"  {name}: {records:>8,} ({records / max(total, 1):.1%})")
            print(f"  total {total:,} records; len(dht) = {len(dht):,}\n")
            print(format_status(cluster.status()))
            ok = not failed and failures.value == 0 and total == args.records
    finally:
        print("\nShutting the deployment down...", flush=True)
        deployment.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    print("Demo OK." if ok else "Demo FAILED.", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
