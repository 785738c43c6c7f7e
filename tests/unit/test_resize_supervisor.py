"""Resizing a DHT, as the supervisor drives it (domus.supervisor.server,
"resizing"), and the layouts it makes (domus.supervisor.balancer.resized):
driven through ``op_resize_dht`` with each service's link replaced by a
direct call into a real service's control handler (through msgpack, as on
the wire; test_supervisor's ServiceLink), so that any step can be made to
fail, and with the services' regrouping run a step per turn of a stand-in
for the reactor, so that clients can work in between."""

import time

import pytest
import twisted.internet
from domus.supervisor import balancer
from domus.supervisor.server import SupervisorService
from domus.supervisor.state import SupervisorState
from test_handler import DHT_ID, keys_in
from test_resize import Turns
from test_supervisor import ServiceLink, result_of
from twisted.internet import defer
from twisted.python.failure import Failure

from domus.placement import layout
from domus.service import hosted as hosted_module
from domus.wire import protocol as wire
from domus.wire.control import ControlError, RemoteControlError
from domus.wire.keys import bucket_of

NAME = "t"
PER_BUCKET = 12


class Link(ServiceLink):
    """A ServiceLink whose answers may come later (``regroup_buckets``
    answers once the regroup is done)."""

    def __init__(self, name, tmp_path):
        super().__init__(name, tmp_path)
        self.lost = defer.Deferred()
        self.answering = 0          # calls whose answer has not come yet

    def call(self, op, timeout=None, **params):
        self.calls.append(op)
        error, after = self._failures.pop((op, self.calls.count(op)), (None, False))
        if error is not None and not after:
            return defer.fail(error)
        body = wire.unpack(wire.pack({"op": op, **params}))
        try:
            answer = defer.maybeDeferred(self.service._supervisor_control, body, self)
        except ControlError as exc:             # (maybeDeferred catches it already)
            return defer.fail(RemoteControlError(exc.kind, exc.message))
        self.answering += 1

        def through_the_wire(result):
            self.answering -= 1
            if isinstance(result, Failure):
                if result.check(ControlError):
                    return Failure(RemoteControlError(result.value.kind, result.value.message))
                return result
            if error is not None:                # applied; the acknowledgement is lost
                return Failure(error)
            return wire.unpack(wire.pack(result))

        answer.addBoth(through_the_wire)
        if op == self._held_op:
            self._held_op = None
            held = defer.Deferred()
            self._held = (held, None)
            answer.addBoth(lambda result: setattr(self, "_held", (held, result)))
            return held
        return answer


def descriptor(platform="python-dict", storage=(("s1", 3), ("s2", 5)), buckets=8):
    """DHT 't', routed by s1 and s2 (4 buckets each), stored by ``storage``
    (name, count) in that order, created with ``buckets`` buckets."""
    medium = "disk" if platform.startswith("domus-bsddb") else "ram"
    return {
        "id": DHT_ID, "name": NAME, "buckets": buckets, "hash": "xxh3", "storage": medium,
        "platform": platform, "routing": "chord", "lookup": "D", "state": "active",
        "durability": "async" if medium == "disk" else "none", "version": 1,
        "initial_buckets": buckets,
        "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": buckets // 2},
                             {"name": "s2", "address": "127.0.0.1:2", "count": buckets // 2}],
        "storage_services": [{"name": name, "address": f"127.0.0.1:{name[-1]}", "count": count}
                             for name, count in storage],
    }


class Deployment:
    """The supervisor, its links to s1, s2 (the DHT's) and s3 (not in it),
    the records, and the Clock the services' regroups step on."""

    def __init__(self, supervisor, links, records, reactor):
        self.supervisor = supervisor
        self.links = links
        self.records = records
        self.reactor = reactor
        self.turns = 0

    @property
    def dht(self):
        return self.supervisor.state.dhts[NAME]

    def saved(self):
        return SupervisorState(self.supervisor.state.data_dir).dhts[NAME]

    def run(self, deferred, between=None, turns=10_000):
        """Turn the reactor until ``deferred`` fires (``between()`` is
        called at each turn: clients at work); its result."""
        fired = []
        deferred.addBoth(fired.append)
        for _ in range(turns):
            if fired:
                break
            if between is not None:
                between()
            self.turns += self.reactor.turn()
        assert fired, "the resize never finished"
        if isinstance(fired[0], Failure):
            fired[0].raiseException()
        return fired[0]

    def resize(self, buckets, between=None):
        return self.run(defer.maybeDeferred(self.supervisor.op_resize_dht, None, name=NAME,
                                            buckets=buckets), between)

    def owner(self, key, dht=None):
        dht = dht or self.dht
        return layout.owners(dht, "storage").owner(bucket_of(key, "xxh3", dht["buckets"]))

    def get(self, name, key, count):
        message = wire.encode_keyed(wire.OP_GET, 1, 0xC, DHT_ID,
                                    bucket_of(key, "xxh3", count), key, b"",
                                    wire.numbering(count))
        reply = self.links[name].handler.handle_fast(message, wire.MAX_UDP_PAYLOAD)
        return reply[2], reply[wire.REPLY_HEADER_SIZE:]

    def put(self, name, key, value, count):
        message = wire.encode_keyed(wire.OP_PUT, int(time.monotonic_ns()) & 0xFFFFFFFF, 0xC,
                                    DHT_ID, bucket_of(key, "xxh3", count), key, value,
                                    wire.numbering(count))
        reply = self.links[name].handler.handle_fast(message, wire.MAX_UDP_PAYLOAD)
        assert reply[2] == wire.ST_OK, reply
        self.records[key] = value

    def check(self):
        """Every record is served by the service the saved layout names,
        to clients of the DHT's count and of half and twice it; each
        service holds its records once (its records, by LENGTH)."""
        dht = self.saved()
        assert dht == self.dht
        count = dht["buckets"]
        held = {name: 0 for name in self.links}
        for key, value in self.records.items():
            owner = self.owner(key, dht)
            held[owner] += 1
            for numbering in (count // 2 or 1, count, count * 2):
                assert self.get(owner, key, numbering) == (wire.ST_OK, value), (key, owner)
        for name, link in self.links.items():
            hosted = link.hosted
            if hosted is not None:
                assert hosted.bucket_count == count, name
                assert hosted.records() == held[name], name
                assert hosted.layout_tag == wire.layout_tag(dht["version"])


@pytest.fixture
def make_deployment(tmp_path, monkeypatch):
    reactor = Turns()
    monkeypatch.setattr(twisted.internet, "reactor", reactor, raising=False)
    monkeypatch.setattr(hosted_module, "REGROUP_PAGE", 4)
    made = []

    def make(**options):
        supervisor = SupervisorService(listen="127.0.0.1:0",
                                       data_dir=str(tmp_path / f"supervisor{len(made)}"),
                                       down_after=1e9)
        links = {}
        for name in ("s1", "s2", "s3"):
            link = links[name] = Link(name, tmp_path / f"d{len(made)}")
            supervisor.state.services[name] = {"name": name, "address": link.service.address,
                                               "registered": time.time(),
                                               "resources": {"cores": 2, "ram": 1 << 30,
                                                             "disk": 1 << 34}}
            supervisor.links[name] = link
            supervisor.live[name] = {"last_seen": time.monotonic()}
        dht = descriptor(**options)
        for name in ("s1", "s2"):
            result_of(links[name].call("assign", dht=dht))
        supervisor.state.dhts[NAME] = dht
        supervisor.state.save()
        records = {}
        owners = layout.owners(dht, "storage")
        for bucket in range(dht["buckets"]):
            for index, key in enumerate(keys_in(bucket, PER_BUCKET, prefix=f"b{bucket}-")):
                value = b"value %d/%d" % (bucket, index)
                hosted = links[owners.owner(bucket)].hosted
                hosted.repos[bucket].put(key, value)
                records[key] = value
        for link in links.values():
            link.calls.clear()
        made.append(Deployment(supervisor, links, records, reactor))
        return made[-1]

    yield make
    for deployment in made:
        for link in deployment.links.values():
            link.handler.close()


def writer(deployment, prefix):
    """Clients that write new keys and overwrite old ones, numbering
    buckets out of the count the supervisor says, and out of the one the
    owner has (they differ while the DHT is being resized)."""
    counter = iter(range(1 << 30))

    def write():
        index = next(counter)
        key = keys_in(index % 8, 1, prefix=f"{prefix}{index}-")[0]
        owner = deployment.owner(key)
        if deployment.links[owner].hosted.bucket_of(key) not in \
                deployment.links[owner].hosted.repos:
            return                       # (a bucket being moved: MOVING, tried again later)
        for count in {deployment.dht["buckets"], deployment.links[owner].hosted.bucket_count}:
            deployment.put(owner, key, b"written at turn %d" % index, count)

    return write


# ------------------------------------------------------------ doubling

@pytest.mark.parametrize("platform", ["python-dict", "domus-bsddb-btree"])
def test_doubling_gives_every_service_the_layout_and_saves_it_once_all_took_it(
        make_deployment, platform):
    deployment = make_deployment(platform=platform)
    supervisor, links = deployment.supervisor, deployment.links
    links["s2"].hold("assign")
    resizing = defer.maybeDeferred(supervisor.op_resize_dht, None, name=NAME, buckets=16)
    # s1 took it, s2 has not answered yet: nothing is saved.
    assert links["s1"].hosted.bucket_count == 16
    assert deployment.saved()["buckets"] == 8 and deployment.dht["buckets"] == 8
    assert "being resized to 16 buckets" in supervisor._changing[NAME]
    links["s2"].release()
    answer = deployment.run(resizing, between=writer(deployment, "w"))
    assert deployment.turns > 10                 # split a step at a time, with writes between
    assert len(deployment.records) > 8 * PER_BUCKET + 10
    assert answer["name"] == NAME and (answer["from"], answer["buckets"]) == (8, 16)
    (step,) = answer["steps"]
    assert step["buckets"] == 16 and step["lagging"] == {}
    assert step["split"] >= 8 * PER_BUCKET              # every record copied (and writes)
    saved = deployment.saved()
    assert saved["buckets"] == 16 and saved["initial_buckets"] == 8 and saved["version"] == 2
    assert [entry["count"] for entry in saved["storage_services"]] == [6, 10]
    assert [entry["count"] for entry in saved["routing_services"]] == [8, 8]
    assert "storage_moves" not in saved and "routing_moves" not in saved
    for name in ("s1", "s2"):
        assert links[name].calls == ["assign", "regroup_buckets"]
        assert links[name].hosted.shared_buckets() == 0
    assert links["s3"].calls == [] and links["s3"].hosted is None
    assert NAME not in supervisor._changing and supervisor._balancing is None
    deployment.check()


FAILURES = {
    "a service refuses the layout": (RemoteControlError("StorageError", "service s2: disk "
                                                        "full"), False, "disk full"),
    "its acknowledgement is lost": (TimeoutError("no reply from service s2 in time"), True,
                                    "no reply from service s2 in time"),
}


@pytest.mark.parametrize("error, after, why", FAILURES.values(), ids=FAILURES.keys())
def test_a_doubling_a_service_does_not_take_leaves_the_dht_as_it_was(make_deployment, error,
                                                                       after, why):
    deployment = make_deployment()
    supervisor, links = deployment.supervisor, deployment.links
    before = dict(deployment.dht)
    links["s2"].fail("assign", 1, error, after=after)
    with pytest.raises(ControlError, match=f"could not double DHT 't'; it keeps 8 buckets: "
                                           f"s2: .*{why}"):
        deployment.resize(16)
    assert deployment.dht == before and deployment.saved() == before
    for name, bucket in (("s1", 0), ("s2", 7)):
        # every service that may have taken the doubled layout is given the old one back
        assert links[name].hosted.bucket_count == 8, name
        assert links[name].hosted.shared_buckets() == 0
        assert "regroup_buckets" not in links[name].calls
        # (a service left at 16 would refuse the scans of clients told 8)
        scan = wire.encode_scan(7, 0xC, DHT_ID, bucket, 0, 0, wire.numbering(8))
        assert links[name].handler.handle(scan)[2] == wire.ST_OK
    assert NAME not in supervisor._changing
    deployment.check()
    # Tried again, it works.
    assert deployment.resize(16)["buckets"] == 16
    deployment.check()


def test_a_service_that_cannot_split_yet_serves_as_it_is_and_splits_later(make_deployment):
    deployment = make_deployment()
    supervisor, links = deployment.supervisor, deployment.links
    links["s2"].fail("regroup_buckets", 1, ConnectionError("connection to s2 lost"))
    answer = deployment.resize(16)
    assert answer["steps"][0]["lagging"] == {"s2": "connection to s2 lost"}
    assert deployment.saved()["buckets"] == 16
    assert links["s2"].hosted.shared_buckets() == 10       # served from its 5 parts of 8
    deployment.check()
    # Its heartbeat says so; the supervisor's next round has it split them.
    for name in ("s1", "s2"):
        supervisor.live[name]["stats"] = {"dhts": links[name].handler.stats()["dhts"]}
    supervisor._regroup_round()
    assert supervisor._changing[NAME] == "having its buckets regrouped on s2"
    for _ in range(1000):
        if NAME not in supervisor._changing:
            break
        deployment.reactor.turn()
    assert NAME not in supervisor._changing
    assert links["s2"].hosted.shared_buckets() == 0
    assert links["s1"].calls.count("regroup_buckets") == 1     # s1 had nothing left to do
    deployment.check()


# ------------------------------------------------------------ halving

@pytest.mark.parametrize("platform", ["python-dict", "domus-bsddb-hash"])
def test_halving_brings_pairs_together_merges_and_takes_the_halved_layout(make_deployment,
                                                                         platform):
    """s1 stores buckets 0-2, s2 3-7: buckets 2 and 3, which become bucket
    1 of 4, straddle them.  Bucket 3 moves to s1 (live, with its records),
    then each service merges its pairs while clients write, then every
    service takes the layout of 4 buckets, which is saved."""
    deployment = make_deployment(platform=platform)
    supervisor, links = deployment.supervisor, deployment.links
    answer = deployment.resize(4, between=writer(deployment, "w"))
    assert deployment.turns > 10                 # merged a step at a time, with writes between
    (step,) = answer["steps"]
    assert step == {"buckets": 4, "moved": PER_BUCKET, "merged": step["merged"]}
    assert step["merged"] >= 8 * PER_BUCKET
    saved = deployment.saved()
    assert saved["buckets"] == 4 and saved["version"] == 3     # the move, then the halving
    assert [entry["count"] for entry in saved["storage_services"]] == [2, 2]
    assert layout.owners(saved, "storage").owner(1) == "s1"
    assert "storage_moves" not in saved
    moving = ["track_bucket", "export_bucket", "catch_up_bucket", "freeze_bucket"]
    source = links["s2"].calls
    assert [op for op in source if op in moving][:2] == ["track_bucket", "export_bucket"]
    assert source.index("freeze_bucket") < source.index("regroup_buckets") < \
        len(source) - 1 - source[::-1].index("assign")
    assert links["s1"].calls.index("stage_bucket") < links["s1"].calls.index("regroup_buckets")
    for name in ("s1", "s2"):
        assert links[name].calls[-2:] == ["regroup_buckets", "assign"]
        assert links[name].hosted.shared_buckets() == 0
    assert NAME not in supervisor._changing
    deployment.check()


def test_a_halving_whose_merge_fails_keeps_the_count_and_splits_back(make_deployment):
    deployment = make_deployment()
    supervisor, links = deployment.supervisor, deployment.links
    links["s2"].fail("regroup_buckets", 1, RemoteControlError("StorageError",
                                                              "service s2: disk full"))
    with pytest.raises(ControlError, match="could not halve DHT 't', which keeps 8 buckets: "
                                           "merging failed on s2: service s2: disk full"):
        deployment.resize(4)
    saved = deployment.saved()
    assert saved["buckets"] == 8 and saved["storage_moves"] == {"3": "s1"}
    assert links["s1"].hosted.shared_buckets() == 4     # merged: its pairs share a part
    deployment.check()
    for name in ("s1", "s2"):
        supervisor.live[name]["stats"] = {"dhts": links[name].handler.stats()["dhts"]}
    supervisor._regroup_round()
    for _ in range(1000):
        if NAME not in supervisor._changing:
            break
        deployment.reactor.turn()
    assert links["s1"].hosted.shared_buckets() == 0
    deployment.check()
    assert deployment.resize(4)["buckets"] == 4
    deployment.check()


def test_a_halving_a_service_does_not_take_keeps_the_count(make_deployment):
    deployment = make_deployment()
    links = deployment.links
    links["s1"].fail("assign", 2, RemoteControlError("StorageError", "service s1: broken"))
    with pytest.raises(ControlError, match="could not halve DHT 't'; it keeps 8 buckets: "
                                           "s1: service s1: broken"):
        deployment.resize(4)
    assert deployment.saved()["buckets"] == 8
    assert links["s2"].hosted.bucket_count == 8          # given the old layout back
    deployment.check()


def test_resizing_goes_a_step_at_a_time(make_deployment):
    deployment = make_deployment()
    answer = deployment.resize(32)
    assert [step["buckets"] for step in answer["steps"]] == [16, 32]
    assert deployment.saved()["version"] == 3
    deployment.check()
    answer = deployment.resize(2)
    assert [step["buckets"] for step in answer["steps"]] == [16, 8, 4, 2]
    assert deployment.saved()["buckets"] == 2
    deployment.check()
    assert deployment.resize(2)["steps"] == []                # already so: nothing to do
    assert deployment.saved()["buckets"] == 2


# ------------------------------------------------------------ what is refused

@pytest.mark.parametrize("buckets", [12, 0, -8, 1 << 25, True, "16", 16.0, None])
def test_a_bucket_count_that_is_not_a_power_of_two_in_range_is_refused(make_deployment,
                                                                       buckets):
    deployment = make_deployment()
    with pytest.raises(ControlError, match=r"a DHT's bucket count must be a power of two "
                                           r"from 1 to 16777216, not ") as refused:
        deployment.supervisor.op_resize_dht(None, name=NAME, buckets=buckets)
    assert refused.value.kind == "InvalidAttribute"
    assert all(link.calls == [] for link in deployment.links.values())
    assert deployment.saved() == deployment.dht and deployment.dht["buckets"] == 8


def test_resizing_is_refused_for_an_unknown_or_inactive_dht(make_deployment):
    deployment = make_deployment()
    supervisor = deployment.supervisor
    with pytest.raises(ControlError, match="no DHT named 'nope'"):
        supervisor.op_resize_dht(None, name="nope", buckets=16)
    result_of(supervisor.op_deactivate_dht(None, name=NAME))
    with pytest.raises(ControlError, match="DHT 't' is inactive; activate it "
                                           r"\(`domus dht activate t`\) before resizing it"):
        supervisor.op_resize_dht(None, name=NAME, buckets=16)
    assert deployment.saved()["buckets"] == 8


def test_resizing_a_replicated_dht_is_refused_saying_what_to_do(make_deployment):
    deployment = make_deployment()
    deployment.supervisor.state.dhts[NAME]["replicas"] = 2
    with pytest.raises(ControlError, match="DHT 't' keeps 2 copies of each bucket; resizing a "
                                           "replicated DHT is not supported yet"):
        deployment.supervisor.op_resize_dht(None, name=NAME, buckets=16)
    assert all(link.calls == [] for link in deployment.links.values())


def test_resizing_is_refused_while_the_dht_is_being_changed(make_deployment):
    deployment = make_deployment()
    supervisor, links = deployment.supervisor, deployment.links
    links["s3"].hold("stage_bucket")
    moving = supervisor.op_move_bucket(None, name=NAME, bucket=1, role="storage", service="s3")
    with pytest.raises(ControlError, match="cannot resize DHT 't' now: it is having storage "
                                           "of bucket 1 moved to s3; try again once"):
        supervisor.op_resize_dht(None, name=NAME, buckets=16)
    links["s3"].release()
    result_of(moving)
    # ... and a DHT being resized takes no other change.
    links["s2"].hold("assign")
    resizing = defer.maybeDeferred(supervisor.op_resize_dht, None, name=NAME, buckets=16)
    for change in (lambda: supervisor.op_resize_dht(None, name=NAME, buckets=4),
                   lambda: supervisor.op_move_bucket(None, name=NAME, bucket=1,
                                                     role="storage", service="s1"),
                   lambda: supervisor.op_deactivate_dht(None, name=NAME)):
        with pytest.raises(ControlError, match="it is being resized to 16 buckets"):
            result_of(defer.maybeDeferred(change))
    links["s2"].release()
    assert deployment.run(resizing)["buckets"] == 16
    deployment.check()


def test_resizing_is_refused_while_a_service_of_the_dht_is_down(make_deployment):
    deployment = make_deployment()
    supervisor, links = deployment.supervisor, deployment.links
    links["s3"].connected = False                  # not the DHT's: no matter
    links["s2"].connected = False
    with pytest.raises(ControlError, match=r"cannot resize DHT 't': service\(s\) \['s2'\] are "
                                           r"not up; start them \(or remove them\) first"):
        supervisor.op_resize_dht(None, name=NAME, buckets=16)
    assert all(link.calls == [] for link in links.values())
    links["s2"].connected = True
    assert deployment.resize(16)["buckets"] == 16


# ------------------------------------------------------------ layout versions

def test_every_change_of_a_layout_is_a_new_version(make_deployment):
    """Services tag their replies with it, and clients fetch the layout
    when they see a newer one: every change must bump it, and save it."""
    deployment = make_deployment()
    supervisor, links = deployment.supervisor, deployment.links
    versions = [deployment.dht["version"]]

    def changed(what):
        version = deployment.dht["version"]
        assert version == versions[-1] + 1, (what, version, versions)
        assert deployment.saved()["version"] == version, what
        for name in ("s1", "s2"):
            if links[name].hosted is not None:
                assert links[name].hosted.layout_tag == wire.layout_tag(version), (what, name)
        versions.append(version)

    result_of(supervisor.op_move_bucket(None, name=NAME, bucket=3, role="storage",
                                        service="s1"))
    changed("storage move")
    result_of(supervisor.op_move_bucket(None, name=NAME, bucket=0, role="routing",
                                        service="s2"))
    changed("routing move")
    result_of(supervisor.op_move_bucket(None, name=NAME, bucket=0, role="routing",
                                        service="s1"))
    changed("routing moved back")
    result_of(supervisor._rebase(NAME))              # s1 stores 0-3: counts again
    assert "storage_moves" not in deployment.dht
    changed("rebase")
    deployment.resize(16)
    changed("doubling")
    deployment.resize(8)
    changed("halving (no pair to bring together)")
    result_of(supervisor.op_dht_services(None, name=NAME, add=["s3"], roles=["routing"]))
    assert deployment.dht["version"] > versions[-1]
    versions.append(deployment.dht["version"])
    assert layout.owners(deployment.dht, "routing").buckets("s3") > 0
    assert deployment.saved() == deployment.dht
    result_of(supervisor.op_remove_service(None, name="s3", force=True))
    assert deployment.dht["version"] > versions[-1]
    versions.append(deployment.dht["version"])
    assert deployment.saved() == deployment.dht
    links["s1"].transport = None
    held = {str(dht_id): sorted(hosted.repos)          # (as a service registers)
            for dht_id, hosted in links["s1"].handler.dhts.items()}
    supervisor.op_register(links["s1"], name="s1", address="127.0.0.1:11",
                           resources={"cores": 2, "ram": 1 << 30, "disk": 1 << 34}, held=held)
    assert deployment.dht["routing_services"][0]["address"] == "127.0.0.1:11"
    assert deployment.dht["version"] == versions[-1] + 1
    assert deployment.saved() == deployment.dht


# ------------------------------------------------------------ balancer.resized

def counts_of(dht, role="storage"):
    return [entry["count"] for entry in dht[f"{role}_services"]]


def test_a_layout_of_counts_doubled_is_counts_still():
    dht = descriptor(storage=(("s1", 3), ("s2", 5)))
    doubled = balancer.resized(dht, 16)
    assert (doubled["buckets"], doubled["version"], doubled["initial_buckets"]) == (16, 2, 8)
    assert counts_of(doubled) == [6, 10] and counts_of(doubled, "routing") == [8, 8]
    assert "storage_moves" not in doubled and "routing_moves" not in doubled
    owners = layout.owners(doubled, "storage")
    for bucket in range(16):           # a finer bucket is its coarser bucket's
        assert owners.owner(bucket) == layout.owners(dht, "storage").owner(bucket // 2)
    assert balancer.resized(doubled, 32)["initial_buckets"] == 8
    assert counts_of(balancer.resized(dht, 64)) == [24, 40]
    assert dht == descriptor(storage=(("s1", 3), ("s2", 5)))        # a copy


def test_moved_buckets_stay_moved_when_doubled():
    dht = layout.move(descriptor(storage=(("s1", 4), ("s2", 4))), "storage", 1, "s3",
                      "127.0.0.1:3")
    doubled = balancer.resized(dht, 16)
    assert doubled["storage_moves"] == {"2": "s3", "3": "s3"}
    assert counts_of(doubled) == [8, 8, 0]
    assert doubled["version"] == dht["version"] + 1


def test_a_halved_bucket_goes_to_its_first_half_s_owner_and_counts_follow():
    dht = descriptor(storage=(("s1", 4), ("s2", 4)))
    halved = balancer.resized(dht, 4)
    assert counts_of(halved) == [2, 2] and "storage_moves" not in halved
    # Co-located pairs (the supervisor moves bucket 3 to s1 first), from 3 + 5:
    straddled = layout.move(descriptor(storage=(("s1", 3), ("s2", 5))), "storage", 3, "s1",
                            "127.0.0.1:1")
    halved = balancer.resized(straddled, 4)
    assert [layout.owners(halved, "storage").owner(bucket) for bucket in range(4)] == \
        ["s1", "s1", "s2", "s2"]
    assert counts_of(halved) == [2, 2] and "storage_moves" not in halved
    # Counts that do not halve evenly: the owners stand, the difference is moves.
    uneven = descriptor(storage=(("s1", 2), ("s2", 2), ("s3", 4)))
    halved = balancer.resized(uneven, 4)
    assert [layout.owners(halved, "storage").owner(bucket) for bucket in range(4)] == \
        ["s1", "s2", "s3", "s3"]
    assert sum(counts_of(halved)) == 4
    # A service whose buckets were all the second halves of pairs holds none.
    odd = layout.move(descriptor(storage=(("s1", 8),)), "storage", 5, "s3", "127.0.0.1:3")
    halved = balancer.resized(odd, 4)
    assert layout.owners(halved, "storage").buckets("s3") == 0


def test_halving_to_one_bucket_and_back():
    dht = descriptor(storage=(("s1", 1), ("s2", 1)), buckets=2)
    one = balancer.resized(dht, 1)
    assert counts_of(one) == [1, 0] and layout.owners(one, "storage").owner(0) == "s1"
    again = balancer.resized(one, 2)
    assert counts_of(again) == [2, 0] and again["version"] == 3
