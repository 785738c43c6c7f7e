"""Lookup strategies on a real deployment: every strategy (D, D,C,R, C,R, R)
over chord and de Bruijn routing passes the random workload against a dict;
distributed lookups stay within the hop bound; a dead routing service is
reported and fallen back from, never waited on forever."""

from __future__ import annotations

import os
import signal
import time

import pytest

import domus
from domus.ops.cli import format_status
from domus.routing import make_graph
from domus.wire.keys import encode_key

from .support import stop_process, wait_until
from .test_workload import SEED, Workload

STRATEGIES = ["D", "D,C,R", "C,R", "R"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("routing, degree, algorithm", [
    ("chord", None, "fewest-hops"),
    ("bruijn", 4, "least-work"),
])
def test_every_strategy_passes_the_random_workload(cluster, routing, degree, algorithm):
    cluster.create_dht("lookups", routing=routing, routing_degree=degree,
                       routing_algorithm=algorithm, buckets=256, lookup="C,R")
    bound = make_graph(routing, 256, degree).hop_bound()
    model: dict = {}
    for index, strategy in enumerate(STRATEGIES):
        dht = cluster.open_dht("lookups", lookup=strategy, cache=0.25)
        assert dht.strategy == tuple(strategy.split(","))
        workload = Workload(dht, SEED + index)
        workload.model = model          # one model: each strategy reads the others' writes
        workload.run(3_000, whole_every=1_500)
        stats = dht.stats()
        methods = stats["lookups"]
        assert set(methods) == set(strategy.split(","))
        # hops: messages to reach the storage service (a walk of h forwards
        # is h + 1 LOOKUPs, then the request itself).
        assert stats["hops"]["max"] <= bound + 2, stats
        assert stats["lookup_failures"] == 0 and stats["redirects"] == 0, stats
        if strategy.startswith("D"):
            # Nothing moved: direct answers everything, in one hop.
            assert methods["D"]["misses"] == 0 and methods["D"]["hits"] > 3_000, stats
            assert stats["hops"]["mean"] == 1.0
        else:
            first = methods[strategy[0]]
            assert first["distributed"] > 0, stats
            if strategy == "C,R":
                # A quarter of the buckets cached: about a quarter of the
                # lookups hit, the rest route from the nearest cached entry.
                assert stats["cache"]["entries"] <= stats["cache"]["capacity"] == 64
                assert 0.1 < first["hits"] / first["lookups"] < 0.5, stats
                assert methods["R"]["lookups"] <= 1, stats   # only while the cache was empty
            assert 1 < stats["hops"]["mean"] <= bound + 2, stats
    # The services count the LOOKUPs they answered (their routing load).
    answered = [service["stats"]["dhts"]["lookups"]["lookups"]
                for service in cluster.services()]        # (the DHT is named "lookups")
    assert all(counts["found"] > 0 for counts in answered), answered
    # ... and `domus status` shows it as each service's LOOKUP/S.
    status = cluster.status()
    assert any(service["load"]["lookups_per_s"] > 0 for service in status["services"]), status
    assert "LOOKUP/S" in format_status(status).splitlines()[2]


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_a_dead_routing_service_is_reported_and_the_request_still_answered(deployment,
                                                                           cluster, how):
    """s2 routes a third of the buckets and stores none.  Killed (its port
    refuses) or hung (it never answers), random lookups that reach it fail
    within the client's deadline, are counted and explained in stats(), and
    the requests are answered from the supervisor's layout instead."""
    cluster.create_dht("deadhop", buckets=64, routing_services=["s1", "s2", "s3"],
                       storage_services=["s1", "s3"])
    cluster.open_dht("deadhop").put_many({key: key for key in range(200)})
    pid = deployment.services["s2"].pid
    if how == "killed":
        deployment.kill_service("s2", signal.SIGKILL)
    else:
        stop_process(pid)
    try:
        with domus.connect(deployment.supervisor_address, timeout=1.0) as impatient:
            dht = impatient.open_dht("deadhop", lookup="R")
            dht._random.seed(SEED)       # (random starts, replayable)
            started = time.monotonic()
            keys = range(0, 200, 25)
            for key in keys:
                assert dht[key] == key
            elapsed = time.monotonic() - started
            stats = dht.stats()
    finally:
        if how == "hung":
            os.kill(pid, signal.SIGCONT)
    assert stats["lookups"]["R"]["lookups"] == len(keys)
    assert stats["lookup_failures"] > 0, stats     # some started at, or passed, s2
    assert "service s2" in stats["last_lookup_failure"], stats
    assert ("did not answer" if how == "hung" else "refused") in \
        stats["last_lookup_failure"], stats
    # Bounded: a failed lookup costs at most the client's deadline.
    assert elapsed < len(keys) * 1.5, (elapsed, stats)


def test_random_starts_are_weighted_by_the_buckets_each_service_routes(cluster):
    cluster.create_dht("weights", buckets=64, routing_services=["s1", "s2"])
    dht = cluster.open_dht("weights", lookup="R")
    routed = {entry["name"]: entry["count"] for entry in dht.descriptor["routing_services"]}
    starts = [dht._random_start()[0].name for _ in range(4000)]
    for name, count in routed.items():
        assert abs(starts.count(name) / 4000 - count / 64) < 0.05


def test_open_dht_refuses_a_bad_strategy_or_cache(cluster):
    cluster.create_dht("strict", buckets=16)
    for bad in ({"lookup": "C"}, {"lookup": "D,R"}, {"cache": 0}, {"cache": 1.5},
                {"cache": "half"}, {"direct_cutoff": 0}):
        with pytest.raises(ValueError) as raised:
            cluster.open_dht("strict", **bad)
        assert str(next(iter(bad.values()))) in str(raised.value)



# ------------------------------------------------------------ after moves
def test_after_moves_every_strategy_is_right_and_direct_learns_the_moves(cluster):
    """Move storage and routing of several buckets by hand; then every
    strategy, on handles opened before and after, reads back every record.
    A handle opened after the moves looks them up directly with no miss (its
    direct table is the layout, moves included); one opened before misses
    once or twice, learns from its replies' layout tags that the layout is
    newer, and fetches it."""
    cluster.create_dht("moved", buckets=64)
    writer = cluster.open_dht("moved")
    records = {key: f"v{key}" for key in range(2_000)}
    writer.put_many(records)
    before = {strategy: cluster.open_dht("moved", lookup=strategy, cache=0.5)
              for strategy in STRATEGIES}
    for handle in before.values():              # warm: caches fill with the old layout
        assert handle.get_many(list(records)[:300]) == {k: records[k] for k in range(300)}
    owners = {entry["name"]: entry["count"] for entry in writer.descriptor["storage_services"]}
    assert sorted(owners) == ["s1", "s2", "s3"]
    # Buckets 0..9 belong to s1 by the placement: move their storage to s2
    # and s3 and the routing of a few of them, so lookups and D both miss.
    for bucket in range(10):
        cluster.move_bucket("moved", bucket, storage="s2" if bucket % 2 else "s3")
    for bucket in (0, 3, 40):
        cluster.move_bucket("moved", bucket, routing="s3" if bucket != 3 else "s1")
    after = {strategy: cluster.open_dht("moved", lookup=strategy, cache=0.5, direct_cutoff=4)
             for strategy in STRATEGIES}
    for handles in (before, after):
        for strategy, handle in handles.items():
            for key, value in records.items():
                assert handle[key] == value, (strategy, key)
            assert handle.get_many(list(records)) == records, strategy
    for number, (strategy, handle) in enumerate([*before.items(), *after.items()]):
        handle.put_many({key: f"{value}!{number}" for key, value in records.items()
                         if key % 50 == number})
        handle[number + 5_000] = strategy
    expected = {key: f"{value}!{key % 50}" if key % 50 < 8 else value
                for key, value in records.items()}
    expected.update({number + 5_000: strategy for number, strategy
                     in enumerate([*before, *after])})
    assert writer.get_many(list(expected)) == expected
    assert len(writer) == len(expected)
    fresh = after["D,C,R"].stats()
    assert fresh["in_use"] == "D,C,R" and fresh["direct_misses"] == 0, fresh
    assert fresh["lookups"]["D"]["misses"] == 0 and fresh["lookups"]["D"]["hits"] > 4_000
    assert fresh["hops"]["mean"] == 1.0                 # one message per request
    assert after["D"].stats()["redirects"] == 0
    for strategy in ("D", "D,C,R"):
        stale = before[strategy].stats()
        assert stale["refreshes"] >= 1, (strategy, stale)
        assert stale["lookups"]["D"]["misses"] <= 3, (strategy, stale)
        assert stale["in_use"] == strategy
    # The stale cached entries were corrected, never trusted twice.
    cached = before["C,R"].stats()["lookups"]["C"]
    assert cached["misses"] > 0, cached


def test_writes_during_a_storage_move_are_all_kept(deployment, cluster):
    """A writer keeps putting into a bucket while its storage moves (the
    source answers MOVING meanwhile, the client waits and retries): every
    acknowledged write is there afterwards, on the new owner."""
    import threading

    cluster.create_dht("busy", buckets=8, storage_services=["s1", "s2"])
    dht = cluster.open_dht("busy", lookup="D,C,R")
    bucket = 0
    base = {key: "x" * 200 for key in range(20_000) if dht._bucket(encode_key(key)) == bucket}
    dht.put_many(base)
    acknowledged: dict[int, int] = {}
    stop = threading.Event()

    def write() -> None:
        with domus.connect(deployment.supervisor_address) as own:
            handle = own.open_dht("busy", lookup="D,C,R")
            while not stop.is_set():
                key = keys[written[0] % len(keys)]
                handle[key] = written[0]
                acknowledged[key] = written[0]
                written[0] += 1
            acknowledged["stats"] = handle.stats()   # type: ignore[index]

    keys = list(base)
    written = [0]
    writer = threading.Thread(target=write)
    writer.start()
    wait_until(lambda: written[0] >= 50, timeout=30, what="the writer to get going")
    answer = cluster.move_bucket("busy", bucket, storage="s2")
    moved_at = written[0]
    wait_until(lambda: written[0] >= moved_at + 50, timeout=30,
               what="writes to the bucket on its new owner")
    stop.set()
    writer.join(30)
    stats = acknowledged.pop("stats")    # type: ignore[call-overload]
    assert answer["changed"] and answer["records"] == len(base)
    assert len(acknowledged) > 10, acknowledged
    for key, number in acknowledged.items():
        assert dht[key] == number
    assert dht.records_by_service()["s2"] >= len(base)
    assert stats["redirects"] + stats["lookups"]["C"]["lookups"] + stats["refreshes"] > 0, stats
