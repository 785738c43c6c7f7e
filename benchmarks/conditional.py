"""What pop and setdefault cost against put and delete.

    python -m benchmarks.conditional [--services 2] [--keys 3000] [--rounds 3]
                                     [--json FILE]

One local deployment of ``--services`` services and RAM DHTs with 1 and 2
copies; one blocking client, one request at a time.  Per round and DHT:
``--keys`` puts of new int keys, then ``pop`` of each (GET, then
DELETE_IF of the value read), ``setdefault`` of each (PUT_IF_ABSENT on an
absent key), ``delete`` of each; the median of the rounds' microseconds a
call.  A pop is two round trips where a delete is one; a setdefault of an
absent key is one, as a put is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from domus.ops.deploy import LocalDeployment, free_port_block

from .provenance import machine

CALLS = ("put", "pop", "setdefault", "delete")


def _timed(call: Callable[[int], Any], keys: range) -> float:
    started = time.perf_counter()
    for key in keys:
        call(key)
    return (time.perf_counter() - started) / len(keys) * 1e6


def measure(services: int, count: int, rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="domus-conditional-") as data_dir, \
            LocalDeployment(services, port=free_port_block(services + 1), data_dir=data_dir,
                            supervisor_args=["--balance", "manual"]) as deployment, \
            deployment.connect() as cluster:
        dhts = {copies: cluster.create_dht(f"copies-{copies}", buckets=16 * services,
                                           replicas=copies)
                for copies in (1, 2)}
        times: dict[int, dict[str, list[float]]] = {
            copies: {call: [] for call in CALLS} for copies in dhts}
        for round_number in range(rounds):
            for copies, dht in dhts.items():
                keys = range(round_number * count, (round_number + 1) * count)
                runs = times[copies]
                runs["put"].append(_timed(lambda key, dht=dht: dht.put(key, key), keys))
                runs["pop"].append(_timed(lambda key, dht=dht: dht.pop(key), keys))
                runs["setdefault"].append(_timed(lambda key, dht=dht: dht.setdefault(key, key),
                                                 keys))
                runs["delete"].append(_timed(lambda key, dht=dht: dht.delete(key), keys))
                if len(dht) != 0:
                    raise SystemExit(f"DHT with {copies} copies is not empty after the round")
        for copies, runs in times.items():
            results[f"replicas_{copies}"] = {call: round(statistics.median(runs[call]), 1)
                                             for call in CALLS}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--services", type=int, default=2)
    parser.add_argument("--keys", type=int, default=3000, help="keys per call and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    args = parser.parse_args(argv)
    provenance = machine()
    print(f"# {provenance['date']}, commit {provenance['commit']}, load "
          f"{provenance['load_average']} (the machine is shared)", flush=True)
    results = measure(args.services, args.keys, args.rounds)
    for name, row in results.items():
        print(f"{name}: " + ", ".join(f"{call} {row[call]:.1f} us" for call in CALLS))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as output:
            json.dump({"provenance": provenance, "services": args.services, "keys": args.keys,
                       "rounds": args.rounds, "microseconds_per_call": results}, output,
                      indent=2)
            output.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
