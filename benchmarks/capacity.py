"""Service capacity: one Domus service against one redis-server, each
saturated from C, and the latency each gives as load grows.

    python -m benchmarks.capacity [--seconds 3] [--inflight 50] [--keys 100000]
        [--value-size 64] [--points 10,20,...,100] [--insecure] [--no-redis]
        [--put1-seconds 3] [--json FILE] [--png FILE]

1. **Peaks.**  A local deployment of one service (with its secret unless
   ``--insecure``), one DHT of one bucket; ``domus-bench`` (one thread, one
   UDP socket, ``--inflight`` requests in flight) PUTs as fast as it can,
   then GETs the keys it preloaded.  Then a ``redis-server`` of our own
   (Debian's, on 127.0.0.1, a free port, no persistence; stopped by its
   PID) saturated by ``redis-benchmark -t set,get -P 1 -c INFLIGHT``: the
   same number of requests outstanding, none pipelined.
2. **Latency against throughput.**  Each system in open loop at 10 % ...
   100 % of its own peak (``domus-bench --rate``; for Redis ``domus-bench
   --redis``: the same generator and clock over RESP, one request at a time
   on each of INFLIGHT connections): p50 and p99 from the intended send
   time, so a stall is charged to every request it delays.  The curves go
   into a PNG (with matplotlib) and the JSON; the peaks' ratio and each p99
   at 80 % of its peak are printed.
3. **CPU per request.**  The service process's CPU (psutil) per request
   while domus-bench saturates it, beside ``domus-udp-echo`` (one
   ``recvfrom`` and one ``sendto`` per datagram) saturated by
   ``domus-bench --echo``; and, as the issue measures it, the service's CPU
   per request under 4 Python put1 client processes beside the bare loop's
   under the same clients (benchmarks.put1's floor client).  The bare
   loop's own latency curve too, at the same percentages of its own peak:
   what the machine (loopback, scheduler, the generator) gives a server
   that does nothing but answer, the floor of every p99 above.

Only requests served count: a request the service refuses with ``BUSY``
(its reply cache full: more than ``--reply-cache-entries``/2 changes in
15 s, 100,000 a second by default) is counted apart (``busy``), never as
throughput or latency.  The machine is shared with other work: the load
average goes into the JSON; compare ratios taken within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import psutil

from domus.ops.deploy import LocalDeployment, free_port_block

from . import put1
from .programs import ProgramMissing, bench_targets, program
from .provenance import machine

OPS = {"SET": "put", "GET": "get"}


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def bench(arguments: list[str], timeout: float = 300) -> dict[str, Any]:
    """One domus-bench run's JSON report."""
    done = subprocess.run([program("domus-bench"), *arguments, "--json"], capture_output=True,
                          text=True, timeout=timeout)
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"domus-bench {' '.join(arguments)} failed ({done.returncode}): "
                           f"{done.stderr.strip()}")
    return json.loads(done.stdout)


def curve(arguments: list[str], peak: float, points: list[int], seconds: float,
          label: str) -> list[dict[str, Any]]:
    """p50/p99 at each percentage of ``peak``, open loop."""
    rows = []
    for percent in points:
        rate = peak * percent / 100
        report = bench([*arguments, "--rate", f"{rate:.0f}", "--seconds", str(seconds),
                        "--warmup", "0.5"])
        row = {"percent": percent, "target_rate": round(rate, 1),
               "throughput": report["throughput"], "p50_us": report["latency_us"]["p50"],
               "p99_us": report["latency_us"]["p99"], "p999_us": report["latency_us"]["p99.9"],
               "max_us": report["latency_us"]["max"], "timeouts": report["timeouts"],
               "unsent": report["unsent"], "busy": report.get("busy", 0)}
        rows.append(row)
        print(f"  {label} {percent:>3} %: {rate:>9,.0f}/s asked, {row['throughput']:>9,.0f}/s "
              f"done, p50 {row['p50_us']:>8.1f} us, p99 {row['p99_us']:>9.1f} us"
              f"{', lost ' + str(row['timeouts']) if row['timeouts'] else ''}"
              f"{', unsent ' + str(row['unsent']) if row['unsent'] else ''}"
              f"{', refused BUSY ' + str(row['busy']) if row['busy'] else ''}", flush=True)
    return rows


def measure_domus(args: argparse.Namespace, points: list[int]) -> dict[str, Any]:
    data_dir = tempfile.mkdtemp(prefix="domus-capacity-")
    os.environ.pop("DOMUS_SECRET_FILE", None)
    common = ["--keys", str(args.keys), "--value-size", str(args.value_size),
              "--inflight", str(args.inflight), "--threads", "1", "--timeout", "2"]
    try:
        with LocalDeployment(1, port=free_port_block(2), data_dir=data_dir,
                             insecure=args.insecure) as deployment:
            with deployment.connect() as cluster:
                cluster.create_dht("capacity", buckets=1)
                descriptor = cluster.supervisor.call("open_dht", name="capacity")
            (target,) = bench_targets(descriptor)
            credentials = (["--insecure"] if args.insecure
                           else ["--secret-file", deployment.secret_file])
            arguments = [*target, *credentials, *common]
            service = psutil.Process(deployment.services["s1"].pid)
            result: dict[str, Any] = {"secure": not args.insecure, "peaks": {}, "curves": {},
                                      "cpu_us_per_request": {}}
            bench([*arguments, "--op", "put", "--preload", "--seconds", "0.5", "--warmup", "0"])
            for name, op in OPS.items():
                before, answered = _cpu(service), 0
                report = bench([*arguments, "--op", op, "--seconds", str(args.seconds)])
                answered = report["replies"]
                result["cpu_us_per_request"][name] = 1e6 * (_cpu(service) - before) / answered
                result["peaks"][name] = report["throughput"]
                result.setdefault("peak_busy", {})[name] = report.get("busy", 0)
                print(f"domus {name} peak: {report['throughput']:,.0f}/s served (closed loop, "
                      f"{args.inflight} in flight; p50 {report['latency_us']['p50']:.0f} us, "
                      f"p99 {report['latency_us']['p99']:.0f} us), service CPU "
                      f"{result['cpu_us_per_request'][name]:.2f} us/request"
                      f"{'; refused BUSY ' + str(report['busy']) if report.get('busy') else ''}",
                      flush=True)
            for name, op in OPS.items():
                result["curves"][name] = curve([*arguments, "--op", op],
                                               result["peaks"][name], points, args.seconds,
                                               f"domus {name}")
            return result
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


def _redis_benchmark(port: int, inflight: int, requests: int, keys: int,
                     value_size: int) -> dict[str, float]:
    done = subprocess.run(["redis-benchmark", "-h", "127.0.0.1", "-p", str(port), "-t",
                           "set,get", "-P", "1", "-c", str(inflight), "-n", str(requests),
                           "-r", str(keys), "-d", str(value_size), "--csv"],
                          capture_output=True, text=True, timeout=600, check=True)
    rates = {}
    for line in done.stdout.splitlines():
        cells = [cell.strip('"') for cell in line.split(",")]
        if cells[0] in OPS:
            rates[cells[0]] = float(cells[1])
    return rates


def measure_redis(args: argparse.Namespace, points: list[int],
                  domus_peaks: dict[str, float]) -> dict[str, Any] | None:
    binary = shutil.which("redis-server")
    if binary is None or shutil.which("redis-benchmark") is None:
        print("redis-server or redis-benchmark not found (apt-get install redis-server); "
              "skipping Redis", file=sys.stderr)
        return None
    port = free_port_block(1)
    server = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        put1.wait_for_redis(port)
        process = psutil.Process(server.pid)
        requests = int(max(domus_peaks.values()) * args.seconds) or 100000
        before = _cpu(process)
        peaks = _redis_benchmark(port, args.inflight, requests, args.keys, args.value_size)
        cpu = 1e6 * (_cpu(process) - before) / (2 * requests)
        print(f"redis peaks (redis-benchmark -P 1 -c {args.inflight}): "
              + ", ".join(f"{name} {rate:,.0f}/s" for name, rate in peaks.items())
              + f"; server CPU {cpu:.2f} us/request", flush=True)
        arguments = ["--redis", "--service", f"127.0.0.1:{port}", "--keys", str(args.keys),
                     "--value-size", str(args.value_size), "--inflight", str(args.inflight),
                     "--threads", "1", "--timeout", "2"]
        same_generator = {}
        for name, op in OPS.items():
            report = bench([*arguments, "--op", op, "--seconds", str(args.seconds)])
            same_generator[name] = report["throughput"]
        print("redis peaks (domus-bench --redis, closed loop): " + ", ".join(
            f"{name} {rate:,.0f}/s" for name, rate in same_generator.items()), flush=True)
        curves = {name: curve([*arguments, "--op", op], peaks[name], points, args.seconds,
                              f"redis {name}") for name, op in OPS.items()}
        return {"peaks": peaks, "peaks_domus_bench": same_generator, "curves": curves,
                "cpu_us_per_request": cpu}
    finally:
        server.terminate()
        server.wait(10)


def measure_floor(args: argparse.Namespace, points: list[int]) -> dict[str, Any] | None:
    """domus-udp-echo saturated by domus-bench --echo: its CPU per datagram;
    then its own latency curve (open loop at ``points`` % of its peak), the
    same generator and clock: what this machine's loopback and scheduler
    give a server that does nothing but answer."""
    try:
        echo = program("domus-udp-echo")
    except ProgramMissing as missing:
        print(f"{missing}; skipping the bare loop", file=sys.stderr)
        return None
    server = subprocess.Popen([echo, "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        address = server.stdout.readline().split()[-1]
        process = psutil.Process(server.pid)
        before = _cpu(process)
        arguments = ["--echo", "--service", address, "--inflight", str(args.inflight),
                     "--value-size", str(args.value_size)]
        report = bench([*arguments, "--seconds", str(args.seconds)])
        cpu = 1e6 * (_cpu(process) - before) / max(1, report["replies"])
        print(f"bare C loop (domus-udp-echo) peak: {report['throughput']:,.0f}/s, CPU "
              f"{cpu:.2f} us/datagram", flush=True)
        rows = curve(arguments, report["throughput"], points, args.seconds, "bare loop")
        return {"peak": report["throughput"], "cpu_us_per_request": cpu, "curve": rows}
    finally:
        server.terminate()
        server.wait(10)


def measure_put1_cpu(seconds: float, insecure: bool) -> dict[str, Any]:
    """CPU per request of the service and of the bare loop, each under 4
    Python put1 client processes."""
    domus_cpu: dict[int, float] = {}
    floor_cpu: dict[int, float] = {}
    rates = put1.measure_domus([4], seconds, insecure, domus_cpu)
    floor_rates = put1.measure_c_floor([4], seconds, floor_cpu) or {}
    result = {"domus_rate": rates[4], "domus_cpu_us": domus_cpu[4],
              "floor_rate": floor_rates.get(4), "floor_cpu_us": floor_cpu.get(4)}
    if floor_cpu:
        result["ratio"] = domus_cpu[4] / floor_cpu[4]
        print(f"under 4 Python put1 clients: service {domus_cpu[4]:.2f} us/request "
              f"({rates[4]:,.0f}/s), bare C loop {floor_cpu[4]:.2f} us/request "
              f"({floor_rates[4]:,.0f}/s): {result['ratio']:.2f}x", flush=True)
    return result


def plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed; no PNG (pip install matplotlib)", file=sys.stderr)
        return
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for axis, name in zip(axes, OPS):
        for system, colour in (("domus", "tab:blue"), ("redis", "tab:red")):
            if not results.get(system):
                continue
            rows = results[system]["curves"][name]
            throughput = [row["throughput"] for row in rows]
            axis.plot(throughput, [row["p50_us"] for row in rows], "o--", color=colour,
                      label=f"{system} p50")
            axis.plot(throughput, [row["p99_us"] for row in rows], "s-", color=colour,
                      label=f"{system} p99")
        floor = results.get("bare_loop")
        if floor and floor.get("curve"):
            rows = floor["curve"]
            axis.plot([row["throughput"] for row in rows], [row["p99_us"] for row in rows],
                      "^:", color="tab:gray", label="bare C loop p99")
        axis.set_yscale("log")
        axis.set_xlabel(f"{name} requests/s (open loop)")
        axis.set_ylabel("latency from intended send (us)")
        axis.set_title(f"{name}, one server core")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    figure.suptitle(f"benchmarks.capacity, commit {results['commit']}, {results['date']} "
                    f"(shared 2-core VM, load {results['load_average'][0]})", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    print(f"wrote {path}")


def summary(results: dict[str, Any]) -> dict[str, Any]:
    def at(rows: list[dict[str, Any]], percent: int) -> float | None:
        return next((row["p99_us"] for row in rows if row["percent"] == percent), None)

    out: dict[str, Any] = {}
    domus, redis = results["domus"], results.get("redis")
    for name in OPS:
        line: dict[str, Any] = {"domus_peak": domus["peaks"][name],
                                "domus_p99_at_80_us": at(domus["curves"][name], 80)}
        if redis:
            line.update(redis_peak=redis["peaks"][name],
                        peak_ratio=domus["peaks"][name] / redis["peaks"][name],
                        redis_p99_at_80_us=at(redis["curves"][name], 80))
        floor = results.get("bare_loop")
        if floor and floor.get("curve"):
            line["bare_loop_p99_at_80_us"] = at(floor["curve"], 80)
        out[name] = line
        print(f"{name}: domus peak {line['domus_peak']:,.0f}/s"
              + (f", redis {line['redis_peak']:,.0f}/s, ratio {line['peak_ratio']:.2f}"
                 if redis else "")
              + (f"; p99 at 80 % of peak: domus {line['domus_p99_at_80_us']:.0f} us"
                 if line["domus_p99_at_80_us"] is not None else "")
              + (f", redis {line['redis_p99_at_80_us']:.0f} us"
                 if redis and line["redis_p99_at_80_us"] is not None else "")
              + (f", bare C loop {line['bare_loop_p99_at_80_us']:.0f} us"
                 if line.get("bare_loop_p99_at_80_us") is not None else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per measurement")
    parser.add_argument("--inflight", type=int, default=50,
                        help="requests outstanding: domus-bench's in flight, Redis's connections")
    parser.add_argument("--keys", type=int, default=100000, help="key space")
    parser.add_argument("--value-size", type=int, default=64, help="bytes per value")
    parser.add_argument("--points", default="10,20,30,40,50,60,70,80,90,100",
                        help="percentages of each peak for the open-loop curves")
    parser.add_argument("--insecure", action="store_true", help="Domus without its secret")
    parser.add_argument("--no-redis", action="store_true", help="leave Redis out")
    parser.add_argument("--put1-seconds", type=float, default=3.0,
                        help="seconds of the 4 put1 clients for CPU per request (0: skip)")
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON")
    parser.add_argument("--png", metavar="FILE", help="plot the curves (needs matplotlib)")
    args = parser.parse_args(argv)
    points = [int(part) for part in args.points.split(",")]
    try:
        program("domus-bench")
    except ProgramMissing as missing:
        print(missing, file=sys.stderr)
        return 2
    results: dict[str, Any] = {"benchmark": "capacity", **machine(),
                               "note": "2-core VM shared with other work",
                               "seconds": args.seconds, "inflight": args.inflight,
                               "keys": args.keys, "value_size": args.value_size}
    print(f"capacity: one service vs one redis-server, {args.inflight} outstanding, "
          f"{args.value_size}-byte values, {args.keys:,} keys; load average "
          f"{os.getloadavg()[0]:.2f} (a shared machine)", flush=True)
    results["domus"] = measure_domus(args, points)
    results["redis"] = None if args.no_redis else measure_redis(args, points,
                                                                 results["domus"]["peaks"])
    results["bare_loop"] = measure_floor(args, points)
    if args.put1_seconds > 0:
        results["put1_cpu"] = measure_put1_cpu(args.put1_seconds, args.insecure)
    results["summary"] = summary(results)
    results["load_average_after"] = [round(load, 2) for load in os.getloadavg()]
    if args.png:
        plot(results, args.png)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as target:
            json.dump(results, target, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
