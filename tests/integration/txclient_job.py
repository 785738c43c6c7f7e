"""A job that drives a real deployment through domus.client.tx.

Run by tests/integration/test_txclient.py in a subprocess, because a Twisted
reactor cannot be restarted inside the pytest process::

    python txclient_job.py HOST:PORT             # the model job
    python txclient_job.py HOST:PORT dead NAME   # after service NAME was killed

The model job checks every TxDht operation against a dict model, the error cases, and
interop with the synchronous client (it reads the DHT "from_sync" that the
test wrote with domus.client.blocking, and writes "from_tx" for the test to read).
It prints one JSON summary line and exits 0 if every check passed.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from twisted.internet import defer, task

CONCURRENT_PUTS = 2000


def interop_items(tag: str) -> dict[Any, Any]:
    """The records one client writes and the other reads back; values of
    every type msgpack carries (lists, not tuples: tuples come back as
    lists), and one big enough to travel over TCP."""
    items: dict[Any, Any] = {}
    for n in range(300):
        items[f"{tag}:{n}"] = [n, str(n), {"square": n * n, "half": n / 2}]
        items[n * 7919 + (1 if tag == "tx" else 2)] = {n: f"value {n}", "flag": n % 2 == 0}
        items[f"{tag}-bytes-{n}".encode()] = bytes(range(n % 256)) or None
    items[f"{tag}:big"] = "x" * 100_000 + tag
    items[-(2**63)] = -(2**63)
    items[2**70] = "a key past 64 bits"
    items[f"{tag}:unicode ✓ \u00e9"] = "sn\u00f8wman \u2603"
    return items


def _model_items() -> dict[Any, Any]:
    items: dict[Any, Any] = {}
    for n in range(CONCURRENT_PUTS):
        if n % 3 == 0:
            items[n] = n * n
        elif n % 3 == 1:
            items[f"key-{n}"] = {"n": n, "words": ["a", "b", str(n)], "ratio": n / 7}
        else:
            items[f"bytes-{n}".encode()] = f"payload {n}".encode() * (n % 5)
    return items


class Checks:
    def __init__(self) -> None:
        self.passed = 0
        self.failures: list[str] = []

    def __call__(self, name: str, ok: bool, detail: Any = "") -> None:
        if ok:
            self.passed += 1
        else:
            self.failures.append(f"{name}: {detail}"[:500])

    async def fails_with(self, name: str, deferred: defer.Deferred, error: type) -> None:
        try:
            result = await deferred
        except error:
            self(name, True)
            return
        except Exception as exc:  # reported as a failed check, not hidden
            self(name, False, f"expected {error.__name__}, got {type(exc).__name__}: {exc}")
            return
        self(name, False, f"expected {error.__name__}, got the result {result!r}")


async def job(reactor: Any, supervisor: str) -> dict[str, Any]:
    from domus import txclient
    from domus.errors import (
        DhtExists,
        DhtInactive,
        InvalidAttribute,
        KeyTypeError,
        SupervisorUnreachable,
        UnknownDht,
        ValueTypeError,
    )

    check = Checks()
    timings: dict[str, float] = {}
    cluster = await txclient.connect(supervisor, reactor=reactor)
    services = await cluster.services()
    check("three services up", sorted(s["state"] for s in services) == ["up"] * 3, services)

    dht = await cluster.create_dht("tx_model", buckets=64)
    model = _model_items()

    # -- many requests outstanding at once
    started = time.perf_counter()
    created = await defer.gatherResults([dht.put(k, v) for k, v in model.items()])
    timings["concurrent_puts"] = time.perf_counter() - started
    check("concurrent puts all new", created == [True] * len(model), created.count(False))
    started = time.perf_counter()
    values = await defer.gatherResults([dht.get(k) for k in model])
    timings["concurrent_gets"] = time.perf_counter() - started
    check("concurrent gets match", values == list(model.values()),
          sum(v != m for v, m in zip(values, model.values())))

    keys = list(model)
    overwrite = keys[::10]
    replaced = await defer.gatherResults([dht.put(k, ["new", i]) for i, k in
                                          enumerate(overwrite)])
    check("overwrites are not new", replaced == [False] * len(overwrite), replaced.count(True))
    model.update({k: ["new", i] for i, k in enumerate(overwrite)})

    doomed = keys[1::7]
    deleted = await defer.gatherResults([dht.delete(k) for k in doomed])
    check("deletes found their keys", deleted == [True] * len(doomed), deleted.count(False))
    for key in doomed:
        del model[key]
    again = await defer.gatherResults([dht.delete(k) for k in doomed[:50]])
    check("second deletes find nothing", again == [False] * 50, again)

    absent = ["absent", b"absent", 10**9, -1]
    probes = keys[:100] + absent
    present = await defer.gatherResults([dht.contains(k) for k in probes])
    check("contains", present == [k in model for k in probes], present)
    check("length", await dht.length() == len(model), len(model))
    check("get default", await dht.get("absent", "dflt") == "dflt")
    await check.fails_with("getitem of an absent key", dht.getitem("absent"), KeyError)
    check("getitem", await dht.getitem(keys[0]) == model[keys[0]])
    # pop: of three concurrent pops of one key, one gets its value, the
    # others the default; without a default, KeyError
    popped = next(key for key in keys[1:] if key in model)
    pops = await defer.gatherResults([dht.pop(popped, "gone") for _ in range(3)])
    check("concurrent pops: one value", sorted(pops, key=repr) == sorted(
        [model.pop(popped), "gone", "gone"], key=repr), pops)
    await check.fails_with("pop of an absent key", dht.pop(popped), KeyError)
    # setdefault: of three concurrent setdefaults of one key, one stores its
    # default, and all three get that one
    claims = await defer.gatherResults([dht.setdefault("claimed", f"mine-{n}")
                                        for n in range(3)])
    check("concurrent setdefaults: one value", len(set(claims)) == 1
          and claims[0] in {"mine-0", "mine-1", "mine-2"}, claims)
    check("setdefault keeps what is there", await dht.setdefault("claimed", "late") == claims[0])
    model["claimed"] = claims[0]

    # -- batches
    batch = {f"many-{n}": [n] * (n % 4) for n in range(500)}
    batch.update({k: "from put_many" for k in list(model)[:100]})
    check("put_many counts new keys", await dht.put_many(batch) == 500)
    model.update(batch)
    check("put_many of pairs", await dht.put_many([("pair", 1), ("pair", 2)]) == 1)
    model["pair"] = 2
    check("put_many of nothing", await dht.put_many({}) == 0)
    wanted = list(model) + absent
    started = time.perf_counter()
    got = await dht.get_many(wanted)
    timings["get_many"] = time.perf_counter() - started
    check("get_many matches the model", got == model, len(got))
    check("length after batches", await dht.length() == len(model))
    counts = await dht.records_by_service()
    check("records on every service", len(counts) == 3 and sum(counts.values()) == len(model),
          counts)

    # -- values too big for a datagram: TCP both ways
    big = {f"big-{n}": bytes([n]) * 70_000 for n in range(3)}
    created = await defer.gatherResults([dht.put(k, v) for k, v in big.items()])
    check("big puts over TCP", created == [True] * 3, created)
    back = await defer.gatherResults([dht.get(k) for k in big])
    check("big gets over TCP", back == list(big.values()))
    model.update(big)
    medium = {f"medium-{n}": "m" * 30_000 + str(n) for n in range(12)}
    check("put_many of medium values", await dht.put_many(medium) == 12)
    model.update(medium)
    check("get_many of big values", await dht.get_many(list(big) + list(medium))
          == {**big, **medium})
    check("final state matches the model", await dht.get_many(list(model)) == model)

    # -- errors
    await check.fails_with("open an unknown DHT", cluster.open_dht("no_such_dht"), UnknownDht)
    await check.fails_with("float key", dht.put(1.5, 1), KeyTypeError)
    await check.fails_with("float in a tuple key in put_many", dht.put_many({(1, 2.5): 1}),
                           KeyTypeError)
    await check.fails_with("unstorable value", dht.put("k", object()), ValueTypeError)
    await check.fails_with("duplicate DHT", cluster.create_dht("tx_model"), DhtExists)
    await check.fails_with("bad attribute", cluster.create_dht("bad", buckets=3),
                           InvalidAttribute)
    await check.fails_with("bad lookup", cluster.open_dht("tx_model", lookup="C"),
                           InvalidAttribute)
    # Every strategy reads what the model holds, through distributed lookups.
    for strategy in ("D,C,R", "C,R", "R"):
        other = await cluster.open_dht("tx_model", lookup=strategy, cache=0.25)
        keys = list(model)[:100]
        values = await defer.gatherResults([other.get(key) for key in keys])
        check(f"{strategy} reads the model", values == [model[key] for key in keys],
              other.stats())
        check(f"{strategy} got the batch", await other.get_many(keys) ==
              {key: model[key] for key in keys}, other.stats())
        check(f"{strategy} looked up", other.stats()["lookups"][strategy[0]]["lookups"] > 0,
              other.stats())
    napping = await cluster.create_dht("tx_napping", buckets=8, platform="domus-rbt")
    await napping.put_many({number: number for number in range(200)})
    kept = await cluster.deactivate_dht("tx_napping")
    check("deactivation keeps every record", sum(kept.values()) == 200, kept)
    await check.fails_with("use an inactive DHT", napping.get(7), DhtInactive)
    loaded = await cluster.activate_dht("tx_napping")
    check("activation loads them back", loaded == kept, loaded)
    check("records back after activation", await napping.get(199) == 199)
    info = await cluster.dht_info("tx_napping")
    owners = [entry["name"] for entry in info["storage_services"] for _ in range(entry["count"])]
    target = next(entry["name"] for entry in info["storage_services"]
                  if entry["name"] != owners[3])
    moved = await cluster.move_bucket("tx_napping", 3, storage=target)
    check("move_bucket moves a bucket and its records",
          moved["changed"] and (moved["from"], moved["to"]) == (owners[3], target)
          and moved["records"] > 0, moved)
    check("every record is read after the move",
          await napping.get_many(range(200)) == {number: number for number in range(200)})
    await check.fails_with("move_bucket without a service", cluster.move_bucket("tx_napping", 3),
                           TypeError)
    # most of the buckets on one service: out of balance
    for bucket in [bucket for bucket in range(8) if owners[bucket] != target][:4]:
        await cluster.move_bucket("tx_napping", bucket, storage=target)
    plan = await cluster.rebalance("tx_napping", dry_run=True)
    check("rebalance --dry-run plans storage moves off the crowded service",
          any(move["role"] == "storage" and move["source"] == target for move in plan), plan)
    done = await cluster.rebalance("tx_napping")
    check("rebalance does what it planned",
          [(m["bucket"], m["role"]) for m in done if m["role"] == "storage"]
          == [(m["bucket"], m["role"]) for m in plan if m["role"] == "storage"], done)
    check("records kept by the rebalance",
          await napping.get_many(range(200)) == {number: number for number in range(200)})
    check("balancer status answers", (await cluster.balancer_status())["mode"] == "manual")
    await cluster.destroy_dht("tx_napping")
    doomed_dht = await cluster.create_dht("tx_doomed", buckets=8)
    await doomed_dht.put("k", 1)
    await cluster.destroy_dht("tx_doomed")
    await check.fails_with("use a destroyed DHT", doomed_dht.get("k"), UnknownDht)
    await check.fails_with("destroy it again", cluster.destroy_dht("tx_doomed"), UnknownDht)
    started = time.perf_counter()
    await check.fails_with("connect to nothing",
                           txclient.connect("127.0.0.1:1", timeout=2.0, reactor=reactor),
                           SupervisorUnreachable)
    check("connect to nothing fails fast", time.perf_counter() - started < 2.5)

    # -- interop with the synchronous client
    from_sync = await cluster.open_dht("from_sync")
    expected = interop_items("sync")
    read = await from_sync.get_many(list(expected))
    check("reads what the sync client wrote", read == expected,
          [k for k in expected if read.get(k) != expected[k]][:5])
    one_by_one = await defer.gatherResults([from_sync.get(k) for k in expected])
    check("gets what the sync client wrote", one_by_one == list(expected.values()))
    from_tx = await cluster.create_dht("from_tx", buckets=32)
    created = await defer.gatherResults([from_tx.put(k, v) for k, v in
                                         interop_items("tx").items()])
    check("writes for the sync client", all(created), created.count(False))

    names = sorted(entry["name"] for entry in await cluster.list_dhts())
    check("list_dhts", names == ["from_sync", "from_tx", "tx_model"], names)
    stats = dht.stats()
    check("stats count lookups", stats["lookups"]["D"]["lookups"] >= 2 * CONCURRENT_PUTS, stats)
    await cluster.close()
    return {"ok": not check.failures, "passed": check.passed, "failures": check.failures,
            "records": len(model), "timings": timings, "stats": stats}


async def dead_service_job(reactor: Any, supervisor: str, dead: str) -> dict[str, Any]:
    """DHT "tx_dead" has buckets on service ``dead``, which was killed: its
    requests fail with ServiceUnavailable naming it, the others succeed."""
    from domus import txclient
    from domus.errors import ServiceUnavailable

    check = Checks()
    cluster = await txclient.connect(supervisor, timeout=1.0, reactor=reactor)
    dht = await cluster.open_dht("tx_dead")
    started = time.perf_counter()
    outcomes = await defer.DeferredList([dht.put(n, n) for n in range(200)],
                                        consumeErrors=True)
    elapsed = time.perf_counter() - started
    errors = [result.value for succeeded, result in outcomes if not succeeded]
    check("some puts reach live services", 0 < len(errors) < 200, len(errors))
    check("the others fail with ServiceUnavailable",
          all(isinstance(error, ServiceUnavailable) for error in errors),
          {type(error).__name__ for error in errors})
    check("the error names the service, DHT and bucket",
          all(error.service == dead and error.dht == "tx_dead" and error.bucket is not None
              and dead in str(error) and f"bucket {error.bucket}" in str(error)
              for error in errors), str(errors[0]) if errors else "")
    check("they give up at the deadline", 1.0 <= elapsed < 3.0, elapsed)
    await check.fails_with("get_many touching it", dht.get_many(range(200)), ServiceUnavailable)
    await cluster.close()
    return {"ok": not check.failures, "passed": check.passed, "failures": check.failures,
            "unavailable": len(errors), "elapsed": elapsed}


def main(reactor: Any, supervisor: str, mode: str = "model", *args: str) -> defer.Deferred:
    def report(summary: dict[str, Any]) -> None:
        print(json.dumps(summary, default=repr))
        if not summary["ok"]:
            raise SystemExit(1)

    running = job(reactor, supervisor) if mode == "model" else dead_service_job(
        reactor, supervisor, *args)
    return defer.Deferred.fromCoroutine(running).addCallback(report)


if __name__ == "__main__":
    task.react(main, sys.argv[1:])
