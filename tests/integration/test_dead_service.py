"""A dead (or hung) service costs the buckets it stores, not the DHT: its
keys fail fast with a clear error, everyone else's keep working."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

import domus
from domus.errors import DataLost, ServiceUnavailable, SupervisorError
from domus.ops.deploy import free_port_block

from .support import (
    LOOPBACK,
    bucket_of_key,
    keys_on,
    owner_of,
    service_stats,
    stop_process,
    wait_until,
)

TIMEOUT = 2.0          # the client's deadline for one answer
SLACK = 6.0            # what a loaded 2-core machine may add on top of it


def state_of(cluster, name: str) -> str:
    return {entry["name"]: entry["state"] for entry in cluster.services()}[name]


def expect_unavailable(call, dht, key, service: str):
    """``call`` must raise ServiceUnavailable naming ``service`` and the
    key's bucket, within the deadline and some slack."""
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable) as raised:
        call()
    elapsed = time.monotonic() - started
    assert elapsed < TIMEOUT + SLACK, f"took {elapsed:.1f}s to give up"
    error = raised.value
    assert isinstance(error, ConnectionError)
    assert error.service == service
    assert service in str(error)
    if key is not None:
        bucket = bucket_of_key(dht, key)
        assert error.bucket == bucket
        assert f"bucket {bucket}" in str(error)
        assert error.dht == dht.name and dht.name in str(error)
    return error


@pytest.mark.timeout(120)
def test_a_killed_service_fails_its_keys_only(deployment):
    cluster = domus.connect(deployment.supervisor_address, timeout=TIMEOUT)
    try:
        dht = cluster.create_dht("victim")
        doomed = keys_on(dht, "s2", 20, "doomed")
        spared = keys_on(dht, "s1", 20, "spared") + keys_on(dht, "s3", 20, "spared")
        dht.put_many({key: key.upper() for key in doomed + spared})

        deployment.kill_service("s2", signal.SIGKILL)

        key = doomed[0]
        expect_unavailable(lambda: dht.put(key, "new"), dht, key, "s2")
        expect_unavailable(lambda: dht[key], dht, key, "s2")
        expect_unavailable(lambda: dht.get(key, "default"), dht, key, "s2")
        expect_unavailable(lambda: dht.delete(key), dht, key, "s2")
        expect_unavailable(lambda: key in dht, dht, key, "s2")
        expect_unavailable(lambda: dht.get_many([spared[0], key]), dht, None, "s2")
        # (Not atomic across services: the part for live ones may have landed.)
        bystander = keys_on(dht, "s1", 1, "bystander")[0]
        expect_unavailable(lambda: dht.put_many({bystander: 0, key: 0}), dht, None, "s2")
        expect_unavailable(lambda: len(dht), dht, None, "s2")

        # Every key stored elsewhere keeps working, reads and writes.
        for key in spared:
            assert dht[key] == key.upper()
            assert dht.put(key, key.lower()) is False
            assert dht[key] == key.lower()
        assert dht.get_many(spared) == {key: key.lower() for key in spared}
        assert dht.put_many({key: 1 for key in spared}) == 0
        assert dht.delete(spared[0]) is True and spared[0] not in dht

        wait_until(lambda: state_of(cluster, "s2") == "down", timeout=15,
                   what="the supervisor to see s2 down")
        assert state_of(cluster, "s1") == state_of(cluster, "s3") == "up"

        # A new DHT while s2 is down goes to the live services; naming s2 is refused.
        later = cluster.create_dht("while-s2-down")
        assert sorted(e["name"] for e in later.descriptor["storage_services"]) == ["s1", "s3"]
        later.put_many({number: number for number in range(200)})
        assert len(later) == 200
        with pytest.raises(SupervisorError, match="s2"):
            cluster.create_dht("on-s2", storage_services=["s2"])

        # Restarted on the same name and port, s2 serves again; its RAM
        # records died with it, and its buckets say so (DataLost, never a
        # silent KeyError) until the loss is accepted; then they take
        # new writes.
        deployment.start_service(deployment.service_index("s2"))
        deployment.wait_until_up(["s2"], timeout=30)
        with pytest.raises(DataLost, match="lost its records with service s2"):
            dht[doomed[0]]
        with pytest.raises(DataLost):
            dht[doomed[0]] = "too soon"
        assert dht[spared[1]] == 1
        assert cluster.accept_loss("victim")
        for key in doomed:
            dht[key] = f"reborn {key}"
        assert dht.get_many(doomed) == {key: f"reborn {key}" for key in doomed}
        assert owner_of(dht, doomed[0]) == "s2"
        assert dht.records_by_service()["s2"] == len(doomed)
        assert len(later) == 200
    finally:
        cluster.close()


@pytest.mark.timeout(120)
def test_a_hung_service_times_out_within_the_deadline(deployment):
    cluster = domus.connect(deployment.supervisor_address, timeout=TIMEOUT)
    try:
        dht = cluster.create_dht("hung")
        stuck = keys_on(dht, "s3", 1, "stuck")[0]
        fine = keys_on(dht, "s1", 1, "fine")[0]
        dht[stuck] = dht[fine] = "value"
        pid = deployment.services["s3"].pid
        stop_process(pid)
        try:
            error = expect_unavailable(lambda: dht[stuck], dht, stuck, "s3")
            assert "did not answer" in str(error)
            assert dht[fine] == "value"
            dht[fine] = "still writable"
        finally:
            os.kill(pid, signal.SIGCONT)
        # Woken up, it answers again (no restart needed).
        assert wait_until(lambda: dht.get(stuck) == "value", timeout=10,
                          what="s3 to answer again after SIGCONT")
        assert dht[fine] == "still writable"
    finally:
        cluster.close()


@pytest.mark.timeout(60)
def test_a_client_connecting_while_a_service_is_down_can_use_the_others(deployment, cluster):
    dht = cluster.create_dht("partial")
    spared = keys_on(dht, "s1", 5, "p")
    doomed = keys_on(dht, "s3", 1, "d")[0]
    deployment.kill_service("s3", signal.SIGKILL)
    with domus.connect(deployment.supervisor_address, timeout=TIMEOUT) as late:
        reopened = late.open_dht("partial")
        reopened.put_many({key: "ok" for key in spared})
        assert dht.get_many(spared) == {key: "ok" for key in spared}
        expect_unavailable(lambda: reopened.put(doomed, 1), reopened, doomed, "s3")


@pytest.mark.timeout(120)
def test_a_service_back_at_a_new_address_is_found_again(deployment, cluster):
    dht = cluster.create_dht("moving")
    moved = keys_on(dht, "s2", 10, "m")
    deployment.kill_service("s2", signal.SIGKILL)
    wait_until(lambda: state_of(cluster, "s2") == "down", timeout=15, what="s2 down")

    old_address = deployment.service_address(deployment.service_index("s2"))
    new_address = old_address
    while new_address == old_address:      # (its old port is free again)
        new_address = f"{LOOPBACK}:{free_port_block(1)}"
    deployment.services["s2"] = deployment.spawn_service("s2", new_address)
    deployment.wait_until_up(["s2"], timeout=30)
    assert {e["name"]: e["address"] for e in cluster.services()}["s2"] == new_address

    # The handle still has the old address: the first request is refused,
    # the client asks the supervisor again, and goes to the new one, which
    # says that s2's buckets lost their records (it came back empty).
    with pytest.raises(DataLost, match=f"answered by service s2 \\({new_address}\\)"):
        dht[moved[0]] = "lost"
    cluster.accept_loss("moving")
    for key in moved:
        dht[key] = key
    assert dht.get_many(moved) == {key: key for key in moved}
    assert dht.stats()["refreshes"] >= 1
    storage = {e["name"]: e["address"] for e in dht.descriptor["storage_services"]}
    assert storage["s2"] == new_address
    with domus.connect(deployment.supervisor_address, timeout=TIMEOUT) as fresh:
        assert fresh.open_dht("moving").get_many(moved) == {key: key for key in moved}


@pytest.mark.timeout(60)
def test_a_second_service_with_a_taken_name_is_refused(deployment, cluster):
    dht = cluster.create_dht("named")
    dht.put_many({number: number for number in range(50)})
    intruder = deployment.spawn_service("s1", f"{LOOPBACK}:{free_port_block(1)}",
                                        log_as="intruder")
    code = intruder.wait(30)
    assert code == 2, f"the intruder exited with {code}"
    log = open(deployment.log_path("intruder"), encoding="utf-8").read()
    assert "taken" in log and "s1" in log
    services = {e["name"]: e for e in cluster.services()}
    assert services["s1"]["address"] == deployment.service_address(0)
    assert services["s1"]["state"] == "up"
    assert dht.get_many(range(50)) == {number: number for number in range(50)}


@pytest.mark.timeout(120)
def test_a_silent_service_can_be_replaced_under_its_name_at_a_new_address(deployment, cluster):
    # Its host "vanished": the old process is stopped with its link still open.
    dht = cluster.create_dht("replaced")
    keys = keys_on(dht, "s3", 10, "r")
    stop_process(deployment.services["s3"].pid)
    wait_until(lambda: state_of(cluster, "s3") == "unresponsive", timeout=30,
               what="s3 unresponsive")
    new_address = f"{LOOPBACK}:{free_port_block(1)}"
    replacement = deployment.spawn_service("s3", new_address, log_as="s3-replacement")
    deployment.wait_until_up(["s3"], timeout=30)
    assert replacement.poll() is None
    assert {e["name"]: e["address"] for e in cluster.services()}["s3"] == new_address
    with pytest.raises(DataLost, match="service s3"):     # the new process holds nothing
        dht[keys[0]] = "lost"
    cluster.accept_loss("replaced")
    for key in keys:
        dht[key] = key
    assert dht.get_many(keys) == {key: key for key in keys}


@pytest.mark.timeout(120)
def test_a_retried_put_is_applied_once(deployment):
    """The reply cache: a put whose retries reach the service after another
    client's put of the same key must not undo that put."""
    first = domus.connect(deployment.supervisor_address, timeout=5)
    second = domus.connect(deployment.supervisor_address, timeout=5)
    try:
        dht_a = first.create_dht("retries")
        dht_b = second.open_dht("retries")
        key = keys_on(dht_a, "s3", 1, "contested")[0]
        dht_a[key] = "initial"
        address = deployment.service_address(deployment.service_index("s3"))
        before = service_stats(address)
        results: dict[str, object] = {}

        def put(name: str, dht, value: str) -> None:
            try:
                results[name] = dht.put(key, value)
            except Exception as exc:  # reported below, not lost in the thread
                results[name] = exc

        pid = deployment.services["s3"].pid
        stop_process(pid)
        try:
            # Queued while s3 sleeps: A, A's retry, B, B's retry, A's next retry ...
            writer_a = threading.Thread(target=put, args=("a", dht_a, "A"))
            writer_a.start()
            wait_until(lambda: dht_a.stats()["retries"] >= 1, timeout=10,
                       what="A's first retry")
            writer_b = threading.Thread(target=put, args=("b", dht_b, "B"))
            writer_b.start()
            wait_until(lambda: dht_b.stats()["retries"] >= 1 and dht_a.stats()["retries"] >= 2,
                       timeout=10, what="B's first retry and A's second, after B")
        finally:
            os.kill(pid, signal.SIGCONT)
        writer_a.join(15)
        writer_b.join(15)
        assert results == {"a": False, "b": False}
        assert dht_a[key] == "B", "a stale retry of A's put overwrote B's later put"
        assert dht_a.stats()["retries"] >= 2
        replayed = service_stats(address)["replayed"] - before["replayed"]
        assert replayed >= 2, f"only {replayed} retries were answered from the reply cache"
    finally:
        first.close()
        second.close()


@pytest.mark.timeout(120)
def test_create_fails_cleanly_when_a_service_does_not_acknowledge(deployment, cluster):
    """A DHT exists only once every service involved acknowledged it."""
    pid = deployment.services["s3"].pid
    stop_process(pid)
    try:
        started = time.monotonic()
        with pytest.raises(SupervisorError) as raised:
            cluster.create_dht("stuck")
        assert time.monotonic() - started < 30
        assert "s3" in str(raised.value)
        assert cluster.list_dhts() == []
        # Silent for longer than the supervisor's patience, but still connected.
        wait_until(lambda: state_of(cluster, "s3") == "unresponsive", timeout=15,
                   what="the supervisor to call s3 unresponsive")
    finally:
        os.kill(pid, signal.SIGCONT)
    addresses = {name: deployment.service_address(deployment.service_index(name))
                 for name in ("s1", "s2", "s3")}
    for name, address in addresses.items():
        wait_until(lambda address=address: "stuck" not in service_stats(address)["dhts"],
                   timeout=15, what=f"{name} to drop the DHT that was never created")
    wait_until(lambda: state_of(cluster, "s3") == "up", timeout=15, what="s3 up again")
    dht = cluster.create_dht("stuck")
    dht.put_many({number: number for number in range(300)})
    assert sorted(dht.records_by_service()) == ["s1", "s2", "s3"]
    assert len(dht) == 300
