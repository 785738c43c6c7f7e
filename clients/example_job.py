"""An array-job task that stores its results in a DHT, and a collector.

Each task (inside clients/slurm/ or clients/pbs/ job scripts: $DOMUS_TASK_ID
of $DOMUS_TASKS; in an array job: $SLURM_ARRAY_TASK_ID or $PBS_ARRAYID)
computes results for its slice of the inputs and stores them with put_many;
any task (or a final step) collects them.  Every task creates the DHT with
exist_ok=True: tasks that start together all get the one DHT.

    python clients/example_job.py --tasks 8 --task-id 3      # one task
    python clients/example_job.py --tasks 8 --collect          # check all results
"""

from __future__ import annotations

import argparse
import os
import sys

import domus


def compute(item: int) -> dict[str, int]:
    """Stand-in for real work: the Collatz stopping time of ``item``."""
    steps, value = 0, item
    while value != 1:
        value = value // 2 if value % 2 == 0 else 3 * value + 1
        steps += 1
    return {"item": item, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--supervisor", default=None)
    parser.add_argument("--dht", default="collatz")
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--tasks", type=int, default=int(os.environ.get("DOMUS_TASKS") or 1))
    parser.add_argument("--task-id", type=int,
                        default=int(os.environ.get("DOMUS_TASK_ID")
                                    or os.environ.get("SLURM_ARRAY_TASK_ID")
                                    or os.environ.get("PBS_ARRAYID") or 0))
    parser.add_argument("--collect", action="store_true")
    args = parser.parse_args(argv)

    with domus.connect(args.supervisor) as cluster:
        results = cluster.create_dht(args.dht, exist_ok=True)
        if args.collect:
            found = results.get_many(range(1, args.items + 1))
            missing = args.items - len(found)
            longest = max(found.values(), key=lambda r: r["steps"], default=None)
            print(f"{len(found):,} results, {missing:,} missing; longest: {longest}")
            return 0 if missing == 0 else 1
        mine = range(1 + args.task_id, args.items + 1, args.tasks)
        batch: dict[int, dict[str, int]] = {}
        for item in mine:
            batch[item] = compute(item)
            if len(batch) == 5000:
                results.put_many(batch)
                batch.clear()
        results.put_many(batch)
        print(f"task {args.task_id}: stored {len(mine):,} results in DHT {args.dht!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
