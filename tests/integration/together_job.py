"""Tasks that start together, over the Twisted client: one TxCluster sends
a create_dht, then opens and exist_ok creations of the same DHT at once,
so that they reach the supervisor while the creation is in flight (one TCP
link keeps their order).  Run by test_create_together.py in a subprocess (a
reactor cannot be restarted inside pytest)::

    python together_job.py HOST:PORT NAME COUNT

Prints one JSON line: the DHT id each call got (or its error), and exits 0.
"""

from __future__ import annotations

import json
import sys

from twisted.internet import defer, task


@defer.inlineCallbacks
def main(reactor, address: str, name: str, count: str):
    from domus.client import tx

    cluster = yield tx.connect(address, timeout=5.0)
    calls = [cluster.create_dht(name, buckets=32)]
    for index in range(1, int(count)):
        calls.append(cluster.open_dht(name) if index % 2 else
                     cluster.create_dht(name, buckets=32, exist_ok=True))
    results = yield defer.DeferredList(calls, consumeErrors=True)
    outcome = [dht.id if ok else f"{type(dht.value).__name__}: {dht.value}"
               for ok, dht in results]
    stored = yield defer.gatherResults([dht.put(index, index) for index, (ok, dht)
                                        in enumerate(results) if ok])
    print(json.dumps({"ids": outcome, "stored": len(stored)}), flush=True)
    yield cluster.close()


if __name__ == "__main__":
    task.react(main, sys.argv[1:])
