"""A client of the scalability suite: one process on one host (a network
namespace), started once per run, driven by JSON lines on stdin, answering
each with one JSON line on stdout.

    {"do": "run", "system": "domus"|"redis"|"mariadb", "target": ..., "op":
     "put1"|"get"|"ycsb", "seconds": S, "start_at": WALL, "seed": N, ...}
    {"do": "load", ...}                 (records for get and YCSB)
    {"do": "quit"}

A run waits until ``start_at`` (every client of a point starts together),
issues one request per round trip for ``seconds``, and answers with its
operations, elapsed time, CPU seconds and latency percentiles per kind of
operation.  Connections are kept between commands.
"""

from __future__ import annotations

import array
import json
import random
import resource
import sys
import time
from itertools import islice
from typing import Any

from benchmarks.scalability import ycsb

INT64 = 1 << 63
_connections: dict[str, Any] = {}


def _domus(target: dict[str, Any]) -> Any:
    key = f"domus:{target['supervisor']}"
    if key not in _connections:
        import domus

        _connections[key] = domus.connect(target["supervisor"], timeout=10.0,
                                          secret_file=target.get("secret"))
    return _connections[key]


def _redis(target: dict[str, Any]) -> Any:
    key = f"redis:{target['nodes'][0]}"
    if key not in _connections:
        from redis.cluster import ClusterNode, RedisCluster

        nodes = [ClusterNode(*node.rsplit(":", 1)) for node in target["nodes"]]
        _connections[key] = RedisCluster(startup_nodes=nodes, socket_timeout=10)
    return _connections[key]


def _mariadb(target: dict[str, Any]) -> Any:
    key = f"mariadb:{target['host']}:{target['port']}"
    if key not in _connections:
        import pymysql

        _connections[key] = pymysql.connect(host=target["host"], port=target["port"],
                                            user="root", database="bench", autocommit=True)
    return _connections[key]


def operations(command: dict[str, Any]) -> dict[str, Any]:
    """The callables a run draws from: name -> callable(rng) doing one
    request of that kind."""
    system, op = command["system"], command["op"]
    keys = command.get("keys", 0)
    seed = command["seed"]
    rng = random.Random(seed)
    if system == "domus":
        cluster = _domus(command["target"])
        dhts = [cluster.open_dht(name, lookup=command.get("lookup"),
                                 cache=command.get("cache"))
                for name in command["target"]["dhts"]]
        command["_dhts"] = dhts
        turn = iter(range(1 << 62))

        def dht() -> Any:
            return dhts[next(turn) % len(dhts)] if len(dhts) > 1 else dhts[0]

        if op == "put1":
            return {"put1": lambda: dht().put(rng.getrandbits(64) - INT64,
                                              rng.getrandbits(64) - INT64)}
        if op == "get":
            return {"get": lambda: dht().get(rng.randrange(keys))}
        return _ycsb_domus(dhts[0], command, rng)
    if system == "redis":
        client = _redis(command["target"])
        if op == "put1":
            return {"put1": lambda: client.set(rng.getrandbits(64) - INT64,
                                               rng.getrandbits(64) - INT64)}
        if op == "get":
            return {"get": lambda: client.get(rng.randrange(keys))}
        return _ycsb_redis(client, command, rng)
    connection = _mariadb(command["target"])
    cursor = connection.cursor()
    if op == "put1":
        return {"put1": lambda: cursor.execute(
            "INSERT INTO kv VALUES (%s, %s) ON DUPLICATE KEY UPDATE v = VALUES(v)",
            (rng.getrandbits(64) - INT64, rng.getrandbits(64) - INT64))}
    if op == "get":
        return {"get": lambda: (cursor.execute("SELECT v FROM kv WHERE k = %s",
                                               (rng.randrange(keys),)), cursor.fetchall())}
    raise ValueError(f"no {op} on {system}")


def _workload(command: dict[str, Any]) -> ycsb.Workload:
    return ycsb.Workload(command["workload"], command["records"], seed=command["seed"],
                         first_insert=command["records"] + command["client"],
                         stride=command["clients"])


def _ycsb_domus(dht: Any, command: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    workload = _workload(command)

    def step() -> str:
        operation, number, length = workload.next()
        key = ycsb.key_name(number)
        if operation == "read":
            dht.get(key)
        elif operation in ("update", "insert"):
            dht.put(key, ycsb.record(number, rng))
        elif operation == "scan":
            list(islice(dht.irange(key, items=True), length))
        else:                                   # read-modify-write
            dht.get(key)
            dht.put(key, ycsb.record(number, rng))
        return operation

    return {"ycsb": step}


def _ycsb_redis(client: Any, command: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    workload = _workload(command)

    def step() -> str:
        operation, number, length = workload.next()
        key = ycsb.key_name(number)
        if operation == "read":
            client.hgetall(key)
        elif operation == "update":
            client.hset(key, mapping=ycsb.record(number, rng))
        elif operation == "insert":
            client.hset(key, mapping=ycsb.record(number, rng))
            client.zadd(INDEX, {key: java_hash(key)})
        elif operation == "scan":
            # as YCSB's Redis binding: the keys from a sorted-set index,
            # then each record
            for found in client.zrangebyscore(INDEX, java_hash(key), "+inf", 0, length):
                client.hgetall(found)
        else:
            client.hgetall(key)
            client.hset(key, mapping=ycsb.record(number, rng))
        return operation

    return {"ycsb": step}


INDEX = "_indices"


def java_hash(text: str) -> int:
    """Java's String.hashCode (YCSB's Redis binding scores its index so)."""
    value = 0
    for char in text:
        value = (31 * value + ord(char)) & 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def percentiles(samples: array.array) -> dict[str, float]:
    ordered = sorted(samples)
    if not ordered:
        return {}

    def at(fraction: float) -> float:
        return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))] / 1000.0

    return {"count": len(ordered), "p50_us": at(0.50), "p99_us": at(0.99),
            "p999_us": at(0.999), "mean_us": sum(ordered) / len(ordered) / 1000.0}


def run(command: dict[str, Any]) -> dict[str, Any]:
    kinds = operations(command)
    (name, step), = kinds.items()
    latencies: dict[str, array.array] = {}
    clock = time.perf_counter_ns
    delay = command["start_at"] - time.time()
    if delay > 0:
        time.sleep(delay)
    dhts = command.get("_dhts") or []
    # (the counters are the client's, kept across runs: this run's share)
    before = [sum(dht.stats()[counter] for dht in dhts) for counter in ("retries", "busy")]
    usage = resource.getrusage(resource.RUSAGE_SELF)
    started = clock()
    end = started + int(command["seconds"] * 1e9)
    count = 0
    now = started
    while now < end:
        result = step()
        after = clock()
        kind = result if name == "ycsb" else name
        samples = latencies.get(kind)
        if samples is None:
            samples = latencies[kind] = array.array("q")
        samples.append(after - now)
        now = after
        count += 1
    elapsed = (now - started) / 1e9
    finished = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (finished.ru_utime - usage.ru_utime) + (finished.ru_stime - usage.ru_stime)
    answer = {"ops": count, "elapsed": elapsed, "cpu": cpu,
              "latency": {kind: percentiles(samples) for kind, samples in latencies.items()}}
    if dhts:
        answer["hops"] = dhts[0].stats()["hops"]["mean"]
        answer["retries"], answer["busy"] = (
            sum(dht.stats()[counter] for dht in dhts) - earlier
            for counter, earlier in zip(("retries", "busy"), before))
    return answer


def load(command: dict[str, Any]) -> dict[str, Any]:
    """Store the records a get or YCSB run reads: keys [first, end)."""
    system, first, end = command["system"], command["first"], command["end"]
    rng = random.Random(command["seed"])
    started = time.perf_counter()
    batch = 500
    for low in range(first, end, batch):
        numbers = range(low, min(end, low + batch))
        if command.get("ycsb"):
            items = {ycsb.key_name(n): ycsb.record(n, rng) for n in numbers}
        else:
            items = {n: n for n in numbers}
        if system == "domus":
            cluster = _domus(command["target"])
            for name in command["target"]["dhts"]:
                cluster.open_dht(name).put_many(items)
        elif system == "redis":
            client = _redis(command["target"])
            pipe = client.pipeline()
            for key, value in items.items():
                if command.get("ycsb"):
                    pipe.hset(key, mapping=value)
                    pipe.zadd(INDEX, {key: java_hash(key)})
                else:
                    pipe.set(key, value)
            pipe.execute()
        else:
            cursor = _mariadb(command["target"]).cursor()
            cursor.executemany("INSERT INTO kv VALUES (%s, %s) ON DUPLICATE KEY UPDATE "
                               "v = VALUES(v)", list(items.items()))
    return {"loaded": end - first, "seconds": time.perf_counter() - started}


def main() -> int:
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "quit":
            break
        if command["do"] == "forget":
            forget()
            print(json.dumps({"forgot": True}), flush=True)
            continue
        try:
            answer = run(command) if command["do"] == "run" else load(command)
        except Exception as exc:  # noqa: BLE001  (the driver reports it)
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
    forget()
    return 0


def forget() -> None:
    for connection in _connections.values():
        try:
            connection.close()
        except Exception:  # noqa: BLE001  (a server already gone)
            pass
    _connections.clear()


if __name__ == "__main__":
    raise SystemExit(main())
