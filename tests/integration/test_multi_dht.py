"""Several DHTs in one deployment, each with its own routing and storage
sets; their names, their lifecycle, and their isolation."""

from __future__ import annotations

import random
import threading

import pytest

import domus
from domus.errors import (
    DhtExists,
    InvalidAttribute,
    SupervisorError,
    UnknownDht,
    UnknownService,
)
from domus.ops.cli import format_status

from .support import (
    CLIENT_TIMEOUT,
    first_difference,
    owner_of,
    records_held,
    same_value,
    service_addresses,
    service_stats,
    wait_until,
)

SEED = 7


def make_disjoint(cluster):
    """alpha routes on s1 and stores on s2, s3; beta routes on s2, s3 and
    stores on s1."""
    alpha = cluster.create_dht("alpha", buckets=64, routing_services=["s1"],
                               storage_services=["s2", "s3"])
    beta = cluster.create_dht("beta", buckets=32, routing_services=["s2", "s3"],
                              storage_services=["s1"])
    return alpha, beta


def test_disjoint_sets_show_in_roles_and_buckets(shared_cluster):
    alpha, beta = make_disjoint(shared_cluster)
    services = {entry["name"]: entry for entry in shared_cluster.services()}
    assert set(services) == {"s1", "s2", "s3"}
    assert services["s1"]["buckets"] == {"alpha": {"routing": 64}, "beta": {"storage": 32}}
    for name in ("s2", "s3"):
        buckets = services[name]["buckets"]
        assert set(buckets) == {"alpha", "beta"}
        assert set(buckets["alpha"]) == {"storage"}, f"{name} routes alpha: {buckets}"
        assert set(buckets["beta"]) == {"routing"}, f"{name} stores beta: {buckets}"
        assert buckets["alpha"]["storage"] > 0 and buckets["beta"]["routing"] > 0
    assert services["s2"]["buckets"]["alpha"]["storage"] \
        + services["s3"]["buckets"]["alpha"]["storage"] == 64
    assert services["s2"]["buckets"]["beta"]["routing"] \
        + services["s3"]["buckets"]["beta"]["routing"] == 32
    for entry in services.values():
        assert entry["roles"] == ["routing", "storage"], entry["name"]
        assert entry["state"] == "up"

    assert [e["name"] for e in alpha.descriptor["storage_services"]] == ["s2", "s3"]
    assert [e["name"] for e in alpha.descriptor["routing_services"]] == ["s1"]
    assert [e["name"] for e in beta.descriptor["storage_services"]] == ["s1"]
    assert [e["name"] for e in beta.descriptor["routing_services"]] == ["s2", "s3"]


def test_a_service_with_no_role_in_a_dht_shows_none(shared_cluster):
    shared_cluster.create_dht("only-s3", buckets=4, routing_services=["s3"],
                              storage_services=["s3"])
    services = {entry["name"]: entry for entry in shared_cluster.services()}
    assert services["s3"]["buckets"] == {"only-s3": {"routing": 4, "storage": 4}}
    for name in ("s1", "s2"):
        assert services[name]["buckets"] == {}
        assert services[name]["roles"] == []


def test_records_land_only_on_the_storage_set(shared_cluster):
    alpha, beta = make_disjoint(shared_cluster)
    alpha.put_many({f"a{number}": number for number in range(600)})
    for number in range(300):
        beta[f"b{number}"] = [number]

    by_service = alpha.records_by_service()
    assert set(by_service) == {"s2", "s3"}
    assert sum(by_service.values()) == 600
    assert all(count > 0 for count in by_service.values()), by_service
    assert beta.records_by_service() == {"s1": 300}
    # The owner computed from the placement rule is where the record is.
    expected = {"s2": 0, "s3": 0}
    for number in range(600):
        expected[owner_of(alpha, f"a{number}")] += 1
    assert by_service == expected

    # Ask each service itself what it holds: the routing-only ones hold nothing.
    addresses = service_addresses(shared_cluster)
    stats = {name: service_stats(address) for name, address in addresses.items()}
    assert records_held(stats["s1"], "alpha") == 0
    # (Direct lookups only: no LOOKUP reached any service.)
    unasked = {"found": 0, "forwarded": 0}
    assert stats["s1"]["dhts"]["alpha"] == {"records": 0, "active": True, "buckets": 64,
                                            "storage_buckets": 0, "routing_buckets": 64,
                                            "lookups": unasked, "layout_version": 1}
    assert stats["s1"]["dhts"]["beta"] == {"records": 300, "active": True, "buckets": 32,
                                           "storage_buckets": 32, "routing_buckets": 0,
                                           "lookups": unasked, "layout_version": 1}
    for name in ("s2", "s3"):
        assert records_held(stats[name], "beta") == 0
        assert stats[name]["dhts"]["beta"]["storage_buckets"] == 0
        assert records_held(stats[name], "alpha") == expected[name]
    assert len(alpha) == 600 and len(beta) == 300


def test_interleaved_operations_on_two_dhts_stay_separate(shared_cluster):
    alpha, beta = make_disjoint(shared_cluster)
    rng = random.Random(SEED)
    handles = {"alpha": alpha, "beta": beta}
    models: dict[str, dict] = {"alpha": {}, "beta": {}}
    keys = [number for number in range(60)] + [f"k{number}" for number in range(60)] \
        + [bytes([number]) for number in range(60)]
    for step in range(4000):
        name = rng.choice(("alpha", "beta"))
        dht, model = handles[name], models[name]
        key = rng.choice(keys)
        action = rng.random()
        where = f"step {step} on {name}, key {key!r}"
        if action < 0.45:
            value = {"dht": name, "step": step}   # the same key differs per DHT
            assert dht.put(key, value) is (key not in model), where
            model[key] = value
        elif action < 0.75:
            assert same_value(dht.get(key), model.get(key)), where
        elif action < 0.9:
            assert dht.delete(key) is (key in model), where
            model.pop(key, None)
        elif action < 0.97:
            assert (key in dht) is (key in model), where
        else:
            wanted = rng.sample(keys, 20)
            found = dht.get_many(wanted)
            assert first_difference(found, {k: model[k] for k in wanted if k in model}) == [], \
                where
    for name, dht in handles.items():
        assert first_difference(dict(dht.items()), models[name]) == [], name
        assert len(dht) == len(models[name])
        assert all(value["dht"] == name for value in dict(dht.items()).values())


def test_a_second_dht_of_the_same_name_is_refused(shared_cluster):
    alpha, _beta = make_disjoint(shared_cluster)
    alpha["kept"] = 1
    for attributes in ({}, {"buckets": 64, "routing_services": ["s1"],
                            "storage_services": ["s2", "s3"]}, {"buckets": 2}):
        with pytest.raises(DhtExists) as raised:
            shared_cluster.create_dht("alpha", **attributes)
        assert isinstance(raised.value, SupervisorError)
        assert "alpha" in str(raised.value)
    assert shared_cluster.open_dht("alpha")["kept"] == 1
    assert [entry["name"] for entry in shared_cluster.list_dhts()] == ["alpha", "beta"]


def test_two_clients_racing_to_create_one_name_get_one_dht(deployment):
    outcomes: list[object] = []
    barrier = threading.Barrier(4)

    def create() -> None:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            barrier.wait(timeout=10)
            try:
                outcomes.append(cluster.create_dht("contested").id)
            except DhtExists as exc:
                outcomes.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(outcomes) == 4
    created = [outcome for outcome in outcomes if isinstance(outcome, int)]
    assert len(created) == 1, outcomes
    with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
        assert [(d["name"], d["id"]) for d in cluster.list_dhts()] == [("contested", created[0])]


def test_unknown_dht(shared_cluster):
    shared_cluster.create_dht("known")
    for call in (lambda: shared_cluster.open_dht("unknown"),
                 lambda: shared_cluster.dht_info("unknown"),
                 lambda: shared_cluster.destroy_dht("unknown")):
        with pytest.raises(UnknownDht) as raised:
            call()
        assert isinstance(raised.value, LookupError)
        assert "unknown" in str(raised.value)
    assert [entry["name"] for entry in shared_cluster.list_dhts()] == ["known"]


def test_destroy_then_open_is_unknown_and_ids_are_not_reused(shared_cluster):
    alpha, beta = make_disjoint(shared_cluster)
    alpha.put_many({number: number for number in range(100)})
    beta.put_many({number: -number for number in range(100)})
    old_beta_id = beta.id

    shared_cluster.destroy_dht("beta")
    with pytest.raises(UnknownDht):
        shared_cluster.open_dht("beta")
    assert [entry["name"] for entry in shared_cluster.list_dhts()] == ["alpha"]
    services = {entry["name"]: entry for entry in shared_cluster.services()}
    assert all("beta" not in entry["buckets"] for entry in services.values())

    # The services drop it soon after; then the stale handle says so.
    def stale_handle_refused() -> bool:
        try:
            beta.get(1)
        except UnknownDht:
            return True
        return False

    wait_until(stale_handle_refused, timeout=10, what="the services to drop 'beta'")
    with pytest.raises(UnknownDht):
        beta[2] = 2
    s1 = service_addresses(shared_cluster)["s1"]
    wait_until(lambda: "beta" not in service_stats(s1)["dhts"], timeout=10,
               what="s1 to stop hosting 'beta'")

    # The other DHT did not notice.
    assert len(alpha) == 100
    assert alpha.get_many(range(100)) == {number: number for number in range(100)}

    # A new DHT of the same name is a new DHT: new id, empty, and the stale
    # handle (old id) never reaches it.
    again = shared_cluster.create_dht("beta", buckets=32, storage_services=["s1"])
    assert again.id > max(old_beta_id, alpha.id)
    assert len(again) == 0
    assert again.get(1) is None
    again[1] = "new"
    with pytest.raises(UnknownDht):
        beta.get(1)
    assert shared_cluster.open_dht("beta")[1] == "new"


def test_list_dhts_describes_every_dht(shared_cluster):
    assert shared_cluster.list_dhts() == []
    alpha, beta = make_disjoint(shared_cluster)
    gamma = shared_cluster.create_dht("gamma", hash="blake2b")
    listed = {entry["name"]: entry for entry in shared_cluster.list_dhts()}
    assert set(listed) == {"alpha", "beta", "gamma"}
    assert listed["alpha"]["id"] == alpha.id
    assert listed["beta"]["id"] == beta.id
    assert listed["gamma"]["id"] == gamma.id
    assert len({alpha.id, beta.id, gamma.id}) == 3
    common = {"storage": "ram", "platform": "python-dict", "routing": "chord", "lookup": "D",
              "state": "active"}
    for entry in listed.values():
        assert {key: entry[key] for key in common} == common, entry["name"]
        assert isinstance(entry["created"], float)
    assert (listed["alpha"]["buckets"], listed["alpha"]["hash"]) == (64, "xxh3")
    assert listed["alpha"]["routing_services"] == ["s1"]
    assert listed["alpha"]["storage_services"] == ["s2", "s3"]
    assert (listed["beta"]["buckets"], listed["beta"]["hash"]) == (32, "xxh3")
    assert listed["beta"]["routing_services"] == ["s2", "s3"]
    assert listed["beta"]["storage_services"] == ["s1"]
    assert listed["gamma"]["hash"] == "blake2b"
    assert listed["gamma"]["buckets"] == gamma.bucket_count
    assert gamma.bucket_count & (gamma.bucket_count - 1) == 0
    assert sorted(listed["gamma"]["routing_services"]) == ["s1", "s2", "s3"]
    assert sorted(listed["gamma"]["storage_services"]) == ["s1", "s2", "s3"]

    info = shared_cluster.dht_info("alpha")
    assert info["id"] == alpha.id
    assert [(e["name"], e["count"]) for e in info["storage_services"]] == \
        [(e["name"], e["count"]) for e in alpha.descriptor["storage_services"]]


def test_bad_attributes_are_refused_and_create_nothing(shared_cluster):
    attempts = [
        (UnknownService, {"storage_services": ["s1", "s9"]}),
        (UnknownService, {"routing_services": ["nobody"]}),
        (InvalidAttribute, {"buckets": 3}),
        (InvalidAttribute, {"buckets": 0}),
        (InvalidAttribute, {"hash": "md5"}),
        (InvalidAttribute, {"storage": "tape"}),
        (InvalidAttribute, {"platform": "no-such-platform"}),
        (InvalidAttribute, {"storage": "disk", "platform": "python-dict"}),
        (InvalidAttribute, {"routing": "kademlia"}),
        (InvalidAttribute, {"storage_services": ["s1", "s1"]}),
    ]
    for error, attributes in attempts:
        with pytest.raises(error):
            shared_cluster.create_dht("refused", **attributes)
    for bad_name in ("", "has space", "-leading", "x" * 129, "slash/name"):
        with pytest.raises(InvalidAttribute):
            shared_cluster.create_dht(bad_name)
    assert shared_cluster.list_dhts() == []
    # The refusals did not consume anything that breaks the next create.
    assert shared_cluster.create_dht("refused").get("anything") is None


def test_services_report_their_node_and_what_they_hold_bucket_by_bucket(shared_cluster):
    dht = shared_cluster.create_dht("watched", buckets=16)
    dht.put_many({number: number for number in range(500)})

    def reported():
        entries = {entry["name"]: entry for entry in shared_cluster.services()}
        held = {name: entry["stats"].get("bucket_records", {}).get("watched", {})
                for name, entry in entries.items()}
        return entries if sum(sum(counts.values()) for counts in held.values()) == 500 else None

    entries = wait_until(reported, timeout=15, what="heartbeats with the new records")
    for name, entry in entries.items():
        load = entry["load"]
        assert load["free_ram"] > 0 and load["free_disk"] > 0, load
        assert load["net_bytes_per_s"] >= 0 and 0 <= load["node_cpu"] <= 100, load
        counts = entry["stats"]["bucket_records"]["watched"]
        # the buckets it stores now, as the supervisor counts them
        assert len(counts) == entry["buckets"]["watched"]["storage"], (name, counts)
    status = format_status(shared_cluster.status())
    assert "FREE RAM" in status and "NET KB/S" in status
