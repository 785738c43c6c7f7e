"""The supervisor (domus.supervisor.server) moving a bucket's routing or
storage: driven through ``op_move_bucket`` with each service's link
replaced by a direct call into a real service's control handler (through
msgpack, as on the wire), so that any step can be made to fail."""

import time

import pytest
from domus.supervisor.server import SupervisorService
from domus.supervisor.state import SupervisorState
from test_handler import DHT_ID, call, descriptor, keyed, keys_in, parse, put
from twisted.internet import defer
from twisted.python.failure import Failure

from domus.service import server as service_server
from domus.service.server import DomusService
from domus.storage.base import TrackedRepository
from domus.wire import launch as launch_record
from domus.wire import protocol as wire
from domus.wire.control import ControlError, RemoteControlError

NAME = "t"
MOVED = 2                      # s1's, by the placement (s1 stores 0..3, s2 4..7)


class ServiceLink:
    """The supervisor's link to one service, minus the socket.

    ``fail(op, nth, error, after=False)`` makes the nth call of ``op`` (1:
    the next) fail with ``error``: before the service sees it, or, with
    ``after``, once it has applied it (a lost acknowledgement).
    ``hold(op)`` keeps the next answer to ``op`` until ``release()``."""

    connected = True

    def __init__(self, name, tmp_path):
        self.service = DomusService(supervisor="127.0.0.1:1", listen=f"127.0.0.1:{name[-1]}",
                                    data_dir=str(tmp_path / name), name=name)
        self.handler = self.service.handler
        self.calls = []
        self._failures = {}
        self._held_op = None
        self._held = None

    def fail(self, op, nth=1, error=None, *, after=False):
        seen = self.calls.count(op)
        self._failures[(op, seen + nth)] = (error or TimeoutError("no reply in time"), after)

    def hold(self, op):
        self._held_op = op

    def release(self):
        deferred, result = self._held
        self._held = None
        deferred.callback(result)

    def call(self, op, timeout=None, **params):
        self.calls.append(op)
        error, after = self._failures.pop((op, self.calls.count(op)), (None, False))
        if error is not None and not after:
            return defer.fail(error)
        body = wire.unpack(wire.pack({"op": op, **params}))
        try:
            result = wire.unpack(wire.pack(self.service._supervisor_control(body, self)))
        except ControlError as exc:
            return defer.fail(RemoteControlError(exc.kind, exc.message))
        if error is not None:
            return defer.fail(error)
        if op == self._held_op:
            self._held_op = None
            self._held = (defer.Deferred(), result)
            return self._held[0]
        return defer.succeed(result)

    # What the service holds of the DHT.
    @property
    def hosted(self):
        return self.handler.dhts.get(DHT_ID)

    def get(self, key):
        return call(self.handler, keyed(wire.OP_GET, key))


def result_of(deferred):
    results = []
    deferred.addBoth(results.append)
    assert results, "the Deferred has not fired"
    if isinstance(results[0], Failure):
        results[0].raiseException()
    return results[0]


@pytest.fixture
def deployment(tmp_path, request):
    """A supervisor with services s1, s2 (the DHT's) and s3 (not in it),
    and 20 records in each of the DHT's 8 buckets."""
    platform = getattr(request, "param", "python-dict")
    storage = "disk" if platform.startswith("domus-bsddb") else "ram"
    supervisor = SupervisorService(listen="127.0.0.1:0", data_dir=str(tmp_path / "supervisor"),
                                   down_after=1e9)
    links = {}
    for name in ("s1", "s2", "s3"):
        link = links[name] = ServiceLink(name, tmp_path)
        supervisor.state.services[name] = {"name": name, "address": link.service.address,
                                           "resources": {}}
        supervisor.links[name] = link
        supervisor.live[name] = {"last_seen": time.monotonic()}
    dht = descriptor(name=NAME, platform=platform, storage=storage)
    for name in ("s1", "s2"):
        result_of(links[name].call("assign", dht=dht))
    supervisor.state.dhts[NAME] = dht
    records = {}
    for bucket in range(8):
        owner = links["s1" if bucket < 4 else "s2"]
        for index, key in enumerate(keys_in(bucket, 20, prefix=f"b{bucket}-")):
            value = b"value %d/%d" % (bucket, index)
            assert put(owner.handler, key, value)[0] == wire.ST_OK
            records[key] = value
    for link in links.values():
        link.calls.clear()
    return supervisor, links, records


def move(supervisor, bucket=MOVED, role="storage", service="s3"):
    return supervisor.op_move_bucket(None, name=NAME, bucket=bucket, role=role, service=service)


def served_by(links, records, name):
    """The records ``name`` serves, of those given."""
    return {key: value for key, value in records.items()
            if links[name].get(key) == (wire.ST_OK, value)}


def in_bucket(records, bucket):
    return {key: value for key, value in records.items() if key in keys_in(bucket, 20,
                                                                           prefix=f"b{bucket}-")}


def assert_unchanged(supervisor, links, records, target):
    """Nothing happened: the layout is the old one (in memory and on disk),
    every record is served where it was, the target holds nothing of the
    bucket, and the DHT can be changed again."""
    assert supervisor.state.dhts[NAME] == descriptor(name=NAME,
                                                     **_attributes(supervisor))
    assert SupervisorState(supervisor.state.data_dir).dhts.get(NAME, supervisor.state.dhts[NAME]) \
        == supervisor.state.dhts[NAME]
    for name, buckets in (("s1", range(4)), ("s2", range(4, 8))):
        mine = {key: value for bucket in buckets for key, value in in_bucket(records,
                                                                             bucket).items()}
        assert served_by(links, mine, name) == mine
        assert not links[name].hosted.frozen and not links[name].hosted.snapshots
        assert not any(isinstance(repo, TrackedRepository)
                       for repo in links[name].hosted.repos.values())
    hosted = links[target].hosted
    if hosted is not None:
        assert MOVED not in hosted.repos and not hosted.staged
    assert NAME not in supervisor._changing


def _attributes(supervisor):
    dht = supervisor.state.dhts[NAME]
    return {"platform": dht["platform"], "storage": dht["storage"]}


# ------------------------------------------------------------ storage moves

@pytest.mark.parametrize("deployment", ["python-dict", "domus-bsddb-btree"], indirect=True)
def test_a_storage_move_takes_every_record_and_saves_the_layout(deployment, monkeypatch):
    supervisor, links, records = deployment
    monkeypatch.setattr(service_server, "EXPORT_PAGE_BYTES", 100)      # several pages
    answer = result_of(move(supervisor))
    assert answer["records"] == 20 and answer["changed"] and not answer["lagging"]
    assert (answer["from"], answer["to"], answer["role"]) == ("s1", "s3", "storage")
    assert links["s1"].calls.count("export_bucket") > 3
    moving = in_bucket(records, MOVED)
    assert served_by(links, moving, "s3") == moving
    assert served_by(links, moving, "s1") == {}
    assert MOVED not in links["s1"].hosted.repos and not links["s1"].hosted.frozen
    saved = SupervisorState(supervisor.state.data_dir).dhts[NAME]
    assert saved == supervisor.state.dhts[NAME]
    assert saved["storage_moves"] == {str(MOVED): "s3"}
    assert saved["storage_services"][-1] == {"name": "s3", "address": "127.0.0.1:3",
                                             "count": 0}
    # s1 routes every bucket: its storage reference follows.
    assert links["s1"].hosted.storage_service(MOVED) == "s3"
    assert NAME not in supervisor._changing


def test_an_empty_bucket_moves_too(deployment):
    supervisor, links, _records = deployment
    for key in keys_in(MOVED, 20, prefix=f"b{MOVED}-"):
        call(links["s1"].handler, keyed(wire.OP_DELETE, key))
    assert result_of(move(supervisor))["records"] == 0
    assert MOVED in links["s3"].hosted.repos


# (link, op, nth call of op, after it is applied)
FAILURES = {
    "the newcomer cannot host the DHT": ("s3", "assign", 1, False),
    "tracking fails": ("s1", "track_bucket", 1, False),
    "catching up fails": ("s1", "catch_up_bucket", 1, False),
    "the last catch-up, frozen, fails": ("s1", "catch_up_bucket", 2, False),
    "freezing fails": ("s1", "freeze_bucket", 1, False),
    "exporting fails": ("s1", "export_bucket", 2, False),
    "staging fails": ("s3", "stage_bucket", 2, False),
    "a staging answer is lost": ("s3", "stage_bucket", 1, True),
    "the target does not take the new layout": ("s3", "assign", 2, False),
    "the target's acknowledgement is lost": ("s3", "assign", 2, True),
}


@pytest.mark.parametrize("link, op, nth, after", FAILURES.values(), ids=FAILURES.keys())
def test_a_storage_move_that_fails_changes_nothing(deployment, monkeypatch, link, op, nth,
                                                   after):
    supervisor, links, records = deployment
    monkeypatch.setattr(service_server, "EXPORT_PAGE_BYTES", 100)
    links[link].fail(op, nth, ConnectionError(f"connection to service {link} lost"),
                     after=after)
    with pytest.raises(ControlError) as failed:
        result_of(move(supervisor))
    message = failed.value.message
    assert f"could not move storage of bucket {MOVED} of DHT 't' from s1 to s3" in message
    assert f"connection to service {link} lost" in message
    assert "nothing changed: the bucket is served by s1 as before" in message
    assert_unchanged(supervisor, links, records, "s3")
    assert links["s3"].hosted is None          # it had nothing of the DHT, and has nothing
    # The same move, tried again, works.
    assert result_of(move(supervisor))["records"] == 20


@pytest.mark.parametrize("deployment", ["python-dict", "domus-bsddb-btree"], indirect=True)
def test_a_failed_move_to_a_service_of_the_dht_leaves_it_as_it_was(deployment):
    supervisor, links, records = deployment
    links["s2"].fail("assign", 1, TimeoutError("no reply from service s2 in time"), after=True)
    with pytest.raises(ControlError, match="giving service s2 the new layout failed: no reply"):
        result_of(move(supervisor, service="s2"))
    assert_unchanged(supervisor, links, records, "s2")
    assert links["s2"].calls[-2:] == ["assign", "discard_bucket"]   # old layout, then discard


def test_a_copy_short_of_records_is_not_published(deployment, monkeypatch):
    supervisor, links, records = deployment
    stage = links["s3"].service._move_step

    def lossy(op, body):
        if op == "stage_bucket":
            body = dict(body, records=body["records"][2:])
        return stage(op, body)

    monkeypatch.setattr(links["s3"].service, "_move_step", lossy)
    with pytest.raises(ControlError, match="staged 19 records of the 20 frozen on s1"):
        result_of(move(supervisor))
    assert_unchanged(supervisor, links, records, "s3")


def test_once_the_target_serves_the_bucket_the_move_stands(deployment):
    """The source may have deleted its copy on hearing of the new layout:
    the move is not undone; the source is told again when it registers."""
    supervisor, links, records = deployment
    links["s1"].fail("assign", 1, TimeoutError("no reply from service s1 in time"))
    answer = result_of(move(supervisor))
    assert answer["lagging"] == {"s1": "no reply from service s1 in time"}
    assert supervisor.state.dhts[NAME]["storage_moves"] == {str(MOVED): "s3"}
    moving = in_bucket(records, MOVED)
    assert served_by(links, moving, "s3") == moving
    key = next(iter(moving))
    assert links["s1"].get(key)[0] == wire.ST_MOVING          # still frozen there
    # s1 registers again: it takes the layout and lets its copy go.
    links["s1"].handler.sync([supervisor.state.dhts[NAME]])
    assert links["s1"].get(key)[0] == wire.ST_NOT_OWNER
    assert not links["s1"].hosted.frozen and MOVED not in links["s1"].hosted.repos


def test_a_dht_being_moved_takes_no_other_change(deployment):
    supervisor, links, records = deployment
    links["s3"].hold("stage_bucket")
    moving = move(supervisor)
    busy = "it is having storage of bucket 2 moved to s3"
    for change in (lambda: move(supervisor, bucket=5, service="s1"),
                   lambda: supervisor.op_deactivate_dht(None, name=NAME),
                   lambda: supervisor.op_destroy_dht(None, name=NAME)):
        with pytest.raises(ControlError, match=busy):
            result_of(defer.maybeDeferred(change))
    links["s3"].release()
    assert result_of(moving)["records"] == 20
    assert result_of(move(supervisor, bucket=5, service="s1"))["records"] == 20


# ------------------------------------------------------------ routing moves

def test_a_routing_move_reaches_every_service(deployment):
    supervisor, links, _records = deployment
    answer = result_of(move(supervisor, bucket=5, role="routing", service="s3"))
    assert answer["changed"] and answer["records"] is None
    assert links["s3"].hosted.routed == [(5, 6)]
    assert links["s1"].hosted.routed == [(0, 5), (6, 8)]
    assert links["s2"].calls == ["assign"]
    saved = SupervisorState(supervisor.state.data_dir).dhts[NAME]
    assert saved["routing_moves"] == {"5": "s3"}
    # Moved back: the move is gone; s3 stays listed, with nothing.
    result_of(move(supervisor, bucket=5, role="routing", service="s1"))
    assert "routing_moves" not in supervisor.state.dhts[NAME]
    assert links["s3"].hosted.routed == [] and links["s1"].hosted.routed == [(0, 8)]


def test_a_routing_move_is_all_or_nothing(deployment):
    supervisor, links, records = deployment
    links["s2"].fail("assign", 1, RemoteControlError("StorageError", "service s2: disk full"))
    with pytest.raises(ControlError, match="could not move routing of bucket 5 of DHT 't'; "
                                           "nothing changed: s2: service s2: disk full"):
        result_of(move(supervisor, bucket=5, role="routing", service="s3"))
    assert_unchanged(supervisor, links, records, "s3")
    assert links["s1"].hosted.routed == [(0, 8)]          # given the old layout back
    assert links["s3"].hosted is None                     # dropped: it had none of it


# ------------------------------------------------------------ what is refused

@pytest.mark.parametrize("params, error", [
    ({"name": "nope"}, "no DHT named 'nope'"),
    ({"role": "both"}, "'routing' or 'storage', not 'both'"),
    ({"bucket": 8}, "has buckets 0 to 7; 8 is not one of them"),
    ({"bucket": -1}, "-1 is not one of them"),
    ({"bucket": "2"}, "'2' is not one of them"),
    ({"bucket": True}, "True is not one of them"),
    ({"service": "s9"}, "no service named 's9' is registered"),
])
def test_bad_moves_are_refused(deployment, params, error):
    supervisor, links, records = deployment
    with pytest.raises(ControlError, match=error):
        supervisor.op_move_bucket(None, **({"name": NAME, "bucket": MOVED, "role": "storage",
                                            "service": "s3"} | params))
    assert_unchanged(supervisor, links, records, "s3")


def test_a_move_needs_its_services_up_and_the_dht_active(deployment):
    supervisor, links, records = deployment
    links["s3"].connected = False
    with pytest.raises(ControlError, match=r"service\(s\) \['s3'\] are not up"):
        move(supervisor)
    links["s3"].connected = True
    links["s2"].connected = False               # routes nothing, stores another bucket
    assert result_of(move(supervisor))["records"] == 20
    with pytest.raises(ControlError, match=r"\['s2'\] are not up"):
        move(supervisor, bucket=1, role="routing", service="s3")   # every service takes it
    links["s2"].connected = True
    result_of(supervisor.op_deactivate_dht(None, name=NAME))
    with pytest.raises(ControlError, match="inactive; activate it"):
        move(supervisor, bucket=1)


def test_moving_a_bucket_to_its_owner_does_nothing(deployment):
    supervisor, links, records = deployment
    answer = move(supervisor, service="s1")
    assert answer["changed"] is False and answer["from"] == answer["to"] == "s1"
    assert all(not link.calls for link in links.values())
    assert_unchanged(supervisor, links, records, "s3")


def test_the_supervisors_patience_is_set_and_kept_for_a_restart(tmp_path):
    supervisor = SupervisorService(listen="127.0.0.1:0", data_dir=str(tmp_path),
                                   down_after=2.0, push_timeout=4.5)
    assert (supervisor.down_after, supervisor.push_timeout) == (2.0, 4.5)
    # `domus deployment restart` starts it again with the same patience
    arguments = launch_record.arguments(supervisor.state.launch)
    assert arguments[-4:] == ["--down-after", "2.0", "--push-timeout", "4.5"]
    default = SupervisorService(listen="127.0.0.1:0", data_dir=str(tmp_path / "default"))
    assert "--down-after" not in launch_record.arguments(default.state.launch)
    for bad in ({"down_after": 0}, {"push_timeout": -1.0}):
        with pytest.raises(ValueError, match="must be positive"):
            SupervisorService(listen="127.0.0.1:0", data_dir=str(tmp_path / "bad"), **bad)


# ------------------------------------------- platforms a service can run

WITHOUT_BDB = ["python-dict", "domus-rbt"]     # what `pip install domus` alone runs


def create(supervisor, name, **attributes):
    return result_of(supervisor.op_create_dht(None, name=name, attributes=attributes))


def storage_of(descriptor):
    return [entry["name"] for entry in descriptor["storage_services"]]


def test_a_berkeley_db_dht_is_stored_only_on_services_that_have_it(deployment):
    supervisor, links, records = deployment
    supervisor.state.services["s3"]["platforms"] = WITHOUT_BDB
    disk = create(supervisor, "on-disk", platform="domus-bsddb-btree", storage="disk")
    assert storage_of(disk) == ["s1", "s2"]
    assert [entry["name"] for entry in disk["routing_services"]] == ["s1", "s2", "s3"]
    assert storage_of(create(supervisor, "in-ram", platform="domus-rbt")) == ["s1", "s2", "s3"]
    view = {entry["name"]: entry for entry in supervisor.op_services(None)}
    assert view["s3"]["platforms"] == WITHOUT_BDB
    assert "domus-bsddb-hash" in view["s1"]["platforms"]    # said nothing: every platform


def test_a_berkeley_db_dht_no_service_can_store_is_refused_naming_the_extra(deployment):
    supervisor, links, records = deployment
    for name in ("s1", "s2", "s3"):
        supervisor.state.services[name]["platforms"] = WITHOUT_BDB
    with pytest.raises(ControlError, match=r"no live service can store platform "
                       r"'domus-bsddb-hash'.*domus\[bdb\].*libdb") as refused:
        create(supervisor, "nowhere", platform="domus-bsddb-hash")
    assert refused.value.kind == "PlatformUnavailable"
    assert "nowhere" not in supervisor.state.dhts
    assert all(link.calls == [] for link in links.values())     # nothing was assigned


def test_named_storage_services_without_the_platform_are_refused(deployment):
    supervisor, links, records = deployment
    supervisor.state.services["s3"]["platforms"] = WITHOUT_BDB
    with pytest.raises(ControlError, match=r"service\(s\) \['s3'\] cannot store platform "
                       r"'domus-bsddb-btree'.*domus\[bdb\]"):
        create(supervisor, "named", platform="domus-bsddb-btree",
               storage_services=["s2", "s3"])
    assert "named" not in supervisor.state.dhts


@pytest.mark.parametrize("deployment", ["domus-bsddb-btree"], indirect=True)
def test_a_berkeley_db_bucket_is_not_moved_to_a_service_without_it(deployment):
    supervisor, links, records = deployment
    supervisor.state.services["s3"]["platforms"] = WITHOUT_BDB
    with pytest.raises(ControlError, match=r"service\(s\) \['s3'\] cannot.*domus\[bdb\]"):
        move(supervisor)
    assert_unchanged(supervisor, links, records, "s3")
    # its routing has no platform to need
    assert result_of(move(supervisor, role="routing"))["changed"]


@pytest.mark.parametrize("deployment", ["domus-bsddb-btree"], indirect=True)
def test_a_disk_bucket_is_on_the_targets_disk_before_the_source_deletes_it(deployment,
                                                                           monkeypatch):
    # an async disk DHT: without a flush the moved records would sit in the
    # target's cache while the source deleted its file, and a crash of the
    # target then would lose the whole bucket
    from domus.storage import bsddb

    supervisor, links, records = deployment
    events = []
    flush, remove = bsddb.BerkeleyStore.flush, bsddb.BerkeleyStore.remove

    def flushing(store):
        events.append(("flush", store.home))
        return flush(store)

    def removing(store, bucket, count=None, **kwargs):
        events.append(("remove", store.home, bucket))
        return remove(store, bucket, count, **kwargs)

    monkeypatch.setattr(bsddb.BerkeleyStore, "flush", flushing)
    monkeypatch.setattr(bsddb.BerkeleyStore, "remove", removing)
    assert result_of(move(supervisor))["records"] == 20
    target_home, source_home = links["s3"].hosted.home, links["s1"].hosted.home
    removed = events.index(("remove", source_home, MOVED))
    assert ("flush", target_home) in events[:removed], events


@pytest.mark.parametrize("deployment", ["python-dict", "domus-rbt", "domus-bsddb-btree"],
                         indirect=True)
def test_writes_made_while_a_bucket_is_copied_reach_its_new_owner(deployment, monkeypatch):
    """A live move: the bucket is served while it is copied; writes made
    meanwhile (new keys, overwrites, deletes; through the C hot path where
    it is built) are caught up, and the final copy is exact."""
    supervisor, links, records = deployment
    monkeypatch.setattr(service_server, "EXPORT_PAGE_BYTES", 100)      # several pages
    source = links["s1"]
    moving = in_bucket(records, MOVED)
    old_keys = sorted(moving)
    fresh = keys_in(MOVED, 30, prefix="new-")
    expected = dict(moving)
    call_through = source.call
    pages = []

    def write(key, value):
        request = keyed(wire.OP_PUT, key, value)
        reply = parse(source.handler.handle_fast(request, wire.MAX_UDP_PAYLOAD), request)
        assert reply[0] == wire.ST_OK, reply       # served, not MOVING, while it copies
        expected[key] = value

    def writing(op, timeout=None, **params):
        if op == "export_bucket":
            pages.append(params["offset"])
            if len(pages) == 2:                    # mid-copy
                for key in fresh[:10]:
                    write(key, b"written during the copy")
                write(old_keys[0], b"overwritten during the copy")
                reply = source.handler.handle_fast(keyed(wire.OP_DELETE, old_keys[1]),
                                                   wire.MAX_UDP_PAYLOAD)
                assert reply[2] == wire.ST_OK
                del expected[old_keys[1]]
        if op == "catch_up_bucket" and len(pages) and "caught" not in pages:
            pages.append("caught")
            for key in fresh[10:20]:               # during the first catch-up
                write(key, b"written during a catch-up")
        return call_through(op, timeout=timeout, **params)

    monkeypatch.setattr(source, "call", writing)
    answer = result_of(move(supervisor))
    assert answer["records"] == len(expected)
    assert served_by(links, expected, "s3") == expected
    assert links["s3"].get(old_keys[1]) == (wire.ST_NOT_FOUND, b"")
    assert source.calls.count("catch_up_bucket") >= 2


class Clock:
    """time.monotonic for a module under test, moved by hand."""

    def __init__(self):
        self.now = time.monotonic()

    def __call__(self):
        return self.now


def test_a_bucket_frozen_for_a_move_that_never_finishes_is_served_again(deployment,
                                                                        monkeypatch):
    # the supervisor froze it and died: the source's lease runs out
    from domus.service import hosted as hosted_module

    supervisor, links, records = deployment
    clock = Clock()
    monkeypatch.setattr(hosted_module.time, "monotonic", clock)
    source = links["s1"]
    source.call("track_bucket", id=DHT_ID, bucket=MOVED)
    source.call("freeze_bucket", id=DHT_ID, bucket=MOVED)
    key = sorted(in_bucket(records, MOVED))[0]
    assert source.get(key)[0] == wire.ST_MOVING
    clock.now += wire.FREEZE_LEASE - 1
    assert source.hosted.thaw_expired() == []
    clock.now += 2
    assert source.hosted.thaw_expired() == [MOVED]
    assert source.get(key) == (wire.ST_OK, records[key])
    assert not source.hosted.snapshots and not isinstance(source.hosted.repos[MOVED],
                                                          TrackedRepository)


def test_a_target_will_not_serve_a_copy_staged_longer_ago_than_half_the_lease(deployment,
                                                                             monkeypatch):
    from domus.service import hosted as hosted_module

    supervisor, links, records = deployment
    clock = Clock()
    monkeypatch.setattr(hosted_module.time, "monotonic", clock)
    target = links["s3"]
    call_through = target.call

    def slow_publication(op, timeout=None, **params):
        if op == "assign" and target.hosted is not None and target.hosted.staged:
            clock.now += wire.FREEZE_LEASE / 2 + 1      # the layout arrives late
        return call_through(op, timeout=timeout, **params)

    monkeypatch.setattr(target, "call", slow_publication)
    with pytest.raises(ControlError, match="staged 16s ago, and its source may serve it"):
        result_of(move(supervisor))
    assert_unchanged(supervisor, links, records, "s3")


def test_the_supervisor_gives_up_a_move_whose_last_catch_up_is_too_slow(deployment,
                                                                        monkeypatch):
    from domus.supervisor import server as supervisor_server

    supervisor, links, records = deployment
    clock = Clock()
    monkeypatch.setattr(supervisor_server.time, "monotonic", clock)
    source = links["s1"]
    call_through = source.call
    calls = []

    def slow_catch_up(op, timeout=None, **params):
        if op == "catch_up_bucket" and "freeze_bucket" in source.calls:
            clock.now += wire.FREEZE_LEASE / 4 + 1
        calls.append(op)
        return call_through(op, timeout=timeout, **params)

    monkeypatch.setattr(source, "call", slow_catch_up)
    with pytest.raises(ControlError, match="too long for the source's 30s freeze"):
        result_of(move(supervisor))
    assert_unchanged(supervisor, links, records, "s3")
