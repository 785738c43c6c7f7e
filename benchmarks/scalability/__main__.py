"""python -m benchmarks.scalability: see the package's docstring."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import time

from benchmarks.provenance import machine
from benchmarks.scalability import model as models
from benchmarks.scalability.hosts import can_make_namespaces
from benchmarks.scalability.plots import curves, draw
from benchmarks.scalability.run import FULL, QUICK, Suite

EXPERIMENTS = ("domus", "shared", "instances", "redis", "mariadb", "ycsb", "model")
RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def _list(text: str, *, cast: type = int) -> list:
    return [cast(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scalability",
                                     description=(__import__("benchmarks.scalability")
                                                  .scalability.__doc__.split("\n\n")[0]))
    parser.add_argument("--quick", action="store_true",
                        help="a small sweep, 0.3 s per point (about a minute on a quiet machine)")
    parser.add_argument("--delay-us", type=float, default=50.0,
                        help="one-way delay added on each host's interface with tc netem "
                        "(default 50; 0: none; run without it, saying so, if the kernel "
                        "lacks netem)")
    parser.add_argument("--services", help="M values, e.g. 1,2,3")
    parser.add_argument("--clients", help="N values, e.g. 1,2,3,4")
    parser.add_argument("--per-host", help="X values, e.g. 1,2")
    parser.add_argument("--seconds", type=float, help="seconds per point")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(EXPERIMENTS)}")
    parser.add_argument("--json", metavar="FILE", help="write the run here (default: "
                        "benchmarks/results/scalability[-quick].json)")
    parser.add_argument("--png-dir", metavar="DIR", help="write the figures here (default: "
                        "benchmarks/results)")
    args = parser.parse_args(argv)
    why_not = can_make_namespaces()
    if why_not:
        print(f"benchmarks.scalability: {why_not}", file=sys.stderr)
        return 2
    only = set(_list(args.only, cast=str)) if args.only else None
    unknown = (only or set()) - set(EXPERIMENTS)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {', '.join(EXPERIMENTS)}")
    # SIGTERM and SIGHUP unwind like Ctrl-C: every system, client and
    # namespace is stopped or deleted by the finally blocks on the way out
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, lambda number, _frame: sys.exit(128 + number))
    plan = QUICK if args.quick else FULL
    for name, flag in (("services", args.services), ("clients", args.clients),
                       ("per_host", args.per_host)):
        if flag:
            setattr(plan, name, _list(flag))
    if args.seconds:
        plan.seconds = args.seconds
    load = os.getloadavg()
    started = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - started:6.1f}s] {line}", flush=True)

    progress(f"scalability suite ({'quick' if args.quick else 'full'}): {os.cpu_count()} cores, "
             f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} at the start"
             + ("  (SHARED machine: a load over the core count makes slow, noisy numbers)"
                if load[0] > (os.cpu_count() or 1) else ""))
    suite = Suite(plan, args.delay_us, progress=progress)
    run = suite.run(only - {"model"} if only else None)
    heartbeats = None
    if only is None or "model" in only:
        from benchmarks.scalability import heartbeats as beats

        progress(f"model: the supervisor with {plan.heartbeat_services} simulated services "
                 f"heartbeating")
        try:
            heartbeats = beats.measure(plan.heartbeat_services, plan.heartbeat_seconds)
            progress(f"  supervisor CPU {heartbeats['supervisor_cpu']:.3f} cores for "
                     f"{heartbeats['services']} services")
        except Exception as exc:  # noqa: BLE001  (said, and the run goes on)
            run["notes"].append(f"model: heartbeat load not measured: {exc}")
            progress(f"  heartbeat load not measured: {exc}")
    run["model"] = models.fit(run["points"], heartbeats)
    measured = curves(run["points"]).get("domus max(N Xcli M 1srv)", {})
    for line in models.describe(run["model"], measured):
        progress(line)
    provenance = machine()
    run.update(provenance, quick=args.quick, load_average_start=[round(v, 2) for v in load],
               machine_short=f"{platform.node()} {os.cpu_count()} cores (shared)",
               cores=os.cpu_count())
    json_path = args.json or os.path.join(
        RESULTS, f"scalability{'-quick' if args.quick else ''}.json")
    os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
    png_dir = args.png_dir or (os.path.dirname(os.path.abspath(json_path)))
    os.makedirs(png_dir, exist_ok=True)
    run["figures"] = [os.path.basename(path) for path in draw(
        run, png_dir, prefix="scalability-quick" if args.quick else "scalability")]
    with open(json_path, "w", encoding="utf-8") as target:
        json.dump(run, target, indent=1, sort_keys=True)
    progress(f"wrote {json_path} and {', '.join(run['figures'])} in {png_dir}")
    for note in run["notes"]:
        progress(f"note: {note}")
    progress(f"done in {time.monotonic() - started:.0f}s; load average now "
             f"{os.getloadavg()[0]:.2f}; namespaces and processes torn down")
    return 1 if not run["points"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
