"""domus.service.handler, replication: a replicated DHT's primary writes to
every backup of a bucket before it applies and answers a change; a backup
takes the primary's REPLICATE messages; lost buckets answer DATA_LOST.
Driven with protocol bytes, the backups' links replaced by a replicator
whose Deferreds the tests fire by hand (or deliver to a real backup's
handler)."""

from __future__ import annotations

import pytest
from test_handler import (
    BUCKETS,
    CLIENT_A,
    CLIENT_B,
    DHT_ID,
    FakeClock,
    descriptor,
    keyed,
    keys_in,
    next_id,
    parse,
)

from domus.service.handler import Later, RequestHandler
from domus.wire import protocol as wire
from domus.wire.keys import bucket_of

SERVICES = [{"name": "s1", "address": "127.0.0.1:1", "count": 4},
            {"name": "s2", "address": "127.0.0.1:2", "count": 4},
            {"name": "s3", "address": "127.0.0.1:3", "count": 0}]
# s1 is the primary of buckets 0..3, s2 of 4..7; rank 1: s2 backs 0..3 up,
# s3 backs 4..7 up; rank 2 (replicas=3): s3 backs 0..3 up, s1 4..7.
RANK1 = [[0, 4, "s2"], [4, 8, "s3"]]
RANK2 = [[0, 4, "s3"], [4, 8, "s1"]]


def replicated(copies=2, backups=None, **changes):
    ranks = backups if backups is not None else [RANK1, RANK2][:copies - 1]
    return descriptor(**{"replicas": copies, "storage_services": SERVICES,
                         "storage_backups": ranks, "version": 3, **changes})


class Forward:
    """One change the primary sent a backup, waiting for its answer."""

    def __init__(self, service, address, request, done, args):
        self.service, self.address, self.request = service, address, request
        self._done, self._args = done, args

    def answer(self, reply):
        """The backup's reply to the change."""
        self._done(reply, *self._args)

    def fail(self, error):
        """What kept the backup from answering (a lost link, a timeout)."""
        self._done(error, *self._args)


class Replicator:
    """What the primary sends its backups (domus.service.handler's
    ``replicator(service, address, request, done, *args)``), each to be
    answered by the test."""

    def __init__(self):
        self.sent: list[Forward] = []

    def __call__(self, service, address, request, done, *args):
        self.sent.append(Forward(service, address, request, done, args))

    def to(self, service):
        return [forward for forward in self.sent if forward.service == service]


def primary(descriptor_=None, name="s1", data_dir=None):
    """A handler holding ``descriptor_`` with a fake replicator, and the
    backups it reported as failed."""
    handler = RequestHandler(name, clock=FakeClock(), data_dir=data_dir)
    handler.assign(descriptor_ or replicated())
    handler.replicator = Replicator()
    failed = []
    handler.copy_failed = lambda hosted, holder, why: failed.append((hosted.name, holder, why))
    return handler, failed


def backup(descriptor_=None, name="s2", data_dir=None):
    handler = RequestHandler(name, clock=FakeClock(), data_dir=data_dir)
    handler.assign(descriptor_ or replicated())
    return handler


def replicate(backup_handler, request, request_id=None):
    """What the primary's link sends a backup: the reply (status, inner reply)."""
    outer_id = next_id() if request_id is None else request_id
    answer = backup_handler.handle(wire.encode_replicate(outer_id, 0x5E, request),
                                   wire.MAX_FRAME_BYTES)
    status, echoed = wire.decode_reply_header(answer)
    assert echoed == outer_id
    return status, answer[wire.REPLY_HEADER_SIZE:]


def deliver(forward, backup_handler):
    """Carry a forward to a real backup and answer it with the inner reply,
    as the service's peer links do (domus.service.server.PeerLinks)."""
    status, inner = replicate(backup_handler, forward.request)
    if status != wire.ST_OK:
        forward.fail(ConnectionError(f"the backup refused the change: {inner!r}"))
    else:
        forward.answer(inner)


def fired(later):
    """What a later reply (domus.service.handler.Later) fired with so far."""
    results = []
    later.addCallback(results.append)
    return results


def value_at(handler, key, backups=False):
    hosted = handler.dhts[DHT_ID]
    repo = (hosted.backups if backups else hosted.repos).get(bucket_of(key, "xxh3", BUCKETS))
    return None if repo is None else repo.get(key)


KEY = keys_in(0, 1, prefix="r")[0]          # a bucket s1 is the primary of


# ------------------------------------------------------------ the primary

def test_a_write_is_applied_and_answered_only_once_every_backup_took_it():
    handler, failed = primary(replicated(3))
    s2, s3 = backup(replicated(3), "s2"), backup(replicated(3), "s3")
    request = keyed(wire.OP_PUT, KEY, b"v1")
    answer = handler.handle(request)
    assert isinstance(answer, Later)
    reply = fired(answer)
    # The client's request as it came, to each backup, at its address.
    sent = handler.replicator.sent
    assert [(f.service, f.address, f.request) for f in sent] == [
        ("s2", "127.0.0.1:2", request), ("s3", "127.0.0.1:3", request)]
    deliver(sent[0], s2)
    assert reply == [] and value_at(handler, KEY) is None       # one backup still to answer
    assert value_at(s2, KEY, backups=True) == b"v1"
    deliver(sent[1], s3)
    assert parse(reply[0], request) == (wire.ST_OK, b"\x01")
    assert reply[0][3] == wire.layout_tag(3)
    assert value_at(handler, KEY) == b"v1" and value_at(s3, KEY, backups=True) == b"v1"
    assert handler.counters["replication_failures"] == 0 and failed == []
    # Answered from the reply cache now: not forwarded, not applied again.
    assert handler.handle(request) == reply[0]
    assert len(sent) == 2 and handler.counters["replayed"] == 1


def test_the_backups_answer_of_a_delete_of_an_absent_key_counts_as_taken():
    handler, _failed = primary()
    s2 = backup()
    request = keyed(wire.OP_DELETE, KEY)
    reply = fired(handler.handle(request))
    deliver(handler.replicator.sent[0], s2)
    assert parse(reply[0], request) == (wire.ST_NOT_FOUND, b"")


def test_a_put_many_is_forwarded_to_the_backups_of_every_bucket_it_writes():
    handler, _failed = primary()
    s2 = backup()
    entries = [(bucket, key, b"batch") for bucket in (0, 3) for key in keys_in(bucket, 2, "pm")]
    request = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, entries)
    reply = fired(handler.handle(request))
    assert [f.service for f in handler.replicator.sent] == ["s2"]      # once per backup
    deliver(handler.replicator.sent[0], s2)
    assert parse(reply[0], request) == (wire.ST_OK, wire.U16X2.pack(4, 4))
    for _bucket, key, value in entries:
        assert value_at(handler, key) == value and value_at(s2, key, backups=True) == value


@pytest.mark.parametrize("failure", ["lost link", "storage error", "not a backup",
                                     "short reply"])
def test_a_backup_that_fails_gives_moving_changes_nothing_and_is_reported(failure):
    handler, failed = primary(replicated(3))
    s2 = backup(replicated(3), "s2")
    handler.handle(keyed(wire.OP_PUT, KEY, b"old"))          # (both backups take it)
    for forward in handler.replicator.sent:
        forward.answer(wire.reply(wire.ST_OK, 0, b"\x01"))
    assert value_at(handler, KEY) == b"old"
    handler.replicator.sent.clear()
    request = keyed(wire.OP_PUT, KEY, b"new")
    reply = fired(handler.handle(request))
    to_s2, to_s3 = handler.replicator.sent
    deliver(to_s2, s2)
    if failure == "lost link":
        to_s3.fail(ConnectionError("connection to s3 lost"))
    elif failure == "short reply":
        to_s3.answer(b"\x02")
    else:
        status = wire.ST_STORAGE_ERROR if failure == "storage error" else wire.ST_NOT_OWNER
        to_s3.answer(wire.error_reply(status, 0, "why s3 refused"))
    status, message = parse(reply[0], request)
    assert status == wire.ST_MOVING
    assert b"a backup of DHT 't' on ['s3'] did not take the change" in message
    assert b"it was not acknowledged" in message
    assert reply[0][3] == wire.layout_tag(3)
    assert value_at(handler, KEY) == b"old"                  # the primary is unchanged
    assert [(dht, holder) for dht, holder, _why in failed] == [("t", "s3")]
    why = failed[0][2]
    assert {"lost link": "connection to s3 lost", "storage error": "why s3 refused",
            "not a backup": "why s3 refused", "short reply": "a short reply"}[failure] in why
    assert handler.counters["replication_failures"] == 1
    # MOVING is not cached: the same request again is forwarded again, and
    # applied once every backup takes it.
    again = fired(handler.handle(request))
    assert len(handler.replicator.sent) == 4
    for forward in handler.replicator.sent[2:]:
        forward.answer(wire.reply(wire.ST_OK, 0, b"\x00"))
    assert parse(again[0], request) == (wire.ST_OK, b"\x00")
    assert value_at(handler, KEY) == b"new"


def test_a_retry_while_the_backups_are_asked_waits_for_the_same_reply_forwarded_once():
    handler, _failed = primary()
    handler.handle(keyed(wire.OP_PUT, KEY, b"v"))
    handler.replicator.sent[0].answer(wire.reply(wire.ST_OK, 0, b"\x01"))
    request = keyed(wire.OP_DELETE, KEY)
    first, retry = fired(handler.handle(request)), fired(handler.handle(request))
    assert first == retry == [] and len(handler.replicator.sent) == 2
    handler.replicator.sent[1].answer(wire.reply(wire.ST_OK, 0))
    assert first == retry
    assert parse(first[0], request) == (wire.ST_OK, b"")       # deleted once, not NOT_FOUND
    assert value_at(handler, KEY) is None
    late = handler.handle(request)
    assert late == first[0] and len(handler.replicator.sent) == 2


def test_a_retry_while_a_failing_write_is_in_flight_gets_moving_too_and_may_try_again():
    handler, failed = primary()
    request = keyed(wire.OP_PUT, KEY, b"v")
    first, retry = fired(handler.handle(request)), fired(handler.handle(request))
    handler.replicator.sent[0].fail(TimeoutError("no reply from s2 in time"))
    assert first == retry and first[0][2] == wire.ST_MOVING
    assert len(failed) == 1
    third = fired(handler.handle(request))
    assert third == [] and len(handler.replicator.sent) == 2      # a new try, not stuck


def test_a_replicator_that_fails_at_once_is_a_failed_backup_not_a_crash():
    handler, failed = primary()

    def unreachable(service, address, request, done, *args):
        raise ValueError(f"no address for service {service}")

    handler.replicator = unreachable
    request = keyed(wire.OP_PUT, KEY, b"v")
    reply = fired(handler.handle(request))
    assert parse(reply[0], request)[0] == wire.ST_MOVING
    assert failed == [("t", "s2", "no address for service s2")]
    assert value_at(handler, KEY) is None
    # Not stuck as in flight: tried again (and applied) once the link works.
    handler.replicator = Replicator()
    again = fired(handler.handle(request))
    handler.replicator.sent[0].answer(wire.reply(wire.ST_OK, 0, b"\x01"))
    assert parse(again[0], request) == (wire.ST_OK, b"\x01")


def test_the_services_link_to_a_backup_it_cannot_reach_fails_each_forward_at_once():
    # (a backup known by no usable address: each change fails, and is not
    # left waiting for a connection that was never begun)
    from domus.service.server import PeerLinks

    links = PeerLinks("s1")
    answers = []
    for number in range(2):
        links.forward("s2", "", keyed(wire.OP_PUT, KEY, b"v"),
                      lambda result, *args: answers.append((result, args)), number)
    assert [args for _result, args in answers] == [(0,), (1,)]
    for error, _args in answers:
        assert isinstance(error, ConnectionError)
        assert "cannot reach service s2: address '' needs a port" in str(error)


def test_a_write_to_a_bucket_with_no_backup_left_is_applied_at_once():
    # (degraded: its backup was lost and is not repaired yet)
    handler, _failed = primary(replicated(backups=[[[1, 4, "s2"], [4, 8, "s3"]]]))
    request = keyed(wire.OP_PUT, KEY, b"alone")
    assert parse(handler.handle(request), request) == (wire.ST_OK, b"\x01")
    assert handler.replicator.sent == [] and value_at(handler, KEY) == b"alone"


def test_a_dht_with_one_copy_is_never_forwarded():
    handler, _failed = primary(descriptor())
    request = keyed(wire.OP_PUT, KEY, b"v")
    assert parse(handler.handle_fast(request), request) == (wire.ST_OK, b"\x01")
    assert handler.replicator.sent == []


def test_refused_changes_are_answered_at_once_and_not_forwarded():
    # (forwarded, every backup would refuse them too, and be reported as
    # failed and taken off the bucket for a client's bad request)
    handler, failed = primary()
    not_mine = keys_in(5, 1, prefix="n")[0]
    for request, status in [
            (keyed(wire.OP_PUT, not_mine, b"v"), wire.ST_NOT_OWNER),
            (keyed(wire.OP_PUT, KEY, b"v" * (wire.MAX_VALUE_BYTES + 1)), wire.ST_TOO_LARGE),
            (keyed(wire.OP_PUT, KEY, b"v")[:-3], wire.ST_MALFORMED),
            (keyed(wire.OP_DELETE, KEY) + b"xx", wire.ST_MALFORMED),
            (keyed(wire.OP_PUT, b"k" * (wire.MAX_KEY_BYTES + 1), b"v", bucket=0),
             wire.ST_TOO_LARGE),
            (wire.encode_put_many(next_id(), CLIENT_A, DHT_ID,
                                  [(0, KEY, b"v"), (0, KEY, b"v" * (wire.MAX_VALUE_BYTES + 1))]),
             wire.ST_TOO_LARGE),
            (wire.encode_put_many(next_id(), CLIENT_A, DHT_ID,
                                  [(0, KEY, b"v"), (5, not_mine, b"v")]), wire.ST_NOT_OWNER)]:
        answer = handler.handle(request, wire.MAX_FRAME_BYTES)
        assert isinstance(answer, bytes) and answer[2] == status
    assert handler.replicator.sent == [] and failed == []
    assert all(len(repo) == 0 for repo in handler.dhts[DHT_ID].repos.values())


def test_the_c_path_leaves_a_replicated_dhts_changes_to_python_and_serves_its_reads():
    handler, _failed = primary()
    if handler.fast is None:
        pytest.skip("the C hot path is not built (DOMUS_PURE_PYTHON=1)")
    request = keyed(wire.OP_PUT, KEY, b"v")
    reply = fired(handler.handle_fast(request))
    assert reply == [] and value_at(handler, KEY) is None
    handler.replicator.sent[0].answer(wire.reply(wire.ST_OK, 0, b"\x01"))
    assert parse(reply[0], request) == (wire.ST_OK, b"\x01")
    served = handler.fast.requests
    get = keyed(wire.OP_GET, KEY)
    assert parse(handler.handle_fast(get), get) == (wire.ST_OK, b"v")
    assert handler.fast.requests == served + 1 and handler.fast.fallbacks == 1


# ------------------------------------------------------------ the backup

@pytest.fixture(params=["c", "python"])
def s2(request):
    """The backup of buckets 0..3, its REPLICATE applied in C where built,
    or in Python."""
    handler = backup()
    if request.param == "python":
        handler.backup_fast = None
    elif handler.backup_fast is None:
        pytest.skip("the C hot path is not built (DOMUS_PURE_PYTHON=1)")
    return handler


def test_replicate_applies_to_the_backup_copy_only_and_answers_with_the_changes_reply(s2):
    request = keyed(wire.OP_PUT, KEY, b"v1", request_id=77)
    status, inner = replicate(s2, request, request_id=9)
    assert status == wire.ST_OK
    assert parse(inner, request) == (wire.ST_OK, b"\x01")
    assert wire.decode_reply_header(inner)[1] == 77
    hosted = s2.dhts[DHT_ID]
    assert value_at(s2, KEY, backups=True) == b"v1" and 0 not in hosted.repos
    assert s2.counters["replicated"] == 1
    assert hosted.records() == 0           # a backup is no part of len()
    delete = keyed(wire.OP_DELETE, KEY)
    assert parse(replicate(s2, delete)[1], delete) == (wire.ST_OK, b"")
    assert value_at(s2, KEY, backups=True) is None
    if s2.backup_fast is not None:                  # (applied in C, as it was meant)
        assert (s2.backup_fast.requests, s2.backup_fast.fallbacks) == (2, 0)


@pytest.mark.parametrize("op", [wire.OP_GET, wire.OP_PUT, wire.OP_DELETE, wire.OP_CONTAINS])
def test_clients_asking_a_backup_are_sent_to_the_primary(s2, op):
    replicate(s2, keyed(wire.OP_PUT, KEY, b"kept"))
    request = keyed(op, KEY, b"x" if op == wire.OP_PUT else b"")
    for handle in (s2.handle, s2.handle_fast):
        answer = handle(request, wire.MAX_UDP_PAYLOAD)
        assert isinstance(answer, bytes) and answer[2] == wire.ST_NOT_OWNER
        name, address, message = wire.decode_redirect(answer)
        assert (name, address) == ("s1", "127.0.0.1:1")
        assert "service s1 does" in message
    assert value_at(s2, KEY, backups=True) == b"kept"
    for batch in (wire.encode_get_many(next_id(), CLIENT_A, DHT_ID, [(0, KEY)]),
                  wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, [(0, KEY, b"x")])):
        assert wire.decode_redirect(s2.handle(batch))[:2] == ("s1", "127.0.0.1:1")
    assert value_at(s2, KEY, backups=True) == b"kept"


def test_a_put_many_on_a_backup_leaves_out_the_buckets_not_backed_up_here(s2):
    # s2 backs up bucket 0 only; bucket 1's backup is on s3
    split = replicated(backups=[[[0, 1, "s2"], [1, 4, "s3"], [4, 8, "s3"]]])
    s2.assign(split)
    entries = [(0, key, b"zero") for key in keys_in(0, 3, "b0")] + \
              [(1, key, b"one") for key in keys_in(1, 2, "b1")]
    request = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, entries)
    status, inner = replicate(s2, request)
    assert status == wire.ST_OK
    assert parse(inner, request) == (wire.ST_OK, wire.U16X2.pack(3, 3))
    hosted = s2.dhts[DHT_ID]
    assert sorted(hosted.backups) == [0]
    assert {key: value for key, value in hosted.backups[0].records()} == {
        key: b"zero" for _bucket, key, _value in entries[:3]}
    assert not any(len(repo) for repo in hosted.repos.values())


def test_a_change_for_a_bucket_not_backed_up_here_is_refused_and_stores_nothing(s2):
    not_here = keys_in(5, 1, prefix="x")[0]          # s3 backs bucket 5 up; s2 is its primary
    request = keyed(wire.OP_PUT, not_here, b"v")
    status, inner = replicate(s2, request)
    assert status == wire.ST_OK and inner[2] == wire.ST_NOT_OWNER
    assert b"has no backup of that bucket" in inner
    assert all(len(repo) == 0 for repo in s2.dhts[DHT_ID].repos.values())


@pytest.mark.parametrize("inner", [keyed(wire.OP_GET, KEY), b"", b"\x00" * 30,
                                   wire.encode_length(5, CLIENT_A, DHT_ID)])
def test_replicate_carries_changes_only(s2, inner):
    status, message = replicate(s2, inner)
    assert status == wire.ST_MALFORMED
    assert b"replicate must carry a change" in message
    assert s2.counters["replicated"] == 0


def test_a_backup_promoted_answers_a_clients_retry_from_the_cache_and_applies_it_once(s2):
    # The primary forwarded the client's put, the backup applied it, the
    # primary died before answering; a later write to the key came before
    # the failover too.  The client's retry (the same bytes) reaches the
    # backup once promoted: the put's own reply, the later write kept.
    first = keyed(wire.OP_PUT, KEY, b"first", client=CLIENT_A)
    later = keyed(wire.OP_PUT, KEY, b"later", client=CLIENT_B)
    _status, first_reply = replicate(s2, first)
    replicate(s2, later)
    promoted = replicated(storage_moves={str(bucket): "s2" for bucket in range(4)},
                          backups=[[[0, 8, "s3"]]], version=4)
    s2.assign(promoted)
    assert value_at(s2, KEY) == b"later" and s2.dhts[DHT_ID].backups == {}
    retry = s2.handle_fast(first, wire.MAX_UDP_PAYLOAD)
    assert retry == first_reply and parse(retry, first) == (wire.ST_OK, b"\x01")
    assert value_at(s2, KEY) == b"later"
    assert s2.stats()["replayed"] == 1


def test_a_backup_keeps_its_copies_through_deactivation(tmp_path):
    # A RAM DHT deactivated (or a deployment shut down) saves its records
    # and loads them back: its backups' too, or a failover after it would
    # promote an empty copy.
    s2 = backup(data_dir=str(tmp_path / "s2"))
    records = {key: b"saved %d" % index for index, key in enumerate(keys_in(0, 5, "d"))}
    for key, value in records.items():
        replicate(s2, keyed(wire.OP_PUT, key, value))
    saved = s2.assign(replicated(state="inactive"))["records"]
    assert saved == len(records)
    assert s2.assign(replicated(saved={"s2": saved}))["records"] == len(records)
    for key, value in records.items():
        assert value_at(s2, key, backups=True) == value
    s2.assign(replicated(storage_moves={str(bucket): "s2" for bucket in range(4)},
                         backups=[[[0, 8, "s3"]]], version=4))
    for key, value in records.items():
        get = keyed(wire.OP_GET, key)
        assert parse(s2.handle(get), get) == (wire.ST_OK, value)


# ------------------------------------------------------------ lost buckets

LOST = 2


def lost_requests(key):
    return {
        "put": keyed(wire.OP_PUT, key, b"v"),
        "get": keyed(wire.OP_GET, key),
        "delete": keyed(wire.OP_DELETE, key),
        "contains": keyed(wire.OP_CONTAINS, key),
        "put_many": wire.encode_put_many(next_id(), CLIENT_A, DHT_ID,
                                         [(0, KEY, b"v"), (LOST, key, b"v")]),
        "get_many": wire.encode_get_many(next_id(), CLIENT_A, DHT_ID, [(0, KEY), (LOST, key)]),
        "length": wire.encode_length(next_id(), CLIENT_A, DHT_ID),
        "scan": wire.encode_scan(next_id(), CLIENT_A, DHT_ID, LOST, 0, 0),
        "range": wire.encode_range(next_id(), CLIENT_A, wire.RangeQuery(DHT_ID, None, None)),
    }


@pytest.mark.parametrize("op", list(lost_requests(b"k")))
@pytest.mark.parametrize("copies", [1, 2])
def test_every_request_on_a_lost_bucket_is_data_lost_naming_dht_bucket_and_service(op, copies):
    changes = {"storage_lost": {str(LOST): "s1"}, "platform": "domus-rbt"}
    dht = replicated(**changes) if copies > 1 else descriptor(**changes)
    handler, _failed = primary(dht)
    other = keys_in(1, 1, prefix="fine")[0]
    assert handler.dhts[DHT_ID].repos.keys() == {0, 1, 3}        # stored nowhere
    for handle in (handler.handle, handler.handle_fast):
        request = lost_requests(keys_in(LOST, 1, prefix="lost")[0])[op]
        answer = handle(request, wire.MAX_UDP_PAYLOAD)
        assert isinstance(answer, bytes)
        status, message = parse(answer, request)
        assert status == wire.ST_DATA_LOST, (op, status, message)
        assert (b"bucket 2 of DHT 't' lost its records with service s1" in message
                and b"domus dht accept-loss t" in message), message
    assert handler.replicator.sent == []
    assert all(len(repo) == 0 for repo in handler.dhts[DHT_ID].repos.values())
    # The other buckets serve on.
    get = keyed(wire.OP_GET, other)
    assert parse(handler.handle_fast(get, wire.MAX_UDP_PAYLOAD), get)[0] == wire.ST_NOT_FOUND


def test_an_accepted_loss_serves_the_bucket_again_empty():
    handler, _failed = primary(descriptor(storage_lost={str(LOST): "s1"}))
    key = keys_in(LOST, 1, prefix="lost")[0]
    assert handler.handle(keyed(wire.OP_GET, key))[2] == wire.ST_DATA_LOST
    handler.assign(descriptor(version=9))
    assert handler.handle(keyed(wire.OP_GET, key))[2] == wire.ST_NOT_FOUND
    put = keyed(wire.OP_PUT, key, b"again")
    assert parse(handler.handle_fast(put, wire.MAX_UDP_PAYLOAD), put) == (wire.ST_OK, b"\x01")
    length = wire.encode_length(next_id(), CLIENT_A, DHT_ID)
    assert parse(handler.handle(length), length) == (wire.ST_OK, wire.U64.pack(1))


# ------------------------------------------------------------ put_many on a storage fault

def full_at(repo, puts):
    """Let ``puts`` more Berkeley DB puts through to a bucket, then fail
    the next one as a disk full at that moment does (what the batch wrote
    before it is then undone: deletes and smaller values find room)."""
    from domus.storage import bsddb

    database = repo._db
    count = [0]

    class FullOnce:
        def __getattr__(self, name):
            return getattr(database, name)

        def put(self, *args, **kwargs):
            count[0] += 1
            if count[0] == puts + 1:
                raise bsddb.db.DBNoSpaceError(28, "No space left on device")
            return database.put(*args, **kwargs)

    repo._db = FullOnce()


@pytest.mark.parametrize("storage, durability", [("disk", "async"), ("disk", "sync"),
                                                 ("ram", "none")])
@pytest.mark.parametrize("puts", [0, 2, 3])     # (an existing key takes two puts)
def test_a_put_many_that_meets_a_storage_fault_changes_nothing(tmp_path, storage, durability,
                                                                puts):
    pytest.importorskip("berkeleydb")
    handler = RequestHandler("s1", clock=FakeClock(), data_dir=str(tmp_path))
    handler.assign(descriptor(platform="domus-bsddb-btree", storage=storage,
                              durability=durability))
    old = {bucket: keys_in(bucket, 1, prefix="old")[0] for bucket in range(3)}
    for key in old.values():
        assert handler.handle(keyed(wire.OP_PUT, key, b"before"))[2] == wire.ST_OK
    hosted = handler.dhts[DHT_ID]
    fresh = {bucket: keys_in(bucket, 2, prefix="new") for bucket in range(3)}
    entries = [(bucket, key, b"later") for bucket in range(3)
               for key in [old[bucket], *fresh[bucket]]]
    full_at(hosted.repos[2], puts)                 # (bucket 2 is written last)
    request = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, entries)
    status, message = parse(handler.handle(request), request)
    # (No space: StorageFull for the client, nothing stored.)
    assert status == wire.ST_STORAGE_FULL
    assert b"DHT 't' bucket 2: Berkeley DB failed: no space left on the device of " in message
    assert b"No space left on device" in message
    for bucket in range(3):
        repo = hosted.repos[bucket]
        assert repo.get(old[bucket]) == b"before", bucket
        assert [repo.get(key) for key in fresh[bucket]] == [None, None], bucket
        assert len(repo) == 1, bucket
    assert handler.stats()["dhts"]["t"]["records"] == 3
    retry = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, entries)
    assert parse(handler.handle(retry), retry) == (wire.ST_OK, wire.U16X2.pack(9, 6))
    assert handler.stats()["dhts"]["t"]["records"] == 9
