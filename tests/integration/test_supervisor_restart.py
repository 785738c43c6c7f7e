"""The supervisor persists what it knows, and is not on the data path."""

from __future__ import annotations

import signal
import time

import pytest

import domus
from domus.errors import SupervisorUnreachable

from .support import CLIENT_TIMEOUT, first_difference, wait_until

RESTART_TIMEOUT = 30.0   # services reconnect with a back-off of at most 2 s


def all_up(cluster) -> bool:
    return {e["name"]: e["state"] for e in cluster.services()} == \
        {"s1": "up", "s2": "up", "s3": "up"}


def layout(descriptor: dict) -> dict:
    """What must survive a restart: identity, attributes and bucket layout."""
    return {key: descriptor[key] for key in ("id", "name", "buckets", "hash", "storage",
                                             "platform", "routing", "lookup", "state",
                                             "created", "routing_services",
                                             "storage_services")}


def populate(cluster):
    dhts = {
        "everywhere": cluster.create_dht("everywhere"),
        "split": cluster.create_dht("split", buckets=64, routing_services=["s1"],
                                    storage_services=["s2", "s3"]),
        "single": cluster.create_dht("single", buckets=1, hash="sha256",
                                     storage_services=["s3"]),
    }
    models: dict[str, dict] = {}
    for name, dht in dhts.items():
        model = {number: {"dht": name, "n": number} for number in range(400)}
        model.update({f"text-{number}": "ü" * number for number in range(100)})
        model[b"big"] = bytes(200_000)   # stored over TCP
        dht.put_many(model)
        models[name] = model
    return dhts, models


def assert_same_records(dht, model) -> None:
    assert first_difference(dict(dht.items()), model) == [], dht.name
    assert len(dht) == len(model)
    assert dht[b"big"] == model[b"big"]


@pytest.mark.timeout(120)
def test_a_restarted_supervisor_knows_every_dht_and_record(deployment, cluster):
    dhts, models = populate(cluster)
    listed_before = sorted(cluster.list_dhts(), key=lambda entry: entry["id"])
    layouts_before = {name: layout(cluster.dht_info(name)) for name in dhts}

    deployment.stop_supervisor(signal.SIGTERM)
    assert deployment.supervisor.returncode == 0, "the supervisor did not stop cleanly"
    deployment.start_supervisor()

    wait_until(lambda: all_up(cluster), timeout=RESTART_TIMEOUT,
               what="every service to re-register with the new supervisor")
    assert sorted(cluster.list_dhts(), key=lambda entry: entry["id"]) == listed_before
    for name in dhts:
        assert layout(cluster.dht_info(name)) == layouts_before[name], name

    with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as fresh:
        for name, model in models.items():
            reopened = fresh.open_dht(name)
            assert reopened.id == dhts[name].id
            assert_same_records(reopened, model)     # a new client, new descriptor
            assert_same_records(dhts[name], model)   # the handle opened before the restart

        # New writes work, old and new handles see each other's writes.
        for name, dht in dhts.items():
            reopened = fresh.open_dht(name)
            assert dht.put("after-restart", name) is True
            assert reopened["after-restart"] == name
            assert reopened.delete(0) is True
            assert 0 not in dht
        # Creating and destroying still work, and ids are never reused.
        newer = fresh.create_dht("newer")
        assert newer.id > max(dht.id for dht in dhts.values())
        newer["x"] = 1
        fresh.destroy_dht("single")
    assert sorted(entry["name"] for entry in cluster.list_dhts()) == \
        ["everywhere", "newer", "split"]
    services = {entry["name"]: entry for entry in cluster.services()}
    assert services["s1"]["buckets"]["split"] == {"routing": 64}
    assert "single" not in services["s3"]["buckets"]


@pytest.mark.timeout(120)
def test_the_data_path_works_while_the_supervisor_is_down(deployment, cluster):
    dhts, models = populate(cluster)
    deployment.stop_supervisor(signal.SIGTERM)
    try:
        started = time.monotonic()
        with pytest.raises(SupervisorUnreachable):
            domus.connect(deployment.supervisor_address, timeout=2)
        with pytest.raises(SupervisorUnreachable):
            cluster.list_dhts()
        assert time.monotonic() - started < 10, "a down supervisor made callers hang"

        for name, dht in dhts.items():
            model = models[name]
            for number in range(200):
                key = f"while-down-{number}"
                assert dht.put(key, [name, number]) is True
                model[key] = [name, number]
            assert dht.get(1) == model[1]
            assert dht.delete(2) is True
            del model[2]
            assert (3 in dht) is True
            assert dht.put_many({"batch": 1, 4: "replaced"}) == 1
            model.update(batch=1)
            model[4] = "replaced"
            assert dht.get_many([1, 2, 3, "batch"]) == {1: model[1], 3: model[3], "batch": 1}
            assert_same_records(dht, model)
    finally:
        deployment.start_supervisor()

    # The supervisor is back: everything written meanwhile is there for a
    # brand-new client too.
    wait_until(lambda: all_up(cluster), timeout=RESTART_TIMEOUT,
               what="every service to re-register")
    with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as fresh:
        for name, model in models.items():
            assert_same_records(fresh.open_dht(name), model)


@pytest.mark.timeout(120)
def test_a_supervisor_killed_hard_also_comes_back(deployment, cluster):
    dhts, models = populate(cluster)
    deployment.stop_supervisor(signal.SIGKILL)
    deployment.start_supervisor()
    wait_until(lambda: all_up(cluster), timeout=RESTART_TIMEOUT,
               what="every service to re-register")
    assert sorted(entry["name"] for entry in cluster.list_dhts()) == sorted(dhts)
    for name, model in models.items():
        assert_same_records(cluster.open_dht(name), model)
