"""Clients for every style of job, on one deployment in one run.

    python -m benchmarks.clients [--threads 1,4,8,16] [--outstanding 1,16,256]
                                 [--seconds 3] [--repeat 2] [--services 1] [--no-uvloop]

Threads: one blocking client shared by T threads (what a
``ThreadPoolExecutor`` job does) against one client per thread, T threads
each putting random 64-bit int keys and values, one request per round trip,
for S seconds; the rate is every thread's puts together.

Event loops: the asyncio client (domus.aio, on asyncio's default loop, then
on uvloop when it is installed) against the Twisted client
(domus.txclient), N requests outstanding at once (N coroutines, each
putting as above, awaiting each put before the next), for S seconds.

Each measurement runs in a fresh process (one at a time, after one
unmeasured warm-up), ``--repeat`` times, alternating with the one it is
compared with, and the best run counts; all against the same local deployment (a supervisor and
``--services`` services, secure, as deployed).  Prints the rates and the
ratios the issue aims at (shared client at 8 threads / one client per
thread >= 0.9; asyncio / Twisted >= 1) and writes the raw numbers with their provenance to
benchmarks/results/clients.json.  The machine may be shared with other
work: the load average is recorded with the numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import random
import shutil
import tempfile
import threading
import time
from typing import Any

from domus.ops.deploy import LocalDeployment, free_port_block

from .provenance import machine

INT64 = 1 << 63
DHT = "clients"
RESULTS = os.path.join(os.path.dirname(__file__), "results", "clients.json")


# ------------------------------------------------------------------ threads
def _thread_puts(dht: Any, seconds: float, seed: int, start: threading.Barrier,
                 counts: list[int], index: int) -> None:
    rng = random.Random(seed)
    getrandbits = rng.getrandbits
    put = dht.put
    start.wait()
    end = time.perf_counter() + seconds
    done = 0
    while True:
        for _ in range(64):
            put(getrandbits(64) - INT64, getrandbits(64) - INT64)
        done += 64
        if time.perf_counter() >= end:
            break
    counts[index] = done


def threads_run(address: str, threads: int, shared: bool, seconds: float) -> dict[str, Any]:
    """T threads putting for ``seconds``: through one client, or each
    through its own.  Runs in a process of its own."""
    import domus

    clusters = [domus.connect(address) for _ in range(1 if shared else threads)]
    dhts = [cluster.open_dht(DHT) for cluster in clusters]
    for dht in dhts:
        dht.put(-1, 0)
    counts = [0] * threads
    start = threading.Barrier(threads + 1)
    workers = [threading.Thread(target=_thread_puts,
                                args=(dhts[0 if shared else index], seconds, 7000 + index,
                                      start, counts, index))
               for index in range(threads)]
    for worker in workers:
        worker.start()
    started = time.perf_counter()
    start.wait()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    for cluster in clusters:
        cluster.close()
    return {"operations": sum(counts), "seconds": round(elapsed, 3),
            "rate": round(sum(counts) / elapsed)}


# ------------------------------------------------------------------ event loops
async def _outstanding_puts(put: Any, outstanding: int, seconds: float, now: Any,
                            gather: Any) -> tuple[int, float]:
    count = 0
    end = now() + seconds

    async def worker(seed: int) -> None:
        nonlocal count
        rng = random.Random(seed)
        while now() < end:
            await put(rng.getrandbits(64) - INT64, rng.getrandbits(64) - INT64)
            count += 1

    started = now()
    await gather([worker(9000 + index) for index in range(outstanding)])
    return count, now() - started


def asyncio_run(address: str, outstanding: int, seconds: float, loop: str) -> dict[str, Any]:
    import asyncio

    import domus.aio

    async def job() -> tuple[int, float]:
        async with domus.aio.connect(address) as cluster:
            dht = await cluster.open_dht(DHT)
            await dht.put(-1, 0)

            async def gather(coroutines: list[Any]) -> None:
                await asyncio.gather(*coroutines)

            return await _outstanding_puts(dht.put, outstanding, seconds, time.perf_counter,
                                           gather)

    if loop == "uvloop":
        import uvloop

        count, elapsed = uvloop.run(job())
    else:
        count, elapsed = asyncio.run(job())
    return {"operations": count, "seconds": round(elapsed, 3), "rate": round(count / elapsed)}


def twisted_run(address: str, outstanding: int, seconds: float) -> dict[str, Any]:
    from twisted.internet import defer, reactor

    from domus import txclient

    outcome: list[Any] = []

    async def job() -> tuple[int, float]:
        cluster = await txclient.connect(address, reactor=reactor)
        dht = await cluster.open_dht(DHT)
        await dht.put(-1, 0)

        async def gather(coroutines: list[Any]) -> None:
            await defer.gatherResults([defer.Deferred.fromCoroutine(coroutine)
                                       for coroutine in coroutines])

        result = await _outstanding_puts(dht.put, outstanding, seconds, time.perf_counter,
                                         gather)
        await cluster.close()
        return result

    def done(result: Any) -> None:
        outcome.append(result)
        reactor.stop()

    reactor.callWhenRunning(lambda: defer.Deferred.fromCoroutine(job()).addBoth(done))
    reactor.run()
    if not isinstance(outcome[0], tuple):
        outcome[0].raiseException()
    count, elapsed = outcome[0]
    return {"operations": count, "seconds": round(elapsed, 3), "rate": round(count / elapsed)}


# ------------------------------------------------------------------ running
def _child(function: Any, args: tuple[Any, ...], queue: Any) -> None:
    try:
        queue.put(("ok", function(*args)))
    except BaseException as exc:  # reported to the parent, which raises it
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def in_process(function: Any, *args: Any, timeout: float = 300.0) -> dict[str, Any]:
    """``function(*args)`` in a fresh process (spawned: no state of this one)."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_child, args=(function, args, queue))
    process.start()
    try:
        status, result = queue.get(timeout=timeout)
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    if status != "ok":
        raise RuntimeError(result)
    return result


def best_of(repeat: int, measures: list[Any]) -> list[dict[str, Any]]:
    """Each measurement's best of ``repeat`` runs (the one least disturbed
    by other work on the machine), the runs alternating in order (A B, B A,
    ...) so that drift touches all alike; every run's rate is kept."""
    runs: list[list[dict[str, Any]]] = [[] for _ in measures]
    for round_ in range(repeat):
        order = range(len(measures)) if round_ % 2 == 0 else reversed(range(len(measures)))
        for index in order:
            runs[index].append(measures[index]())
    best = []
    for results in runs:
        top = dict(max(results, key=lambda result: result["rate"]))
        top["runs"] = [result["rate"] for result in results]
        best.append(top)
    return best


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.clients",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="1,4,8,16")
    parser.add_argument("--outstanding", default="1,16,256")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--services", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs of each measurement; the best is reported")
    parser.add_argument("--no-uvloop", action="store_true")
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args(argv)
    thread_counts = [int(part) for part in args.threads.split(",")]
    outstanding = [int(part) for part in args.outstanding.split(",")]
    loops = ["asyncio"] + (["uvloop"] if uvloop_available() and not args.no_uvloop else [])

    report: dict[str, Any] = {"provenance": machine(), "seconds": args.seconds,
                              "repeat": args.repeat,
                              "services": args.services, "threads": {}, "event_loops": {},
                              "uvloop": uvloop_available()}
    data_dir = tempfile.mkdtemp(prefix="domus-bench-clients-")
    deployment = LocalDeployment(args.services, port=free_port_block(args.services + 1),
                                 data_dir=data_dir)
    try:
        deployment.start(timeout=60)
        if deployment.secret_file is not None:
            os.environ["DOMUS_SECRET_FILE"] = deployment.secret_file
        import domus

        with domus.connect(deployment.supervisor_address) as cluster:
            cluster.create_dht(DHT, buckets=64)
        address = deployment.supervisor_address
        # (a deployment's first seconds are slower: warm it up, unmeasured)
        in_process(threads_run, address, 2, True, 1.0)
        print(f"one deployment: {args.services} service(s), secure; {args.seconds:g} s each; "
              f"load average {os.getloadavg()[0]:.1f} (the machine may be shared)")
        print(f"{'threads':>8} {'shared client':>15} {'client per thread':>18} {'ratio':>6}")
        for threads in thread_counts:
            shared, own = best_of(args.repeat, [
                functools.partial(in_process, threads_run, address, threads, True, args.seconds),
                functools.partial(in_process, threads_run, address, threads, False,
                                  args.seconds)])
            ratio = shared["rate"] / own["rate"]
            report["threads"][threads] = {"shared": shared, "per_thread": own,
                                          "ratio": round(ratio, 3)}
            print(f"{threads:>8} {shared['rate']:>11,} /s {own['rate']:>14,} /s {ratio:>6.2f}")
        header = "".join(f"{loop:>14}" for loop in loops)
        print(f"{'outstanding':>11} {'twisted':>12}{header}  (ratio to twisted)")
        for count in outstanding:
            measured = best_of(args.repeat, [
                functools.partial(in_process, twisted_run, address, count, args.seconds),
                *(functools.partial(in_process, asyncio_run, address, count, args.seconds, loop)
                  for loop in loops)])
            twisted = measured[0]
            row = {"twisted": twisted}
            cells = []
            for loop, result in zip(loops, measured[1:]):
                result["ratio"] = round(result["rate"] / twisted["rate"], 3)
                row[loop] = result
                cells.append(f"{result['rate']:>8,} {result['ratio']:>4.2f}")
            report["event_loops"][count] = row
            print(f"{count:>11} {twisted['rate']:>9,} /s" + "".join(f"{cell:>14}"
                                                                    for cell in cells))
    finally:
        deployment.stop()
        shutil.rmtree(data_dir, ignore_errors=True)
    report["provenance"]["load_average_after"] = [round(load, 2) for load in os.getloadavg()]
    if args.output:
        os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
        with open(args.output, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
        print(f"raw numbers: {args.output}")
    return report


if __name__ == "__main__":
    main()
