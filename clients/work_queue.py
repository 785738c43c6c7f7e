"""An array-job task that takes its work from the DHT: tasks claim chunks.

Where example_job.py gives each task a fixed slice, here every task walks
the chunks and claims each one it finds free with ``setdefault`` -- one
step on the service, so of tasks claiming a chunk at once exactly one gets
it -- then computes it and stores its results.  A fast task takes more
chunks than a slow one, and tasks may start at any time.  A task that dies
after claiming a chunk leaves it claimed and undone: ``--collect`` names
such chunks, and ``--release`` frees them (run it once no task is left).

    python clients/work_queue.py --items 100000 --chunk 1000     # in each task
    python clients/work_queue.py --items 100000 --chunk 1000 --collect
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from example_job import compute  # (the same stand-in for real work, beside this file)

import domus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--supervisor", default=None)
    parser.add_argument("--dht", default="collatz-queue")
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--chunk", type=int, default=1000, help="items a claim covers")
    parser.add_argument("--collect", action="store_true",
                        help="check every result is there; name chunks claimed and undone")
    parser.add_argument("--release", action="store_true",
                        help="free the chunks claimed and left undone (no task running)")
    args = parser.parse_args(argv)
    me = f"{socket.gethostname()}:{os.getpid()}"
    chunks = range(-(-args.items // args.chunk))

    def items_of(chunk: int) -> range:
        return range(1 + chunk * args.chunk, 1 + min((chunk + 1) * args.chunk, args.items))

    with domus.connect(args.supervisor) as cluster:
        dht = cluster.create_dht(args.dht, exist_ok=True)
        if args.collect or args.release:
            claims = dht.get_many([("claim", chunk) for chunk in chunks])
            done = dht.get_many([("done", chunk) for chunk in chunks])
            undone = [chunk for chunk in chunks
                      if ("claim", chunk) in claims and ("done", chunk) not in done]
            if args.release:
                for chunk in undone:
                    dht.pop(("claim", chunk), None)
                print(f"released {len(undone)} chunks claimed and left undone")
                return 0
            found = dht.get_many(range(1, args.items + 1))
            by_task: dict[str, int] = {}
            for worker in done.values():
                by_task[worker] = by_task.get(worker, 0) + 1
            print(f"{len(found):,} of {args.items:,} results; chunks done by task: "
                  f"{dict(sorted(by_task.items()))}; claimed and undone: {undone}")
            return 0 if len(found) == args.items else 1
        taken = 0
        for chunk in chunks:
            if dht.setdefault(("claim", chunk), me) != me:
                continue                # (another task has it)
            dht.put_many({item: compute(item) for item in items_of(chunk)})
            dht[("done", chunk)] = me
            taken += 1
        print(f"task {me}: computed {taken} of {len(chunks)} chunks in DHT {args.dht!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
