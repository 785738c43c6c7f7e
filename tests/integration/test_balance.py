"""The balancer with real processes: a service that joins gets its share,
a drained service gives everything away and can then be removed, and a
rebalance by hand does what its dry run said, while a writer keeps putting
and every acknowledged write reads back."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator

import pytest

import domus
from domus.errors import DataLost, SupervisorError
from domus.ops.deploy import free_port_block

from .conftest import TrackedDeployment, start_deployment
from .support import CLIENT_TIMEOUT, LOOPBACK, bucket_of_key, owner_of, wait_until

# (load damping off: the test's own writer keeps services busy, and the
# shares it checks are the capacity ones; tests/unit/test_balancer.py
# covers damping)
AUTO = ("--balance", "auto", "--balance-settle", "1", "--balance-cooldown", "5",
        "--balance-cpu-busy", "101")


class Writer:
    """Puts distinct keys one after the other from its own client until
    stopped, keeping every acknowledged one, and any error it met."""

    def __init__(self, address: str, name: str) -> None:
        self.acknowledged: dict[str, int] = {}
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, name))
        self._thread.start()

    def _run(self, address: str, name: str) -> None:
        try:
            with domus.connect(address, timeout=CLIENT_TIMEOUT) as own:
                dht = own.open_dht(name)
                number = 0
                while not self._stop.is_set():
                    key = f"w{number}"
                    dht[key] = number
                    self.acknowledged[key] = number
                    number += 1
        except BaseException as exc:  # reported by the test
            self.errors.append(exc)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(120)
        assert not self._thread.is_alive(), "the writer did not stop"

    def wrote_more_than(self, count: int) -> bool:
        return len(self.acknowledged) > count


def storage_held(cluster: domus.Cluster, dht: str) -> dict[str, int]:
    return {entry["name"]: entry["buckets"].get(dht, {}).get("storage", 0)
            for entry in cluster.services()}


@pytest.fixture
def elastic(tmp_path) -> Iterator[tuple[TrackedDeployment, domus.Cluster]]:
    deployment = start_deployment(tmp_path, services=2, supervisor_args=AUTO)
    cluster = domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT)
    try:
        yield deployment, cluster
    finally:
        cluster.close()
        deployment.stop_everything()


@pytest.mark.timeout(240)
def test_a_joining_service_gets_its_share_and_a_drained_one_can_leave(elastic):
    deployment, cluster = elastic
    dht = cluster.create_dht("elastic", buckets=64)
    assert storage_held(cluster, "elastic") == {"s1": 32, "s2": 32}
    writer = Writer(deployment.supervisor_address, "elastic")
    try:
        wait_until(lambda: writer.wrote_more_than(200), timeout=30, what="the writer")
        # s3 registers later: the DHT follows the deployment
        deployment.spawn_service("s3", f"{LOOPBACK}:{free_port_block(1)}")
        deployment.wait_until_up(["s3"], timeout=30)
        wait_until(lambda: storage_held(cluster, "elastic") == {"s1": 22, "s2": 21, "s3": 21},
                   timeout=90, what="s3 to get its third of the buckets")
        # routing follows the cores that other work leaves free, which moves
        # with the load of this busy test machine: every service has some
        routing = {entry["name"]: entry["buckets"]["elastic"]["routing"]
                   for entry in cluster.services()}
        assert sum(routing.values()) == 64 and all(routing.values()), routing
        decisions = [d["decision"] for d in cluster.balancer_status()["decisions"]]
        assert any("to s3" in text and "share" in text for text in decisions), decisions

        # a service that holds buckets cannot just be removed
        with pytest.raises(SupervisorError, match="drain it first"):
            cluster.remove_service("s2")
        drained = cluster.drain_service("s2")
        assert drained["drained"] == "s2" and drained["moves"] > 0
        assert storage_held(cluster, "elastic")["s2"] == 0
        assert drained["records"] > 0
        written = len(writer.acknowledged)
        wait_until(lambda: writer.wrote_more_than(written + 200), timeout=30,
                   what="writes after the drain")
    finally:
        writer.stop()
    assert writer.errors == [], writer.errors
    cluster.remove_service("s2")
    assert "s2" not in {entry["name"] for entry in cluster.services()}
    wait_until(lambda: deployment.services["s2"].poll() is not None, timeout=30,
               what="the removed service to stop")
    # every acknowledged write, once, with its value
    assert len(dht) == len(writer.acknowledged)
    assert dht.get_many(list(writer.acknowledged)) == writer.acknowledged
    held = storage_held(cluster, "elastic")
    assert held == {"s1": 32, "s3": 32}
    assert "storage_moves" not in cluster.dht_info("elastic")   # counts describe it again


@pytest.mark.timeout(180)
def test_a_rebalance_by_hand_does_what_its_dry_run_said(tmp_path):
    deployment = start_deployment(tmp_path, services=2)       # manual balancer
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            dht = cluster.create_dht("manual", buckets=16, platform="domus-rbt")
            dht.put_many({number: str(number) for number in range(2_000)})
            deployment.spawn_service("s3", f"{LOOPBACK}:{free_port_block(1)}")
            deployment.wait_until_up(["s3"], timeout=30)
            assert cluster.balancer_status()["mode"] == "manual"
            # manual: nothing moves by itself
            assert storage_held(cluster, "manual") == {"s1": 8, "s2": 8, "s3": 0}
            direct = cluster.open_dht("manual", lookup="D")     # counts from before
            plan = cluster.rebalance("manual", dry_run=True)
            assert plan and {move["target"] for move in plan} <= {"s2", "s3"}
            assert all(move["why"] for move in plan)
            assert storage_held(cluster, "manual") == {"s1": 8, "s2": 8, "s3": 0}
            done = cluster.rebalance("manual")

            def storage_moves(moves):   # (routing follows CPU, which may shift between)
                return [(m["bucket"], m["source"], m["target"]) for m in moves
                        if m["role"] == "storage"]

            assert storage_moves(done) == storage_moves(plan) != []
            assert storage_held(cluster, "manual") == {"s1": 6, "s2": 5, "s3": 5}
            assert sum(m["records"] for m in done if m["role"] == "storage") > 0
            assert dht.get_many(range(2_000)) == {number: str(number) for number in range(2_000)}
            assert storage_moves(cluster.rebalance("manual", dry_run=True)) == []
            # The rebalanced DHT is described by counts again: a D client of
            # the old layout follows redirects, then fetches the new layout
            # and hits directly again (no redirect per request for ever).
            def reads_all() -> bool:
                assert direct.get_many(range(2_000)) == {n: str(n) for n in range(2_000)}
                for number in range(0, 2_000, 7):
                    assert direct[number] == str(number)
                return direct.stats()["refreshes"] >= 1

            wait_until(reads_all, timeout=20, what="the D client to fetch the new layout")
            settled = direct.stats()
            assert settled["in_use"] == "D", settled
            for number in range(2_000):
                assert direct[number] == str(number)
            assert direct.stats()["redirects"] == settled["redirects"]
    finally:
        deployment.stop_everything()


@pytest.mark.timeout(180)
def test_a_dht_with_its_own_service_lists_changes_them_by_hand(tmp_path):
    deployment = start_deployment(tmp_path, services=3)       # manual balancer
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            dht = cluster.create_dht("listed", buckets=16, routing_services=["s1", "s2"],
                                     storage_services=["s1", "s2"])
            dht.put_many({number: number for number in range(3_000)})
            moves = cluster.dht_services("listed", add=["s3"], remove=["s1"])
            assert moves and all(move["target"] in ("s2", "s3") for move in moves)
            assert storage_held(cluster, "listed") == {"s1": 0, "s2": 8, "s3": 8}
            info = cluster.dht_info("listed")
            for role in ("routing", "storage"):
                assert [entry["name"] for entry in info[f"{role}_services"]] == ["s2", "s3"]
                assert f"{role}_leaving" not in info
            assert info["follow"] == []
            # s1 has nothing of it left and may go
            cluster.remove_service("s1")
            assert dht.get_many(range(3_000)) == {number: number for number in range(3_000)}
            with pytest.raises(SupervisorError, match="no storage service left"):
                cluster.dht_services("listed", remove=["s2", "s3"], roles=["storage"])
    finally:
        deployment.stop_everything()


@pytest.mark.timeout(180)
def test_a_dead_service_removed_by_force_loses_only_its_records(tmp_path):
    deployment = start_deployment(tmp_path, services=3)       # manual balancer
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            dht = cluster.create_dht("forced", buckets=16)
            dht.put_many({number: number for number in range(3_000)})
            on_s2 = set(wait_until(lambda: {
                key for key in range(3_000)
                if owner_of(dht, key) == "s2"}, timeout=5, what="keys on s2"))
            wait_until(lambda: storage_reported(cluster, "s2", "forced") == len(on_s2),
                       timeout=15, what="s2's heartbeat with its records")
            deployment.kill_service("s2", signal.SIGKILL)
            wait_until(lambda: {e["name"]: e["state"] for e in cluster.services()}["s2"]
                       == "down", timeout=15, what="s2 down")
            with pytest.raises(SupervisorError, match="drain it first.*--force"):
                cluster.remove_service("s2")
            answer = cluster.remove_service("s2", force=True)
            assert answer["lost_records"] == len(on_s2) and answer["dhts"] == ["forced"]
            assert "s2" not in {entry["name"] for entry in cluster.services()}
            info = cluster.dht_info("forced")
            assert all(entry["name"] != "s2" for role in ("routing", "storage")
                       for entry in info[f"{role}_services"])
            # the rest is there, s2's records are gone (its buckets say so
            # until the loss is accepted), and its buckets take writes
            fresh = cluster.open_dht("forced")
            with pytest.raises(DataLost, match="lost its records with service s2"):
                fresh[next(iter(on_s2))]
            assert sorted(cluster.accept_loss("forced")) == sorted(
                {bucket_of_key(dht, key) for key in on_s2})
            kept = {key: key for key in range(3_000) if key not in on_s2}
            assert fresh.get_many(range(3_000)) == kept
            for stale in (dht, fresh):
                assert stale.get(next(iter(on_s2))) is None
            fresh.put_many({key: -key for key in on_s2})
            assert dht.get_many(on_s2) == {key: -key for key in on_s2}
            assert len(dht) == 3_000
    finally:
        deployment.stop_everything()


def storage_reported(cluster: domus.Cluster, service: str, dht: str) -> int:
    entry = {e["name"]: e for e in cluster.services()}[service]
    return ((entry.get("stats") or {}).get("dhts", {}).get(dht) or {}).get("records", -1)


@pytest.mark.timeout(180)
def test_heterogeneous_services_end_within_one_bucket_of_their_weighted_shares(tmp_path):
    # a RAM DHT follows RAM, a disk DHT free disk, routing the cores
    # (declared with --ram/--disk/--cores, as on nodes shared with other work)
    deployment = start_deployment(tmp_path, services=1, supervisor_args=AUTO)
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            ram = cluster.create_dht("by-ram", buckets=64)
            disk = cluster.create_dht("by-disk", buckets=64, platform="domus-bsddb-btree",
                                      storage="disk")
            ram.put_many({number: number for number in range(2_000)})
            disk.put_many({number: -number for number in range(2_000)})
            gib = 1 << 30
            declared = {"s2": (3 * gib, 10 * gib), "s3": (4 * gib, 30 * gib)}
            port = free_port_block(len(declared))
            for offset, (name, (ram_bytes, disk_bytes)) in enumerate(declared.items()):
                deployment.spawn_service(name, f"{LOOPBACK}:{port + offset}",
                                         extra=("--ram", str(ram_bytes), "--disk",
                                                str(disk_bytes)))
            deployment.wait_until_up(list(declared), timeout=30)
            weights = {entry["name"]: entry["resources"] for entry in cluster.services()}

            def shares_reached(dht: str, field: str) -> bool:
                total = sum(resources[field] for resources in weights.values())
                held = storage_held(cluster, dht)
                return all(abs(held[name] - 64 * resources[field] / total) < 1
                           for name, resources in weights.items())

            wait_until(lambda: shares_reached("by-ram", "ram")
                       and shares_reached("by-disk", "disk"), timeout=120,
                       what="storage shares in proportion to RAM and disk")
            assert ram.get_many(range(2_000)) == {number: number for number in range(2_000)}
            assert disk.get_many(range(2_000)) == {number: -number for number in range(2_000)}
    finally:
        deployment.stop_everything()


@pytest.mark.parametrize("lookup", ["D", "C,R", "R", "D,C,R"])
def test_a_client_whose_layout_names_a_removed_service_finds_the_new_owners(deployment, lookup):
    """A job's client learnt the layout while s3 held buckets; s3 is then
    drained and removed.  Every key is still written and read through
    that client, whatever its lookup strategy: a request that finds s3
    gone asks the supervisor where its bucket is now and goes there.  The
    same for a batch sent first on such a stale layout."""
    with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
        cluster.create_dht("leaving", buckets=32)
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as job, \
                domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as other:
            dht = job.open_dht("leaving", lookup=lookup)
            batches = other.open_dht("leaving", lookup=lookup)
            keys = list(range(400))
            for key in keys:
                dht[key] = key
            assert any(owner_of(dht, key) == "s3" for key in keys)
            assert batches.get_many(keys) == {key: key for key in keys}
            cluster.drain_service("s3")
            cluster.remove_service("s3")
            wait_until(lambda: deployment.services["s3"].poll() is not None, timeout=30,
                       what="the removed service to stop")
            batches.put_many({key: 2 * key for key in keys})
            assert batches.get_many(keys) == {key: 2 * key for key in keys}
            for key in keys:
                dht[key] = -key
            assert dht.get_many(keys) == {key: -key for key in keys}
