"""domus._hotpath: the C data path answers exactly as the Python handler does.

Two handlers are set up identically; every request goes to the Python one
(``RequestHandler.handle``, the reference) and to the C ``FastPath`` of the
other (falling back to its Python handler when C declines).  The replies must
be the same bytes, a declined request must have changed nothing, and in the
end both handlers must hold the same records (and record counts), the same
reply cache and the same counters.  This holds on every storage technology C
drives: dicts, RBTrees, and Berkeley DB databases (btree and hash, in RAM and
on disk, with async and sync durability).  The reference handler keeps its
replies in the pure-Python ``ReplyCache``, the accelerated one in the compact
C cache that FastPath fills itself, so the two caches are held to each other
too.
"""

import contextlib
import errno
import gc
import importlib
import os
import random
import shutil
import socket
import sys
import tempfile
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scale import examples

pytest.importorskip("domus._hotpath", reason="domus._hotpath is not built "
                    "(.venv/bin/python setup.py build_ext --inplace)")

from domus import _hotpath  # noqa: E402
from domus.service import hotpath  # noqa: E402

if hotpath.PURE_PYTHON:
    pytest.skip("DOMUS_PURE_PYTHON=1: services answer in Python; the C path is not in use",
                allow_module_level=True)

from domus.service.handler import RequestHandler  # noqa: E402
from domus.service.replycache import (  # noqa: E402
    DEFAULT_MAX_ENTRIES,
    CompactReplyCache,
    ReplyCache,
    cache_key,
)
from domus.storage import DictRepository, Repository, StorageFault  # noqa: E402
from domus.wire import protocol as wire  # noqa: E402

DHT_ID = 1          # active, buckets 0..3 stored here
INACTIVE_ID = 2     # inactive
ODD_ID = 3          # active, with repositories C must not drive
UNKNOWN_ID = 99
BUCKETS = 8
HELD = range(4)
CLIENT_A, CLIENT_B = 0xA, 0xB


class FakeClock:
    def __init__(self):
        self.now = 5000.0

    def __call__(self):
        return self.now


class ListRepository(Repository):
    """A repository that is not a dict: C must leave it to Python."""

    def __init__(self):
        self.items = []

    def put(self, key, value):
        for index, (stored, _value) in enumerate(self.items):
            if stored == key:
                self.items[index] = (key, value)
                return False
        self.items.append((key, value))
        return True

    def get(self, key):
        return next((value for stored, value in self.items if stored == key), None)

    def delete(self, key):
        before = len(self.items)
        self.items = [(k, v) for k, v in self.items if k != key]
        return len(self.items) < before

    def contains(self, key):
        return self.get(key) is not None

    def __len__(self):
        return len(self.items)

    def key_snapshot(self):
        return [key for key, _value in self.items]

    def records(self):
        return iter(self.items)


class CountingRepository(DictRepository):
    """A dict subclass with state beside the dict: C must leave it to Python."""

    def __init__(self):
        super().__init__()
        self.puts = 0

    def put(self, key, value):
        self.puts += 1
        return super().put(key, value)


# What a test names as its `platform`: a storage technology, as
# (platform, medium, durability).
TECHNOLOGIES = {
    "python-dict": ("python-dict", "ram", None),
    "domus-rbt": ("domus-rbt", "ram", None),
    "bsddb-btree-ram": ("domus-bsddb-btree", "ram", "none"),
    "bsddb-btree-disk": ("domus-bsddb-btree", "disk", "async"),
    "bsddb-btree-disk-sync": ("domus-bsddb-btree", "disk", "sync"),
    "bsddb-hash-ram": ("domus-bsddb-hash", "ram", "none"),
    "bsddb-hash-disk": ("domus-bsddb-hash", "disk", "async"),
}
BERKELEY = [name for name in TECHNOLOGIES if name.startswith("bsddb")]


def descriptor(dht_id, platform, state="active", storage="ram", durability=None, version=0):
    return {
        "id": dht_id, "name": f"t{dht_id}", "buckets": BUCKETS, "hash": "xxh3",
        "storage": storage, "platform": platform, "routing": "chord", "lookup": "D",
        "state": state, "durability": durability, "version": version,
        "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 8}],
        "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 4},
                             {"name": "s2", "address": "127.0.0.1:2", "count": 4}],
    }


# Handlers whose stores hold Berkeley DB environments (and data dirs) until
# the test ends; see close_handlers.
OPEN_HANDLERS = []


CACHE_SEED = 0x5EED


def make_handler(platform="python-dict", max_entries=DEFAULT_MAX_ENTRIES, version=0,
                 cache_type=CompactReplyCache):
    """A handler with the C path (its reply cache the C one), or, given
    ``cache_type=ReplyCache``, a reference whose cache is the pure-Python
    twin (its C path is then off: C needs the C cache)."""
    platform_name, medium, durability = TECHNOLOGIES[platform]
    clock = FakeClock()
    data_dir = tempfile.mkdtemp(prefix="domus-hotpath-") if medium == "disk" else None
    # (One seed for every handler: a pair's caches hold the same keys.)
    handler = RequestHandler("s1", reply_cache=cache_type(max_entries=max_entries, clock=clock,
                                                          seed=CACHE_SEED),
                             clock=clock, data_dir=data_dir)
    OPEN_HANDLERS.append((handler, data_dir))
    for dht_id, dht_state in ((DHT_ID, "active"), (INACTIVE_ID, "inactive"), (ODD_ID, "active")):
        handler.assign(descriptor(dht_id, platform_name, dht_state, medium, durability,
                                  version))
    odd = handler.dhts[ODD_ID].repos
    odd[0] = ListRepository()
    odd[1] = CountingRepository()
    return handler


def close_handler(handler):
    """Close the handler's stores and remove its data dir."""
    for index, (opened, data_dir) in enumerate(OPEN_HANDLERS):
        if opened is handler:
            del OPEN_HANDLERS[index]
            handler.close()
            if data_dir is not None:
                shutil.rmtree(data_dir, ignore_errors=True)
            return


@pytest.fixture(autouse=True)
def close_handlers():
    yield
    while OPEN_HANDLERS:
        close_handler(OPEN_HANDLERS[-1][0])


@pytest.fixture(params=list(TECHNOLOGIES))
def platform(request):
    if request.param == "domus-rbt" and hotpath.record_tree_type() is None:
        pytest.skip("domus._recordtree (the C RecordTree) is not built, so record tree "
                    "repositories cannot go through the C path")
    return request.param


def records(handler):
    """{dht id: {bucket: (record count, {key: value})}} for every hosted DHT;
    a bucket whose database fails shows the failure instead."""
    def contents(repo):
        try:
            return len(repo), {key: repo.get(key) for key in repo.key_snapshot()}
        except StorageFault as exc:
            return "failed", str(exc)

    return {dht_id: {bucket: contents(repo) for bucket, repo in hosted.repos.items()}
            for dht_id, hosted in handler.dhts.items()}


def bucket_records(handler, dht_id, bucket):
    """{key: value} of one bucket."""
    return records(handler)[dht_id][bucket][1]


def state(handler):
    cache = handler.reply_cache
    return records(handler), cache.snapshot()


def counters(handler):
    stats = handler.stats()
    return {name: stats[name] for name in (
        "requests", "by_op", "by_status", "malformed", "errors", "replayed", "internal_errors",
        "reply_cache", "busy")}


class Pair:
    """A reference handler and an accelerated one, fed the same requests."""

    def __init__(self, platform="python-dict", max_entries=DEFAULT_MAX_ENTRIES, version=0):
        self.reference = make_handler(platform, max_entries, version, cache_type=ReplyCache)
        self.accelerated = make_handler(platform, max_entries, version)
        assert self.accelerated.fast is not None
        self.handled_in_c = 0

    def send(self, data, limit=wire.MAX_UDP_PAYLOAD):
        expected = self.reference.handle(data, limit)
        before = state(self.accelerated)
        answer = self.accelerated.fast.handle(data, limit)
        if answer is None:
            assert state(self.accelerated) == before, "C declined but changed something"
            answer = self.accelerated.handle(data, limit)
        else:
            self.handled_in_c += 1
        if is_stats(data) and answer is not None and answer[2] == wire.ST_OK:
            # Both handlers answer in Python; only the C path's own
            # counter of declined requests may differ.
            assert without_fallbacks(answer) == without_fallbacks(expected)
        else:
            assert answer == expected, f"request {data!r} (limit {limit})"
        return answer

    def check(self):
        assert state(self.accelerated) == state(self.reference)
        assert counters(self.accelerated) == counters(self.reference)

    def close(self):
        close_handler(self.reference)
        close_handler(self.accelerated)


def is_stats(data):
    return (len(data) >= wire.REQUEST_HEADER_SIZE and data[:3] == bytes(
        (wire.REQUEST_MAGIC, wire.VERSION, wire.OP_STATS)))


def without_fallbacks(reply):
    stats = wire.unpack(reply[wire.REPLY_HEADER_SIZE:])
    del stats["hot_path_fallbacks"]
    del stats["hot_path"]           # (the reference, with the Python cache, says "python")
    return reply[:wire.REPLY_HEADER_SIZE], stats


def keyed(op, key, value=b"", bucket=0, client=CLIENT_A, request_id=1, dht=DHT_ID):
    return wire.encode_keyed(op, request_id, client, dht, bucket, key, value)


# ------------------------------------------------------------ the module

def test_the_limits_are_the_protocol_modules():
    assert _hotpath.MAX_KEY_BYTES == wire.MAX_KEY_BYTES
    assert _hotpath.MAX_VALUE_BYTES == wire.MAX_VALUE_BYTES
    assert _hotpath.MAX_UDP_PAYLOAD == wire.MAX_UDP_PAYLOAD
    assert _hotpath.RECV_BUFFER_SIZE > 65535 - 8        # any UDP payload fits


def test_the_handler_uses_the_c_path_unless_told_not_to(monkeypatch):
    assert hotpath.FastPath is _hotpath.FastPath
    assert make_handler().fast is not None
    monkeypatch.setenv("DOMUS_PURE_PYTHON", "1")
    try:
        importlib.reload(hotpath)
        assert hotpath.FastPath is None
        handler = make_handler()
        assert handler.fast is None
        put = keyed(wire.OP_PUT, b"\x03k", b"v")
        assert handler.handle_fast(put) == wire.reply(wire.ST_OK, 1, b"\x01")
        assert handler.stats()["hot_path"] == "python"
        assert handler.stats()["requests"] == 1
    finally:
        monkeypatch.delenv("DOMUS_PURE_PYTHON")
        importlib.reload(hotpath)
    assert hotpath.FastPath is _hotpath.FastPath


def new_cache(max_entries=DEFAULT_MAX_ENTRIES):
    return CompactReplyCache(max_entries=max_entries, clock=FakeClock(), seed=CACHE_SEED)


def test_bad_constructor_arguments_are_type_errors():
    with pytest.raises(TypeError):
        _hotpath.FastPath([], new_cache())
    with pytest.raises(TypeError):
        _hotpath.FastPath({}, [{}, {}])                 # the old dicts: not a cache
    with pytest.raises(TypeError):
        _hotpath.FastPath({}, ReplyCache())             # the Python twin: C cannot fill it
    with pytest.raises(TypeError):
        _hotpath.FastPath({}, new_cache(), 42)
    with pytest.raises(TypeError):
        _hotpath.FastPath({}, new_cache(), dict_type=list)
    with pytest.raises(ValueError):
        _hotpath.ReplyCache(-1)


def test_a_handler_given_the_python_cache_serves_in_python():
    handler = make_handler(cache_type=ReplyCache)
    assert handler.fast is None and handler.backup_fast is None
    put = keyed(wire.OP_PUT, b"\x03k", b"v")
    assert handler.handle_fast(put) == wire.reply(wire.ST_OK, 1, b"\x01")


def test_the_fast_path_is_seen_by_the_garbage_collector():
    table, cache = {}, new_cache()
    fast = _hotpath.FastPath(table, cache)
    referents = gc.get_referents(fast)
    assert any(r is table for r in referents)
    assert any(r is cache for r in referents)


# ------------------------------------------------------------ what C answers

def test_c_answers_conditional_changes_itself(platform):
    handler = make_handler(platform)
    fast = handler.fast
    key = b"\x03pear"
    assert fast.handle(keyed(wire.OP_PUT_IF_ABSENT, key, b"green", request_id=1)) == \
        wire.reply(wire.ST_OK, 1, b"\x01")
    assert fast.handle(keyed(wire.OP_PUT_IF_ABSENT, key, b"red", request_id=2)) == \
        wire.reply(wire.ST_OK, 2, b"\x00")
    assert fast.handle(keyed(wire.OP_GET, key, request_id=3)) == \
        wire.reply(wire.ST_OK, 3, b"green")
    assert fast.handle(keyed(wire.OP_DELETE_IF, key, wire.value_digest(b"red"),
                             request_id=4)) == wire.reply(wire.ST_OK, 4, b"\x00")
    assert fast.handle(keyed(wire.OP_DELETE_IF, key, wire.value_digest(b"green"),
                             request_id=5)) == wire.reply(wire.ST_OK, 5, b"\x01")
    assert fast.handle(keyed(wire.OP_DELETE_IF, key, wire.value_digest(b"green"),
                             request_id=6)) == wire.reply(wire.ST_NOT_FOUND, 6)
    # (a retry is answered from the reply cache, and changes nothing)
    assert fast.handle(keyed(wire.OP_PUT, key, b"green", request_id=7)) == \
        wire.reply(wire.ST_OK, 7, b"\x01")
    assert fast.handle(keyed(wire.OP_DELETE_IF, key, wire.value_digest(b"green"),
                             request_id=5)) == wire.reply(wire.ST_OK, 5, b"\x01")
    assert fast.handle(keyed(wire.OP_GET, key, request_id=8)) == \
        wire.reply(wire.ST_OK, 8, b"green")
    assert fast.fallbacks == 0 and fast.replayed == 1


def test_c_answers_the_common_requests_itself(platform):
    handler = make_handler(platform)
    fast = handler.fast
    key = b"\x03apple"
    assert fast.handle(keyed(wire.OP_PUT, key, b"red", request_id=1)) == \
        wire.reply(wire.ST_OK, 1, b"\x01")
    assert fast.handle(keyed(wire.OP_GET, key, request_id=2)) == wire.reply(wire.ST_OK, 2, b"red")
    assert fast.handle(keyed(wire.OP_CONTAINS, key, request_id=3)) == wire.reply(wire.ST_OK, 3)
    assert fast.handle(keyed(wire.OP_DELETE, key, request_id=4)) == wire.reply(wire.ST_OK, 4)
    assert fast.handle(keyed(wire.OP_GET, key, request_id=5)) == wire.reply(wire.ST_NOT_FOUND, 5)
    assert fast.handle(keyed(wire.OP_DELETE, key, request_id=6)) == \
        wire.reply(wire.ST_NOT_FOUND, 6)
    batch = wire.encode_put_many(7, CLIENT_A, DHT_ID, [(0, key, b"a"), (3, b"\x03x", b"b")])
    assert fast.handle(batch) == wire.reply(wire.ST_OK, 7, wire.U16X2.pack(2, 2))
    read = wire.encode_get_many(8, CLIENT_A, DHT_ID, [(3, b"\x03x"), (1, b"\x03none")])
    assert wire.decode_get_many_reply(fast.handle(read)) == [b"b", None]
    assert fast.requests == 8
    assert fast.fallbacks == 0
    assert [fast.by_op[op] for op in range(1, 7)] == [1, 2, 2, 1, 1, 1]
    # by reply status: the GET and DELETE of a missing key are NOT_FOUND
    assert fast.by_status[wire.ST_OK] == 6 and fast.by_status[wire.ST_NOT_FOUND] == 2
    assert sum(fast.by_status) == 8
    assert handler.dhts[DHT_ID].repos[0].get(key) == b"a"
    stats = handler.stats()
    assert stats["requests"] == 8
    assert stats["by_op"] == {"put": 1, "get": 2, "delete": 2, "contains": 1,
                              "put_many": 1, "get_many": 1}
    assert stats["by_status"] == {"ok": 6, "not_found": 2}


def test_changes_answered_in_c_are_cached_in_the_current_generation():
    handler = make_handler()
    request = keyed(wire.OP_PUT, b"\x03k", b"v", request_id=9)
    reply = handler.fast.handle(request)
    current, previous = handler.reply_cache.snapshot()
    assert current == {cache_key(request, CACHE_SEED): reply}
    assert previous == {}


@pytest.mark.parametrize("rotations", [0, 1])
def test_a_retry_is_answered_from_the_cache_and_not_applied_again(platform, rotations):
    handler = make_handler(platform)
    fast = handler.fast
    key = b"\x03contested"
    first_try = keyed(wire.OP_PUT, key, b"from-a", client=CLIENT_A, request_id=7)
    first_reply = fast.handle(first_try)                      # the reply is "lost"
    assert first_reply == wire.reply(wire.ST_OK, 7, b"\x01")
    assert fast.handle(keyed(wire.OP_PUT, key, b"from-b", client=CLIENT_B,
                             request_id=8)) == wire.reply(wire.ST_OK, 8, b"\x00")
    for _ in range(rotations):
        handler.reply_cache.rotate()                          # the entry is in `previous`
    assert fast.handle(first_try) == first_reply              # the retry
    assert fast.handle(keyed(wire.OP_GET, key, request_id=9)) == \
        wire.reply(wire.ST_OK, 9, b"from-b")
    assert fast.replayed == 1
    assert handler.stats()["replayed"] == 1
    # the retry's reply (from the cache) is counted by its status, as any reply
    assert handler.stats()["by_status"] == {"ok": 4}


def test_a_retry_of_a_delete_in_c_does_not_delete_a_later_write():
    handler = make_handler()
    fast = handler.fast
    key = b"\x03k"
    fast.handle(keyed(wire.OP_PUT, key, b"v0", client=CLIENT_B, request_id=1))
    delete = keyed(wire.OP_DELETE, key, client=CLIENT_A, request_id=2)
    assert fast.handle(delete) == wire.reply(wire.ST_OK, 2)
    fast.handle(keyed(wire.OP_PUT, key, b"v2", client=CLIENT_B, request_id=3))
    assert fast.handle(delete) == wire.reply(wire.ST_OK, 2)
    assert handler.dhts[DHT_ID].repos[0].get(key) == b"v2"


def test_a_refused_change_is_not_cached_so_its_retry_is_judged_afresh():
    # A refusal changed nothing; the reply cache keeps only what was applied
    # (issue 15: junk must not fill it), so a retry once the DHT is active
    # again is applied, by C.
    handler = make_handler()
    request = keyed(wire.OP_PUT, b"\x03k", b"v", dht=INACTIVE_ID)
    assert handler.fast.handle(request) is None
    assert handler.handle(request)[2] == wire.ST_INACTIVE
    assert len(handler.reply_cache) == 0
    handler.assign(descriptor(INACTIVE_ID, "python-dict"))
    assert handler.fast.handle(request)[2] == wire.ST_OK
    assert bucket_records(handler, INACTIVE_ID, 0) == {b"\x03k": b"v"}


def test_a_put_many_with_one_bad_entry_changes_nothing_and_python_refuses_it(platform):
    pair = Pair(platform)
    pair.send(wire.encode_put_many(1, CLIENT_A, DHT_ID, [(0, b"\x03a", b"old")]))
    request_ids = iter(range(10, 100))
    for bad in [(5, b"\x03elsewhere", b"v"),                    # bucket not held
                (1, b"k" * (wire.MAX_KEY_BYTES + 1), b"v"),     # key over the limit
                (1, b"", b"v")]:                                 # empty key
        for position in (0, 1, 2):
            good = [(0, b"\x03a", b"new"), (2, b"\x03b", b"new")]
            entries = good[:position] + [bad] + good[position:]
            request = wire.encode_put_many(next(request_ids), CLIENT_A, DHT_ID, entries)
            assert pair.send(request)[2] in (wire.ST_NOT_OWNER, wire.ST_TOO_LARGE,
                                             wire.ST_MALFORMED)
    assert pair.handled_in_c == 1               # the first put_many only
    assert bucket_records(pair.accelerated, DHT_ID, 0) == {b"\x03a": b"old"}
    pair.check()


def test_limits_of_keys_and_values_are_the_python_handlers(platform):
    pair = Pair(platform)
    at_limit, over = b"k" * wire.MAX_KEY_BYTES, b"k" * (wire.MAX_KEY_BYTES + 1)
    frame = wire.MAX_FRAME_BYTES
    requests = [
        keyed(wire.OP_PUT, at_limit, b"v", request_id=1),
        keyed(wire.OP_PUT, over, b"v", request_id=2),
        keyed(wire.OP_GET, over, request_id=3),
        keyed(wire.OP_PUT, b"\x03big", b"v" * wire.MAX_VALUE_BYTES, request_id=4),
        keyed(wire.OP_PUT, b"\x03big2", b"v" * (wire.MAX_VALUE_BYTES + 1), request_id=5),
        keyed(wire.OP_GET, b"\x03big", request_id=6),
        # get_many has no key limit of its own: Python answers it, so must C.
        wire.encode_get_many(7, CLIENT_A, DHT_ID, [(0, over), (0, at_limit)]),
        wire.encode_put_many(8, CLIENT_A, DHT_ID,
                             [(0, b"\x03x", b"v" * (wire.MAX_VALUE_BYTES + 1))]),
    ]
    for request in requests:
        pair.send(request, frame)
    pair.send(keyed(wire.OP_GET, b"\x03big", request_id=9))     # too big for UDP
    assert pair.handled_in_c >= 4
    pair.check()


def test_replies_that_do_not_fit_the_limit_are_left_to_python(platform):
    pair = Pair(platform)
    pair.send(keyed(wire.OP_PUT, b"\x03k", b"x" * 100, request_id=1))
    fits = wire.REPLY_HEADER_SIZE + 100
    handled = pair.handled_in_c
    assert pair.send(keyed(wire.OP_GET, b"\x03k", request_id=2), fits)[2] == wire.ST_OK
    assert pair.handled_in_c == handled + 1              # a reply that just fits is C's
    assert pair.send(keyed(wire.OP_GET, b"\x03k", request_id=3), fits - 1)[2] == \
        wire.ST_REPLY_TOO_LARGE
    entries = [(0, b"\x03k")] * 5
    many = wire.encode_get_many(4, CLIENT_A, DHT_ID, entries)
    for limit in (0, 10, 113, 114, 222, 10_000):
        pair.send(many, limit)
    pair.send(wire.encode_get_many(5, CLIENT_A, DHT_ID, []), 0)
    pair.check()


def test_repositories_c_cannot_drive_are_left_to_python():
    pair = Pair()
    request_ids = iter(range(1, 100))
    for bucket in (0, 1):           # a non-dict repository, a dict subclass with state
        for request in [
                keyed(wire.OP_PUT, b"\x03k", b"v", bucket=bucket, dht=ODD_ID,
                      request_id=next(request_ids)),
                keyed(wire.OP_GET, b"\x03k", bucket=bucket, dht=ODD_ID),
                keyed(wire.OP_CONTAINS, b"\x03k", bucket=bucket, dht=ODD_ID),
                wire.encode_get_many(1, CLIENT_A, ODD_ID, [(bucket, b"\x03k")]),
                wire.encode_put_many(next(request_ids), CLIENT_A, ODD_ID, [
                    (2, b"\x03j", b"w"), (bucket, b"\x03k", b"v")]),
                keyed(wire.OP_DELETE, b"\x03k", bucket=bucket, dht=ODD_ID,
                      request_id=next(request_ids))]:
            pair.send(request)
    assert pair.handled_in_c == 0
    assert pair.accelerated.dhts[ODD_ID].repos[1].puts == 2
    pair.check()


def test_values_that_are_not_bytes_are_left_to_python():
    # Only the protocol stores values, so they are bytes; if one is not, C
    # must not guess what Python would answer.
    pair = Pair()
    for handler in (pair.reference, pair.accelerated):
        handler.dhts[DHT_ID].repos[0][b"\x03odd"] = None
    for request in [keyed(wire.OP_GET, b"\x03odd", request_id=1),
                    wire.encode_get_many(2, CLIENT_A, DHT_ID, [(0, b"\x03odd")]),
                    keyed(wire.OP_DELETE, b"\x03odd", request_id=3)]:
        pair.send(request)
    assert pair.handled_in_c == 0
    pair.check()


def test_a_full_current_generation_makes_c_answer_busy_as_python_does():
    pair = Pair(max_entries=4)          # the current generation holds 2
    puts = [keyed(wire.OP_PUT, b"\x03k%d" % request_id, b"v", request_id=request_id)
            for request_id in range(1, 6)]
    replies = [pair.send(request) for request in puts]
    pair.check()
    assert [reply[2] for reply in replies] == [wire.ST_OK] * 2 + [wire.ST_BUSY] * 3
    assert all(len(reply) == wire.REPLY_HEADER_SIZE for reply in replies[2:])
    assert pair.handled_in_c == 5 and pair.accelerated.fast.busy == 3
    # Nothing was dropped to make room: both first puts are still answered
    # from the cache, and the refused ones applied nothing.
    assert pair.send(puts[0]) == replies[0]
    assert b"\x03k3" not in bucket_records(pair.accelerated, DHT_ID, 0)
    # Once the cache rotates (by time), they go through.
    for handler in (pair.reference, pair.accelerated):
        handler.reply_cache.rotate()
    assert pair.send(puts[2])[2] == wire.ST_OK
    pair.check()


def test_declines_of_every_kind_change_nothing(platform):
    pair = Pair(platform)
    pair.send(keyed(wire.OP_PUT, b"\x03k", b"v", request_id=1))
    request_ids = iter(range(100, 200))

    def good_put():     # each with its own token: a repeated one is a retry
        return keyed(wire.OP_PUT, b"\x03k", b"new", request_id=next(request_ids))

    bad_version = bytearray(good_put())
    bad_version[1] = 2
    bad_magic = bytearray(good_put())
    bad_magic[0] = 0xD1
    cases = [
        b"", b"\xd0", bytes(bad_magic), bytes(bad_version), good_put()[:15],
        good_put()[:wire.KEYED_END - 1], good_put()[:-1], good_put() + b"!",
        keyed(wire.OP_GET, b"\x03k", request_id=3) + b"!",
        keyed(wire.OP_DELETE, b"\x03k", request_id=4) + b"!",
        keyed(wire.OP_PUT, b"", b"v", request_id=5),
        keyed(wire.OP_PUT, b"\x03k", b"v", bucket=5, request_id=6),
        keyed(wire.OP_PUT, b"\x03k", b"v", bucket=0xFFFFFFFF, request_id=7),
        keyed(wire.OP_PUT, b"\x03k", b"v", dht=UNKNOWN_ID, request_id=8),
        keyed(wire.OP_DELETE, b"\x03k", dht=INACTIVE_ID, request_id=9),
        wire.encode_length(10, CLIENT_A, DHT_ID),
        wire.encode_scan(11, CLIENT_A, DHT_ID, 0, 0, 0),
        wire.request_header(wire.OP_PING, 12, CLIENT_A),
        wire.request_header(wire.OP_STATS, 13, CLIENT_A),
        wire.request_header(0x0C, 14, CLIENT_A) + b"xx",
        wire.encode_range(21, CLIENT_A, wire.RangeQuery(DHT_ID, None, None)),
        wire.encode_control(15, CLIENT_A, {"op": "stats"}),
        wire.encode_put_many(16, CLIENT_A, DHT_ID, [(0, b"\x03k", b"v")])[:-1],
        wire.encode_put_many(17, CLIENT_A, DHT_ID, [(0, b"\x03k", b"v")]) + b"\x00",
        wire.request_header(wire.OP_PUT_MANY, 18, CLIENT_A) + b"\x00\x00\x00\x01\xff\xff",
        wire.encode_get_many(19, CLIENT_A, UNKNOWN_ID, [(0, b"\x03k")]),
        wire.encode_get_many(20, CLIENT_A, DHT_ID, [(0, b"\x03k"), (6, b"\x03k")]),
    ]
    handled = pair.handled_in_c
    for request in cases:
        pair.send(request)
        assert pair.handled_in_c == handled, f"C answered {request!r}"
    assert pair.accelerated.fast.fallbacks == len(cases)
    pair.check()


def backup_pair():
    """A reference handler (Python only) and an accelerated one, each the
    backup of DHT 5's buckets 4..7 (s2 backs up 0..3)."""
    backed_up = dict(descriptor(5, "python-dict"), replicas=2,
                     storage_backups=[[[0, 4, "s2"], [4, 8, "s1"]]])
    reference, accelerated = make_handler(cache_type=ReplyCache), make_handler()
    for handler in (reference, accelerated):
        handler.assign(backed_up)
    reference.backup_fast = None
    return reference, accelerated


def test_a_replicate_applied_by_c_is_counted_as_the_python_handler_counts_it():
    # A backup counts the REPLICATE, not the change inside it (as handle
    # counts it), whichever path applies the change; a retry is a replay.
    reference, accelerated = backup_pair()
    change = wire.encode_keyed(wire.OP_PUT, 1, CLIENT_A, 5, 4, b"\x03k", b"v")
    for request_id in (2, 3):                   # applied, then a retry from the cache
        request = wire.encode_replicate(request_id, 0x5A, change)
        assert accelerated.handle(request) == reference.handle(request)
    assert accelerated.backup_fast.requests == 2
    assert counters(accelerated) == counters(reference)
    assert accelerated.stats()["by_op"] == {"replicate": 2}
    assert accelerated.stats()["requests"] == 2
    assert accelerated.stats()["replayed"] == 1


def test_a_malformed_dht_table_makes_c_decline():
    repos = {0: {b"k": b"v"}}
    for entry in (["not a dict"], ("not a dict", 0), (repos,), (repos, "0"), (repos, -1),
                  (repos, 1 << 18), [repos, 0], repos):
        table = {DHT_ID: entry}
        assert _hotpath.FastPath(table, new_cache()).handle(keyed(wire.OP_GET, b"k")) is None


# ------------------------------------------------------------ Berkeley DB

@pytest.mark.parametrize("platform", BERKELEY)
def test_berkeley_db_buckets_are_served_in_c_and_keep_their_record_count(platform):
    handler = make_handler(platform)
    fast = handler.fast
    repo = handler.dhts[DHT_ID].repos[0]
    assert isinstance(repo, _hotpath.DatabaseRepository)
    for number in range(20):
        key = b"\x03k%d" % (number % 15)
        assert fast.handle(keyed(wire.OP_PUT, key, b"v%d" % number, request_id=number)) == \
            wire.reply(wire.ST_OK, number, b"\x01" if number < 15 else b"\x00")
    assert len(repo) == 15
    for number in range(10):
        assert fast.handle(keyed(wire.OP_DELETE, b"\x03k%d" % number, request_id=100 + number)) \
            == wire.reply(wire.ST_OK, 100 + number)
    assert fast.handle(keyed(wire.OP_DELETE, b"\x03k0", request_id=200)) == \
        wire.reply(wire.ST_NOT_FOUND, 200)
    batch = wire.encode_put_many(300, CLIENT_A, DHT_ID, [
        (0, b"\x03k0", b"a"), (0, b"\x03k14", b"b"), (0, b"\x03k0", b"c")])
    assert fast.handle(batch) == wire.reply(wire.ST_OK, 300, wire.U16X2.pack(3, 1))
    assert len(repo) == 6
    assert len(repo.key_snapshot()) == 6
    assert repo.get(b"\x03k0") == b"c"
    assert fast.fallbacks == 0
    assert handler.stats()["dhts"]["t1"]["records"] == 6


def close_database(handler, bucket):
    """Make every Berkeley DB call on a bucket fail, as a broken medium
    would: its database handle is closed under the repository."""
    handler.dhts[DHT_ID].repos[bucket]._db.close()


@pytest.mark.parametrize("platform", BERKELEY)
def test_a_failing_database_is_left_to_python_which_reports_a_storage_error(platform):
    pair = Pair(platform)
    pair.send(keyed(wire.OP_PUT, b"\x03k", b"v", bucket=2, request_id=1))
    pair.send(keyed(wire.OP_PUT, b"\x03k", b"v", bucket=0, request_id=2))
    for handler in (pair.reference, pair.accelerated):
        close_database(handler, 2)
    handled = pair.handled_in_c
    request_ids = iter(range(10, 100))
    for request in [
            keyed(wire.OP_PUT, b"\x03k", b"w", bucket=2, request_id=next(request_ids)),
            keyed(wire.OP_PUT, b"\x03new", b"w", bucket=2, request_id=next(request_ids)),
            keyed(wire.OP_GET, b"\x03k", bucket=2),
            keyed(wire.OP_CONTAINS, b"\x03k", bucket=2),
            keyed(wire.OP_DELETE, b"\x03k", bucket=2, request_id=next(request_ids)),
            wire.encode_get_many(3, CLIENT_A, DHT_ID, [(0, b"\x03k"), (2, b"\x03k")]),
            wire.encode_put_many(next(request_ids), CLIENT_A, DHT_ID, [(2, b"\x03k", b"w")])]:
        reply = pair.send(request)
        assert reply[2] == wire.ST_STORAGE_ERROR
        assert b"DHT 't1' bucket 2: Berkeley DB failed" in reply
    assert pair.handled_in_c == handled
    assert pair.send(keyed(wire.OP_GET, b"\x03k", bucket=0, request_id=4)) == \
        wire.reply(wire.ST_OK, 4, b"v")
    assert pair.handled_in_c == handled + 1
    assert pair.accelerated.counters["storage_errors"] == 7
    assert pair.accelerated.counters["internal_errors"] == 0
    pair.check()


@pytest.mark.parametrize("platform", BERKELEY)
def test_a_put_many_whose_database_fails_is_undone_and_left_to_python(platform):
    pair = Pair(platform)
    pair.send(wire.encode_put_many(1, CLIENT_A, DHT_ID, [
        (0, b"\x03old", b"0"), (1, b"\x03old", b"1"), (2, b"\x03old", b"2")]))
    for handler in (pair.reference, pair.accelerated):
        close_database(handler, 2)
    before = records(pair.accelerated)[DHT_ID]
    assert before[0] == (1, {b"\x03old": b"0"})
    # Created, replaced, put twice, and a last entry whose database fails:
    # C undoes the first ones and declines.
    request = wire.encode_put_many(2, CLIENT_A, DHT_ID, [
        (0, b"\x03new", b"a"), (0, b"\x03old", b"b"), (1, b"\x03twice", b"c"),
        (1, b"\x03twice", b"d"), (1, b"\x03old", b"e"), (2, b"\x03x", b"f")])
    assert pair.accelerated.fast.handle(request) is None
    assert records(pair.accelerated)[DHT_ID] == before
    # Python meets the failure too, and undoes what it applied before it:
    # all or nothing, a storage fault included.
    assert pair.send(request)[2] == wire.ST_STORAGE_ERROR
    assert records(pair.accelerated)[DHT_ID] == before
    pair.check()


def test_a_put_many_mixing_databases_with_other_repositories_is_left_to_python():
    pair = Pair("bsddb-btree-ram")
    for handler in (pair.reference, pair.accelerated):
        handler.dhts[DHT_ID].repos[3] = DictRepository()
    request = wire.encode_put_many(1, CLIENT_A, DHT_ID, [(0, b"\x03a", b"x"), (3, b"\x03b", b"y")])
    assert pair.send(request) == wire.reply(wire.ST_OK, 1, wire.U16X2.pack(2, 2))
    assert pair.handled_in_c == 0
    pair.send(wire.encode_get_many(2, CLIENT_A, DHT_ID, [(0, b"\x03a"), (3, b"\x03b")]))
    assert pair.handled_in_c == 1           # reads may mix
    pair.check()


class NotCDatabase:
    """Berkeley DB's method names, written in Python."""

    def get(self, key):
        return None

    put = exists = delete = get


@contextlib.contextmanager
def memory_database():
    """A Berkeley DB btree in memory, in an environment of its own, and the
    conventions a DatabaseRepository of it takes; both closed after."""
    from berkeleydb import db

    environment = db.DBEnv()
    environment.open(None, db.DB_CREATE | db.DB_INIT_MPOOL | db.DB_PRIVATE)
    database = db.DB(environment)
    database.open(None, None, db.DB_BTREE, db.DB_CREATE)
    try:
        yield database, {"no_overwrite": db.DB_NOOVERWRITE, "key_exists": db.DBKeyExistError,
                         "not_found": db.DBNotFoundError}
    finally:
        database.close()
        environment.close()


def test_database_repositories_need_c_methods_and_their_conventions():
    with memory_database() as (database, conventions):
        with pytest.raises(TypeError, match="NotCDatabase.get to be a method written in C"):
            _hotpath.DatabaseRepository(NotCDatabase(), **conventions)
        with pytest.raises(TypeError, match="keyword arguments"):
            _hotpath.DatabaseRepository(database)
        with pytest.raises(TypeError, match="exception classes"):
            _hotpath.DatabaseRepository(database, **dict(conventions, not_found="oops"))
        repo = _hotpath.DatabaseRepository(database, **conventions)
        assert repo.record_count == 0
        # One whose __init__ never ran is declined, not driven.
        table = {DHT_ID: ({0: repo, 1: _hotpath.DatabaseRepository.__new__(
            _hotpath.DatabaseRepository)}, 0)}
        fast = _hotpath.FastPath(table, new_cache())
        assert fast.handle(keyed(wire.OP_PUT, b"k", b"v", bucket=0)) == \
            wire.reply(wire.ST_OK, 1, b"\x01")
        assert repo.record_count == 1
        assert database.get(b"k") == b"v"
        assert fast.handle(keyed(wire.OP_PUT, b"k", b"v", bucket=1, request_id=2)) is None
        referents = gc.get_referents(repo)
        assert any(getattr(r, "__self__", None) is database for r in referents)


def test_a_cache_found_full_makes_c_try_no_put_until_a_delete_gives_room_back():
    """A RAM Berkeley DB cache that a put found full (``room``, shared by
    its store's repositories) is not searched again by every put, four
    seconds each: C declines puts at once (Python refuses them, saying
    why), and a delete clears it."""
    from berkeleydb import db

    with memory_database() as (database, conventions):
        with pytest.raises(TypeError, match="room must be a bytearray"):
            _hotpath.DatabaseRepository(database, **conventions, room=b"\x00")
        with pytest.raises(TypeError, match="room must be a bytearray"):
            _hotpath.DatabaseRepository(database, **conventions, room=bytearray())
        with pytest.raises(TypeError, match="no_memory must be an exception class"):
            _hotpath.DatabaseRepository(database, **conventions, no_memory="oops")
        room = bytearray(1)
        repo = _hotpath.DatabaseRepository(database, **conventions, room=room,
                                           no_memory=db.DBNoMemoryError)
        fast = _hotpath.FastPath({DHT_ID: ({0: repo}, 0)}, new_cache())
        assert fast.handle(keyed(wire.OP_PUT, b"k", b"v", request_id=1)) == \
            wire.reply(wire.ST_OK, 1, b"\x01")
        room[0] = 1
        assert fast.handle(keyed(wire.OP_PUT, b"k2", b"v", request_id=2)) is None
        assert fast.handle(keyed(wire.OP_PUT, b"k", b"w", request_id=3)) is None
        assert database.get(b"k2") is None and database.get(b"k") == b"v"
        assert fast.handle(keyed(wire.OP_GET, b"k")) == wire.reply(wire.ST_OK, 1, b"v")
        assert repo.record_count == 1 and room[0] == 1
        assert fast.handle(keyed(wire.OP_DELETE, b"k", request_id=4)) == \
            wire.reply(wire.ST_OK, 4)
        assert room[0] == 0
        assert fast.handle(keyed(wire.OP_PUT, b"k2", b"v", request_id=5)) == \
            wire.reply(wire.ST_OK, 5, b"\x01")


# ------------------------------------------------------------ random requests

KEYS = [b"\x03a", b"\x03b", b"\x04\x00", b"\x01" + bytes(8), b"k" * 300]
OPS = [wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS, wire.OP_PUT_MANY,
       wire.OP_GET_MANY, wire.OP_LENGTH, wire.OP_SCAN, wire.OP_PING, wire.OP_STATS,
       wire.OP_RANGE, wire.OP_CONTROL, 0x0C]
keys = st.one_of(st.sampled_from(KEYS), st.binary(min_size=1, max_size=12))
buckets = st.sampled_from([0, 1, 2, 3, 4, 7, 1 << 20, 0xFFFFFFFF])
dht_ids = st.sampled_from([DHT_ID, DHT_ID, DHT_ID, DHT_ID, INACTIVE_ID, ODD_ID, UNKNOWN_ID])
values = st.one_of(st.binary(max_size=16), st.binary(min_size=150, max_size=400))
limits = st.sampled_from([0, 8, 9, 30, 200, 1000, wire.MAX_UDP_PAYLOAD, wire.MAX_FRAME_BYTES])


# The bucket numbering a request says: none, the DHT's own (8 buckets), a
# coarser and a finer one (a resize the client or the service has not
# heard of: C leaves both to Python, which translates), and nonsense.
numberings = st.sampled_from([0, 0, wire.numbering(BUCKETS), wire.numbering(BUCKETS),
                              wire.numbering(BUCKETS // 2), wire.numbering(BUCKETS * 4), 200])


@st.composite
def well_formed(draw):
    """A request that follows the protocol; a small request id range and three
    clients make some tokens repeat (retries, and same token other body)."""
    op = draw(st.sampled_from(OPS))
    request_id = draw(st.integers(0, 30))
    client = draw(st.sampled_from([CLIENT_A, CLIENT_B, 0xC]))
    dht = draw(dht_ids)
    numbered = draw(numberings)
    if op in (wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS):
        value = draw(values) if op == wire.OP_PUT else b""
        return wire.encode_keyed(op, request_id, client, dht, draw(buckets), draw(keys), value,
                                 numbered)
    if op == wire.OP_PUT_MANY:
        entries = draw(st.lists(st.tuples(buckets, keys, values), max_size=6))
        return wire.encode_put_many(request_id, client, dht, entries, numbered)
    if op == wire.OP_GET_MANY:
        entries = draw(st.lists(st.tuples(buckets, keys), max_size=6))
        return wire.encode_get_many(request_id, client, dht, entries, numbered)
    if op == wire.OP_LENGTH:
        return wire.encode_length(request_id, client, dht)
    if op == wire.OP_SCAN:
        return wire.encode_scan(request_id, client, dht, draw(buckets), 0, 0, numbered)
    if op == wire.OP_RANGE:
        bound = st.one_of(st.none(), keys)
        return wire.encode_range(request_id, client, wire.RangeQuery(
            dht, draw(bound), draw(bound), draw(st.booleans()), draw(st.booleans()),
            draw(st.booleans()), draw(st.booleans()), draw(st.sampled_from([0, 1, 2, 100]))))
    return wire.request_header(op, request_id, client) + draw(st.binary(max_size=8))


@st.composite
def malformed(draw):
    """A well-formed request, damaged."""
    data = bytearray(draw(well_formed()))
    how = draw(st.sampled_from(["truncate", "extend", "flip", "length", "magic",
                                "version", "delete", "insert"]))
    if how == "truncate":
        del data[draw(st.integers(0, len(data))):]
    elif how == "extend":
        data += draw(st.binary(min_size=1, max_size=8))
    elif how == "flip":
        position = draw(st.integers(0, len(data) - 1))
        data[position] ^= 1 << draw(st.integers(0, 7))
    elif how == "length" and len(data) > 18:
        position = draw(st.integers(wire.REQUEST_HEADER_SIZE, len(data) - 2))
        data[position:position + 2] = draw(st.sampled_from([b"\xff\xff", b"\x00\x00",
                                                            b"\x00\x01", b"\x20\x01"]))
    elif how == "magic":
        data[0] = draw(st.integers(0, 255))
    elif how == "version":
        data[1] = draw(st.integers(0, 255))
    elif how == "delete" and data:
        position = draw(st.integers(0, len(data) - 1))
        del data[position:position + draw(st.integers(1, 6))]
    elif how == "insert":
        position = draw(st.integers(0, len(data)))
        data[position:position] = draw(st.binary(min_size=1, max_size=6))
    return bytes(data)


requests = st.one_of(well_formed(), well_formed(), malformed(), st.binary(max_size=48))


@settings(max_examples=examples(400), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_requests_get_identical_replies_and_effects(data):
    run_random_requests(data, "python-dict")


def test_random_requests_on_rbtree_repositories():
    if hotpath.record_tree_type() is None:
        pytest.skip("domus._recordtree (the C RecordTree) is not built, so record tree "
                    "repositories cannot go through the C path")

    @settings(max_examples=examples(200), deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def run(data):
        run_random_requests(data, "domus-rbt")

    run()


@pytest.mark.parametrize("platform", BERKELEY)
def test_random_requests_on_berkeley_db_repositories(platform):
    @settings(max_examples=examples(60), deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(st.data())
    def run(data):
        run_random_requests(data, platform)

    run()


def run_random_requests(data, platform):
    # (A layout version, so that replies carry a layout tag: 300 is tag 45.)
    pair = Pair(platform, max_entries=data.draw(st.sampled_from([8, DEFAULT_MAX_ENTRIES])),
                version=data.draw(st.sampled_from([0, 300])))
    try:
        history = []
        for _ in range(data.draw(st.integers(1, 30))):
            if history and data.draw(st.integers(0, 9)) == 0:
                request = data.draw(st.sampled_from(history))      # a retry, byte for byte
            else:
                request = data.draw(requests)
                history.append(request)
            pair.send(request, data.draw(limits))
            if data.draw(st.integers(0, 19)) == 0:
                for handler in (pair.reference, pair.accelerated):
                    handler.reply_cache.rotate()
        pair.check()
    finally:
        pair.close()


@pytest.mark.parametrize("platform", ["python-dict", "domus-rbt", "bsddb-btree-disk"])
def test_10000_seeded_requests_get_identical_replies_and_effects(platform):
    rng = random.Random(0xD0D0)
    pair = Pair(platform, version=300)
    history = []
    count = examples(10_000)
    for _ in range(count):
        if history and rng.random() < 0.1:
            request = rng.choice(history)
        else:
            request = seeded_request(rng)
            history.append(request)
        pair.send(request, rng.choice([30, 200, 1000, wire.MAX_UDP_PAYLOAD]))
    pair.check()
    # The mix exercised both paths (a fifth of the requests each, at least).
    assert pair.handled_in_c > count // 5
    assert pair.accelerated.fast.fallbacks > count // 5
    assert pair.accelerated.fast.replayed > count // 100


def seeded_request(rng):
    request_id, client = rng.getrandbits(32), rng.choice([CLIENT_A, CLIENT_B])
    key = rng.choice(KEYS) if rng.random() < 0.7 else rng.randbytes(rng.randint(1, 10))
    bucket = rng.choice([0, 1, 2, 3, 3, 5])
    op = rng.choice([wire.OP_PUT, wire.OP_PUT, wire.OP_GET, wire.OP_GET, wire.OP_DELETE,
                     wire.OP_CONTAINS, wire.OP_PUT_MANY, wire.OP_GET_MANY,
                     wire.OP_PUT_IF_ABSENT, wire.OP_DELETE_IF])
    if op == wire.OP_PUT_MANY:
        data = wire.encode_put_many(request_id, client, DHT_ID, [
            (rng.choice([0, 1, 2, 3, 3, 3, 4]), rng.choice(KEYS), rng.randbytes(rng.randint(0, 9)))
            for _ in range(rng.randint(0, 6))])
    elif op == wire.OP_GET_MANY:
        data = wire.encode_get_many(request_id, client, DHT_ID, [
            (rng.choice([0, 1, 2, 3, 3, 3, 4]), rng.choice(KEYS))
            for _ in range(rng.randint(0, 6))])
    else:
        value = (rng.randbytes(rng.choice([0, 5, 180]))
                 if op in (wire.OP_PUT, wire.OP_PUT_IF_ABSENT) else b"")
        if op == wire.OP_DELETE_IF:     # (the empty value's digest: some are there)
            value = wire.value_digest(b"" if rng.random() < 0.7 else rng.randbytes(5))
        data = wire.encode_keyed(op, request_id, client, DHT_ID, bucket, key, value)
    if rng.random() < 0.5:        # numbered as the DHT is, or (rarely) otherwise
        data = bytearray(data)
        data[3] = rng.choice([wire.numbering(BUCKETS)] * 8 + [wire.numbering(BUCKETS // 2),
                                                               wire.numbering(BUCKETS * 2)])
        data = bytes(data)
    if rng.random() < 0.25:
        data = bytearray(data)
        position = rng.randrange(len(data))
        data[position] ^= 1 << rng.randrange(8)
        data = bytes(data)
    return data


# ------------------------------------------------------------ leaks

@pytest.mark.skipif(os.environ.get("PYTHONMALLOC", "").startswith("malloc"),
                    reason="sys.getallocatedblocks() counts nothing under PYTHONMALLOC=malloc")
@pytest.mark.parametrize("platform", ["python-dict", "domus-rbt", "bsddb-btree-ram"])
def test_handling_requests_leaks_no_memory(platform):
    handler = make_handler(platform)
    fast = handler.fast
    big = b"x" * 70_000
    fast.handle(keyed(wire.OP_PUT, b"\x03big", big, request_id=0), wire.MAX_FRAME_BYTES)

    def round_of_requests(number):
        for request_id in range(number, number + 50):
            key = b"\x03k%d" % (request_id % 7)
            fast.handle(keyed(wire.OP_PUT, key, b"v%d" % request_id, request_id=request_id))
            fast.handle(keyed(wire.OP_PUT, key, b"again", request_id=request_id))   # replay
            fast.handle(keyed(wire.OP_GET, key, request_id=request_id))
            fast.handle(keyed(wire.OP_GET, b"\x03big", request_id=request_id))     # too large
            fast.handle(keyed(wire.OP_CONTAINS, key, request_id=request_id))
            fast.handle(keyed(wire.OP_DELETE, key, client=CLIENT_B, request_id=request_id))
            fast.handle(keyed(wire.OP_DELETE, key, client=0xC, request_id=request_id))
            fast.handle(wire.encode_put_many(request_id, 0xD, DHT_ID, [
                (0, key, b"a"), (1, b"\x03m", b"b"), (2, b"\x03n", b"")]))
            fast.handle(wire.encode_put_many(request_id, 0xE, DHT_ID, [
                (0, key, b"a"), (5, b"\x03m", b"b")]))                               # declined
            fast.handle(wire.encode_get_many(request_id, CLIENT_A, DHT_ID, [
                (0, key), (1, b"\x03m"), (2, b"\x03none"), (0, b"\x03big")]))
            fast.handle(keyed(wire.OP_GET, key, request_id=request_id)[:-1])          # declined
            handler.handle_fast(wire.encode_length(request_id, CLIENT_A, DHT_ID))
        handler.reply_cache.rotate()
        handler.reply_cache.rotate()

    round_of_requests(0)
    gc.collect()
    before = sys.getallocatedblocks()
    for number in range(1, 41):
        round_of_requests(number * 1000)
    gc.collect()
    assert sys.getallocatedblocks() - before < 100
    assert fast.requests > 10_000


@pytest.mark.skipif(os.environ.get("PYTHONMALLOC", "").startswith("malloc"),
                    reason="sys.getallocatedblocks() counts nothing under PYTHONMALLOC=malloc")
def test_serving_datagrams_leaks_no_memory():
    handler = make_handler()
    with udp_pair(socket.AF_INET, "127.0.0.1") as (server, client):
        def answer(data, peer, stamp):
            server.sendto(handler.handle(data), peer)

        def round_of_datagrams(number):
            for request_id in range(number, number + 40):
                client.send(keyed(wire.OP_PUT, b"\x03k", b"v", request_id=request_id))
                client.send(keyed(wire.OP_GET, b"\x03k", request_id=request_id))
                client.send(wire.encode_length(request_id, CLIENT_A, DHT_ID))  # fallback
                drain(handler.fast, server, 3, answer)
                for _ in range(3):
                    client.recv(65536)
            handler.reply_cache.rotate()
            handler.reply_cache.rotate()

        round_of_datagrams(0)
        gc.collect()
        before = sys.getallocatedblocks()
        for number in range(1, 21):
            round_of_datagrams(number * 1000)
        gc.collect()
        assert sys.getallocatedblocks() - before < 100


# ------------------------------------------------------------ serve()

class udp_pair:
    """A non-blocking server socket and a client socket connected to it."""

    def __init__(self, family, host):
        self.family, self.host = family, host

    def __enter__(self):
        self.server = socket.socket(self.family, socket.SOCK_DGRAM)
        self.server.setblocking(False)
        self.server.bind((self.host, 0))
        self.client = socket.socket(self.family, socket.SOCK_DGRAM)
        self.client.settimeout(5)
        self.client.connect(self.server.getsockname()[:2])
        return self.server, self.client

    def __exit__(self, *exc):
        self.server.close()
        self.client.close()


def drain(fast, server, expected, fallback=None, **options):
    """serve() until ``expected`` datagrams were read (loopback delivery is
    immediate, but be patient all the same)."""
    fallback = fallback or no_fallback
    read = 0
    deadline = time.monotonic() + 5
    while read < expected and time.monotonic() < deadline:
        read += fast.serve(server.fileno(), fallback, **options)
    return read


def no_fallback(data, peer, stamp):
    raise AssertionError(f"C declined {data!r} from {peer}")


def ipv6_loopback_or_skip():
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6 support")
    try:
        probe = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        probe.bind(("::1", 0))
        probe.close()
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback (::1) on this machine: {exc}")


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_serve_answers_over_real_sockets_and_falls_back_with_the_peer(family):
    if family == "ipv6":
        ipv6_loopback_or_skip()
    sock_family, host = ((socket.AF_INET, "127.0.0.1") if family == "ipv4"
                         else (socket.AF_INET6, "::1"))
    reference = make_handler(cache_type=ReplyCache)
    handler = make_handler()
    fallen_back = []

    def fallback(data, peer, stamp):
        fallen_back.append((data, peer))
        server.sendto(handler.handle(data), peer)

    with udp_pair(sock_family, host) as (server, client):
        requests = [keyed(wire.OP_PUT, b"\x03k", b"v" * 1000, request_id=1),
                    keyed(wire.OP_GET, b"\x03k", request_id=2),
                    keyed(wire.OP_GET, b"\x03none", request_id=3),
                    wire.encode_get_many(4, CLIENT_A, DHT_ID, [(0, b"\x03k"), (0, b"\x03k")]),
                    wire.request_header(0x0C, 5, CLIENT_A),            # unknown op
                    keyed(wire.OP_DELETE, b"\x03k", request_id=6)]
        for request in requests:
            client.send(request)
        assert drain(handler.fast, server, len(requests), fallback) == len(requests)
        replies = [client.recv(65536) for _ in requests]
        assert replies == [reference.handle(request) for request in requests]
        assert fallen_back == [(requests[4], client.getsockname())]
        assert handler.fast.serve(server.fileno(), fallback) == 0        # empty now
    assert handler.fast.requests == 5
    assert handler.fast.send_errors == 0
    # every datagram read is counted, the declined one too; the replies C
    # sent, not the one the fallback sent
    assert handler.fast.bytes_received == sum(map(len, requests))
    assert handler.fast.bytes_sent == sum(len(reply) for index, reply in enumerate(replies)
                                          if index != 4)
    assert handler.fast.by_status[wire.ST_OK] == 4
    assert handler.fast.by_status[wire.ST_NOT_FOUND] == 1
    assert sum(handler.by_status) == 1 and handler.by_status[replies[4][2]] == 1


def test_serve_stops_after_max_datagrams():
    handler = make_handler()
    with udp_pair(socket.AF_INET, "127.0.0.1") as (server, client):
        for request_id in range(5):
            client.send(keyed(wire.OP_GET, b"\x03k", request_id=request_id))
        time.sleep(0.05)
        assert handler.fast.serve(server.fileno(), no_fallback, 2) == 2
        assert handler.fast.serve(server.fileno(), no_fallback, max_datagrams=2) == 2
        assert handler.fast.serve(server.fileno(), no_fallback) == 1
        assert [client.recv(100)[4:8] for _ in range(5)] == [
            request_id.to_bytes(4, "big") for request_id in range(5)]


def test_serve_answers_a_full_size_datagram():
    handler = make_handler()
    value = bytes(range(256)) * 300
    value = value[:wire.MAX_UDP_PAYLOAD - wire.KEYED_END - 2 - 4]
    request = keyed(wire.OP_PUT, b"\x03k", value)
    assert len(request) == wire.MAX_UDP_PAYLOAD
    with udp_pair(socket.AF_INET, "127.0.0.1") as (server, client):
        client.send(request)
        drain(handler.fast, server, 1)
        assert client.recv(100) == wire.reply(wire.ST_OK, 1, b"\x01")
        client.send(keyed(wire.OP_GET, b"\x03k", request_id=2))
        drain(handler.fast, server, 1)
        assert client.recv(65536) == wire.reply(wire.ST_OK, 2, value)


def test_serve_goes_past_errors_left_by_icmp():
    # With IP_RECVERR an unconnected socket reports ICMP errors; the service
    # must count them and keep reading.
    ip_recverr = getattr(socket, "IP_RECVERR", 11)
    handler = make_handler()
    with udp_pair(socket.AF_INET, "127.0.0.1") as (server, client):
        try:
            server.setsockopt(socket.IPPROTO_IP, ip_recverr, 1)
        except OSError as exc:
            pytest.skip(f"IP_RECVERR not supported here: {exc}")
        gone = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        gone.bind(("127.0.0.1", 0))
        nobody = gone.getsockname()
        gone.close()
        server.sendto(b"hello?", nobody)                 # port unreachable comes back
        time.sleep(0.05)
        client.send(keyed(wire.OP_GET, b"\x03k"))
        time.sleep(0.05)
        assert handler.fast.serve(server.fileno(), no_fallback) == 1
        assert handler.fast.recv_errors == 1
        assert client.recv(100) == wire.reply(wire.ST_NOT_FOUND, 1)


def test_serve_reports_what_it_cannot_go_past():
    handler = make_handler()
    with pytest.raises(TypeError):
        handler.fast.serve(0, "not callable")
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fd = closed.fileno()
    closed.close()
    with pytest.raises(OSError) as raised:
        handler.fast.serve(fd, no_fallback)
    assert raised.value.errno == errno.EBADF

    def broken(data, peer, stamp):
        raise RuntimeError("the Python path broke")

    with udp_pair(socket.AF_INET, "127.0.0.1") as (server, client):
        client.send(wire.request_header(wire.OP_PING, 1, CLIENT_A))
        time.sleep(0.05)
        with pytest.raises(RuntimeError, match="broke"):
            handler.fast.serve(server.fileno(), broken)


# ------------------------------------------------------------ numbering and layout tags

def test_c_serves_requests_numbered_as_the_dht_and_tags_replies_with_its_layout():
    pair = Pair(version=300)
    numbered = wire.numbering(BUCKETS)
    put = wire.encode_keyed(wire.OP_PUT, 1, CLIENT_A, DHT_ID, 0, b"\x03k", b"v", numbered)
    handled = pair.handled_in_c
    answer = pair.send(put)
    assert pair.handled_in_c == handled + 1
    assert answer[3] == wire.layout_tag(300) == 45
    get = wire.encode_keyed(wire.OP_GET, 2, CLIENT_A, DHT_ID, 0, b"\x03k", b"", numbered)
    assert pair.send(get) == wire.reply(wire.ST_OK, 2, b"v")[:3] + bytes((45,)) + \
        wire.reply(wire.ST_OK, 2, b"v")[4:]
    pair.check()
    pair.close()


def test_requests_numbered_otherwise_are_left_to_python_which_translates_them():
    pair = Pair(version=300)
    key = next(key for key in KEYS if bucket_of_key(key) == 1)    # bucket 1 of 8
    # Finer (32 buckets): bucket 1 of 8 is buckets 4..7 of 32; the key says which.
    finer = wire.encode_keyed(wire.OP_PUT, 1, CLIENT_A, DHT_ID, bucket_of_key(key, BUCKETS * 4),
                              key, b"v", wire.numbering(BUCKETS * 4))
    # Coarser (4 buckets): bucket 1 of 8 is in bucket 0 of 4; the key says which.
    coarser = wire.encode_keyed(wire.OP_GET, 2, CLIENT_A, DHT_ID, 0, key, b"",
                                wire.numbering(BUCKETS // 2))
    wrong = wire.encode_keyed(wire.OP_GET, 3, CLIENT_A, DHT_ID, 1, key, b"",
                              wire.numbering(BUCKETS // 2))
    handled = pair.handled_in_c
    assert pair.send(finer)[2] == wire.ST_OK
    assert pair.send(coarser) == wire.reply(wire.ST_OK, 2, b"v")[:3] + bytes((45,)) + \
        wire.reply(wire.ST_OK, 2, b"v")[4:]
    assert pair.send(wrong)[2] == wire.ST_MALFORMED       # the key is not in that bucket
    assert pair.handled_in_c == handled
    assert bucket_records(pair.reference, DHT_ID, 1) == {key: b"v"}
    pair.check()
    pair.close()


def bucket_of_key(key, count=BUCKETS):
    from domus.wire.keys import bucket_of
    return bucket_of(key, "xxh3", count)


def test_c_samples_one_request_in_sample_every_for_the_hot_bucket_report():
    handler = make_handler()
    put = keyed(wire.OP_PUT, b"\x03k", b"v", bucket=2)
    for number in range(_hotpath.SAMPLE_EVERY * 10):
        assert handler.fast.handle(wire.encode_keyed(wire.OP_GET, number, CLIENT_A, DHT_ID, 3,
                                                     b"\x03k")) is not None
    assert handler.fast.handle(put) is not None
    samples, taken = handler.fast.take_samples()
    assert taken == len(samples) == 11 and set(samples) == {DHT_ID << 32 | 3, DHT_ID << 32 | 2}
    assert handler.fast.take_samples() == ([], 0)
    for number in range(_hotpath.SAMPLE_EVERY * (_hotpath.SAMPLE_RING + 5)):
        handler.fast.handle(wire.encode_keyed(wire.OP_GET, number, CLIENT_A, DHT_ID, 1, b"\x03k"))
    samples, taken = handler.fast.take_samples()             # the ring went round
    assert len(samples) == _hotpath.SAMPLE_RING and taken == _hotpath.SAMPLE_RING + 5
    assert handler.bucket_load(1.0) == {}                    # (taken already)


def test_c_counts_each_buckets_changes_for_scans_to_share_snapshots():
    handler = make_handler()
    fast = handler.fast
    before = [fast.generation(DHT_ID, bucket) for bucket in range(4)]
    assert fast.handle(keyed(wire.OP_PUT, b"\x03k", b"v", request_id=1)) is not None
    assert fast.handle(keyed(wire.OP_GET, b"\x03k", request_id=2)) is not None
    after = [fast.generation(DHT_ID, bucket) for bucket in range(4)]
    assert after[0] == before[0] + 1                    # the put's bucket; the get is no change
    batch = wire.encode_put_many(3, CLIENT_A, DHT_ID, [(0, b"\x03a", b"1"), (0, b"\x03b", b"2")])
    assert fast.handle(batch) is not None
    assert fast.generation(DHT_ID, 0) == before[0] + 3
    with pytest.raises(OverflowError):
        fast.generation(2**32, 0)


def test_big_batches_on_record_trees_get_identical_replies_and_effects():
    """Batches of many entries: C walks the record trees' descents of 16
    entries at a time together (prefetching) before applying them, which
    must change nothing but the speed."""
    if hotpath.record_tree_type() is None:
        pytest.skip("domus._recordtree (the C RecordTree) is not built")
    pair = Pair("domus-rbt")
    rng = random.Random(24)
    keys = [b"\x01" + rng.randbytes(8) for _ in range(4000)]

    def bucket(key):
        return key[1] % len(HELD)

    request_id = 0
    for start in range(0, len(keys), 500):
        request_id += 1
        entries = [(bucket(key), key, rng.randbytes(rng.choice([3, 30, 300])))
                   for key in keys[start:start + 500]]
        entries += entries[:20]                                 # keys put twice
        pair.send(wire.encode_put_many(request_id, CLIENT_A, DHT_ID, entries),
                  wire.MAX_FRAME_BYTES)
    wanted = rng.sample(keys, 700) + [b"\x01absent%d" % n for n in range(50)]
    rng.shuffle(wanted)
    for limit in (wire.MAX_FRAME_BYTES, wire.MAX_UDP_PAYLOAD, 2000):
        request_id += 1
        pair.send(wire.encode_get_many(request_id, CLIENT_A, DHT_ID,
                                       [(bucket(key), key) for key in wanted]), limit)
    assert pair.handled_in_c == request_id
    pair.check()


def test_a_replicate_the_c_path_reads_is_applied_as_the_python_handler_applies_it():
    # The serving FastPath hands a REPLICATE's change to the backups'
    # FastPath (handler.fast.backup): the same reply, records, reply cache
    # and counters as the Python handler's _replicate_in; a change C cannot
    # apply (a bucket not backed up here) declines the whole REPLICATE.
    reference, accelerated = backup_pair()
    assert accelerated.fast.backup is accelerated.backup_fast
    changes = [wire.encode_keyed(wire.OP_PUT, 1, CLIENT_A, 5, 4, b"\x03k", b"v"),
               wire.encode_keyed(wire.OP_PUT, 1, CLIENT_A, 5, 4, b"\x03k", b"v"),   # a retry
               wire.encode_keyed(wire.OP_DELETE, 2, CLIENT_A, 5, 5, b"\x03j"),
               wire.encode_put_many(3, CLIENT_A, 5, [(4, b"\x03a", b"1"), (6, b"\x03b", b"2")])]
    for request_id, change in enumerate(changes, 10):
        request = wire.encode_replicate(request_id, 0x5A, change)
        assert accelerated.fast.handle(request) == reference.handle(request)
    declined = wire.encode_replicate(20, 0x5A, wire.encode_keyed(
        wire.OP_PUT, 4, CLIENT_A, 5, 0, b"\x03k", b"v"))        # (bucket 0: s2 backs it up)
    assert accelerated.fast.handle(declined) is None
    assert accelerated.handle(declined) == reference.handle(declined)
    for handler in (reference, accelerated):
        assert dict(handler.dhts[5].backups[4]) == {b"\x03k": b"v", b"\x03a": b"1"}
    assert counters(accelerated) == counters(reference)
    assert accelerated.stats()["replicated"] == reference.stats()["replicated"] == 5
    with pytest.raises(TypeError):
        accelerated.fast.backup = "not a FastPath"
    assert accelerated.fast.claim(5, [4]) is None       # (no serving thread: nothing to order)
