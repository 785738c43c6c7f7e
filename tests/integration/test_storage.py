"""Storage technologies on a real deployment: what a disk DHT keeps when a
service stops and starts again on the same data dir."""

from __future__ import annotations

import os
import signal
import threading

import pytest

import domus
import domus.errors
from domus.ops.cli import format_status
from domus.storage import rbt

from .support import keys_on, service_stats, wait_until


def state_of(cluster, name: str) -> str:
    return {entry["name"]: entry["state"] for entry in cluster.services()}[name]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("platform", ["domus-bsddb-btree", "domus-bsddb-hash"])
def test_a_service_restarted_on_its_data_dir_serves_its_disk_buckets_again(
        deployment, cluster, platform):
    dht = cluster.create_dht("kept", platform=platform, storage="disk")
    records = {key: [key, "v" * (key % 50)] for key in range(3000)}
    dht.put_many(records)
    on_s2 = keys_on(dht, "s2", 20, "s2-")
    for key in on_s2:
        dht[key] = key.upper()
    files = os.path.join(deployment.data_dir, "s2", "dhts", str(dht.id))
    assert any(name.endswith(".db") for name in os.listdir(files))

    deployment.kill_service("s2", signal.SIGTERM)          # a clean stop flushes
    wait_until(lambda: state_of(cluster, "s2") == "down", timeout=15, what="s2 down")
    deployment.start_service(deployment.service_index("s2"))
    deployment.wait_until_up(["s2"], timeout=30)

    assert len(dht) == len(records) + len(on_s2)
    assert dht.get_many(list(records)) == records
    assert dht.get_many(on_s2) == {key: key.upper() for key in on_s2}
    assert dht.records_by_service()["s2"] > 0


@pytest.mark.timeout(60)
def test_destroying_a_disk_dht_deletes_its_files(deployment, cluster):
    dht = cluster.create_dht("gone", platform="domus-bsddb-btree", storage="disk")
    dht.put_many({key: key for key in range(500)})
    homes = [os.path.join(deployment.data_dir, name, "dhts", str(dht.id))
             for name in ("s1", "s2", "s3")]
    assert all(os.path.isdir(home) for home in homes)
    cluster.destroy_dht("gone")
    wait_until(lambda: not any(os.path.exists(home) for home in homes), timeout=10,
               what="the DHT's files removed")


@pytest.mark.timeout(120)
def test_sync_durability_keeps_every_acknowledged_write_when_a_service_is_killed(deployment,
                                                                              cluster):
    dht = cluster.create_dht("durable", platform="domus-bsddb-btree", storage="disk",
                             durability="sync")
    assert dht.descriptor["durability"] == "sync"
    keys = keys_on(dht, "s2", 5000, "d")
    acknowledged: list[str] = []
    failed: list[BaseException] = []

    def write() -> None:
        with domus.connect(deployment.supervisor_address, timeout=1.0) as writer:
            handle = writer.open_dht("durable")
            for key in keys:
                try:
                    handle[key] = key * 3
                except domus.errors.DomusError as exc:
                    failed.append(exc)
                    return
                acknowledged.append(key)

    thread = threading.Thread(target=write)
    thread.start()
    wait_until(lambda: len(acknowledged) >= 300, timeout=30, what="300 writes acknowledged")
    deployment.kill_service("s2", signal.SIGKILL)            # in the middle of the stream
    thread.join(60)
    assert failed, "the writer should have seen s2 go away"
    assert len(acknowledged) < len(keys)
    wait_until(lambda: state_of(cluster, "s2") == "down", timeout=15, what="s2 down")
    deployment.start_service(deployment.service_index("s2"))
    deployment.wait_until_up(["s2"], timeout=30)

    found = dht.get_many(acknowledged)
    missing = [key for key in acknowledged if found.get(key) != key * 3]
    assert not missing, f"{len(missing)} of {len(acknowledged)} acknowledged writes lost"


@pytest.mark.timeout(120)
def test_a_record_tree_bucket_gives_deleted_memory_to_new_records_and_frees_it_when_it_moves(
        deployment, cluster):
    """domus-rbt: fill a bucket, delete most of it, fill it again: the bytes
    the service holds come back to the first fill's (deleted records' memory
    is reused); moving the bucket away frees it on the source."""
    if not rbt.C_EXTENSION:
        pytest.skip("the pure-Python record tree reports no bytes held")
    dht = cluster.create_dht("held", buckets=1, platform="domus-rbt",
                             routing_services=["s1"], storage_services=["s1"])
    addresses = {name: deployment.service_address(index)
                 for index, name in enumerate(("s1", "s2", "s3"))}

    def held(service: str) -> tuple[int, int]:
        stats = service_stats(addresses[service])["dhts"]["held"]
        return stats["records"], stats["storage_bytes"]

    records = 20_000
    dht.put_many({number: number.to_bytes(8, "big") for number in range(records)})
    first_records, first = held("s1")
    assert first_records == records
    assert first <= 40 * records                        # 32 bytes a record, and pages

    kept = range(0, records, 10)
    for number in range(records):
        if number % 10:
            dht.delete(number)
    emptied_records, emptied = held("s1")
    assert emptied_records == len(kept)
    assert emptied < first / 3                          # compacted: the memory went back

    dht.put_many({-number: number.to_bytes(8, "big") for number in range(1, records + 1)
                  if number % 10})
    refilled_records, refilled = held("s1")
    assert refilled_records == records
    assert abs(refilled - first) <= first / 10
    assert dht[-1] == (1).to_bytes(8, "big") and dht[10] == (10).to_bytes(8, "big")

    # What domus status shows once the heartbeats carry it.
    def shown() -> str | None:
        lines = format_status(cluster.status()).splitlines()
        row = next((line.split() for line in lines if line.split()[:2] == ["s1", "held"]),
                   None)
        return row if row is not None and row[2] == f"{records:,}" else None

    row = wait_until(shown, timeout=15, what="domus status showing the bytes s1 holds")
    assert int(row[-1]) == round(refilled / records)    # BYTES/RECORD

    answer = cluster.move_bucket("held", 0, storage="s2")
    assert answer["records"] == records
    assert held("s1") == (0, 0)                          # the source freed its arena
    moved_records, moved = held("s2")
    assert moved_records == records and moved <= refilled * 1.1
    assert len(dht) == records and dht[-1] == (1).to_bytes(8, "big")
