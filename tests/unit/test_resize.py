"""Resizing a DHT on the service side (domus.service.hosted, "Resizing";
domus.service.handler): a DHT doubled, then regrouped (its parts split),
then merged and halved, on every storage technology, while clients that
number their buckets out of the old count and out of the new one keep
reading and writing, checked against a dict model; a regroup stopped
midway; a disk service restarted in the middle of a split or a merge; and
requests numbered out of another bucket count than the DHT's."""

import itertools
import os
import random
import shutil
import tempfile
from collections.abc import Generator

import pytest
from domus.supervisor import balancer

from domus.service import hosted as hosted_module
from domus.service.handler import RequestHandler
from domus.service.hosted import HostedDht
from domus.storage import StorageFault
from domus.wire import protocol as wire
from domus.wire.control import ControlError
from domus.wire.keys import bucket_of, encode_key

DHT_ID = 7
BUCKETS = 8

# What a test names as its technology: (platform, medium, durability).
TECHNOLOGIES = {
    "python-dict": ("python-dict", "ram", None),
    "domus-rbt": ("domus-rbt", "ram", None),
    "bsddb-btree-ram": ("domus-bsddb-btree", "ram", "none"),
    "bsddb-hash-ram": ("domus-bsddb-hash", "ram", "none"),
    "bsddb-btree-disk-async": ("domus-bsddb-btree", "disk", "async"),
    "bsddb-btree-disk-sync": ("domus-bsddb-btree", "disk", "sync"),
    "bsddb-hash-disk-async": ("domus-bsddb-hash", "disk", "async"),
    "bsddb-hash-disk-sync": ("domus-bsddb-hash", "disk", "sync"),
}
ON_DISK = [name for name, (_p, medium, _d) in TECHNOLOGIES.items() if medium == "disk"]


def descriptor(technology="python-dict", buckets=BUCKETS, version=1):
    """A DHT that service s1 routes and stores whole, as the supervisor
    creates it."""
    platform, medium, durability = TECHNOLOGIES[technology]
    return {
        "id": DHT_ID, "name": "t", "buckets": buckets, "hash": "xxh3", "storage": medium,
        "platform": platform, "routing": "chord", "lookup": "D", "state": "active",
        "durability": durability, "version": version, "initial_buckets": buckets,
        "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": buckets}],
        "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": buckets}],
    }


class Service:
    """A service's request handler for one DHT, on a data dir of its own,
    and the descriptor it holds."""

    def __init__(self, technology, data_dir, dht=None):
        self.technology = technology
        self.data_dir = data_dir
        self.handler = RequestHandler("s1", data_dir=str(data_dir))
        self.dht = dht or descriptor(technology)
        self.handler.assign(self.dht)

    @property
    def hosted(self) -> HostedDht:
        return self.handler.dhts[DHT_ID]

    def resize(self, count):
        """Take the descriptor the supervisor makes when it resizes the DHT."""
        self.dht = balancer.resized(self.dht, count)
        self.handler.assign(self.dht)

    def close(self):
        self.handler.close()


# Sync durability syncs its log at every write: its files go on a RAM
# filesystem where the machine has one, so that the tests wait on no disk
# (on a shared machine, seconds a test).  The files, and what a restart
# finds in them, are the same.
RAM_FILESYSTEM = "/dev/shm"


@pytest.fixture
def data_dir_for(tmp_path):
    """A fresh data dir for a service of ``technology``."""
    made = []
    numbers = itertools.count()

    def place(technology):
        if TECHNOLOGIES[technology][2] == "sync" and os.path.isdir(RAM_FILESYSTEM):
            made.append(tempfile.mkdtemp(prefix="domus-resize-", dir=RAM_FILESYSTEM))
            return made[-1]
        return str(tmp_path / f"service-{next(numbers)}")

    yield place
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_service(data_dir_for):
    made = []

    def make(technology, data_dir=None, dht=None):
        service = Service(technology, data_dir or data_dir_for(technology), dht)
        made.append(service)
        return service

    yield make
    for service in made:
        service.close()


class Turns:
    """The reactor, as much as a service's regroup uses it: what is called
    later runs at the next ``turn``, one step at a time (twisted's Clock
    would run a whole chain of callLater(0) in one advance)."""

    def __init__(self):
        self.calls = []

    def callLater(self, delay, function, *args, **kwargs):
        call = Turns.Call(function, args, kwargs)
        self.calls.append(call)
        return call

    def turn(self):
        """Run what was due; False if nothing was."""
        due, self.calls = self.calls, []
        for call in due:
            if not call.cancelled:
                call.function(*call.args, **call.kwargs)
        return bool(due)

    class Call:
        def __init__(self, function, args, kwargs):
            self.function, self.args, self.kwargs = function, args, kwargs
            self.cancelled = False

        def cancel(self):
            self.cancelled = True

        def active(self):
            return not self.cancelled


def finish(steps: Generator) -> dict:
    """Run a regroup to its end; its result."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


# ------------------------------------------------------------ clients

_ids = itertools.count(1)


class Client:
    """A client that numbers buckets out of ``count`` buckets (its layout),
    sending raw requests to a service and checking each answer against the
    model of what the DHT holds."""

    def __init__(self, service, model, count, client_id):
        self.service = service
        self.model = model
        self.count = count
        self.numbered = wire.numbering(count)
        self.client_id = client_id

    def bucket(self, key):
        return bucket_of(key, "xxh3", self.count)

    def send(self, message):
        answer = self.service.handler.handle_fast(message, wire.MAX_UDP_PAYLOAD)
        assert answer[4:8] == message[4:8]
        assert answer[3] == self.service.hosted.layout_tag     # the service's layout, always
        return answer[2], answer[wire.REPLY_HEADER_SIZE:]

    def keyed(self, op, key, value=b""):
        return self.send(wire.encode_keyed(op, next(_ids), self.client_id, DHT_ID,
                                           self.bucket(key), key, value, self.numbered))

    def put(self, key, value):
        created = key not in self.model
        assert self.keyed(wire.OP_PUT, key, value) == (wire.ST_OK, b"\x01" if created
                                                       else b"\x00")
        self.model[key] = value

    def delete(self, key):
        present = key in self.model
        assert self.keyed(wire.OP_DELETE, key) == (wire.ST_OK if present
                                                   else wire.ST_NOT_FOUND, b"")
        self.model.pop(key, None)

    def check(self, key):
        if key in self.model:
            assert self.keyed(wire.OP_GET, key) == (wire.ST_OK, self.model[key])
            assert self.keyed(wire.OP_CONTAINS, key) == (wire.ST_OK, b"")
        else:
            assert self.keyed(wire.OP_GET, key) == (wire.ST_NOT_FOUND, b"")
            assert self.keyed(wire.OP_CONTAINS, key) == (wire.ST_NOT_FOUND, b"")

    def put_many(self, items):
        created = len({key for key, _value in items} - self.model.keys())
        entries = [(self.bucket(key), key, value) for key, value in items]
        answer = self.send(wire.encode_put_many(next(_ids), self.client_id, DHT_ID, entries,
                                                self.numbered))
        assert answer == (wire.ST_OK, wire.U16X2.pack(len(items), created))
        self.model.update(items)

    def get_many(self, keys):
        entries = [(self.bucket(key), key) for key in keys]
        status, body = self.send(wire.encode_get_many(next(_ids), self.client_id, DHT_ID,
                                                      entries, self.numbered))
        assert status == wire.ST_OK
        assert wire.U16.unpack_from(body)[0] == len(keys)
        position = wire.U16.size
        for key in keys:
            size = wire.U32.unpack_from(body, position)[0]
            position += wire.U32.size
            if size == 0xFFFFFFFF:
                assert key not in self.model
            else:
                assert body[position:position + size] == self.model[key]
                position += size
        assert position == len(body)

    def scan(self, bucket, reply_limit=700):
        """Every record of ``bucket`` (of this client's count), paged."""
        found = []
        scan_id = offset = 0
        while True:
            message = wire.encode_scan(next(_ids), self.client_id, DHT_ID, bucket, scan_id,
                                       offset, self.numbered if scan_id == 0 else 0)
            answer = self.service.handler.handle(message, reply_limit)
            assert answer[2] == wire.ST_OK, answer
            scan_id, offset, entries = wire.decode_scan_reply(answer)
            found += entries
            if offset == wire.SCAN_END:
                return found

    def random_work(self, rng, keys, rounds=6):
        """A few random requests of every kind, each checked."""
        for _ in range(rounds):
            key = rng.choice(keys)
            choice = rng.random()
            if choice < 0.35:
                self.put(key, b"%d:%d" % (self.client_id, rng.randrange(1 << 30)))
            elif choice < 0.5:
                self.delete(key)
            elif choice < 0.75:
                self.check(key)
            elif choice < 0.88:
                batch = {rng.choice(keys): b"batch %d" % rng.randrange(1 << 20)
                         for _ in range(rng.randrange(1, 6))}
                self.put_many(list(batch.items()))
            elif choice < 0.96:
                self.get_many(rng.sample(keys, 5))
            elif choice < 0.98:
                assert self.send(wire.encode_length(next(_ids), self.client_id, DHT_ID)) == \
                    (wire.ST_OK, wire.U64.pack(len(self.model)))
            elif self.count == self.service.hosted.bucket_count:
                bucket = rng.randrange(self.count)
                assert dict(self.scan(bucket)) == {
                    key: value for key, value in self.model.items()
                    if bucket_of(key, "xxh3", self.count) == bucket}


def all_keys(count):
    return [encode_key(f"key-{index}") for index in range(count)]


def check_everything(service, model, clients):
    """The DHT holds exactly the model: every key read back by every
    client; LENGTH; each bucket of the DHT's count holds exactly its keys
    (as its scan, and as a heartbeat counts them), none twice."""
    hosted = service.hosted
    count = hosted.bucket_count
    for client in clients:
        for key in model:
            client.check(key)
    length = clients[0].send(wire.encode_length(next(_ids), 1, DHT_ID))
    assert length == (wire.ST_OK, wire.U64.pack(len(model)))
    assert hosted.records() == len(model)
    assert sum(hosted.bucket_records().values()) == len(model)
    current = next(client for client in clients if client.count == count)
    for bucket in range(count):
        expected = {key: value for key, value in model.items()
                    if bucket_of(key, "xxh3", count) == bucket}
        keys = hosted.bucket_keys(bucket)
        assert len(keys) == len(set(keys)) and set(keys) == expected.keys(), bucket
        scanned = current.scan(bucket)
        assert len(scanned) == len(expected) and dict(scanned) == expected, bucket


def parts_cover_each_bucket_once(service):
    """On disk, the parts of the DHT's files cover each bucket of its count
    exactly once: no record can be found in two of them."""
    store = service.hosted.store
    count = service.hosted.bucket_count
    covered = [0] * count
    for part_count, part in store.parts():
        if part_count <= count:
            factor = count // part_count
            for bucket in range(part * factor, (part + 1) * factor):
                covered[bucket] += 1
        else:
            covered[part // (part_count // count)] += 1
    return covered == [1] * count


# ------------------------------------------------------------ double, split, merge, halve

@pytest.mark.parametrize("technology", TECHNOLOGIES)
def test_double_split_merge_and_halve_while_clients_of_both_numberings_work(
        technology, make_service, monkeypatch):
    monkeypatch.setattr(hosted_module, "REGROUP_PAGE", 16)     # many steps
    monkeypatch.setattr(hosted_module, "REGROUP_SETTLED", 2)   # catch-up rounds that yield
    rng = random.Random(technology)
    service = make_service(technology)
    model = {}
    keys = all_keys(240)
    eight = Client(service, model, 8, 0xA)
    eight.put_many([(key, b"first %d" % index) for index, key in enumerate(keys[:180])])

    # Doubled: each repository stands for the two buckets it is cut into.
    service.resize(16)
    sixteen = Client(service, model, 16, 0xB)
    assert service.hosted.bucket_count == 16 and service.hosted.shared_buckets() == 16
    assert service.handler.stats()["dhts"]["t"]["unregrouped_buckets"] == 16
    check_everything(service, model, [eight, sixteen])

    # Split, live.
    steps = service.hosted.start_regroup(16)
    turns = 0
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            done = stop.value
            break
        turns += 1
        eight.random_work(rng, keys)
        sixteen.random_work(rng, keys)
    service.handler.refresh_fast_table(DHT_ID)
    assert turns > 10 and done["parts"] == 8
    assert service.hosted.shared_buckets() == 0
    assert "unregrouped_buckets" not in service.handler.stats()["dhts"]["t"]
    check_everything(service, model, [eight, sixteen])
    if TECHNOLOGIES[technology][1] == "disk":
        assert service.hosted.store.parts() == {(16, bucket) for bucket in range(16)}

    # Merged into parts of 8 (both halves of each stay served), then halved.
    steps = service.hosted.start_regroup(8)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            done = stop.value
            break
        eight.random_work(rng, keys)
        sixteen.random_work(rng, keys)
    assert done["parts"] == 8
    check_everything(service, model, [eight, sixteen])
    service.resize(8)
    four = Client(service, model, 4, 0xC)
    assert service.hosted.bucket_count == 8 and service.hosted.shared_buckets() == 0
    for _ in range(20):
        for client in (four, eight, sixteen):
            client.random_work(rng, keys)
    check_everything(service, model, [four, eight, sixteen])
    if TECHNOLOGIES[technology][1] == "disk":
        assert service.hosted.store.parts() == {(8, bucket) for bucket in range(8)}
        assert not [name for name in os.listdir(service.hosted.home) if "merging" in name]


def regroup_while_working(service, count, clients, rng, keys, turns=None):
    """Regroup into parts of ``count`` buckets, the clients working between
    its steps; runs ``turns`` steps only (None: to its end, whose result is
    returned)."""
    steps = service.hosted.start_regroup(count)
    taken = 0
    while turns is None or taken < turns:
        try:
            next(steps)
        except StopIteration as stop:
            service.handler.refresh_fast_table(DHT_ID)
            return stop.value
        taken += 1
        for client in clients:
            client.random_work(rng, keys)
    return steps


def filled(make_service, technology, records=160, **options):
    """A service whose DHT holds ``records`` records, the model of them, and
    the keys the tests work with."""
    service = make_service(technology, **options)
    model = {}
    keys = all_keys(records + 100)
    Client(service, model, service.hosted.bucket_count, 0xA).put_many(
        [(key, b"first %d" % index) for index, key in enumerate(keys[:records])])
    return service, model, keys


# ------------------------------------------------------------ a regroup stopped midway

@pytest.mark.parametrize("technology", TECHNOLOGIES)
def test_a_regroup_stopped_midway_leaves_every_record_served_and_can_run_again(
        technology, make_service, monkeypatch):
    """Closing the regroup (a re-registration, a deactivation, a new layout)
    at any point puts back the group under way, with the writes made
    meanwhile; groups regrouped before it stay so; nothing is lost, nothing
    found twice, and the regroup runs to its end later."""
    monkeypatch.setattr(hosted_module, "REGROUP_PAGE", 8)
    monkeypatch.setattr(hosted_module, "REGROUP_SETTLED", 2)  # catch-up rounds that yield
    rng = random.Random(technology)
    disk = TECHNOLOGIES[technology][1] == "disk"
    for count, turns in ((16, 1), (16, 6), (4, 2), (4, 5)):
        service, model, keys = filled(make_service, technology, records=120)
        if count == 16:
            service.resize(16)
        clients = [Client(service, model, n, 0xA + n) for n in (count, 8)]
        regrouping = regroup_while_working(service, count, clients, rng, keys, turns)
        assert isinstance(regrouping, Generator), "the regroup ended before it was stopped"
        stop = rng.choice([regrouping.close, service.hosted.abandon_moves])
        stop()
        assert service.hosted._regrouping is None
        assert not [repo for repo in service.hosted.repos.values()
                    if type(repo).__name__ == "TrackedRepository"]
        assert service.handler.fast_table[DHT_ID][0] is service.hosted.repos
        check_everything(service, model, clients)
        if disk:
            assert parts_cover_each_bucket_once(service), service.hosted.store.parts()
            assert not [name for name in os.listdir(service.hosted.home) if "merging" in name]
        regroup_while_working(service, count, clients, rng, keys)
        if count == 16:
            assert service.hosted.shared_buckets() == 0
        else:
            service.resize(4)
            clients.append(Client(service, model, 4, 0xF))
        check_everything(service, model, clients)
        if disk:
            assert service.hosted.store.parts() == {(count, bucket) for bucket in range(count)}
        service.close()


def test_a_new_layout_stops_a_regroup_under_way(make_service, monkeypatch):
    # the supervisor gave up halving: the merge under way stops, and the
    # service takes the layout it is sent
    monkeypatch.setattr(hosted_module, "REGROUP_PAGE", 16)
    rng = random.Random(5)
    service, model, keys = filled(make_service, "bsddb-btree-disk-async")
    clients = [Client(service, model, 8, 0xA)]
    merging = regroup_while_working(service, 4, clients, rng, keys, turns=3)
    service.resize(16)
    assert merging.gi_frame is None             # closed
    clients.append(Client(service, model, 16, 0xB))
    check_everything(service, model, clients)
    regroup_while_working(service, 16, clients, rng, keys)
    check_everything(service, model, clients)
    assert service.hosted.store.parts() == {(16, bucket) for bucket in range(16)}


def test_a_regroup_that_is_refused_does_not_block_the_next(make_service):
    service, model, keys = filled(make_service, "python-dict", records=50)
    for impossible in (16, 3):
        with pytest.raises(StorageFault, match=f"cannot regroup 8 buckets into parts of "
                                               f"{impossible}"):
            finish(service.hosted.start_regroup(impossible))
    assert finish(service.hosted.start_regroup(4))["parts"] == 4
    service.resize(4)
    check_everything(service, model, [Client(service, model, 4, 0xA)])


def test_one_regroup_at_a_time_and_none_while_inactive(make_service):
    service, model, keys = filled(make_service, "python-dict", records=50)
    service.resize(16)
    steps = service.hosted.start_regroup(16)
    next(steps)
    with pytest.raises(StorageFault, match="is regrouping already"):
        service.hosted.start_regroup(16)
    finish(steps)
    service.handler.assign(dict(service.dht, state="inactive", version=9))
    with pytest.raises(StorageFault, match="inactive on service s1; activate it"):
        service.hosted.start_regroup(16)


def test_a_dht_with_buckets_not_regrouped_is_not_deactivated(make_service):
    """A RAM DHT's snapshot is of whole buckets: deactivating waits for the
    regroup; the DHT stays active and served."""
    service, model, keys = filled(make_service, "python-dict", records=50)
    service.resize(16)
    with pytest.raises(StorageFault, match="is regrouping its buckets after a resize"):
        service.handler.assign(dict(service.dht, state="inactive"))
    assert service.hosted.active
    check_everything(service, model, [Client(service, model, 16, 0xA)])
    finish(service.hosted.start_regroup(16))
    assert service.handler.assign(dict(service.dht, state="inactive"))["records"] == 50
    assert service.handler.assign(service.dht)["records"] == 50
    check_everything(service, model, [Client(service, model, 16, 0xA)])


# ------------------------------------------------------------ a restart midway

class Crash(BaseException):
    """The service process dies here: no cleanup runs."""


def crash(service):
    """The service dies: its files stay as they are (with what was written
    to them: the store's databases are closed, nothing else is done; the
    regroup under way never finishes nor undoes anything)."""
    service.hosted.store.close()


def crash_on_removing_parts_of(service, count):
    """The service dies as it starts deleting the parts of ``count`` buckets
    a regroup replaced (after its switch: the new parts are complete)."""
    store = service.hosted.store
    remove = store.remove

    def removing(bucket, part_count=None, **options):
        if part_count == count:
            raise Crash(f"died before deleting bucket {bucket} of {count}")
        return remove(bucket, part_count, **options)

    store.remove = removing


MOMENTS = {
    # the DHT doubled (8 -> 16, saved) and its parts were being split
    "while splitting": (16, 16, 3),
    "after a split, before the halved parts were deleted": (16, 16, "switch"),
    # merging 8 -> 4 before halving (the DHT has 8 buckets still)
    "while merging, before the commit": (8, 4, 3),
    "after a merge's commit, before its halves were deleted": (8, 4, "switch"),
}


@pytest.mark.parametrize("technology", ON_DISK)
@pytest.mark.parametrize("moment", MOMENTS)
def test_a_disk_service_restarted_midway_comes_back_with_every_record_once(
        technology, moment, make_service, data_dir_for, monkeypatch):
    monkeypatch.setattr(hosted_module, "REGROUP_PAGE", 8)
    rng = random.Random(moment)
    buckets, regroup_count, turns = MOMENTS[moment]
    data_dir = data_dir_for(technology)
    service, model, keys = filled(make_service, technology, data_dir=data_dir)
    if buckets == 16:
        service.resize(16)
    clients = [Client(service, model, 8, 0xA), Client(service, model, 16, 0xB)]
    if turns == "switch":
        crash_on_removing_parts_of(service, 8)
        with pytest.raises(Crash):
            regroup_while_working(service, regroup_count, clients, rng, keys)
        assert any(part[0] == regroup_count for part in service.hosted.store.parts())
    else:
        regroup_while_working(service, regroup_count, clients, rng, keys, turns)
        if regroup_count == 4:
            assert [name for name in os.listdir(service.hosted.home) if "merging" in name]
    crash(service)

    # Started again on the same data dir, with the layout the supervisor has.
    again = make_service(technology, data_dir=data_dir, dht=service.dht)
    assert again.hosted.bucket_count == buckets
    assert parts_cover_each_bucket_once(again), again.hosted.store.parts()
    assert not [name for name in os.listdir(again.hosted.home) if "merging" in name]
    clients = [Client(again, model, 8, 0xA), Client(again, model, 16, 0xB),
               Client(again, model, 4, 0xC)]
    check_everything(again, model, clients)
    # ... and the resize goes on from there.
    regroup_while_working(again, regroup_count, clients, rng, keys)
    if regroup_count == 4:
        again.resize(4)
    assert again.hosted.shared_buckets() == 0
    check_everything(again, model, clients)
    assert again.hosted.store.parts() == {(regroup_count, bucket)
                                          for bucket in range(regroup_count)}


@pytest.mark.parametrize("technology", ["bsddb-btree-disk-async", "bsddb-hash-disk-sync"])
def test_a_service_back_after_a_halving_merges_the_finer_parts_it_finds(
        technology, make_service, data_dir_for):
    """Parts finer than the DHT's count, and no coarser one (the DHT was
    halved while they were all this service had): merged into one part of
    the count, and the finer ones deleted."""
    data_dir = data_dir_for(technology)
    service, model, keys = filled(make_service, technology, data_dir=data_dir)
    service.resize(16)
    finish(service.hosted.start_regroup(16))
    assert service.hosted.store.parts() == {(16, bucket) for bucket in range(16)}
    service.close()
    halved = balancer.resized(service.dht, 8)
    again = make_service(technology, data_dir=data_dir, dht=halved)
    assert again.hosted.store.parts() == {(8, bucket) for bucket in range(8)}
    assert again.hosted.shared_buckets() == 0
    check_everything(again, model, [Client(again, model, 8, 0xA),
                                    Client(again, model, 16, 0xB)])


# ------------------------------------------------------------ requests numbered otherwise

def key_in(bucket, count=BUCKETS, not_in=None):
    """An encoded key in ``bucket`` of ``count`` buckets (and not in bucket
    ``not_in`` of the DHT's 8, if given)."""
    for index in itertools.count():
        key = encode_key(f"in-{index}")
        if bucket_of(key, "xxh3", count) == bucket and (
                not_in is None or bucket_of(key, "xxh3", BUCKETS) != not_in):
            return key


def keyed(op, key, bucket, numbered, value=b""):
    return wire.encode_keyed(op, next(_ids), 0xA, DHT_ID, bucket, key,
                             value if op == wire.OP_PUT else b"", numbered)


def answer(service, message):
    reply = service.handler.handle_fast(message, wire.MAX_UDP_PAYLOAD)
    return reply[2], reply[wire.REPLY_HEADER_SIZE:]


@pytest.mark.parametrize("technology", ["python-dict", "bsddb-hash-disk-async"])
def test_requests_numbered_finer_or_coarser_are_translated(technology, make_service):
    """A client that has not heard of a halving (finer) or of a doubling
    (coarser) is served as if it numbered as the DHT does: every keyed
    request and batch, through the C path's fall-back too."""
    service = make_service(technology)
    model = {}
    keys = all_keys(200)
    for count in (1, 2, 4, 16, 64, 1 << 20):
        client = Client(service, model, count, 0xA)
        client.put_many([(key, b"from %d" % count) for key in keys[:100]])
        for key in keys[100:110]:
            client.put(key, b"%d" % count)
            client.check(key)
        client.delete(keys[105])
        client.get_many(keys[95:115])
    for key in keys[100:110]:
        assert len(service.hosted.bucket_keys(bucket_of(key, "xxh3", BUCKETS))) > 0
    check_everything(service, model, [Client(service, model, 8, 0xA)])
    # Not said (0) is the DHT's own numbering.
    key = keys[0]
    assert answer(service, keyed(wire.OP_GET, key, bucket_of(key, "xxh3", 8), 0)) == \
        (wire.ST_OK, model[key])


def test_a_coarser_request_whose_key_is_not_in_its_bucket_is_malformed(make_service):
    service, model, keys = filled(make_service, "python-dict", records=50)
    key = key_in(1, count=4)                      # bucket 1 of 4: bucket 2 or 3 of 8
    for op in (wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS):
        status, message = answer(service, keyed(op, key, 0, wire.numbering(4), b"v"))
        assert status == wire.ST_MALFORMED
        assert b"bucket 0 of 4 is not the bucket of its key" in message
    # A batch with one such entry is refused whole.
    good = key_in(0, count=4)
    entries = [(0, good, b"fine"), (0, key, b"misnumbered")]
    status, message = answer(service, wire.encode_put_many(next(_ids), 0xA, DHT_ID, entries,
                                                           wire.numbering(4)))
    assert status == wire.ST_MALFORMED
    assert not service.hosted.repos[bucket_of(good, "xxh3", 8)].contains(good)
    check_everything(service, model, [Client(service, model, 8, 0xA)])


def test_a_finer_request_whose_key_is_not_in_its_bucket_is_malformed(make_service):
    """As a coarser one: the record would be filed under another bucket than
    its hash's, where no lookup finds it and a split would not keep it."""
    service, model, keys = filled(make_service, "python-dict", records=50)
    key = key_in(3, count=8)                      # buckets 6 and 7 of 16
    for op in (wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS):
        status, message = answer(service, keyed(op, key, 4, wire.numbering(16), b"v"))
        assert status == wire.ST_MALFORMED, (op, status, message)
        assert b"bucket 4 of 16 is not the bucket of its key" in message
    assert not any(repo.contains(key) for repo in service.hosted.repos.values())
    check_everything(service, model, [Client(service, model, 8, 0xA)])


@pytest.mark.parametrize("numbered", [34, 40, 64, 200, 255])
def test_a_numbering_no_bucket_count_has_is_malformed(numbered, make_service):
    service, model, keys = filled(make_service, "python-dict", records=50)
    key = keys[0]
    requests = [keyed(op, key, 0, numbered, b"v") for op in
                (wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS)]
    requests += [wire.encode_put_many(next(_ids), 0xA, DHT_ID, [(0, key, b"v")], numbered),
                 wire.encode_get_many(next(_ids), 0xA, DHT_ID, [(0, key)], numbered),
                 wire.encode_scan(next(_ids), 0xA, DHT_ID, 0, 0, 0, numbered),
                 wire.encode_lookup(next(_ids), 0xA, DHT_ID, 0, 0xFFFFFFFF, numbered)]
    for request in requests:
        status, message = answer(service, request)
        assert status == wire.ST_MALFORMED, (request[2], status, message)
        assert f"bucket numbering {numbered} is not 1 + log2 of a bucket count".encode() \
            in message
    check_everything(service, model, [Client(service, model, 8, 0xA)])


@pytest.mark.parametrize("count", [4, 16])
def test_scans_and_lookups_numbered_otherwise_are_told_the_layout_is_stale(count,
                                                                         make_service):
    """Whole buckets cannot be translated: STALE_LAYOUT says to fetch the
    layout (whose count the message gives), and nothing is started."""
    service, model, keys = filled(make_service, "python-dict", records=50)
    numbered = wire.numbering(count)
    for request in (wire.encode_scan(next(_ids), 0xA, DHT_ID, 1, 0, 0, numbered),
                    wire.encode_lookup(next(_ids), 0xA, DHT_ID, 1, 0xFFFFFFFF, numbered)):
        reply = service.handler.handle_fast(request, wire.MAX_UDP_PAYLOAD)
        assert reply[2] == wire.ST_STALE_LAYOUT and reply[3] == service.hosted.layout_tag
        assert f"DHT 't' has 8 buckets now, not {count}: fetch its layout again".encode() \
            in reply[wire.REPLY_HEADER_SIZE:]
    assert not service.handler._scans
    # Numbered as the DHT is, or not said: served.
    for said in (wire.numbering(8), 0):
        status, _body = answer(service, wire.encode_scan(next(_ids), 0xA, DHT_ID, 1, 0, 0, said))
        assert status == wire.ST_OK
        status, _body = answer(service, wire.encode_lookup(next(_ids), 0xA, DHT_ID, 1,
                                                           0xFFFFFFFF, said))
        assert status == wire.ST_OK


def test_a_translated_request_for_a_bucket_stored_elsewhere_is_redirected(make_service):
    dht = descriptor()
    dht["storage_services"] = [{"name": "s1", "address": "127.0.0.1:1", "count": 4},
                               {"name": "s2", "address": "127.0.0.1:2", "count": 4}]
    service = make_service("python-dict", dht=dht)
    key = key_in(6)                               # s2's
    for bucket, count in ((bucket_of(key, "xxh3", 16), 16), (3, 4)):
        reply = service.handler.handle_fast(keyed(wire.OP_PUT, key, bucket,
                                                  wire.numbering(count), b"v"))
        assert reply[2] == wire.ST_NOT_OWNER
        name, address, message = wire.decode_redirect(reply)
        assert (name, address) == ("s2", "127.0.0.1:2")
        assert "does not store bucket 6 of DHT 't'; service s2 does" in message
    assert service.hosted.records() == 0


@pytest.mark.parametrize("technology", ["python-dict", "bsddb-btree-disk-async"])
def test_replies_carry_the_layout_tag_of_the_layout_the_service_holds(technology,
                                                                      make_service):
    service, model, keys = filled(make_service, technology, records=20)
    key = keys[0]
    for version, tag in ((1, 1), (255, 255), (256, 1), (300, 45)):
        service.dht = dict(service.dht, version=version)
        service.handler.assign(service.dht)
        assert service.handler.stats()["dhts"]["t"]["layout_version"] == version
        for request in (keyed(wire.OP_GET, key, bucket_of(key, "xxh3", 8), 4),   # C's
                        keyed(wire.OP_GET, key, bucket_of(key, "xxh3", 4), 3),   # Python's
                        keyed(wire.OP_GET, encode_key("absent"), 0, 4),
                        keyed(wire.OP_GET, key, 0, 200),                         # an error
                        wire.encode_length(next(_ids), 0xA, DHT_ID)):
            assert service.handler.handle_fast(request)[3] == tag
    # Replies that are not about a DHT carry none.
    assert service.handler.handle_fast(wire.request_header(wire.OP_PING, next(_ids), 0xA))[3] == 0


# ------------------------------------------------------------ a scan across a resize

class ScanRefused(Exception):
    """A page of a scan was not served: ``args[0]`` is the reply."""


def scan_pages(service, bucket, numbered, reply_limit=300):
    """A scan of ``bucket`` as a generator of pages, so that the DHT can
    change between them."""
    scan_id = offset = 0
    while True:
        message = wire.encode_scan(next(_ids), 0xA, DHT_ID, bucket, scan_id, offset,
                                   numbered if scan_id == 0 else 0)
        reply = service.handler.handle(message, reply_limit)
        if reply[2] != wire.ST_OK:
            raise ScanRefused(reply)
        scan_id, offset, entries = wire.decode_scan_reply(reply)
        yield entries
        if offset == wire.SCAN_END:
            return


@pytest.mark.parametrize("technology", ["domus-rbt", "bsddb-hash-disk-sync"])
@pytest.mark.parametrize("resize", ["double and split", "merge and halve"])
def test_a_scan_begun_before_a_resize_ends_with_each_record_once(technology, resize,
                                                                  make_service):
    """The service remembers the count a scan began with and finds each of
    its keys where the new count puts it: every key present all along is
    returned once, with its value now; one deleted meanwhile is not."""
    service, model, keys = filled(make_service, technology)
    writer = Client(service, model, 8, 0xA)
    bucket = 5
    mine = sorted(key for key in model if bucket_of(key, "xxh3", 8) == bucket)
    pages = scan_pages(service, bucket, wire.numbering(8))
    found = list(next(pages))
    assert 0 < len(found) < len(mine)
    unseen = [key for key in mine if key not in dict(found)]
    writer.delete(unseen[-1])
    writer.put(unseen[-2], b"changed during the scan")
    if resize == "double and split":
        service.resize(16)
        finish(service.hosted.start_regroup(16))
    else:
        finish(service.hosted.start_regroup(4))
        service.resize(4)
    for page in pages:
        found += page
    assert len(found) == len({key for key, _value in found})
    assert dict(found) == {key: model[key] for key in mine if key in model}


def test_a_scan_whose_keys_moved_away_after_a_resize_fails_rather_than_miss_them(
        make_service):
    """Doubled, split, then one half of the scanned bucket moved to another
    service: the scan cannot see those keys any more, and says so (as a
    scan whose bucket moved does) instead of ending without them."""
    from domus.placement import layout

    service, model, keys = filled(make_service, "python-dict")
    bucket = 5
    pages = scan_pages(service, bucket, wire.numbering(8), reply_limit=120)
    found = list(next(pages))
    service.resize(16)
    finish(service.hosted.start_regroup(16))
    service.dht = layout.move(service.dht, "storage", 2 * bucket + 1, "s2", "127.0.0.1:2")
    service.handler.assign(service.dht)
    with pytest.raises(ScanRefused) as refused:
        for page in pages:
            found += page
    reply = refused.value.args[0]
    assert reply[2] == wire.ST_NOT_OWNER
    name, address, message = wire.decode_redirect(reply)
    assert (name, address) == ("s2", "127.0.0.1:2")
    assert f"does not store bucket {2 * bucket + 1} of DHT 't'; service s2 does" in message


@pytest.mark.parametrize("technology", ["domus-rbt", "bsddb-btree-disk-async"])
def test_doubled_twice_before_splitting_splits_into_the_newest_count(technology,
                                                                     make_service):
    # (a service that missed the split of the first doubling: the
    # supervisor's next round has it regroup into the count it has now)
    service, model, keys = filled(make_service, technology)
    service.resize(16)
    service.resize(32)
    assert service.hosted.shared_buckets() == 32
    clients = [Client(service, model, count, 0xA + count) for count in (8, 16, 32, 64)]
    check_everything(service, model, clients)
    assert finish(service.hosted.start_regroup(32))["parts"] == 8
    service.handler.refresh_fast_table(DHT_ID)
    assert service.hosted.shared_buckets() == 0
    check_everything(service, model, clients)
    if TECHNOLOGIES[technology][1] == "disk":
        assert service.hosted.store.parts() == {(32, bucket) for bucket in range(32)}


# ------------------------------------------------------------ the control op

@pytest.fixture
def logged_errors():
    """Errors and failures the code under test logs (twisted.logger)."""
    from twisted.logger import LogLevel, globalLogPublisher

    errors = []

    def observe(event):
        if event.get("log_failure") is not None or event.get("log_level") in (
                LogLevel.error, LogLevel.critical):
            errors.append(event)

    globalLogPublisher.addObserver(observe)
    yield errors
    globalLogPublisher.removeObserver(observe)


def regrouping_service(technology, data_dir, monkeypatch):
    """A DomusService whose DHT was doubled, told to regroup it (the
    supervisor's control op), a step per turn of a stand-in reactor."""
    import twisted.internet

    from domus.service.server import DomusService

    reactor = Turns()
    monkeypatch.setattr(twisted.internet, "reactor", reactor, raising=False)
    monkeypatch.setattr(hosted_module, "REGROUP_PAGE", 4)
    service = DomusService(supervisor="127.0.0.1:1", listen="127.0.0.1:5",
                           data_dir=str(data_dir), name="s1")
    dht = descriptor(technology)
    service.handler.assign(dht)
    hosted = service.handler.dhts[DHT_ID]
    for key in all_keys(100):
        hosted.repos[hosted.bucket_of(key)].put(key, b"v")
    dht = balancer.resized(dht, 16)
    service.handler.assign(dht)
    answer = []
    service._supervisor_control({"op": "regroup_buckets", "id": DHT_ID, "count": 16},
                                None).addBoth(answer.append)
    reactor.turn()
    reactor.turn()
    assert not answer and service.handler.dhts[DHT_ID]._regrouping is not None
    return service, dht, reactor, answer


@pytest.mark.parametrize("technology", ["python-dict", "bsddb-btree-disk-async"])
@pytest.mark.parametrize("change", ["dropped", "registered again"])
def test_a_regroup_under_way_stops_when_the_dht_is_dropped_or_synced(
        technology, change, data_dir_for, monkeypatch, logged_errors):
    data_dir = data_dir_for(technology)
    service, dht, reactor, answer = regrouping_service(technology, data_dir, monkeypatch)
    try:
        if change == "dropped":
            assert service.handler.drop({"id": DHT_ID})
        else:
            service.handler.sync([dht])
        while reactor.turn():
            pass
        (failure,) = answer
        assert failure.check(ControlError)
        assert failure.value.message == ("service s1: regrouping DHT 't' was stopped (the "
                                         "DHT changed meanwhile)")
        assert logged_errors == []
        if change == "dropped":
            assert not os.path.exists(hosted_module.dht_home(str(data_dir), DHT_ID))
        else:
            hosted = service.handler.dhts[DHT_ID]
            assert hosted.records() == 100 and hosted._regrouping is None
            finish(hosted.start_regroup(16))
            assert hosted.shared_buckets() == 0 and hosted.records() == 100
    finally:
        service.handler.close()
