"""Deactivating and activating DHTs on a real deployment: records kept,
memory given back, a clear error for requests meanwhile, all or nothing."""

from __future__ import annotations

import os
import signal

import psutil
import pytest

import domus.errors

from .support import wait_until
from .test_cli import hermetic_env, ok


def service_rss(deployment) -> dict[str, int]:
    return {name: psutil.Process(process.pid).memory_info().rss
            for name, process in deployment.services.items()}


@pytest.mark.timeout(180)
def test_a_ram_dht_of_100000_records_is_saved_freed_and_brought_back(deployment, cluster):
    dht = cluster.create_dht("big", platform="python-dict")
    records = {f"key-{number}": f"{number:08d}".encode() * 60 for number in range(100_000)}
    items = list(records.items())
    for start in range(0, len(items), 5000):
        dht.put_many(items[start:start + 5000])
    assert len(dht) == 100_000
    before = service_rss(deployment)

    kept = cluster.deactivate_dht("big")
    assert sum(kept.values()) == 100_000 and set(kept) == {"s1", "s2", "s3"}
    assert cluster.dht_info("big")["state"] == "inactive"
    # Every service let go of its ~16 MB of records (480-byte values).
    after = service_rss(deployment)
    for name in before:
        assert before[name] - after[name] > 0.6 * kept[name] * 480, (name, before, after)
    for name in ("s1", "s2", "s3"):
        saved = os.path.join(deployment.data_dir, name, "dhts", str(dht.id), "ram-snapshot")
        assert os.path.getsize(saved) > kept[name] * 480
    # Requests get a clear error at once, not a timeout.
    with pytest.raises(domus.errors.DhtInactive, match="activate"):
        dht["key-1"]
    with pytest.raises(domus.errors.DhtInactive):
        dht["new"] = b"x"
    with pytest.raises(domus.errors.DhtInactive):
        len(dht)
    with pytest.raises(domus.errors.DhtInactive):
        dht.put_many({"a": 1, "b": 2})

    loaded = cluster.activate_dht("big")
    assert loaded == kept
    assert len(dht) == 100_000
    found = {}
    keys = list(records)
    for start in range(0, len(keys), 5000):
        found.update(dht.get_many(keys[start:start + 5000]))
    assert found == records
    assert "new" not in dht
    # Snapshots are gone once their records are back in memory.
    assert not any(os.path.exists(os.path.join(deployment.data_dir, name, "dhts",
                                               str(dht.id), "ram-snapshot"))
                   for name in ("s1", "s2", "s3"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("platform", ["domus-bsddb-btree", "domus-rbt"])
def test_an_inactive_dht_stays_inactive_across_a_service_restart(deployment, cluster, platform):
    storage = "disk" if platform.startswith("domus-bsddb") else "ram"
    dht = cluster.create_dht("napping", platform=platform, storage=storage)
    records = {number: [number, "x" * (number % 40)] for number in range(3000)}
    dht.put_many(records)
    cluster.deactivate_dht("napping")
    deployment.kill_service("s2", signal.SIGTERM)
    deployment.start_service(deployment.service_index("s2"))
    deployment.wait_until_up(["s2"], timeout=30)
    with pytest.raises(domus.errors.DhtInactive):
        dht.get_many(list(records))
    cluster.activate_dht("napping")
    assert dht.get_many(list(records)) == records


@pytest.mark.timeout(120)
def test_deactivation_is_refused_while_a_service_is_down_and_changes_nothing(deployment,
                                                                            cluster):
    dht = cluster.create_dht("partial", platform="python-dict",
                             storage_services=["s1", "s2"])
    dht.put_many({number: number for number in range(1000)})
    deployment.kill_service("s3", signal.SIGKILL)       # routes, stores nothing
    wait_until(lambda: {e["name"]: e["state"] for e in cluster.services()}["s3"] != "up",
               timeout=15, what="s3 seen down")
    with pytest.raises(domus.errors.SupervisorError, match=r"cannot deactivate.*s3"):
        cluster.deactivate_dht("partial")
    assert cluster.dht_info("partial")["state"] == "active"
    assert dht.get_many(list(range(1000))) == {number: number for number in range(1000)}


@pytest.mark.timeout(120)
def test_the_cli_deactivates_and_activates(deployment, cluster):
    dht = cluster.create_dht("cli-nap", platform="domus-rbt")
    dht.put_many({number: str(number) for number in range(500)})
    env = hermetic_env(DOMUS_SUPERVISOR=deployment.supervisor_address)
    said = ok("dht", "deactivate", "cli-nap", env=env)
    assert "500 records kept" in said and "domus dht activate cli-nap" in said
    assert "inactive" in ok("dht", "list", env=env)
    said = ok("dht", "activate", "cli-nap", env=env)
    assert "500 saved records loaded" in said
    assert ok("dht", "activate", "cli-nap", env=env).strip() == "activated DHT 'cli-nap'"
    assert dht[499] == "499"
