"""The reply cache's memory and its rotation stall: the C cache against the dicts.

    python -m benchmarks.reply_cache [--entries 1000000] [--generation 4000000]
                                     [--json benchmarks/results/reply_cache.json]

For each implementation (``python``: the dicts of ``ReplyCache``, what every
service used before the C cache; ``c``: ``CompactReplyCache``), each in a
process of its own so that one's memory does not blur the other's:

- bytes per entry: the process's RSS grown by filling the current generation
  with ``--entries`` single-put replies (9 bytes, a 20-byte key each, as a
  service keeps them), divided by the entries; for the C cache also what it
  says it allocated (``memory``: its tables and buffers);
- the rotation stall: a full generation of ``--generation`` entries (the
  default cap's current generation) made the previous one, another filled,
  and the time of the ``rotate()`` that drops the first -- the time the
  reactor thread (and the serving thread, waiting for the baton) does
  nothing else;
- the longest single ``put`` while filling (a table doubling in the C cache,
  a dict resizing in Python), in the first generation (grown from nothing)
  and in a generation after a rotation (which starts at the size the last
  one reached, in the C cache), and the most minor page faults in any
  10,000 puts in a row (a fresh array faulted in at once).  As in a
  service, the generation before the rotation is told of it
  (``_prepare``) two thirds of the way through.

No service runs: this measures the cache alone, through its Python methods
(the C path calls the same C functions without them), in a process whose
malloc is set as a service's is (domus.service.allocator).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from typing import Any

import psutil

from .provenance import machine

FAULT_WINDOW = 10_000       # puts over which page faults are counted


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _fill(cache: Any, raw: bytes, worst: list[int] | None = None) -> float:
    """Puts a reply for each 20 bytes of ``raw`` as a service makes them for
    single puts (a 9-byte reply under a 20-byte key whose first 4 bytes are
    the request id the reply echoes; both new objects, as the Python
    handler makes them), and returns the longest single put, in seconds.
    ``worst[0]`` (if given) is raised to the most minor page faults of any
    FAULT_WINDOW puts in a row: a fresh array's pages faulted in by the
    puts that land on them, all at once, is what stalls a busy service."""
    count = len(raw) // 20
    longest = 0.0
    put, clock = cache.put, time.perf_counter
    faults = _minor_faults()
    for number, at in enumerate(range(0, 20 * count, 20), 1):
        key = raw[at:at + 20]
        reply = b"\xd1\x01\x00\x00" + key[:4] + b"\x01"
        started = clock()
        if not put(key, reply):
            raise RuntimeError("the cache refused an entry: --entries is over the cap")
        took = clock() - started
        if took > longest:
            longest = took
        if worst is not None and number % FAULT_WINDOW == 0:
            now = _minor_faults()
            worst[0] = max(worst[0], now - faults)
            faults = now
    return longest


def measure(implementation: str, entries: int, generation: int) -> dict[str, Any]:
    """One implementation's numbers (run in a process of its own)."""
    from domus.service import replycache
    from domus.service.allocator import keep_large_blocks

    keep_large_blocks()     # (malloc set as a service sets it)

    kind = replycache.ReplyCache if implementation == "python" else replycache.CompactReplyCache
    if kind is None:
        raise SystemExit("domus._hotpath is not built: no C reply cache")
    max_entries = max(replycache.DEFAULT_MAX_ENTRIES, 2 * generation)
    process = psutil.Process()
    gc.disable()            # (a service's collections are another matter)
    cache = kind(max_entries=max_entries)
    raw = os.urandom(20 * entries)          # (drawn before, kept after: not counted)
    before = process.memory_info().rss
    _fill(cache, raw)
    grown = process.memory_info().rss - before
    del raw
    result: dict[str, Any] = {
        "implementation": implementation, "entries": entries,
        "rss_bytes_per_entry": round(grown / entries, 1),
    }
    if hasattr(cache, "memory"):
        result["allocated_bytes_per_entry"] = round(cache.memory / entries, 1)
    del cache

    cache = kind(max_entries=max_entries)
    result["generation"] = generation
    worst = [0]
    # (as in a service: the rotation's timer readies the next generation
    # replycache.PREPARE_AHEAD seconds before it, here two thirds through)
    made = 2 * generation // 3
    longest = _fill(cache, os.urandom(20 * made), worst)
    cache._prepare(replycache.DEFAULT_TTL / 2 - replycache.PREPARE_AHEAD,
                   replycache.PREPARE_AHEAD)
    longest = max(longest, _fill(cache, os.urandom(20 * (generation - made)), worst))
    result["longest_put_first_generation_ms"] = round(1e3 * longest, 3)
    result["most_faults_in_10000_puts_first_generation"] = worst[0]
    cache.rotate()
    worst = [0]
    result["longest_put_after_rotation_ms"] = round(
        1e3 * _fill(cache, os.urandom(20 * generation), worst), 3)
    result["most_faults_in_10000_puts_after_rotation"] = worst[0]
    if hasattr(cache, "memory"):
        result["second_generation_allocated_bytes_per_entry"] = round(cache.memory / len(cache),
                                                                      1)
    result["full_rss_mb"] = round(process.memory_info().rss / 2**20)
    started = time.perf_counter()
    dropped = cache.rotate()
    result["rotation_ms"] = round(1e3 * (time.perf_counter() - started), 2)
    assert dropped == generation
    return result


# (what each implementation's own process runs)
_ONE = ("import json, sys; from benchmarks.reply_cache import measure; "
        "print(json.dumps(measure(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--entries", type=int, default=1_000_000,
                        help="entries for bytes per entry (default %(default)s)")
    parser.add_argument("--generation", type=int, default=4_000_000,
                        help="entries of the generation whose rotation is timed "
                        "(default %(default)s: the default cap's current generation)")
    parser.add_argument("--json", help="write the results there")
    args = parser.parse_args(argv)
    results = []
    for implementation in ("python", "c"):
        out = subprocess.run([sys.executable, "-c", _ONE, implementation, str(args.entries),
                              str(args.generation)],
                             capture_output=True, text=True, check=True)
        result = json.loads(out.stdout)
        results.append(result)
        print(f"{implementation:>6}: {result['rss_bytes_per_entry']:6.1f} B/entry (RSS, "
              f"{args.entries:,} entries"
              + (f"; {result['allocated_bytes_per_entry']} allocated, "
                 f"{result['second_generation_allocated_bytes_per_entry']} with two "
                 f"generations of {args.generation:,}"
                 if "allocated_bytes_per_entry" in result else "")
              + f"); rotation of {args.generation:,}: {result['rotation_ms']} ms; "
              f"longest put {result['longest_put_first_generation_ms']} ms (first "
              f"generation), {result['longest_put_after_rotation_ms']} ms (after a rotation); "
              f"most page faults in {FAULT_WINDOW:,} puts in a row "
              f"{result['most_faults_in_10000_puts_first_generation']:,} (first generation), "
              f"{result['most_faults_in_10000_puts_after_rotation']:,} (after a rotation)")
    report = {**machine(), "note": "machine shared with other engineers' work",
              "results": results}
    if args.json:
        with open(args.json, "w") as out_file:
            json.dump(report, out_file, indent=1)
            out_file.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
