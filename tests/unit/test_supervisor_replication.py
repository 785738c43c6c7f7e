"""The supervisor (domus.supervisor.server) keeping a replicated DHT's
copies: creation, failover, a service back without its records, failed
backups, lost buckets, repair, drains and forced removals.  Driven as
test_supervisor.py drives moves: each service's link is a direct call into a
real service's control handler; the services' links to each other (a
primary writing to its backups) are direct calls into the backups'
handlers; the failover timer and the clock are a twisted Clock."""

from __future__ import annotations

import itertools
import time

import pytest
from domus.supervisor import server as supervisor_server
from domus.supervisor.server import FAILOVER_GRACE, SupervisorService
from domus.supervisor.state import SupervisorState
from test_supervisor import ServiceLink, result_of
from twisted.internet import defer, task

from domus.placement import layout, replicas
from domus.service.handler import Later
from domus.wire import identities
from domus.wire import protocol as wire
from domus.wire.control import ControlError
from domus.wire.keys import bucket_of, encode_key

BUCKETS = 16
NAMES = ("s1", "s2", "s3", "s4")


class Link(ServiceLink):
    """test_supervisor's link to a service, registering as a link does."""

    def __init__(self, name, tmp_path):
        super().__init__(name, tmp_path)
        self.lost = defer.Deferred()        # (fires when the connection goes away)


class Cluster:
    """A supervisor and services s1..s4 (each its own host), the services'
    replication links wired to each other, time on a Clock."""

    def __init__(self, tmp_path, monkeypatch):
        self.clock = task.Clock()
        self.clock.advance(time.monotonic())
        monkeypatch.setattr(supervisor_server.time, "monotonic", self.clock.seconds)
        from twisted.internet import reactor

        monkeypatch.setattr(reactor, "callLater", self.clock.callLater)
        self.supervisor = SupervisorService(listen="127.0.0.1:0",
                                            data_dir=str(tmp_path / "supervisor"),
                                            down_after=5.0)
        self.links: dict[str, Link] = {}
        self.unreachable: set[str] = set()       # backups the primaries cannot reach
        self.ids = itertools.count(1)
        for name in NAMES:
            link = self.links[name] = Link(name, tmp_path)
            self.supervisor.state.services[name] = {
                "name": name, "address": link.service.address, "resources": {},
                "registered": time.time()}
            self.supervisor.links[name] = link
            self.supervisor.live[name] = {"last_seen": self.clock.seconds()}
            link.handler.replicator = self._forward
            link.handler.copy_failed = (
                lambda hosted, holder, why, name=name: self.supervisor.op_copy_failed(
                    self.links[name], name=name, dht=hosted.name, holder=holder, why=why))

    def _forward(self, service, address, request, done, *args):
        """A primary's REPLICATE to a backup, as PeerLinks sends it."""
        peer = self.links.get(service)
        if peer is None or not peer.connected or service in self.unreachable:
            done(ConnectionError(f"connection to service {service} lost"), *args)
            return
        answer = peer.handler.handle(wire.encode_replicate(next(self.ids), 0x5E, request),
                                     wire.MAX_FRAME_BYTES)
        if answer[2] != wire.ST_OK:
            done(ConnectionError(f"service {service} refused the change"), *args)
        else:
            done(answer[wire.REPLY_HEADER_SIZE:], *args)

    # -- the deployment
    def heartbeat(self):
        for name, link in self.links.items():
            if link.connected:
                self.supervisor.live[name]["last_seen"] = self.clock.seconds()

    def drop(self, name):
        """The service's link to the supervisor goes (its process died)."""
        link = self.links[name]
        link.connected = False
        self.supervisor._link_lost(name, link)

    def register(self, name, restarted=False):
        """The service registers again (after a restart, holding nothing),
        and takes the DHTs the supervisor tells it of."""
        link = self.links[name]
        if restarted:
            for hosted in list(link.handler.dhts.values()):
                link.handler.drop(identities.of(hosted.descriptor))
        link.connected = True
        link.lost = defer.Deferred()
        link.registered_as = None           # (a new connection)
        held = {str(dht_id): sorted(hosted.repos) for dht_id, hosted in link.handler.dhts.items()}
        answer = self.supervisor.op_register(link, name=name, address=link.service.address,
                                             resources={}, held=held)
        link.handler.sync(answer["dhts"])

    def create(self, name="r", copies=2, **attributes):
        attributes = {"buckets": BUCKETS, "replicas": copies, **attributes}
        return result_of(self.supervisor.op_create_dht(None, name=name, attributes=attributes))

    def descriptor(self, name="r"):
        return self.supervisor.state.dhts[name]

    def calls(self):
        return {name: list(link.calls) for name, link in self.links.items()}

    def clear_calls(self):
        for link in self.links.values():
            link.calls.clear()

    def repair(self):
        """One round of repair, to its end."""
        result_of(self.supervisor._repair_round())

    def missing(self, name="r"):
        return [bucket for _rank, first, end in replicas.missing(self.descriptor(name))
                for bucket in range(first, end)]

    # -- the data
    def write(self, key, value, name="r"):
        """A client's put at the bucket's primary: its reply status."""
        descriptor = self.descriptor(name)
        bucket = bucket_of(key, "xxh3", descriptor["buckets"])
        primary = layout.owners(descriptor, "storage").get(bucket)
        request = wire.encode_keyed(wire.OP_PUT, next(self.ids), 7, descriptor["id"], bucket,
                                    key, value)
        answer = self.links[primary].handler.handle(request)
        if isinstance(answer, Later):
            assert answer.done              # (the backups here answer at once)
            answer = answer.result
        return answer[2]

    def read(self, key, service=None, name="r"):
        """(status, value) of a GET at ``service`` (the primary by default)."""
        descriptor = self.descriptor(name)
        bucket = bucket_of(key, "xxh3", descriptor["buckets"])
        service = service or layout.owners(descriptor, "storage").get(bucket)
        request = wire.encode_keyed(wire.OP_GET, next(self.ids), 7, descriptor["id"], bucket,
                                    key)
        answer = self.links[service].handler.handle(request)
        return answer[2], answer[wire.REPLY_HEADER_SIZE:]

    def copy_of(self, key, service, name="r"):
        """The value ``service`` holds of ``key`` in its backup copy."""
        descriptor = self.descriptor(name)
        hosted = self.links[service].handler.dhts[descriptor["id"]]
        repo = hosted.backups.get(bucket_of(key, "xxh3", descriptor["buckets"]))
        return None if repo is None else repo.get(key)

    def fill(self, per_bucket=3, name="r"):
        records = {}
        for bucket in range(self.descriptor(name)["buckets"]):
            for key in keys_in(bucket, per_bucket, prefix=f"b{bucket}-"):
                value = b"value of " + key
                assert self.write(key, value, name) == wire.ST_OK
                records[key] = value
        return records

    def assert_every_copy_holds(self, records, name="r"):
        """Every bucket's primary serves its records, and each backup
        present holds them too."""
        descriptor = self.descriptor(name)
        for key, value in records.items():
            bucket = bucket_of(key, "xxh3", descriptor["buckets"])
            holders = replicas.holders(descriptor, bucket)
            assert self.read(key) == (wire.ST_OK, value), (key, holders)
            for holder in holders[1:]:
                assert self.copy_of(key, holder, name) == value, (key, holder)


def keys_in(bucket, count, prefix="k", buckets=BUCKETS):
    found = []
    for number in itertools.count():
        key = encode_key(f"{prefix}{number}")
        if bucket_of(key, "xxh3", buckets) == bucket:
            found.append(key)
            if len(found) == count:
                return found


@pytest.fixture
def cluster(tmp_path, monkeypatch):
    return Cluster(tmp_path, monkeypatch)


def primaries_of(descriptor, service):
    return set(layout.buckets_in(layout.ranges_of(layout.owners(descriptor, "storage"),
                                                  service)))


def backups_on(descriptor, service):
    return {bucket for copy in replicas.backups(descriptor)
            for bucket in layout.buckets_in(layout.ranges_of(copy, service))}


def saved(cluster):
    return SupervisorState(cluster.supervisor.state.data_dir).dhts


# ------------------------------------------------------------ creation

@pytest.mark.parametrize("copies", [2, 3])
def test_a_replicated_dht_keeps_each_bucket_on_r_services_which_hold_its_writes(cluster,
                                                                                copies):
    descriptor = cluster.create(copies=copies)
    assert descriptor["replicas"] == copies and len(descriptor["storage_backups"]) == copies - 1
    assert saved(cluster)["r"] == descriptor
    for bucket in range(BUCKETS):
        holders = replicas.holders(descriptor, bucket)
        assert len(holders) == len(set(holders)) == copies
    assert replicas.missing(descriptor) == []
    for name, link in cluster.links.items():
        hosted = link.handler.dhts[descriptor["id"]]
        assert set(hosted.repos) == primaries_of(descriptor, name)
        assert set(hosted.backups) == backups_on(descriptor, name)
    records = cluster.fill()
    cluster.assert_every_copy_holds(records)


def test_a_replicated_dht_needs_as_many_services_that_can_store_it(cluster):
    with pytest.raises(ControlError, match="3 copies of each bucket need 3 services that can "
                                           "store them; there are 2") as refused:
        cluster.create(copies=3, storage_services=["s1", "s2"])
    assert refused.value.kind == "InvalidAttribute"
    for name in ("s3", "s4"):
        cluster.supervisor.state.services[name]["platforms"] = ["python-dict", "domus-rbt"]
    with pytest.raises(ControlError, match="there are 2"):
        cluster.create(copies=3, platform="domus-bsddb-btree", storage="disk")
    with pytest.raises(ControlError, match="replicas must be an int from 1 to 3"):
        cluster.create(copies=4)
    assert cluster.supervisor.state.dhts == {} and saved(cluster) == {}
    assert all(calls == [] for calls in cluster.calls().values())      # nothing assigned


# ------------------------------------------------------------ failover

@pytest.mark.parametrize("copies", [2, 3])
def test_a_service_whose_link_drops_is_failed_over_after_the_grace(cluster, copies):
    before = cluster.create(copies=copies)
    records = cluster.fill()
    cluster.clear_calls()
    mine = primaries_of(before, "s1")
    cluster.drop("s1")
    cluster.clock.advance(FAILOVER_GRACE * 0.9)
    assert cluster.descriptor() is before                 # (not yet: it may come back)
    cluster.clock.advance(FAILOVER_GRACE * 0.2)
    after = cluster.descriptor()
    assert after["version"] == before["version"] + 1 and saved(cluster)["r"] == after
    for bucket in range(BUCKETS):
        was, now = replicas.holders(before, bucket), replicas.holders(after, bucket)
        if bucket in mine:
            # the first backup promoted; its place is missing, to be repaired
            assert now == was[1:]
        else:
            assert now == [holder for holder in was if holder != "s1"]
    assert "s1" not in replicas.copies_held(after)
    missing = sum(end - first for _rank, first, end in replicas.missing(after))
    assert missing == len(mine) + len(backups_on(before, "s1"))
    calls = cluster.calls()
    assert calls["s1"] == [] and all(calls[name] == ["assign"] for name in ("s2", "s3", "s4"))
    for link in cluster.links.values():
        if link.connected:
            assert link.hosted.descriptor["version"] == after["version"]
    cluster.assert_every_copy_holds(records)
    # Writes go on, to the copies left.
    fresh = {key: b"after the failover" for bucket in mine for key in keys_in(bucket, 1, "f")}
    for key, value in fresh.items():
        assert cluster.write(key, value) == wire.ST_OK
    cluster.assert_every_copy_holds(fresh)


def test_a_hung_service_is_failed_over_and_told_so_for_when_it_wakes(cluster):
    # Connected but silent past --down-after: its backups take over, and it
    # is sent the new layout too (its link delivers it once it wakes), or it
    # would go on serving its old buckets' reads, stale, to clients that
    # still send them there.
    before = cluster.create()
    records = cluster.fill()
    cluster.clear_calls()
    cluster.clock.advance(6.0)
    for name in ("s2", "s3", "s4"):
        cluster.supervisor.live[name]["last_seen"] = cluster.clock.seconds()
    assert cluster.supervisor.service_state("s1") == "unresponsive"
    cluster.supervisor._watch_services()
    after = cluster.descriptor()
    assert "s1" not in replicas.copies_held(after)
    assert cluster.calls()["s1"] == ["assign"]
    assert cluster.links["s1"].hosted.descriptor["version"] == after["version"]
    key = next(key for key in records
               if bucket_of(key, "xxh3", BUCKETS) in primaries_of(before, "s1"))
    status, _body = cluster.read(key, service="s1")
    assert status == wire.ST_NOT_OWNER
    assert cluster.read(key) == (wire.ST_OK, records[key])


def test_failover_promotes_the_first_backup_that_is_up(cluster):
    before = cluster.create(copies=3)
    records = cluster.fill()
    bucket = min(primaries_of(before, "s1"))
    _s1, first, second = replicas.holders(before, bucket)
    cluster.links[first].connected = False         # (down too, not failed over yet)
    cluster.supervisor._fail_over("s1", "a test")
    assert replicas.holders(cluster.descriptor(), bucket)[0] == second
    key = next(key for key in records if bucket_of(key, "xxh3", BUCKETS) == bucket)
    assert cluster.read(key) == (wire.ST_OK, records[key])


def test_a_service_back_within_the_grace_is_not_failed_over(cluster):
    before = cluster.create()
    records = cluster.fill()
    cluster.drop("s1")
    cluster.clock.advance(FAILOVER_GRACE / 5)
    cluster.heartbeat()
    cluster.supervisor._watch_services()           # (a tick of the watch meanwhile)
    cluster.clock.advance(FAILOVER_GRACE / 5)
    cluster.register("s1")                         # the link is back; nothing was lost
    for _ in range(4):
        cluster.clock.advance(FAILOVER_GRACE)
        cluster.heartbeat()
        cluster.supervisor._watch_services()
    assert cluster.descriptor() == before
    cluster.assert_every_copy_holds(records)


def test_a_service_still_away_after_the_grace_is_failed_over_by_the_watch_too(cluster):
    # (the timer met the DHT being changed: the watch does it once it is not)
    before = cluster.create()
    cluster.drop("s1")
    cluster.supervisor._changing["r"] = "being changed by a test"
    cluster.clock.advance(FAILOVER_GRACE * 2)
    assert cluster.descriptor() is before
    del cluster.supervisor._changing["r"]
    cluster.heartbeat()
    cluster.supervisor._watch_services()
    assert "s1" not in replicas.copies_held(cluster.descriptor())


def test_a_restarted_supervisor_gives_its_services_time_to_register_again(cluster, tmp_path):
    before = cluster.create()
    # A new supervisor on the same state; s2 registers at once, s1 a few
    # seconds later (reconnecting services back off up to 2 s).
    restarted = SupervisorService(listen="127.0.0.1:0", data_dir=str(tmp_path / "supervisor"),
                                  down_after=5.0)
    cluster.supervisor = restarted
    for name in NAMES:
        cluster.links[name].connected = False
    for name in ("s2", "s3", "s4"):
        cluster.register(name)
    for _ in range(3):
        cluster.clock.advance(1.0)
        cluster.heartbeat()
        restarted._watch_services()
    cluster.register("s1")
    assert restarted.state.dhts["r"] == before


def test_a_service_not_back_after_a_supervisor_restart_is_failed_over_in_the_end(cluster,
                                                                                 tmp_path):
    cluster.create()
    restarted = SupervisorService(listen="127.0.0.1:0", data_dir=str(tmp_path / "supervisor"),
                                  down_after=5.0)
    cluster.supervisor = restarted
    for name in NAMES:
        cluster.links[name].connected = False
    for name in ("s2", "s3", "s4"):
        cluster.register(name)
    for _ in range(4):
        cluster.clock.advance(1.0)
        cluster.heartbeat()
        restarted._watch_services()
    assert "s1" in replicas.copies_held(restarted.state.dhts["r"])
    cluster.clock.advance(1.0)                     # (5 s: --down-after)
    cluster.heartbeat()
    restarted._watch_services()
    assert "s1" not in replicas.copies_held(restarted.state.dhts["r"])


def test_an_inactive_dht_is_not_failed_over_and_activates_again(cluster):
    before = cluster.create()
    records = cluster.fill()
    result_of(cluster.supervisor.op_deactivate_dht(None, name="r"))
    inactive = cluster.descriptor()
    cluster.drop("s1")
    cluster.clock.advance(FAILOVER_GRACE * 2)
    cluster.heartbeat()
    cluster.supervisor._watch_services()
    assert cluster.descriptor() == inactive        # its records are on each service's disk
    cluster.register("s1")
    result_of(cluster.supervisor.op_activate_dht(None, name="r"))
    assert layout.owners(cluster.descriptor(), "storage") == layout.owners(before, "storage")
    cluster.assert_every_copy_holds(records)


def test_a_dht_with_one_copy_is_not_failed_over(cluster):
    before = cluster.create(copies=1)
    cluster.drop("s1")
    cluster.clock.advance(FAILOVER_GRACE * 2)
    assert cluster.descriptor() is before


# ------------------------------------------------------------ a service back without its records

def test_a_restarted_service_is_taken_out_of_every_copy(cluster):
    before = cluster.create()
    records = cluster.fill()
    cluster.clear_calls()
    cluster.register("s1", restarted=True)         # (back within the grace, holding nothing)
    after = cluster.descriptor()
    assert after["version"] > before["version"]
    assert "s1" not in replicas.copies_held(after)
    assert "storage_lost" not in after
    for bucket in primaries_of(before, "s1"):
        assert replicas.holders(after, bucket) == replicas.holders(before, bucket)[1:]
    hosted = cluster.links["s1"].hosted
    assert hosted.repos == {} and hosted.backups == {}
    assert all(calls[-1:] == ["assign"] for name, calls in cluster.calls().items()
               if name != "s1")
    cluster.assert_every_copy_holds(records)


def test_a_restarted_service_loses_the_ram_buckets_it_alone_held(cluster):
    one = cluster.create(name="one", copies=1)
    disk = cluster.create(name="disk", copies=1, platform="domus-bsddb-btree", storage="disk")
    key = keys_in(min(primaries_of(one, "s1")), 1, "lost")[0]
    assert cluster.write(key, b"v", name="one") == wire.ST_OK
    cluster.register("s1", restarted=True)
    lost = cluster.descriptor("one").get("storage_lost")
    assert lost == {str(bucket): "s1" for bucket in sorted(primaries_of(one, "s1"))}
    assert cluster.descriptor("one")["version"] == one["version"] + 1
    status, message = cluster.read(key, name="one")
    assert status == wire.ST_DATA_LOST and b"lost its records with service s1" in message
    assert cluster.descriptor("disk") == disk       # its files are still there
    view = cluster.supervisor.op_dht_info(None, name="one")["replication"]
    assert view["lost_buckets"] == sorted(primaries_of(one, "s1"))
    summary = {dht["name"]: dht for dht in cluster.supervisor.op_list_dhts(None)}
    assert summary["one"]["lost_buckets"] == len(primaries_of(one, "s1"))


def test_a_service_restarted_while_its_dht_changes_is_taken_out_once_it_is_done(cluster):
    before = cluster.create()
    cluster.supervisor._changing["r"] = "being changed by a test"
    cluster.register("s1", restarted=True)
    # meanwhile it is told a layout in which it holds nothing
    assert cluster.descriptor() is before
    assert "s1" not in replicas.copies_held(cluster.links["s1"].hosted.descriptor)
    del cluster.supervisor._changing["r"]
    cluster.supervisor._watch_services()
    assert "s1" not in replicas.copies_held(cluster.descriptor())
    assert cluster.supervisor._taking_out == {}


# ------------------------------------------------------------ failed backups

def test_a_backup_the_primary_cannot_reach_is_taken_off_its_buckets(cluster):
    before = cluster.create()
    records = cluster.fill()
    bucket = min(primaries_of(before, "s1"))
    backup = replicas.holders(before, bucket)[1]
    cluster.unreachable.add(backup)
    key = keys_in(bucket, 1, "failing")[0]
    assert cluster.write(key, b"v") == wire.ST_MOVING       # nothing acknowledged
    after = cluster.descriptor()
    assert after["version"] == before["version"] + 1
    for each in range(BUCKETS):
        expected = replicas.holders(before, each)
        if each in primaries_of(before, "s1"):
            expected = [holder for holder in expected if holder != backup]
        assert replicas.holders(after, each) == expected
    # s1 took the layout: the retry is applied (degraded: no backup left)
    assert cluster.write(key, b"v") == wire.ST_OK
    assert cluster.read(key) == (wire.ST_OK, b"v")
    cluster.assert_every_copy_holds(records)


def test_copy_failed_is_ignored_from_an_old_link_and_while_the_dht_changes(cluster):
    before = cluster.create()
    holder = replicas.holders(before, min(primaries_of(before, "s1")))[1]
    supervisor = cluster.supervisor
    for link, changing in ((object(), False), (cluster.links["s1"], True)):
        if changing:
            supervisor._changing["r"] = "being changed by a test"
        answer = supervisor.op_copy_failed(link, name="s1", dht="r", holder=holder, why="x")
        assert answer == {"changed": False}
    supervisor._changing.clear()
    for dht, backup in (("nope", holder), ("r", "s1")):     # (s1 backs none of its own)
        assert supervisor.op_copy_failed(cluster.links["s1"], name="s1", dht=dht,
                                         holder=backup, why="x") == {"changed": False}
    assert cluster.descriptor() is before


# ------------------------------------------------------------ lost buckets

def test_accepting_a_loss_serves_the_buckets_again_empty(cluster):
    cluster.create(name="one", copies=1)
    cluster.register("s1", restarted=True)
    lost = sorted(int(bucket) for bucket in cluster.descriptor("one")["storage_lost"])
    key = keys_in(lost[0], 1, "again")[0]
    before = cluster.descriptor("one")
    answer = result_of(defer.maybeDeferred(cluster.supervisor.op_accept_loss, None,
                                           name="one"))
    assert answer["accepted"] == lost and answer["lagging"] == {}
    after = cluster.descriptor("one")
    assert "storage_lost" not in after and after["version"] == before["version"] + 1
    assert saved(cluster)["one"] == after
    assert cluster.read(key, name="one")[0] == wire.ST_NOT_FOUND
    assert cluster.write(key, b"new", name="one") == wire.ST_OK
    again = cluster.supervisor.op_accept_loss(None, name="one")
    assert again == {"name": "one", "accepted": []}


def test_accepting_a_loss_waits_for_a_change_and_names_the_dht(cluster):
    cluster.create(name="one", copies=1)
    cluster.register("s1", restarted=True)
    cluster.supervisor._changing["one"] = "being changed by a test"
    with pytest.raises(ControlError, match="cannot accept the loss of DHT 'one' now"):
        cluster.supervisor.op_accept_loss(None, name="one")
    with pytest.raises(ControlError, match="no DHT named 'nope'"):
        cluster.supervisor.op_accept_loss(None, name="nope")


# ------------------------------------------------------------ repair

COPY_STEPS_ON_THE_PRIMARY = ["track_bucket", "export_bucket", "catch_up_bucket",
                             "freeze_bucket", "catch_up_bucket", "assign", "thaw_bucket"]


def test_a_missing_backup_is_copied_live_to_a_service_without_a_copy(cluster):
    before = cluster.create()
    records = cluster.fill()
    cluster.supervisor._fail_over("s1", "a test")
    cluster.links["s1"].connected = False
    degraded = cluster.descriptor()
    gaps = replicas.missing(degraded)
    missing = [bucket for _rank, first, end in gaps for bucket in range(first, end)]
    assert len(missing) == len(primaries_of(before, "s1")) + len(backups_on(before, "s1"))
    cluster.clear_calls()
    cluster.repair()
    repaired = cluster.descriptor()
    assert replicas.missing(repaired) == [] and saved(cluster)["r"] == repaired
    for bucket in range(BUCKETS):
        holders = replicas.holders(repaired, bucket)
        assert len(set(holders)) == 2 and "s1" not in holders
    calls = cluster.calls()
    # each copy: the primary tracked, exported, froze for the last catch-up,
    # took the layout and thawed; the target staged the records and took it
    for source in ("s2", "s3", "s4"):
        copies_from = [bucket for bucket in missing
                       if layout.owners(degraded, "storage").get(bucket) == source]
        if copies_from:
            assert calls[source].count("track_bucket") == len(copies_from)
            assert calls[source].count("thaw_bucket") == len(copies_from)
    assert calls["s1"] == []
    assert sum(calls[name].count("stage_bucket") for name in NAMES) >= len(missing)
    cluster.assert_every_copy_holds(records)
    # the new backups take every write from now on
    fresh = {keys_in(bucket, 1, "late")[0]: b"after the repair" for bucket in missing}
    for key, value in fresh.items():
        assert cluster.write(key, value) == wire.ST_OK
    cluster.assert_every_copy_holds(fresh)
    # (then backups may move to even out the copies each service holds)
    for _ in range(20):
        if cluster.supervisor._repair_round() is None:
            break
    else:
        pytest.fail("repairing and evening out copies never settled")
    assert replicas.missing(cluster.descriptor()) == []
    cluster.assert_every_copy_holds({**records, **fresh})


def test_repair_copies_at_most_a_round_of_buckets_at_a_time(cluster, monkeypatch):
    monkeypatch.setattr(supervisor_server, "REPAIRS_PER_ROUND", 1)
    cluster.create()
    cluster.fill()
    cluster.supervisor._fail_over("s1", "a test")
    cluster.links["s1"].connected = False
    degraded = cluster.descriptor()
    missing = cluster.missing()
    bucket = missing[0]
    (source,) = replicas.holders(degraded, bucket)
    held = replicas.copies_held(degraded)
    free = [name for name in ("s2", "s3", "s4") if name != source]
    target = min(free, key=lambda name: (held[name], name))     # the fewest copies
    cluster.clear_calls()
    cluster.repair()
    assert cluster.missing() == missing[1:]
    assert replicas.holders(cluster.descriptor(), bucket) == [source, target]
    calls = cluster.calls()
    assert calls[source] == COPY_STEPS_ON_THE_PRIMARY
    assert calls[target] == ["stage_bucket", "stage_bucket", "assign"]
    (other,) = set(free) - {target}
    assert calls[other] == ["assign"] and calls["s1"] == []
    assert cluster.supervisor._balancing is None and "r" not in cluster.supervisor._changing


def test_a_repair_that_fails_changes_nothing_and_is_tried_again(cluster):
    cluster.create()
    records = cluster.fill()
    cluster.supervisor._fail_over("s1", "a test")
    cluster.links["s1"].connected = False
    degraded = cluster.descriptor()
    for name in ("s2", "s3", "s4"):
        cluster.links[name].fail("stage_bucket", 1, ConnectionError("the link broke"))
    cluster.repair()
    assert cluster.descriptor() == degraded
    assert any("repair: copying bucket" in decision["decision"] and "the link broke"
               in decision["decision"] for decision in cluster.supervisor.memory.decisions)
    for name in ("s2", "s3", "s4"):
        hosted = cluster.links[name].hosted
        assert not hosted.staged and not hosted.frozen
    while cluster.supervisor._repair_round() is not None:
        pass
    assert replicas.missing(cluster.descriptor()) == []
    cluster.assert_every_copy_holds(records)


def test_repair_leaves_what_it_cannot_copy_and_lets_the_balancer_run(cluster):
    cluster.create(copies=3)
    for name in ("s1", "s4"):
        cluster.supervisor._fail_over(name, "a test")
        cluster.links[name].connected = False
    assert cluster.missing()
    for _ in range(10):
        if cluster.supervisor._repair_round() is None:
            break
    else:
        pytest.fail("repair never had nothing left to do")
    # what is still missing: buckets that both live services hold already
    repaired = cluster.descriptor()
    assert cluster.missing()
    for bucket in cluster.missing():
        assert set(replicas.holders(repaired, bucket)) == {"s2", "s3"}
    # (None: the balancer's round goes on to the balancer)
    assert cluster.supervisor._repair_round() is None
    assert cluster.descriptor() is repaired
    # a service able to hold them is back: they are copied to it
    cluster.links["s4"].connected = True
    cluster.heartbeat()
    while cluster.supervisor._repair_round() is not None:
        pass
    assert cluster.missing() == []


def test_repair_skips_buckets_whose_primary_is_down_or_lost(cluster):
    cluster.create()
    cluster.supervisor._fail_over("s1", "a test")
    cluster.links["s1"].connected = False
    degraded = cluster.descriptor()
    for service in {replicas.holders(degraded, bucket)[0] for bucket in cluster.missing()}:
        cluster.links[service].connected = False
    assert cluster.supervisor._repair_round() is None
    for service in ("s2", "s3", "s4"):
        cluster.links[service].connected = True
    lost = dict(degraded, storage_lost={str(bucket): "s1" for bucket in cluster.missing()})
    cluster.supervisor.state.dhts["r"] = lost
    assert cluster.supervisor._repair_round() is None
    assert cluster.descriptor() is lost


# ------------------------------------------------------------ moves by hand

def test_a_moved_primary_keeps_its_backups(cluster):
    before = cluster.create()
    records = cluster.fill()
    bucket = min(primaries_of(before, "s1"))
    backup = replicas.holders(before, bucket)[1]
    target = next(name for name in ("s2", "s3", "s4") if name != backup)
    answer = result_of(cluster.supervisor.op_move_bucket(None, name="r", bucket=bucket,
                                                         role="storage", service=target))
    assert answer["changed"] and answer["records"] == 3
    assert replicas.holders(cluster.descriptor(), bucket) == [target, backup]
    cluster.assert_every_copy_holds(records)
    key = keys_in(bucket, 1, "moved")[0]
    assert cluster.write(key, b"after the move") == wire.ST_OK
    assert cluster.copy_of(key, backup) == b"after the move"


def test_a_primary_is_not_moved_by_hand_onto_its_backup(cluster):
    # (two copies on one service: one copy fewer, and writes the primary
    # would have to forward to itself)
    before = cluster.create()
    records = cluster.fill()
    bucket = min(primaries_of(before, "s1"))
    backup = replicas.holders(before, bucket)[1]
    with pytest.raises(ControlError, match=f"service {backup} holds a backup of bucket "
                                           f"{bucket} of DHT 'r'"):
        cluster.supervisor.op_move_bucket(None, name="r", bucket=bucket, role="storage",
                                          service=backup)
    assert cluster.descriptor() is before and "r" not in cluster.supervisor._changing
    cluster.assert_every_copy_holds(records)
    # its routing may go anywhere
    assert result_of(cluster.supervisor.op_move_bucket(None, name="r", bucket=bucket,
                                                       role="routing", service=backup))["changed"]


# ------------------------------------------------------------ drains and forced removals

def test_a_drain_hands_the_primaries_to_their_backups_and_copies_the_rest(cluster):
    cluster.create()
    records = cluster.fill()
    answer = result_of(cluster.supervisor.op_drain_service(None, name="s1"))
    assert answer["drained"] == "s1"
    assert cluster.supervisor._held_by("s1") == {}
    after = cluster.descriptor()
    assert replicas.missing(after) == []
    for bucket in range(BUCKETS):
        holders = replicas.holders(after, bucket)
        assert len(set(holders)) == 2 and "s1" not in holders
    hosted = cluster.links["s1"].hosted
    assert not hosted.repos and not hosted.backups
    cluster.assert_every_copy_holds(records)


def test_a_drain_swaps_primaries_with_backups_when_no_other_service_may_take_them(cluster):
    # three copies on three services: every other service backs each bucket
    # up, so the balancer can move none of s1's primaries; they go to a
    # backup, s1 taking its place, and s1's copies are then made on s4
    cluster.create(copies=3, storage_services=["s1", "s2", "s3"])
    records = cluster.fill()
    answer = result_of(cluster.supervisor.op_drain_service(None, name="s1"))
    assert answer["drained"] == "s1" and cluster.supervisor._held_by("s1") == {}
    after = cluster.descriptor()
    assert replicas.missing(after) == []
    for bucket in range(BUCKETS):
        assert sorted(replicas.holders(after, bucket)) == ["s2", "s3", "s4"]
    cluster.assert_every_copy_holds(records)


def test_a_dht_takes_no_other_change_while_a_drain_copies_it(cluster):
    cluster.create(copies=3, storage_services=["s1", "s2", "s3"])
    records = cluster.fill()
    supervisor = cluster.supervisor
    refused = []
    copy_replica, take_layout = supervisor._copy_replica, supervisor._take_layout

    def changes_meanwhile():
        for change in (lambda: supervisor.op_deactivate_dht(None, name="r"),
                       lambda: supervisor.op_move_bucket(None, name="r", bucket=0,
                                                         role="routing", service="s4")):
            try:
                result_of(defer.maybeDeferred(change))
            except ControlError as exc:
                refused.append(exc.message)
        # a backup's failure reported meanwhile waits for the change's end
        holder = replicas.holders(supervisor.state.dhts["r"], 0)[0]
        answer = supervisor.op_copy_failed(cluster.links[holder], name=holder, dht="r",
                                           holder="s2" if holder != "s2" else "s3", why="x")
        refused.append(answer)

    def copying(*args, **kwargs):
        changes_meanwhile()
        return copy_replica(*args, **kwargs)

    def swapping(*args, **kwargs):
        changes_meanwhile()
        return take_layout(*args, **kwargs)

    supervisor._copy_replica, supervisor._take_layout = copying, swapping
    result_of(supervisor.op_drain_service(None, name="s1"))
    assert refused and all(isinstance(answer, str) and "cannot" in answer and "now: it is"
                           in answer or answer == {"changed": False} for answer in refused), \
        refused
    assert cluster.descriptor()["state"] == "active"
    assert replicas.missing(cluster.descriptor()) == []
    cluster.assert_every_copy_holds(records)


def test_a_failover_does_not_wait_for_a_whole_drain(cluster):
    # A service dies while a drain copies the draining service's backups:
    # its failover waits for the copy under way, not for the drain's end.
    cluster.create()
    records = cluster.fill()
    supervisor = cluster.supervisor
    copy_replica = supervisor._copy_replica
    steps = []

    def copying(descriptor, changed, bucket, source, target):
        now = supervisor.state.dhts["r"]
        if not steps:
            sources = {layout.owners(now, "storage").get(backed)
                       for backed in backups_on(now, "s1")}
            dying = sorted({"s2", "s3", "s4"} - sources - {target})[0]
            steps.append(dying)
            cluster.drop(dying)
            cluster.clock.advance(FAILOVER_GRACE * 2)   # (the grace ends mid-copy)
            assert dying in replicas.copies_held(supervisor.state.dhts["r"])
        else:
            steps.append("waiting" if steps[0] in replicas.copies_held(now) else "failed over")
        return copy_replica(descriptor, changed, bucket, source, target)

    supervisor._copy_replica = copying
    result_of(supervisor.op_drain_service(None, name="s1"))
    assert len(steps) >= 2 and steps[1] == "failed over", steps
    after = cluster.descriptor()
    assert steps[0] not in replicas.copies_held(after) and "s1" not in replicas.copies_held(after)
    for key, value in records.items():
        assert cluster.read(key) == (wire.ST_OK, value)


def test_held_by_counts_backups(cluster):
    descriptor = cluster.create()
    held = cluster.supervisor._held_by("s1")["r"]
    assert held["storage"] == len(primaries_of(descriptor, "s1"))
    assert held["backup"] == len(backups_on(descriptor, "s1"))


def test_removing_a_dead_service_by_force_promotes_backups_and_reports_the_loss(cluster):
    replicated = cluster.create()
    one = cluster.create(name="one", copies=1)
    cluster.fill()
    only_here = sorted(primaries_of(one, "s1"))
    for bucket in only_here:
        for key in keys_in(bucket, 2, "one"):
            assert cluster.write(key, b"v", name="one") == wire.ST_OK
    cluster.supervisor.live["s1"]["stats"] = {"bucket_records": {
        "one": {bucket: 2 for bucket in only_here},
        "r": {bucket: 3 for bucket in primaries_of(replicated, "s1")}}}
    cluster.links["s1"].connected = False
    answer = result_of(cluster.supervisor.op_remove_service(None, name="s1", force=True))
    assert answer["lost_records"] == 2 * len(only_here)
    assert "s1" not in cluster.supervisor.state.services
    lost = cluster.descriptor("one")["storage_lost"]
    assert lost == {str(bucket): "s1" for bucket in only_here}
    after = cluster.descriptor("r")
    assert "storage_lost" not in after and "s1" not in replicas.copies_held(after)
    for bucket in primaries_of(replicated, "s1"):
        assert replicas.holders(after, bucket)[0] == replicas.holders(replicated, bucket)[1]
    key = keys_in(only_here[0], 1, "one")[0]
    assert cluster.read(key, name="one")[0] == wire.ST_DATA_LOST


# ------------------------------------------------------------ what dht info shows

def test_dht_info_shows_where_each_buckets_copies_are_and_what_is_missing(cluster):
    before = cluster.create()
    view = cluster.supervisor.op_dht_info(None, name="r")["replication"]
    assert view["replicas"] == 2 and view["missing_copies"] == 0 and view["lost_buckets"] == []
    assert view["copies"][0]["first"] == 0 and view["copies"][-1]["end"] == BUCKETS
    for entry in view["copies"]:
        for bucket in range(entry["first"], entry["end"]):
            assert entry["holders"] == replicas.holders(before, bucket)
    cluster.supervisor._fail_over("s1", "a test")
    view = cluster.supervisor.op_dht_info(None, name="r")["replication"]
    assert view["missing_copies"] == len(primaries_of(before, "s1")) + len(
        backups_on(before, "s1"))
    assert any(None in entry["holders"] for entry in view["copies"])
    summary = {dht["name"]: dht for dht in cluster.supervisor.op_list_dhts(None)}
    assert summary["r"]["degraded"] and summary["r"]["replicas"] == 2


# ------------------------------------------------------------ the balancer

def test_the_balancer_never_moves_a_primary_onto_a_service_backing_it_up():
    from test_balancer import descriptor, run_to_the_end, service

    # s3 joined holding the backups of s2's buckets 32..63, which are
    # where the creation rule would put its share of primaries
    dht = descriptor(buckets=64, storage=("s1", "s2", "s3"), counts=[32, 32, 0])
    dht["replicas"] = 2
    dht["storage_backups"] = [[[0, 32, "s2"], [32, 64, "s3"]]]
    services = {name: service() for name in ("s1", "s2", "s3")}
    final, moves = run_to_the_end(dht, services)
    assert moves                                 # (s1's buckets may go to s3)
    copies = replicas.backups(final)
    for move in moves:
        assert move.role != "storage" or all(copy.get(move.bucket) != move.target
                                              for copy in copies), move
    for bucket in range(64):
        primary = layout.owners(final, "storage").get(bucket)
        assert all(copy.get(bucket) != primary for copy in copies), bucket
