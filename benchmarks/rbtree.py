"""RBTree (C) against sortedcontainers.SortedDict and dict, in the same run.

    python -m benchmarks.rbtree [--n 1000000] [--repeat 5] [--seed 2024] [--json FILE]

n random 64-bit signed int keys (fixed seed; one list of key objects shared by
every container; the value stored is the key itself):

- insert: n ``container[key] = key`` into an empty container, random order;
- lookup: n ``container[key]``, in another random order;
- floor: n random probes; RBTree ``floor(probe, None)``, SortedDict
  ``bisect_right(probe)`` then ``peekitem(index - 1)``; dict: not applicable;
- ceiling: the same with ``ceiling`` / ``bisect_left`` + ``peekitem(index)``;
- iterate: ``for item in container.items()``; in key order for RBTree and
  SortedDict, in insertion order for dict (labelled: it is not ordered);
- delete: n ``del container[key]``, in a third random order;

then n random bytes keys of 8 to 24 bytes for insert and lookup.  Every
container runs the same loop, written the same way (methods bound before the
loop where a method is called); the GC is off while a loop runs, as in
timeit.  Each repetition runs every container in turn (rotating who goes
first), and the best of the repetitions is reported, in ns per operation
(five by default: on a shared 2-core VM single runs vary by +-15%).
Memory per item is what tracemalloc sees allocated while a container is
filled with the int keys (the keys themselves excluded: they exist before).

Targets, checked and printed as PASS/FAIL: int insert >= 2x SortedDict;
floor and ceiling >= 3x SortedDict; lookup >= 20% of dict's operations per
second.  Results go to benchmarks/results/rbtree.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import sys
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from domus._rbtree import RBTree
from sortedcontainers import SortedDict

RESULTS = Path(__file__).parent / "results" / "rbtree.json"
CONTAINERS: dict[str, Callable[[], Any]] = {"RBTree": RBTree, "SortedDict": SortedDict,
                                            "dict": dict}
INT64 = 1 << 63


# ------------------------------------------------------------------ loops
# One function per operation and container kind; the loops are the same
# statement for every container.
def insert(container: Any, keys: list[Any], _probes: list[Any]) -> None:
    for key in keys:
        container[key] = key


def lookup(container: Any, keys: list[Any], _probes: list[Any]) -> None:
    for key in keys:
        container[key]


def delete(container: Any, keys: list[Any], _probes: list[Any]) -> None:
    for key in keys:
        del container[key]


def iterate(container: Any, _keys: list[Any], _probes: list[Any]) -> None:
    for _item in container.items():
        pass


def floor_tree(tree: RBTree, _keys: list[Any], probes: list[Any]) -> None:
    floor = tree.floor
    for probe in probes:
        floor(probe, None)


def floor_sorted(sorted_dict: SortedDict, _keys: list[Any], probes: list[Any]) -> None:
    bisect_right, peekitem = sorted_dict.bisect_right, sorted_dict.peekitem
    for probe in probes:
        index = bisect_right(probe)
        peekitem(index - 1) if index else None


def ceiling_tree(tree: RBTree, _keys: list[Any], probes: list[Any]) -> None:
    ceiling = tree.ceiling
    for probe in probes:
        ceiling(probe, None)


def ceiling_sorted(sorted_dict: SortedDict, _keys: list[Any], probes: list[Any]) -> None:
    bisect_left, peekitem, size = sorted_dict.bisect_left, sorted_dict.peekitem, len(sorted_dict)
    for probe in probes:
        index = bisect_left(probe)
        peekitem(index) if index < size else None


FLOOR = {"RBTree": floor_tree, "SortedDict": floor_sorted}
CEILING = {"RBTree": ceiling_tree, "SortedDict": ceiling_sorted}


def timed(loop: Callable[..., None], container: Any, keys: list[Any],
          probes: list[Any]) -> float:
    """Seconds for one run of loop, with the GC off."""
    gc.collect()
    gc.disable()
    try:
        started = time.perf_counter()
        loop(container, keys, probes)
        return time.perf_counter() - started
    finally:
        gc.enable()


# ------------------------------------------------------------------ data
def int_keys(generator: random.Random, count: int) -> list[int]:
    keys: set[int] = set()
    while len(keys) < count:
        keys.add(generator.getrandbits(64) - INT64)
    ordered = list(keys)
    generator.shuffle(ordered)
    return ordered


def bytes_keys(generator: random.Random, count: int) -> list[bytes]:
    keys: set[bytes] = set()
    while len(keys) < count:
        keys.add(generator.randbytes(generator.randint(8, 24)))
    ordered = list(keys)
    generator.shuffle(ordered)
    return ordered


def shuffled(generator: random.Random, keys: list[Any]) -> list[Any]:
    copy = list(keys)
    generator.shuffle(copy)
    return copy


# ------------------------------------------------------------------ runs
def run(count: int, repeat: int, seed: int) -> dict[str, dict[str, float]]:
    """Best seconds per (operation, container) over the repetitions."""
    generator = random.Random(seed)
    keys = int_keys(generator, count)
    lookup_keys, delete_keys = shuffled(generator, keys), shuffled(generator, keys)
    probes = [generator.getrandbits(64) - INT64 for _ in range(count)]
    byte_keys = bytes_keys(generator, count)
    byte_lookups = shuffled(generator, byte_keys)
    best: dict[str, dict[str, float]] = {}

    def record(operation: str, name: str, seconds: float) -> None:
        slot = best.setdefault(operation, {})
        slot[name] = min(seconds, slot.get(name, float("inf")))

    names = list(CONTAINERS)
    for round_number in range(repeat):
        order = names[round_number % len(names):] + names[:round_number % len(names)]
        for name in order:
            container = CONTAINERS[name]()
            record("insert", name, timed(insert, container, keys, probes))
            record("lookup", name, timed(lookup, container, lookup_keys, probes))
            if name in FLOOR:
                record("floor", name, timed(FLOOR[name], container, keys, probes))
                record("ceiling", name, timed(CEILING[name], container, keys, probes))
            record("iterate", name, timed(iterate, container, keys, probes))
            record("delete", name, timed(delete, container, delete_keys, probes))
            assert not container
            del container
            container = CONTAINERS[name]()
            record("bytes insert", name, timed(insert, container, byte_keys, probes))
            record("bytes lookup", name, timed(lookup, container, byte_lookups, probes))
            del container
        print(f"  round {round_number + 1}/{repeat} done", file=sys.stderr)
    return {operation: {name: seconds / count * 1e9 for name, seconds in by_name.items()}
            for operation, by_name in best.items()}


def memory_per_item(count: int, seed: int) -> dict[str, float]:
    """Bytes tracemalloc sees allocated per item while filling each container
    with int keys that already exist."""
    keys = int_keys(random.Random(seed), count)
    result = {}
    for name, factory in CONTAINERS.items():
        gc.collect()
        tracemalloc.start()
        try:
            container = factory()
            insert(container, keys, [])
            result[name] = tracemalloc.get_traced_memory()[0] / count
        finally:
            tracemalloc.stop()
        del container
    return result


def targets(ns: dict[str, dict[str, float]]) -> list[dict[str, Any]]:
    """The performance targets: (name, measured ratio, threshold)."""
    checks = [
        ("int insert: RBTree vs SortedDict speed",
         ns["insert"]["SortedDict"] / ns["insert"]["RBTree"], 2.0),
        ("floor: RBTree vs SortedDict speed",
         ns["floor"]["SortedDict"] / ns["floor"]["RBTree"], 3.0),
        ("ceiling: RBTree vs SortedDict speed",
         ns["ceiling"]["SortedDict"] / ns["ceiling"]["RBTree"], 3.0),
        ("lookup: RBTree ops/s as a share of dict's",
         ns["lookup"]["dict"] / ns["lookup"]["RBTree"], 0.2),
    ]
    return [{"target": name, "measured": round(value, 3), "required": required,
             "pass": value >= required} for name, value, required in checks]


# ------------------------------------------------------------------ report
def report(ns: dict[str, dict[str, float]], memory: dict[str, float],
           checks: list[dict[str, Any]]) -> str:
    lines = [
        f"{'operation':<16}{'RBTree':>10}{'SortedDict':>12}{'dict':>10}"
        f"{'RBTree speedup':>16}{'RBTree/dict':>13}",
        f"{'':<16}{'ns/op':>10}{'ns/op':>12}{'ns/op':>10}{'vs SortedDict':>16}{'ops/s':>13}",
    ]
    for operation, by_name in ns.items():
        tree, sorted_dict, plain = by_name["RBTree"], by_name.get("SortedDict"), by_name.get("dict")
        label = operation + (" (dict unordered)" if operation == "iterate" else "")
        lines.append(
            f"{label:<16}{tree:>10.0f}"
            + (f"{sorted_dict:>12.0f}" if sorted_dict else f"{'n/a':>12}")
            + (f"{plain:>10.0f}" if plain else f"{'n/a':>10}")
            + (f"{sorted_dict / tree:>15.2f}x" if sorted_dict else f"{'':>16}")
            + (f"{plain / tree:>12.2f}x" if plain else ""))
    lines.append("")
    lines.append("memory per item (tracemalloc, keys excluded): " + ", ".join(
        f"{name} {size:.0f} B" for name, size in memory.items()))
    lines.append("")
    for check in checks:
        verdict = "PASS" if check["pass"] else "FAIL"
        lines.append(f"{verdict}  {check['target']}: {check['measured']:.2f} "
                     f"(required >= {check['required']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="keys per container")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions; the best counts")
    parser.add_argument("--seed", type=int, default=2024)
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write results")
    arguments = parser.parse_args(argv)
    ns = run(arguments.n, arguments.repeat, arguments.seed)
    memory = memory_per_item(arguments.n, arguments.seed)
    checks = targets(ns)
    print(f"n = {arguments.n:,}, best of {arguments.repeat}, Python {platform.python_version()}, "
          f"{os.cpu_count()} CPUs")
    print(report(ns, memory, checks))
    arguments.json.parent.mkdir(parents=True, exist_ok=True)
    arguments.json.write_text(json.dumps({
        "command": "python -m benchmarks.rbtree " + " ".join(sys.argv[1:] if argv is None
                                                             else argv),
        "n": arguments.n, "repeat": arguments.repeat, "seed": arguments.seed,
        "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "ns_per_op": ns, "bytes_per_item": memory, "targets": checks,
    }, indent=1) + "\n")
    return 0 if all(check["pass"] for check in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
