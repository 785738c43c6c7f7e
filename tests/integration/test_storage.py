"""Storage technologies on a real deployment: what a disk DHT keeps when a
service stops and starts again on the same data dir."""

from __future__ import annotations

import os
import signal
import threading

import pytest

import domus
import domus.errors

from .support import keys_on, wait_until


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
