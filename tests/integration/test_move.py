"""Moving a bucket's routing or storage by hand (``Cluster.move_bucket``,
``domus dht move``) on a real deployment: every record moves with its
bucket, clients follow, and a move that fails changes nothing."""

from __future__ import annotations

import itertools
import os
import signal

import pytest

from domus.errors import SupervisorError, UnknownDht, UnknownService

from .support import bucket_of_key, wait_until
from .test_cli import fails, ok

BUCKETS = 16
RECORDS = 1600


def filled(cluster, name, **attributes):
    """A 16-bucket DHT stored on s1 and s2 and routed on s1 (s3 holds
    nothing of it), with RECORDS records; returns (dht, records)."""
    dht = cluster.create_dht(name, buckets=BUCKETS, routing_services=["s1"],
                             storage_services=["s1", "s2"], **attributes)
    records = {f"key-{number}": [number, "v" * (number % 50)] for number in range(RECORDS)}
    dht.put_many(records)
    return dht, records


def in_bucket(dht, records, bucket):
    return {key: value for key, value in records.items() if bucket_of_key(dht, key) == bucket}


def storage_of(cluster, name):
    """bucket -> storage service, as the supervisor's descriptor says now."""
    info = cluster.dht_info(name)
    owners = list(itertools.chain.from_iterable(
        [entry["name"]] * entry["count"] for entry in info["storage_services"]))
    for bucket, service in info.get("storage_moves", {}).items():
        owners[int(bucket)] = service
    return owners


def data_dir(deployment, service, dht):
    return os.path.join(deployment.data_dir, service, "dhts", str(dht.id))


def assert_every_record(dht, records):
    assert dht.get_many(list(records)) == records
    assert len(dht) == len(records)


@pytest.mark.parametrize("platform, storage", [("python-dict", "ram"),
                                               ("domus-bsddb-btree", "disk")])
def test_storage_moves_with_every_record_and_back(deployment, cluster, platform, storage):
    dht, records = filled(cluster, "words", platform=platform, storage=storage)
    bucket = 3                                        # s1's, by the placement
    moving = in_bucket(dht, records, bucket)
    assert moving and storage_of(cluster, "words")[bucket] == "s1"
    before = dht.records_by_service()

    answer = cluster.move_bucket("words", bucket, storage="s3")
    assert answer["changed"] and answer["records"] == len(moving)
    assert (answer["from"], answer["to"], answer["role"]) == ("s1", "s3", "storage")
    assert not answer["lagging"]
    info = cluster.dht_info("words")
    assert info["storage_moves"] == {str(bucket): "s3"}
    assert {"name": "s3", "address": deployment.service_address(2), "count": 0} \
        in info["storage_services"]
    assert [entry["count"] for entry in info["storage_services"]] == [8, 8, 0]

    # The handle's layout is stale: the source says NOT_OWNER, the client
    # asks the supervisor again and finds the records on s3.
    for key, value in moving.items():
        assert dht[key] == value
    assert dht.records_by_service() == {"s1": before["s1"] - len(moving), "s2": before["s2"],
                                        "s3": len(moving)}
    assert_every_record(dht, records)
    dht["after the move"] = "new"
    records["after the move"] = "new"
    assert {service["name"]: service["buckets"].get("words") for service in cluster.services()} \
        == {"s1": {"routing": 16, "storage": 7}, "s2": {"storage": 8}, "s3": {"storage": 1}}
    if storage == "disk":
        assert os.path.exists(os.path.join(data_dir(deployment, "s3", dht), f"bucket-{bucket}.db"))
        assert not os.path.exists(os.path.join(data_dir(deployment, "s1", dht),
                                               f"bucket-{bucket}.db"))

    # Back to its initial owner: no move is listed; s3 stays listed (and
    # tells a client with the old layout NOT_OWNER), with nothing.
    answer = cluster.move_bucket("words", bucket, storage="s1")
    assert answer["changed"] and (answer["from"], answer["to"]) == ("s3", "s1")
    info = cluster.dht_info("words")
    assert "storage_moves" not in info
    assert [entry["count"] for entry in info["storage_services"]] == [8, 8, 0]
    assert_every_record(dht, records)
    assert dht.records_by_service()["s3"] == 0
    assert {service["name"]: service["buckets"].get("words") for service in cluster.services()} \
        == {"s1": {"routing": 16, "storage": 8}, "s2": {"storage": 8}, "s3": {"storage": 0}}


def test_a_fresh_client_finds_the_records_at_the_new_owner(cluster):
    """A move leaves the counts alone and lists the moved bucket in the
    descriptor: a fresh client's direct lookups know it (no miss), a client
    opened before the move misses at most once and learns the new layout
    from its replies' tags, and both find every record."""
    dht, records = filled(cluster, "fresh", platform="domus-rbt")
    cluster.move_bucket("fresh", 12, storage="s3")             # s2's, by the placement
    reopened = cluster.open_dht("fresh")
    assert reopened.get_many(list(records)) == records
    assert reopened.stats()["lookups"]["D"]["misses"] == 0
    for key, value in records.items():
        assert dht[key] == value
    assert dht.stats()["lookups"]["D"]["misses"] <= 1
    assert dht.layout_version == reopened.layout_version
    for key, value in records.items():
        assert reopened[key] == value
    # Key ranges ask every service that stores a bucket now: s3 too.
    assert list(reopened.irange()) == sorted(records)


def test_routing_moves_and_back(cluster):
    filled(cluster, "routed")
    answer = cluster.move_bucket("routed", 5, routing="s2")
    assert answer["changed"] and (answer["from"], answer["to"]) == ("s1", "s2")
    assert answer["records"] is None
    info = cluster.dht_info("routed")
    assert info["routing_moves"] == {"5": "s2"}
    assert [(entry["name"], entry["count"]) for entry in info["routing_services"]] == \
        [("s1", 16), ("s2", 0)]
    assert "storage_moves" not in info
    views = {service["name"]: service for service in cluster.services()}
    assert views["s2"]["buckets"]["routed"] == {"routing": 1, "storage": 8}
    assert views["s1"]["buckets"]["routed"] == {"routing": 15, "storage": 8}

    assert cluster.move_bucket("routed", 5, routing="s1")["changed"]
    info = cluster.dht_info("routed")
    assert "routing_moves" not in info
    assert [(entry["name"], entry["count"]) for entry in info["routing_services"]] == \
        [("s1", 16), ("s2", 0)]


def test_moving_to_the_owner_changes_nothing(cluster):
    filled(cluster, "still")
    answer = cluster.move_bucket("still", 0, storage="s1")
    assert not answer["changed"] and answer["from"] == answer["to"] == "s1"
    assert "storage_moves" not in cluster.dht_info("still")


def test_bad_moves_are_refused_with_the_reason(cluster):
    dht, records = filled(cluster, "kept")
    with pytest.raises(UnknownService, match="no service named 'nope'"):
        cluster.move_bucket("kept", 1, storage="nope")
    for bucket in (-1, BUCKETS):
        with pytest.raises(SupervisorError, match=r"has buckets 0 to 15; -?\d+ is not one"):
            cluster.move_bucket("kept", bucket, storage="s2")
    with pytest.raises(UnknownDht, match="no DHT named 'other'"):
        cluster.move_bucket("other", 1, storage="s2")
    with pytest.raises(SupervisorError, match="'routing' or 'storage', not 'both'"):
        cluster.supervisor.call("move_bucket", name="kept", bucket=1, role="both",
                                service="s2")
    with pytest.raises(TypeError, match="exactly one of"):
        cluster.move_bucket("kept", 1)
    with pytest.raises(TypeError, match="exactly one of"):
        cluster.move_bucket("kept", 1, routing="s2", storage="s2")
    cluster.deactivate_dht("kept")
    with pytest.raises(SupervisorError, match="inactive; activate it"):
        cluster.move_bucket("kept", 1, storage="s2")
    cluster.activate_dht("kept")
    assert "storage_moves" not in cluster.dht_info("kept")
    assert_every_record(dht, records)


def test_a_move_to_a_service_that_is_down_is_refused(deployment, cluster):
    dht, records = filled(cluster, "waiting")
    deployment.kill_service("s3", signal.SIGKILL)
    wait_until(lambda: {s["name"]: s["state"] for s in cluster.services()}["s3"] == "down",
               timeout=15, what="s3 down")
    with pytest.raises(SupervisorError, match=r"\['s3'\] are not up"):
        cluster.move_bucket("waiting", 2, storage="s3")
    assert "storage_moves" not in cluster.dht_info("waiting")
    assert_every_record(dht, records)


def test_a_move_that_fails_half_way_changes_nothing(deployment, cluster):
    """The target cannot create the bucket's database (its file name is
    taken by a directory) after the source froze the bucket: the source
    thaws it and serves every record as before; once the cause is gone,
    the same move works."""
    dht, records = filled(cluster, "stuck", platform="domus-bsddb-btree", storage="disk")
    bucket = 1
    blocker = os.path.join(data_dir(deployment, "s2", dht), f"bucket-{bucket}.db")
    os.makedirs(blocker)
    before = dht.records_by_service()
    with pytest.raises(SupervisorError) as refused:
        cluster.move_bucket("stuck", bucket, storage="s2")
    message = str(refused.value)
    for part in ("bucket 1", "'stuck'", "from s1 to s2", "staging records on service s2",
                 "nothing changed"):
        assert part in message, message
    assert "storage_moves" not in cluster.dht_info("stuck")
    assert dht.records_by_service() == before
    assert_every_record(dht, records)
    dht["written after"] = 1                        # the bucket is not frozen any more
    records["written after"] = 1

    os.rmdir(blocker)
    moving = in_bucket(dht, records, bucket)
    assert cluster.move_bucket("stuck", bucket, storage="s2")["records"] == len(moving)
    assert_every_record(dht, records)


def test_the_command_moves_a_bucket(deployment, cluster):
    dht, records = filled(cluster, "cli")
    moving = in_bucket(dht, records, 4)
    out = ok("dht", "move", "cli", "4", "--storage", "s2",
             "--supervisor", deployment.supervisor_address)
    assert out.startswith(f"DHT cli: bucket 4 storage moved s1 -> s2 ({len(moving):,} records")
    out = ok("dht", "move", "cli", "4", "--routing", "s3",
             "--supervisor", deployment.supervisor_address)
    assert out.strip() == "DHT cli: bucket 4 routing moved s1 -> s3"
    assert "already" in ok("dht", "move", "cli", "4", "--routing", "s3",
                           "--supervisor", deployment.supervisor_address)
    assert "no service named 's9'" in fails("dht", "move", "cli", "4", "--storage", "s9",
                                            "--supervisor", deployment.supervisor_address)
    assert "has buckets 0 to 15" in fails("dht", "move", "cli", "16", "--storage", "s1",
                                          "--supervisor", deployment.supervisor_address)
    assert "one of the arguments --routing --storage is required" in fails(
        "dht", "move", "cli", "4", "--supervisor", deployment.supervisor_address)
    assert "not allowed with argument" in fails(
        "dht", "move", "cli", "4", "--routing", "s1", "--storage", "s1",
        "--supervisor", deployment.supervisor_address)
    assert_every_record(dht, records)
