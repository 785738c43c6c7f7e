"""domus.service.handler: the request handler, driven with protocol bytes (no sockets)."""

import itertools
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domus.errors import ProtocolError
from domus.service.handler import SCAN_TTL, RequestHandler
from domus.service.limits import Limits
from domus.service.replycache import ReplyCache
from domus.storage import rbt
from domus.wire import protocol as wire
from domus.wire.keys import bucket_of, encode_key

DHT_ID = 1
BUCKETS = 8
HELD = range(0, 4)          # s1 stores buckets 0..3; s2 stores 4..7
NOT_HELD = range(4, 8)
CLIENT_A = 0xA
CLIENT_B = 0xB


def descriptor(**changes):
    base = {
        "id": DHT_ID, "name": "t", "buckets": BUCKETS, "hash": "xxh3", "storage": "ram",
        "platform": "python-dict", "routing": "chord", "lookup": "D", "state": "active",
        "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 8}],
        "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 4},
                             {"name": "s2", "address": "127.0.0.1:2", "count": 4}],
    }
    return {**base, **changes}


class FakeClock:
    def __init__(self):
        self.now = 5000.0

    def __call__(self):
        return self.now


def make_handler(clock=None, data_dir=None, limits=None, **changes):
    handler = RequestHandler("s1", clock=clock or FakeClock(), data_dir=data_dir,
                             **({"limits": limits} if limits is not None else {}))
    handler.assign(descriptor(**changes))
    return handler


_request_ids = itertools.count(1)


def next_id():
    return next(_request_ids) & 0xFFFFFFFF


def keys_in(bucket, count, prefix="k"):
    """Encoded keys that really hash into ``bucket`` of the 8-bucket DHT."""
    found = []
    for i in itertools.count():
        encoded = encode_key(f"{prefix}{i}")
        if bucket_of(encoded, "xxh3", BUCKETS) == bucket:
            found.append(encoded)
            if len(found) == count:
                return found


def key_in(bucket, prefix="k"):
    return keys_in(bucket, 1, prefix)[0]


def keyed(op, key, value=b"", bucket=None, client=CLIENT_A, request_id=None, dht=DHT_ID):
    if bucket is None:
        bucket = bucket_of(key, "xxh3", BUCKETS)
    if request_id is None:
        request_id = next_id()
    return wire.encode_keyed(op, request_id, client, dht, bucket, key, value)


def parse(answer, request=None):
    """(status, body) of a reply; checks the reply echoes the request id."""
    assert isinstance(answer, bytes)
    status, request_id = wire.decode_reply_header(answer)
    if request is not None:
        assert answer[4:8] == request[4:8]
    return status, answer[wire.REPLY_HEADER_SIZE:]


def call(handler, request, reply_limit=wire.MAX_UDP_PAYLOAD):
    return parse(handler.handle(request, reply_limit), request)


def put(handler, key, value, **options):
    return call(handler, keyed(wire.OP_PUT, key, value, **options))


def get(handler, key, **options):
    return call(handler, keyed(wire.OP_GET, key, **options))


def stored(handler):
    """Every record the handler stores: {bucket: {key: value}}."""
    return {bucket: dict(repo) for bucket, repo in handler.dhts[DHT_ID].repos.items()}


def all_records(handler):
    return {key: value for repo in stored(handler).values() for key, value in repo.items()}


# ------------------------------------------------------------ hosting

def test_the_descriptor_decides_which_buckets_are_stored_and_routed_here():
    handler = make_handler()
    hosted = handler.dhts[DHT_ID]
    assert sorted(hosted.repos) == list(HELD)
    assert {b: hosted.storage_service(b) for b in range(BUCKETS)} == {
        b: "s1" if b in HELD else "s2" for b in range(BUCKETS)}


# ------------------------------------------------------------ single keys

def test_put_get_contains_delete():
    handler = make_handler()
    key = key_in(0)
    assert put(handler, key, b"v1") == (wire.ST_OK, b"\x01")       # created
    assert get(handler, key) == (wire.ST_OK, b"v1")
    assert put(handler, key, b"v2") == (wire.ST_OK, b"\x00")       # replaced
    assert get(handler, key) == (wire.ST_OK, b"v2")
    assert call(handler, keyed(wire.OP_CONTAINS, key)) == (wire.ST_OK, b"")
    assert call(handler, keyed(wire.OP_DELETE, key)) == (wire.ST_OK, b"")
    assert get(handler, key) == (wire.ST_NOT_FOUND, b"")
    assert call(handler, keyed(wire.OP_CONTAINS, key)) == (wire.ST_NOT_FOUND, b"")
    assert call(handler, keyed(wire.OP_DELETE, key)) == (wire.ST_NOT_FOUND, b"")
    assert all_records(handler) == {}


def test_absent_keys_are_not_found():
    handler = make_handler()
    assert get(handler, key_in(2)) == (wire.ST_NOT_FOUND, b"")


def test_values_are_opaque_bytes_and_an_empty_value_is_a_value():
    handler = make_handler()
    binary, empty = key_in(1, "bin"), key_in(1, "empty")
    value = bytes(range(256)) * 4
    put(handler, binary, value)
    put(handler, empty, b"")
    assert get(handler, binary) == (wire.ST_OK, value)
    assert get(handler, empty) == (wire.ST_OK, b"")
    assert call(handler, keyed(wire.OP_CONTAINS, empty))[0] == wire.ST_OK
    assert call(handler, keyed(wire.OP_DELETE, empty))[0] == wire.ST_OK
    assert get(handler, empty)[0] == wire.ST_NOT_FOUND


def test_records_land_in_the_bucket_the_request_names():
    handler = make_handler()
    key = key_in(3)
    put(handler, key, b"v")
    assert stored(handler)[3] == {key: b"v"}
    assert all(not records for bucket, records in stored(handler).items() if bucket != 3)


def test_keys_at_the_limit_are_stored_and_over_it_are_too_large():
    handler = make_handler()
    at_limit = b"k" * wire.MAX_KEY_BYTES
    over = b"k" * (wire.MAX_KEY_BYTES + 1)
    assert put(handler, at_limit, b"v", bucket=0)[0] == wire.ST_OK
    assert put(handler, over, b"v", bucket=0)[0] == wire.ST_TOO_LARGE
    assert get(handler, over, bucket=0)[0] == wire.ST_TOO_LARGE
    assert all_records(handler) == {at_limit: b"v"}


def test_values_over_the_limit_are_too_large_and_not_stored():
    handler = make_handler()
    key = key_in(0)
    status, message = put(handler, key, b"v" * (wire.MAX_VALUE_BYTES + 1))
    assert status == wire.ST_TOO_LARGE
    assert str(wire.MAX_VALUE_BYTES).encode() in message
    assert all_records(handler) == {}


# ------------------------------------------------------------ the reply cache

def test_a_late_retry_of_an_applied_put_does_not_undo_a_later_write():
    handler = make_handler()
    key = key_in(0)
    first_try = keyed(wire.OP_PUT, key, b"v1", client=CLIENT_A)
    first_reply = handler.handle(first_try)            # applied; the reply is "lost"
    assert parse(first_reply) == (wire.ST_OK, b"\x01")
    assert put(handler, key, b"v2", client=CLIENT_B) == (wire.ST_OK, b"\x00")
    retry_reply = handler.handle(first_try)             # the exact same bytes, late
    assert retry_reply == first_reply
    assert get(handler, key) == (wire.ST_OK, b"v2")
    assert handler.counters["replayed"] == 1


def test_a_late_retry_of_an_applied_delete_does_not_delete_a_later_write():
    handler = make_handler()
    key = key_in(1)
    put(handler, key, b"v0", client=CLIENT_B)
    first_try = keyed(wire.OP_DELETE, key, client=CLIENT_A)
    assert parse(handler.handle(first_try)) == (wire.ST_OK, b"")
    put(handler, key, b"v2", client=CLIENT_B)
    assert parse(handler.handle(first_try)) == (wire.ST_OK, b"")
    assert get(handler, key) == (wire.ST_OK, b"v2")


# ------------------------------------------------------------ conditional changes

def test_put_if_absent_stores_only_where_the_key_is_not():
    handler = make_handler()
    key = key_in(1)
    assert call(handler, keyed(wire.OP_PUT_IF_ABSENT, key, b"first")) == (wire.ST_OK, b"\x01")
    assert call(handler, keyed(wire.OP_PUT_IF_ABSENT, key, b"second")) == (wire.ST_OK, b"\x00")
    assert get(handler, key) == (wire.ST_OK, b"first")
    assert call(handler, keyed(wire.OP_DELETE, key)) == (wire.ST_OK, b"")
    assert call(handler, keyed(wire.OP_PUT_IF_ABSENT, key, b"third")) == (wire.ST_OK, b"\x01")
    assert get(handler, key) == (wire.ST_OK, b"third")


def test_delete_if_deletes_only_the_value_it_names():
    handler = make_handler()
    key = key_in(2)
    put(handler, key, b"v1")
    stale = keyed(wire.OP_DELETE_IF, key, wire.value_digest(b"v0"))
    assert call(handler, stale) == (wire.ST_OK, b"\x00")
    assert get(handler, key) == (wire.ST_OK, b"v1")
    assert call(handler, keyed(wire.OP_DELETE_IF, key, wire.value_digest(b"v1"))) \
        == (wire.ST_OK, b"\x01")
    assert get(handler, key)[0] == wire.ST_NOT_FOUND
    assert call(handler, keyed(wire.OP_DELETE_IF, key, wire.value_digest(b"v1")))[0] \
        == wire.ST_NOT_FOUND


def test_a_late_retry_of_a_conditional_change_is_answered_as_it_was_and_changes_nothing():
    # (The reply cache keeps their replies as any change's: a retry of a
    # delete_if that deleted does not delete the value written since.)
    handler = make_handler()
    key = key_in(3)
    put(handler, key, b"v1", client=CLIENT_B)
    delete_if = keyed(wire.OP_DELETE_IF, key, wire.value_digest(b"v1"))
    assert call(handler, delete_if) == (wire.ST_OK, b"\x01")
    put(handler, key, b"v1", client=CLIENT_B)           # (the same value again)
    assert call(handler, delete_if) == (wire.ST_OK, b"\x01")
    assert get(handler, key) == (wire.ST_OK, b"v1")
    put_if_absent = keyed(wire.OP_PUT_IF_ABSENT, key_in(0), b"mine")
    assert call(handler, put_if_absent) == (wire.ST_OK, b"\x01")
    put(handler, key_in(0), b"theirs", client=CLIENT_B)
    assert call(handler, put_if_absent) == (wire.ST_OK, b"\x01")
    assert get(handler, key_in(0)) == (wire.ST_OK, b"theirs")
    assert handler.counters["replayed"] == 2


def test_conditional_changes_of_a_moving_bucket_are_noted_for_its_target():
    # (A bucket being moved notes every key a change touches, so that its
    # copy on the target catches up: a conditional change is one.)
    handler = make_handler()
    fresh, doomed, kept = key_in(1, "f"), key_in(1, "d"), key_in(1, "k")
    put(handler, doomed, b"old")
    put(handler, kept, b"mine")
    hosted = handler.dhts[DHT_ID]
    hosted.track(1)
    handle = getattr(handler, "handle_fast", handler.handle)
    for request in (keyed(wire.OP_PUT_IF_ABSENT, fresh, b"new"),
                    keyed(wire.OP_DELETE_IF, doomed, wire.value_digest(b"old")),
                    keyed(wire.OP_DELETE_IF, kept, wire.value_digest(b"other")),
                    keyed(wire.OP_PUT_IF_ABSENT, kept, b"theirs")):
        assert parse(handle(request, wire.MAX_UDP_PAYLOAD))[0] == wire.ST_OK
    changes = hosted.catch_up(1)
    assert dict(zip(changes[::2], changes[1::2])) == {fresh: b"new", doomed: None}


@pytest.mark.parametrize("rest", [b"", b"\x00\x00\x00\x04" + bytes(4),
                                  b"\x00\x00\x00\x08" + bytes(7),
                                  b"\x00\x00\x00\x08" + bytes(9)],
                         ids=["nothing", "short digest", "cut", "padded"])
def test_a_malformed_delete_if_deletes_nothing(rest):
    handler = make_handler()
    key = key_in(1)
    put(handler, key, b"v")
    request = wire.encode_keyed(wire.OP_DELETE, next_id(), CLIENT_A, DHT_ID,
                                bucket_of(key, "xxh3", BUCKETS), key) + rest
    request = request[:2] + bytes((wire.OP_DELETE_IF,)) + request[3:]
    status, message = call(handler, request)
    assert status == wire.ST_MALFORMED and b"delete_if" in message
    assert get(handler, key) == (wire.ST_OK, b"v")


def test_conditional_changes_of_buckets_not_stored_here_are_redirected():
    handler = make_handler()
    key = key_in(NOT_HELD[0])
    for request in (keyed(wire.OP_PUT_IF_ABSENT, key, b"v"),
                    keyed(wire.OP_DELETE_IF, key, wire.value_digest(b"v"))):
        assert call(handler, request)[0] == wire.ST_NOT_OWNER
    assert all_records(handler) == {}


def test_a_late_retry_of_an_applied_put_many_is_not_applied_again():
    handler = make_handler()
    first, second = key_in(0), key_in(2)
    request = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID,
                                   [(0, first, b"a1"), (2, second, b"a2")])
    first_reply = handler.handle(request)
    assert parse(first_reply) == (wire.ST_OK, wire.U16X2.pack(2, 2))
    put(handler, first, b"b1", client=CLIENT_B)
    assert handler.handle(request) == first_reply
    assert all_records(handler) == {first: b"b1", second: b"a2"}


def test_the_same_request_id_from_another_client_is_another_request():
    handler = make_handler()
    key = key_in(0)
    put(handler, key, b"from-a", client=CLIENT_A, request_id=77)
    assert put(handler, key, b"from-b", client=CLIENT_B, request_id=77) == (wire.ST_OK, b"\x00")
    assert get(handler, key) == (wire.ST_OK, b"from-b")
    assert handler.counters["replayed"] == 0


def test_the_reply_cache_given_is_the_one_used_even_while_empty():
    cache = ReplyCache(max_entries=10, clock=FakeClock())
    handler = RequestHandler("s1", reply_cache=cache, clock=FakeClock())
    assert handler.reply_cache is cache


def test_reads_are_never_answered_from_the_reply_cache():
    handler = make_handler()
    key = key_in(0)
    read = keyed(wire.OP_GET, key)
    assert call(handler, read) == (wire.ST_NOT_FOUND, b"")
    put(handler, key, b"v")
    assert call(handler, read) == (wire.ST_OK, b"v")    # a retried read sees the present


def test_a_retry_of_a_refused_put_is_judged_afresh():
    # docs/protocol.md: only applied changes are kept in the reply cache (a
    # refusal changed nothing), so a retry once the DHT is active applies.
    handler = make_handler(state="inactive")
    key = key_in(0)
    request = keyed(wire.OP_PUT, key, b"v")
    assert parse(handler.handle(request))[0] == wire.ST_INACTIVE
    assert len(handler.reply_cache) == 0
    handler.assign(descriptor(state="active"))
    assert parse(handler.handle(request)) == (wire.ST_OK, b"\x01")
    assert get(handler, key) == (wire.ST_OK, b"v")


def test_junk_changes_do_not_fill_the_reply_cache():
    # Issue 15: 466k entries came from junk PUT headers.
    handler = make_handler()
    for request_id in range(200):
        handler.handle(wire.request_header(wire.OP_PUT, request_id, 5) + b"\x00junk")
    assert handler.counters["malformed"] == 200
    assert len(handler.reply_cache) == 0


def test_another_request_under_a_reused_id_is_not_answered_with_the_first_ones_reply():
    handler = make_handler()
    first, second = keys_in(0, 2)
    put(handler, first, b"a", client=CLIENT_A, request_id=5)
    # The same client id and request id, another key: applied, and answered
    # as itself (created), not with the first put's cached reply.
    assert put(handler, second, b"b", client=CLIENT_A, request_id=5) == (wire.ST_OK, b"\x01")
    assert get(handler, second) == (wire.ST_OK, b"b")
    assert put(handler, first, b"a", client=CLIENT_A, request_id=5) == (wire.ST_OK, b"\x01")
    assert handler.counters["replayed"] == 1


def test_a_full_reply_cache_answers_busy_and_applies_nothing():
    cache = ReplyCache(max_entries=4, clock=FakeClock())
    handler = RequestHandler("s1", reply_cache=cache, clock=FakeClock())
    handler.assign(descriptor())
    keys = keys_in(0, 3)
    assert [put(handler, key, b"v", request_id=n)[0] for n, key in enumerate(keys)] == \
        [wire.ST_OK, wire.ST_OK, wire.ST_BUSY]
    assert get(handler, keys[2])[0] == wire.ST_NOT_FOUND
    assert put(handler, keys[0], b"v", request_id=0) == (wire.ST_OK, b"\x01")   # a retry
    assert handler.stats()["busy"] == 1


# ------------------------------------------------------------ ownership and DHTs

@pytest.mark.parametrize("bucket", [4, 7, 8, 1000, 0xFFFFFFFF])
def test_a_put_to_a_bucket_not_stored_here_is_refused_and_stores_nothing(bucket):
    handler = make_handler()
    status, message = put(handler, b"\x03key", b"v", bucket=bucket)
    assert status == wire.ST_NOT_OWNER
    assert b"s1" in message and str(bucket).encode() in message
    assert all_records(handler) == {}
    assert handler.counters["errors"] == 1


@pytest.mark.parametrize("op", [wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS])
def test_reads_and_deletes_of_buckets_not_stored_here_are_refused(op):
    handler = make_handler()
    assert call(handler, keyed(op, b"\x03key", bucket=5))[0] == wire.ST_NOT_OWNER


def unknown_dht_requests():
    key = b"\x03key"
    return {
        "put": wire.encode_keyed(wire.OP_PUT, 1, CLIENT_A, 99, 0, key, b"v"),
        "get": wire.encode_keyed(wire.OP_GET, 2, CLIENT_A, 99, 0, key),
        "delete": wire.encode_keyed(wire.OP_DELETE, 3, CLIENT_A, 99, 0, key),
        "contains": wire.encode_keyed(wire.OP_CONTAINS, 4, CLIENT_A, 99, 0, key),
        "put_many": wire.encode_put_many(5, CLIENT_A, 99, [(0, key, b"v")]),
        "get_many": wire.encode_get_many(6, CLIENT_A, 99, [(0, key)]),
        "length": wire.encode_length(7, CLIENT_A, 99),
        "scan": wire.encode_scan(8, CLIENT_A, 99, 0, 0, 0),
    }


@pytest.mark.parametrize("name", sorted(unknown_dht_requests()))
def test_an_unknown_dht_id_is_reported_for_every_operation(name):
    handler = make_handler()
    status, message = call(handler, unknown_dht_requests()[name])
    assert status == wire.ST_UNKNOWN_DHT
    assert b"99" in message
    assert all_records(handler) == {}


def test_an_inactive_dht_refuses_requests_and_keeps_its_records(tmp_path):
    handler = make_handler(data_dir=str(tmp_path))
    key = key_in(0)
    put(handler, key, b"v")
    handler.assign(descriptor(state="inactive"))
    assert get(handler, key)[0] == wire.ST_INACTIVE
    assert put(handler, key, b"w")[0] == wire.ST_INACTIVE
    assert call(handler, wire.encode_length(next_id(), CLIENT_A, DHT_ID))[0] == wire.ST_INACTIVE
    assert handler.dhts[DHT_ID].records() == 0      # nothing held in memory
    handler.assign(descriptor(state="active"))
    assert get(handler, key) == (wire.ST_OK, b"v")


def test_reassignment_drops_buckets_no_longer_stored_here():
    handler = make_handler()
    kept, moved = key_in(0), key_in(3)
    put(handler, kept, b"kept")
    put(handler, moved, b"moved")
    handler.assign(descriptor(storage_services=[
        {"name": "s1", "address": "127.0.0.1:1", "count": 2},
        {"name": "s2", "address": "127.0.0.1:2", "count": 6}]))
    assert get(handler, kept) == (wire.ST_OK, b"kept")
    assert get(handler, moved)[0] == wire.ST_NOT_OWNER
    assert put(handler, moved, b"again")[0] == wire.ST_NOT_OWNER


def test_sync_keeps_dhts_the_supervisor_no_longer_lists_and_reports_them():
    handler = make_handler()
    put(handler, key_in(0), b"v")
    handler.sync([descriptor(id=2, name="other")])
    assert sorted(handler.dhts) == [DHT_ID, 2]
    assert get(handler, key_in(0)) == (wire.ST_OK, b"v")
    unclaimed = handler.holdings(unclaimed=True)
    assert [(held["id"], held["records"], held["loaded"]) for held in unclaimed] == [
        (DHT_ID, 1, True)]
    assert handler.drop({"id": 2}) is True
    assert handler.drop({"id": 2}) is False


def test_a_drop_must_name_the_dhts_deployment_and_stamp():
    handler = make_handler()
    stamped = descriptor(id=3, name="stamped", deployment="d" * 32, stamp="5" * 32)
    handler.assign(stamped)
    for wrong in ({"id": 3}, {"id": 3, "deployment": "d" * 32, "stamp": "6" * 32},
                  {"id": 3, "deployment": "e" * 32, "stamp": "5" * 32}):
        with pytest.raises(ValueError, match="refuses to drop DHT id 3"):
            handler.drop(wrong)
        assert 3 in handler.dhts
    for bad in ({"id": "/home/alice"}, {"id": -1}, {"id": True}, {"id": 2**40},
                {"id": 3, "deployment": "../x", "stamp": "5" * 32}):
        with pytest.raises(ValueError, match="not valid"):
            handler.drop(bad)
    assert handler.drop({"id": 3, "deployment": "d" * 32, "stamp": "5" * 32}) is True
    assert 3 not in handler.dhts


# ------------------------------------------------------------ malformed requests

@pytest.mark.parametrize("data", [b"", b"\xd0", b"\xd0\x01\x01\x00\x00\x00\x00\x01",
                                  b"\xd1" + bytes(30), b"GET / HTTP/1.0\r\n\r\n"])
def test_what_has_no_request_id_is_dropped_and_counted(data):
    handler = make_handler()
    assert handler.handle(data) is None
    assert handler.counters["malformed"] == 1


def test_a_bad_version_is_answered_with_bad_version():
    handler = make_handler()
    request = bytearray(keyed(wire.OP_PUT, key_in(0), b"v"))
    request[1] = 2
    status, message = call(handler, bytes(request))
    assert status == wire.ST_BAD_VERSION
    assert b"version 2" in message
    assert all_records(handler) == {}
    assert handler.counters["malformed"] == 1


@pytest.mark.parametrize("op", [0x00, 0x1E, wire.OP_CONTROL, 0xFF])
def test_an_unknown_op_is_answered_with_unknown_op(op):
    handler = make_handler()
    status, message = call(handler, wire.request_header(op, next_id(), CLIENT_A) + b"xx")
    assert status == wire.ST_UNKNOWN_OP
    assert f"0x{op:02x}".encode() in message


def test_malformed_keyed_requests_are_answered_malformed_and_store_nothing():
    handler = make_handler()
    key = key_in(0)
    cases = [
        keyed(wire.OP_PUT, key, b"value")[:wire.KEYED_END - 1],     # cut in the body header
        keyed(wire.OP_PUT, key, b"value")[:wire.KEYED_END + len(key) - 1],   # cut in the key
        wire.encode_keyed(wire.OP_PUT, next_id(), CLIENT_A, DHT_ID, 0, b"", b"v"),  # empty key
        keyed(wire.OP_GET, key) + b"x",                             # bytes after a get's key
        keyed(wire.OP_DELETE, key) + b"x",
        keyed(wire.OP_CONTAINS, key) + b"x",
    ]
    for request in cases:
        assert call(handler, request)[0] == wire.ST_MALFORMED
    assert handler.counters["malformed"] == len(cases)
    assert all_records(handler) == {}


def test_a_malformed_delete_deletes_nothing():
    handler = make_handler()
    key = key_in(0)
    put(handler, key, b"v")
    assert call(handler, keyed(wire.OP_DELETE, key) + b"\x00")[0] == wire.ST_MALFORMED
    assert get(handler, key) == (wire.ST_OK, b"v")


# ------------------------------------------------------------ put_many

def test_put_many_stores_every_entry_and_counts_created_ones():
    handler = make_handler()
    entries = [(b, k, b"v-" + k) for b in HELD for k in keys_in(b, 3)]
    put(handler, entries[0][1], b"old")
    request = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, entries)
    assert call(handler, request) == (wire.ST_OK, wire.U16X2.pack(len(entries),
                                                                   len(entries) - 1))
    assert all_records(handler) == {k: v for _b, k, v in entries}


def test_put_many_with_a_repeated_key_keeps_the_last_value():
    handler = make_handler()
    key = key_in(1)
    request = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, [(1, key, b"a"), (1, key, b"b")])
    assert call(handler, request) == (wire.ST_OK, wire.U16X2.pack(2, 1))
    assert get(handler, key) == (wire.ST_OK, b"b")


def test_an_empty_put_many_is_ok():
    handler = make_handler()
    assert call(handler, wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, [])) == (
        wire.ST_OK, wire.U16X2.pack(0, 0))


def filled_handler(per_bucket=5):
    handler = make_handler()
    for bucket in HELD:
        for key in keys_in(bucket, per_bucket, prefix="pre"):
            put(handler, key, b"before-" + key)
    return handler


@pytest.mark.parametrize("position", ["first", "middle", "last"])
def test_put_many_with_one_entry_for_a_bucket_not_held_changes_no_record(position):
    handler = filled_handler()
    before = stored(handler)
    existing = [(b, k, b"overwritten") for b in HELD for k in list(before[b])[:2]]
    new = [(b, k, b"new") for b in HELD for k in keys_in(b, 2, prefix="new")]
    good = existing + new
    bad = (5, key_in(5), b"elsewhere")
    at = {"first": 0, "middle": len(good) // 2, "last": len(good)}[position]
    entries = good[:at] + [bad] + good[at:]
    request = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, entries)
    assert call(handler, request)[0] == wire.ST_NOT_OWNER
    assert stored(handler) == before


@pytest.mark.parametrize("bad", ["key", "value"])
def test_put_many_with_one_entry_over_a_limit_changes_no_record(bad):
    handler = filled_handler()
    before = stored(handler)
    entries = [(b, k, b"overwritten") for b in HELD for k in list(before[b])[:2]]
    if bad == "key":
        entries.append((0, b"k" * (wire.MAX_KEY_BYTES + 1), b"v"))
    else:
        entries.append((0, key_in(0, "big"), b"v" * (wire.MAX_VALUE_BYTES + 1)))
    request = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, entries)
    assert call(handler, request, reply_limit=wire.MAX_FRAME_BYTES)[0] == wire.ST_TOO_LARGE
    assert stored(handler) == before


def test_a_malformed_put_many_changes_no_record():
    handler = filled_handler()
    before = stored(handler)
    entries = [(b, k, b"overwritten") for b in HELD for k in list(before[b])[:2]]
    request = wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, entries)
    assert call(handler, request[:-1])[0] == wire.ST_MALFORMED
    assert call(handler, wire.encode_put_many(next_id(), CLIENT_A, DHT_ID, entries) + b"!")[0] \
        == wire.ST_MALFORMED
    assert stored(handler) == before


# ------------------------------------------------------------ reply limits

def test_get_of_a_value_bigger_than_the_reply_limit_is_reply_too_large():
    handler = make_handler()
    key = key_in(0)
    put(handler, key, b"x" * 100)
    fits = wire.REPLY_HEADER_SIZE + 100
    assert call(handler, keyed(wire.OP_GET, key), reply_limit=fits) == (wire.ST_OK, b"x" * 100)
    status, message = call(handler, keyed(wire.OP_GET, key), reply_limit=fits - 1)
    assert status == wire.ST_REPLY_TOO_LARGE
    assert b"TCP" in message
    assert get(handler, key) == (wire.ST_OK, b"x" * 100)     # still stored


def test_get_many_answers_in_request_order_with_absent_keys_as_none():
    handler = make_handler()
    present, absent = key_in(0), key_in(1)
    put(handler, present, b"here")
    request = wire.encode_get_many(next_id(), CLIENT_A, DHT_ID,
                                   [(1, absent), (0, present), (0, present)])
    answer = handler.handle(request)
    assert parse(answer, request)[0] == wire.ST_OK
    assert wire.decode_get_many_reply(answer) == [None, b"here", b"here"]


def test_get_many_answers_the_prefix_that_fits_and_the_rest_on_asking_again():
    handler = make_handler()
    entries = [(b, k) for b in HELD for k in keys_in(b, 5)]
    values = {k: bytes([i]) * (50 + i) for i, (_b, k) in enumerate(entries)}
    for key, value in values.items():
        put(handler, key, value)
    limit = 300
    answered = []
    remaining = entries
    rounds = 0
    while remaining:
        request = wire.encode_get_many(next_id(), CLIENT_A, DHT_ID, remaining)
        answer = handler.handle(request, limit)
        assert len(answer) <= limit
        assert parse(answer, request)[0] == wire.ST_OK
        page = wire.decode_get_many_reply(answer)
        assert 0 < len(page) < len(entries)
        answered.extend(page)
        remaining = remaining[len(page):]
        rounds += 1
    assert rounds > 2
    assert answered == [values[k] for _b, k in entries]


def test_get_many_whose_first_value_does_not_fit_is_reply_too_large():
    handler = make_handler()
    key = key_in(0)
    put(handler, key, b"x" * 500)
    request = wire.encode_get_many(next_id(), CLIENT_A, DHT_ID, [(0, key)])
    assert call(handler, request, reply_limit=400)[0] == wire.ST_REPLY_TOO_LARGE


def test_get_many_of_nothing_answers_nothing():
    handler = make_handler()
    answer = handler.handle(wire.encode_get_many(next_id(), CLIENT_A, DHT_ID, []))
    assert wire.decode_get_many_reply(answer) == []


def test_get_many_with_a_bucket_not_held_is_not_owner():
    handler = make_handler()
    request = wire.encode_get_many(next_id(), CLIENT_A, DHT_ID, [(0, key_in(0)), (6, key_in(6))])
    assert call(handler, request)[0] == wire.ST_NOT_OWNER


# ------------------------------------------------------------ scan

def scan_page(handler, bucket, scan_id, offset, limit):
    request = wire.encode_scan(next_id(), CLIENT_A, DHT_ID, bucket, scan_id, offset)
    answer = handler.handle(request, limit)
    status, _body = parse(answer, request)
    return status, answer


def scan_bucket(handler, bucket, limit, between_pages=None):
    """Every record of one bucket, page by page, as a list; and the page count."""
    records, pages, scan_id, offset = [], 0, 0, 0
    while True:
        status, answer = scan_page(handler, bucket, scan_id, offset, limit)
        assert status == wire.ST_OK
        assert len(answer) <= limit
        new_scan_id, offset, entries = wire.decode_scan_reply(answer)
        assert new_scan_id != 0
        assert scan_id in (0, new_scan_id)
        scan_id = new_scan_id
        records.extend(entries)
        pages += 1
        if offset == wire.SCAN_END:
            return records, pages
        if between_pages:
            between_pages(pages)


def test_scan_returns_every_record_exactly_once_across_pages():
    handler = make_handler()
    expected = {}
    for bucket in HELD:
        for i, key in enumerate(keys_in(bucket, 40)):
            value = b"v" * (i % 17)
            put(handler, key, value)
            expected[key] = value
    seen = []
    for bucket in HELD:
        records, pages = scan_bucket(handler, bucket, limit=150)
        assert pages > 5
        seen.extend(records)
    assert len(seen) == len(expected)
    assert dict(seen) == expected


def test_scan_skips_keys_deleted_mid_scan():
    handler = make_handler()
    keys = keys_in(2, 60)
    for key in keys:
        put(handler, key, b"value")
    deleted = set()

    def delete_some(pages):
        if pages == 1:
            for key in keys[30:45]:          # not yet returned: the first page is smaller
                assert call(handler, keyed(wire.OP_DELETE, key))[0] == wire.ST_OK
                deleted.add(key)

    records, pages = scan_bucket(handler, 2, limit=200, between_pages=delete_some)
    assert pages > 3
    returned = [key for key, _value in records]
    assert len(returned) == len(set(returned))
    assert not deleted & set(returned)
    assert set(returned) == set(keys) - deleted


def test_a_scan_sees_values_as_they_are_when_their_page_is_read():
    handler = make_handler()
    keys = keys_in(1, 30)
    for key in keys:
        put(handler, key, b"old")

    def update_last(pages):
        if pages == 1:
            put(handler, keys[-1], b"new")

    records, _pages = scan_bucket(handler, 1, limit=120, between_pages=update_last)
    assert len(records) == len(keys)
    assert dict(records)[keys[-1]] == b"new"


def test_concurrent_scans_get_their_own_ids():
    handler = make_handler()
    for key in keys_in(0, 20):
        put(handler, key, b"v")
    _s, first = scan_page(handler, 0, 0, 0, 100)
    _s, second = scan_page(handler, 0, 0, 0, 100)
    first_id = wire.decode_scan_reply(first)[0]
    second_id = wire.decode_scan_reply(second)[0]
    assert first_id != second_id


def test_a_scan_id_only_continues_the_bucket_it_was_started_on():
    handler = make_handler()
    for key in keys_in(0, 20):
        put(handler, key, b"v")
    for key in keys_in(1, 20):
        put(handler, key, b"w")
    _status, answer = scan_page(handler, 0, 0, 0, 100)
    scan_id, offset, _entries = wire.decode_scan_reply(answer)
    assert offset != wire.SCAN_END
    status, answer = scan_page(handler, 1, scan_id, offset, 100)
    assert status == wire.ST_MALFORMED
    assert b"start the iteration again" in answer


def test_scan_of_an_empty_bucket_ends_at_once():
    handler = make_handler()
    status, answer = scan_page(handler, 3, 0, 0, 1000)
    assert status == wire.ST_OK
    _scan_id, next_offset, entries = wire.decode_scan_reply(answer)
    assert (next_offset, entries) == (wire.SCAN_END, [])


def test_scan_with_an_unknown_scan_id_asks_to_start_again():
    handler = make_handler()
    status, answer = scan_page(handler, 0, 12345, 0, 1000)
    assert status == wire.ST_MALFORMED
    assert b"start the iteration again" in answer


def test_an_idle_scan_is_forgotten_after_its_ttl():
    clock = FakeClock()
    handler = make_handler(clock=clock)
    for key in keys_in(0, 20):
        put(handler, key, b"value")
    _status, answer = scan_page(handler, 0, 0, 0, 100)
    scan_id, offset, _entries = wire.decode_scan_reply(answer)
    clock.now += SCAN_TTL - 1
    status, answer = scan_page(handler, 0, scan_id, offset, 100)     # still alive
    assert status == wire.ST_OK
    scan_id, offset, _entries = wire.decode_scan_reply(answer)
    clock.now += SCAN_TTL                                            # idle too long
    assert scan_page(handler, 0, scan_id, offset, 100)[0] == wire.ST_MALFORMED


def scan_from(handler, bucket, client, limit=100):
    request = wire.encode_scan(next_id(), client, DHT_ID, bucket, 0, 0)
    answer = handler.handle(request, limit)
    return parse(answer, request)[0], answer


def test_scans_started_while_the_bucket_is_unchanged_share_one_snapshot():
    # Issue 15: each first page copied the bucket's key list.
    handler = make_handler()
    keys = keys_in(0, 50)
    for key in keys:
        put(handler, key, b"v")
    for client in range(100):
        assert scan_from(handler, 0, client)[0] == wire.ST_OK
    assert handler.stats()["scans"] == 100
    assert handler.stats()["scan_keys"] == 50          # not 100 copies
    # A change makes the next scan take its own snapshot, which sees it.
    put(handler, keys_in(0, 51)[-1], b"new")
    _status, answer = scan_from(handler, 0, 500, limit=wire.MAX_FRAME_BYTES)
    assert len(wire.decode_scan_reply(answer)[2]) == 51
    assert handler.stats()["scan_keys"] == 50           # (that scan ended: freed)
    # Every scan still walks its own snapshot to the end, once each.
    records, _pages = scan_bucket(handler, 0, limit=150)
    assert sorted(key for key, _value in records) == sorted(keys_in(0, 51))


def test_snapshots_past_the_key_bound_are_refused_busy_and_none_is_dropped():
    handler = make_handler(limits=Limits(max_scan_keys=100))
    keys = keys_in(1, 40)
    for key in keys:
        put(handler, key, b"v")
    started = []
    for client in range(4):
        status, answer = scan_from(handler, 1, client)
        started.append((status, answer))
        put(handler, keys[client], b"changed")      # the next scan needs a snapshot of its own
    assert [status for status, _answer in started] == [wire.ST_OK] * 2 + [wire.ST_BUSY] * 2
    assert handler.stats()["scan_keys"] == 80 and handler.counters["busy"] == 2
    # The open ones go on to the end.
    scan_id, offset, _entries = wire.decode_scan_reply(started[0][1])
    while offset != wire.SCAN_END:
        status, answer = scan_page(handler, 1, scan_id, offset, 100)
        assert status == wire.ST_OK
        scan_id, offset, _entries = wire.decode_scan_reply(answer)
    assert scan_from(handler, 1, 9)[0] == wire.ST_OK       # room again


def test_open_scans_are_bounded_in_total_and_per_client():
    handler = make_handler(limits=Limits(max_scans=5, max_scans_per_client=2))
    for key in keys_in(2, 30):
        put(handler, key, b"v")
    _status, oldest = scan_from(handler, 2, CLIENT_A)
    scan_from(handler, 2, CLIENT_A)
    scan_from(handler, 2, CLIENT_A)                     # past 2: A's oldest is forgotten
    scan_id, offset, _entries = wire.decode_scan_reply(oldest)
    assert scan_page(handler, 2, scan_id, offset, 100)[0] == wire.ST_MALFORMED
    assert handler.counters["scans_forgotten"] == 1
    for client in (7, 8, 9):
        assert scan_from(handler, 2, client)[0] == wire.ST_OK
    assert scan_from(handler, 2, 10)[0] == wire.ST_BUSY   # 5 open: others' are kept
    assert handler.stats()["scans"] == 5


def test_scan_of_a_record_bigger_than_the_limit_is_reply_too_large():
    handler = make_handler()
    put(handler, key_in(0), b"x" * 1000)
    assert scan_page(handler, 0, 0, 0, 500)[0] == wire.ST_REPLY_TOO_LARGE


def test_a_tcp_sized_scan_page_of_a_huge_bucket_stays_within_the_u16_entry_count():
    # Over TCP the reply limit is a whole frame (16 MiB), room for far more
    # than 65535 small records; the page's count field is a u16.
    handler = make_handler()
    repo = handler.dhts[DHT_ID].repos[0]
    for number in range(wire.MAX_BATCH + 5000):
        repo.put(b"%d" % number, b"")                     # setup straight into the bucket
    records, pages = scan_bucket(handler, 0, limit=wire.MAX_FRAME_BYTES)
    assert pages == 2
    assert len(records) == len(repo)
    assert {key for key, _value in records} == set(repo)
    assert handler.counters["internal_errors"] == 0


def test_scan_of_a_bucket_not_held_is_not_owner():
    handler = make_handler()
    assert scan_page(handler, 4, 0, 0, 1000)[0] == wire.ST_NOT_OWNER


# ------------------------------------------------------------ length, ping, stats

def length(handler):
    status, body = call(handler, wire.encode_length(next_id(), CLIENT_A, DHT_ID))
    assert status == wire.ST_OK
    return wire.U64.unpack(body)[0]


def test_length_counts_the_records_stored_here():
    handler = make_handler()
    assert length(handler) == 0
    keys = [k for b in HELD for k in keys_in(b, 3)]
    for key in keys:
        put(handler, key, b"v")
    assert length(handler) == len(keys)
    put(handler, keys[0], b"again")
    call(handler, keyed(wire.OP_DELETE, keys[1]))
    assert length(handler) == len(keys) - 1


def test_ping_names_the_service():
    handler = make_handler()
    status, body = call(handler, wire.request_header(wire.OP_PING, next_id(), CLIENT_A))
    assert status == wire.ST_OK
    assert wire.unpack(body) == {"name": "s1", "protocol": wire.VERSION}


def test_stats_report_requests_records_and_counters():
    handler = make_handler()
    put(handler, key_in(0), b"v")
    get(handler, key_in(0))
    handler.handle(b"junk")
    status, body = call(handler, wire.request_header(wire.OP_STATS, next_id(), CLIENT_A))
    assert status == wire.ST_OK
    stats = wire.unpack(body)
    assert stats["name"] == "s1"
    assert stats["requests"] == 4
    assert stats["by_op"] == {"put": 1, "get": 1, "stats": 1}
    assert stats["malformed"] == 1
    assert stats["dhts"] == {"t": {"records": 1, "active": True, "buckets": 8,
                                   "storage_buckets": 4, "routing_buckets": 8,
                                   "lookups": {"found": 0, "forwarded": 0},
                                   "layout_version": 0}}


def test_stats_count_replies_by_status():
    handler = make_handler()
    put(handler, key_in(0), b"v")
    get(handler, key_in(0))
    get(handler, key_in(1))                                          # absent
    get(handler, key_in(4))                                          # not stored here
    call(handler, wire.encode_keyed(wire.OP_GET, next_id(), CLIENT_A, 99, 0, b"\x03k"))
    handler.handle(b"junk")                                          # no reply at all
    stats = handler.stats()
    assert stats["by_status"] == {"ok": 2, "not_found": 1, "not_owner": 1, "unknown_dht": 1}
    assert sum(stats["by_status"].values()) == stats["requests"] - 1


def replicated_pair():
    """s1 and s2, each the primary of half of a 2-copy DHT and the backup of
    the other half, s1 writing to s2 in-process as it would over its link."""
    backups = [[[0, 4, "s2"], [4, 8, "s1"]]]
    handlers = {}
    for name in ("s1", "s2"):
        handlers[name] = RequestHandler(name, clock=FakeClock())
        handlers[name].assign(descriptor(replicas=2, storage_backups=backups))
    failing = set()

    def replicator(peer, _address, request, done, *args):
        if peer in failing:
            done(ConnectionError(f"the link to {peer} was lost"), *args)
            return
        reply = handlers[peer].handle(wire.encode_replicate(next_id(), 0x51, request))
        done(reply[wire.REPLY_HEADER_SIZE:], *args)

    handlers["s1"].replicator = replicator
    handlers["s1"].copy_failed = lambda *_args: None
    return handlers["s1"], handlers["s2"], failing


def test_a_replicated_change_is_counted_once_on_its_primary_and_as_replicate_on_its_backup():
    primary, backup, failing = replicated_pair()
    request = keyed(wire.OP_PUT, key_in(0), b"v")
    answers = []
    primary.handle(request).addCallback(answers.append)
    assert [parse(answer)[0] for answer in answers] == [wire.ST_OK]
    assert dict(backup.dhts[DHT_ID].backups[bucket_of(key_in(0), "xxh3", BUCKETS)]) == \
        {key_in(0): b"v"}
    stats = primary.stats()
    assert (stats["requests"], stats["by_op"], stats["by_status"]) == (1, {"put": 1}, {"ok": 1})
    stats = backup.stats()
    assert (stats["requests"], stats["by_op"], stats["by_status"], stats["replicated"]) == \
        (1, {"replicate": 1}, {"ok": 1}, 1)
    # a retry is answered from the cache (counted as a request and a reply
    # again), and not sent to the backup again
    assert primary.handle(request) == answers[0]
    assert primary.stats()["by_status"] == {"ok": 2} and primary.stats()["replayed"] == 1
    assert backup.stats()["requests"] == 1
    # a change the backup does not take is answered MOVING, once
    failing.add("s2")
    answers.clear()
    primary.handle(keyed(wire.OP_PUT, key_in(1), b"w")).addCallback(answers.append)
    assert [parse(answer)[0] for answer in answers] == [wire.ST_MOVING]
    stats = primary.stats()
    assert stats["by_status"] == {"ok": 2, "moving": 1}
    assert stats["by_op"] == {"put": 3} and stats["replication_failures"] == 1


@pytest.mark.parametrize("platform", ["domus-bsddb-btree", "domus-bsddb-hash", "domus-rbt"])
def test_stats_report_the_storage_bytes_of_each_dht_whose_platform_can_tell(platform):
    if platform == "domus-rbt" and not rbt.C_EXTENSION:
        pytest.skip("the pure-Python record tree reports no bytes held")
    handler = make_handler()                                     # python-dict: cannot tell
    handler.assign(descriptor(id=2, name="bdb", platform=platform))
    try:
        def storage_bytes():
            status, body = call(handler, wire.request_header(wire.OP_STATS, next_id(), CLIENT_A))
            assert status == wire.ST_OK
            dhts = wire.unpack(body)["dhts"]
            assert "storage_bytes" not in dhts["t"]
            assert dhts["bdb"]["records"] == stored_records
            return dhts["bdb"]["storage_bytes"]

        stored_records = 0
        empty = storage_bytes()
        if platform == "domus-rbt":
            assert empty == 0               # empty record trees hold nothing
        else:
            assert empty > 0                # each bucket's database has its first pages
        sizes = [empty]
        for batch in range(3):
            for key in keys_in(0, 1000, prefix=f"b{batch}-") + keys_in(2, 1000, f"b{batch}-"):
                put(handler, key, b"v" * 100, dht=2)
            stored_records += 2000
            sizes.append(storage_bytes())
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
        # 2,000 records of ~110 bytes take at least 220 kB of pages.
        assert sizes[-1] - sizes[0] >= 6000 * 110
        put(handler, key_in(0), b"v", dht=1)
        assert "storage_bytes" not in handler.stats()["dhts"]["t"]
    finally:
        handler.close()


# ------------------------------------------------------------ hostile requests

def expected_changes(data, seen_tokens):
    """The record changes docs/protocol.md allows ``data`` to make, worked out
    from the protocol decoders alone: [(bucket, key, value or None)]; empty
    when the request must change nothing (malformed, refused, or a retry)."""
    if len(data) < wire.REQUEST_HEADER_SIZE or data[0] != wire.REQUEST_MAGIC:
        return []
    if data[1] != wire.VERSION or data[2] not in wire.CHANGING_OPS:
        return []
    # The reply cache keys a reply by the whole request (its token and a hash
    # of its bytes) and keeps only changes that were applied.
    token = bytes(data)
    if token in seen_tokens:            # answered from the reply cache
        return []
    op = data[2]
    try:
        if op == wire.OP_PUT_MANY:
            dht_id, entries = wire.decode_put_many(data)
        else:
            dht_id, bucket, key, rest = wire.decode_keyed(data)
            if op == wire.OP_DELETE:
                if rest:
                    return []
                entries = [(bucket, key, None)]
            else:
                entries = [(bucket, key, wire.put_value(rest))]
    except ProtocolError:
        return []
    if dht_id != DHT_ID:
        return []
    numbered, here = data[3], wire.numbering(BUCKETS)
    if numbered > 33:
        return []                       # no bucket count says that: malformed
    local = []
    for bucket, key, value in entries:
        # A request numbered out of another bucket count is translated
        # (docs/protocol.md, "Resizing"): a finer bucket is the one it is
        # part of, a coarser one the key's own; either way if the key is in
        # the bucket the request names.
        if numbered and numbered > here:
            if bucket_of(key, "xxh3", wire.numbered_count(numbered)) != bucket:
                return []
            bucket >>= numbered - here
        elif numbered and numbered < here:
            mine = bucket_of(key, "xxh3", BUCKETS)
            if mine >> (here - numbered) != bucket:
                return []
            bucket = mine
        if bucket not in HELD or len(key) > wire.MAX_KEY_BYTES:
            return []
        if value is not None and len(value) > wire.MAX_VALUE_BYTES:
            return []
        local.append((bucket, key, value))
    seen_tokens.add(token)
    return local


def apply_changes(model, changes):
    for bucket, key, value in changes:
        if value is None:
            model[bucket].pop(key, None)
        else:
            model[bucket][key] = value


def base_requests(rng, existing):
    """Valid requests of every kind, aimed at held and not-held buckets."""
    def some_key():
        if existing and rng.random() < 0.6:
            return rng.choice(existing)
        return rng.randbytes(rng.randint(1, 12))

    def some_bucket():
        return rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 1 << 20])

    request_id, client_id = rng.getrandbits(32), rng.getrandbits(64)
    kind = rng.randrange(9)
    if kind == 0:
        return wire.encode_keyed(wire.OP_PUT, request_id, client_id, DHT_ID, some_bucket(),
                                 some_key(), rng.randbytes(rng.randint(0, 20)))
    if kind in (1, 2, 3):
        op = (wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS)[kind - 1]
        return wire.encode_keyed(op, request_id, client_id, DHT_ID, some_bucket(), some_key())
    if kind == 4:
        return wire.encode_put_many(request_id, client_id, DHT_ID, [
            (some_bucket(), some_key(), rng.randbytes(rng.randint(0, 8)))
            for _ in range(rng.randint(1, 5))])
    if kind == 5:
        return wire.encode_get_many(request_id, client_id, DHT_ID, [
            (some_bucket(), some_key()) for _ in range(rng.randint(1, 5))])
    if kind == 6:
        return wire.encode_scan(request_id, client_id, DHT_ID, some_bucket(),
                                rng.choice([0, 1, 2, rng.getrandbits(32)]), rng.randint(0, 50))
    if kind == 7:
        return wire.encode_length(request_id, client_id, DHT_ID)
    return wire.request_header(rng.choice([wire.OP_PING, wire.OP_STATS]), request_id, client_id)


def mutate(rng, data):
    data = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        how = rng.randrange(7)
        if how == 0 and data:                               # overwrite a byte
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == 1 and len(data) > wire.REQUEST_HEADER_SIZE:   # corrupt a body byte
            data[rng.randrange(wire.REQUEST_HEADER_SIZE, len(data))] ^= 1 << rng.randrange(8)
        elif how == 2:                                      # truncate
            del data[rng.randint(0, len(data)):]
        elif how == 3:                                      # extend
            data += rng.randbytes(rng.randint(1, 20))
        elif how == 4 and len(data) > 18:                   # a length/count field huge or 0
            position = rng.randrange(wire.REQUEST_HEADER_SIZE, len(data) - 1)
            data[position:position + 2] = rng.choice([b"\xff\xff", b"\x00\x00"])
        elif how == 5 and data:                             # delete a few bytes
            position = rng.randrange(len(data))
            del data[position:position + rng.randint(1, 6)]
        elif how == 6:                                      # insert a few bytes
            position = rng.randint(0, len(data))
            data[position:position] = rng.randbytes(rng.randint(1, 6))
    return bytes(data)


def hostile_request(rng, existing, history):
    choice = rng.random()
    if history and choice < 0.05:
        return rng.choice(history)                                  # a retry
    if history and choice < 0.1:
        earlier = bytearray(rng.choice(history))                    # same token, other body
        if len(earlier) > wire.REQUEST_HEADER_SIZE:
            earlier[rng.randrange(wire.REQUEST_HEADER_SIZE, len(earlier))] ^= 0xFF
        return bytes(earlier)
    data = hostile_request_of_new_kind(rng, existing, choice)
    history.append(data)
    return data


def hostile_request_of_new_kind(rng, existing, choice):
    if choice < 0.2:
        return rng.randbytes(rng.randint(0, 60))                    # pure noise
    if choice < 0.3:
        noise = rng.randbytes(rng.randint(0, 60))                   # noise with a header
        return wire.request_header(rng.randrange(256), rng.getrandbits(32),
                                   rng.getrandbits(64)) + noise
    return mutate(rng, base_requests(rng, existing))


def check_hostile_request(handler, data, model, seen_tokens):
    malformed_before = handler.counters["malformed"]
    answer = handler.handle(data, rng_limit(data))
    if len(data) < wire.REQUEST_HEADER_SIZE or data[0] != wire.REQUEST_MAGIC:
        assert answer is None
        assert handler.counters["malformed"] == malformed_before + 1
    else:
        assert isinstance(answer, bytes)
        assert answer[:2] == bytes((wire.REPLY_MAGIC, wire.VERSION))
        assert answer[4:8] == data[4:8]                  # the request id is echoed
    apply_changes(model, expected_changes(data, seen_tokens))
    assert stored(handler) == model
    assert handler.counters["internal_errors"] == 0


def rng_limit(data):
    # Vary the reply limit deterministically with the request.
    return (200, 1000, wire.MAX_UDP_PAYLOAD)[len(data) % 3]


def test_10000_hostile_requests_never_raise_and_change_only_what_valid_changes_allow():
    rng = random.Random(0xD00D)
    handler = filled_handler(per_bucket=10)
    snapshot = stored(handler)
    model = {bucket: dict(records) for bucket, records in snapshot.items()}
    # Requests are built around the targets; the bystanders are never named,
    # so no request can validly change them (the model would say if one did).
    keys = sorted(key for records in snapshot.values() for key in records)
    targets, bystanders = keys[::2], keys[1::2]
    seen_tokens = set()
    dropped = 0
    touched = set()
    history = []
    for _ in range(10_000):
        data = hostile_request(rng, targets, history)
        if len(data) < wire.REQUEST_HEADER_SIZE or data[0] != wire.REQUEST_MAGIC:
            dropped += 1
        changes = expected_changes(data, set(seen_tokens))
        touched.update(key for _bucket, key, _value in changes)
        check_hostile_request(handler, data, model, seen_tokens)
    # The mix really exercised the handler's error paths, and some mutated
    # requests were still valid changes (which the model tracked).
    assert dropped > 500
    assert handler.counters["malformed"] > dropped + 2000
    assert handler.counters["errors"] > 500
    assert touched & set(targets)
    # (Retries of applied changes, byte for byte: the cache keys the whole
    # request, so a mutated one is a request of its own.)
    assert handler.counters["replayed"] > 0
    # Every bystander is exactly as it was.
    after = stored(handler)
    assert not touched & set(bystanders)
    for bucket, records in snapshot.items():
        for key in set(records) & set(bystanders):
            assert after[bucket][key] == records[key]


def test_requests_that_cannot_be_valid_changes_never_change_a_record():
    # No oracle needed: truncated or extended batches and deletes, puts cut
    # inside their key, requests for buckets or DHTs not held here, and bad
    # versions are all refused whole, and every one gets a fresh token.
    rng = random.Random(7)
    handler = filled_handler(per_bucket=10)
    snapshot = stored(handler)
    existing = [(b, k) for b, records in snapshot.items() for k in records]
    refused = {wire.ST_MALFORMED, wire.ST_NOT_OWNER, wire.ST_UNKNOWN_DHT,
               wire.ST_BAD_VERSION, wire.ST_TOO_LARGE}
    for number in range(3000):
        request_id, client = number, 0xF00D
        bucket, key = rng.choice(existing)
        value = rng.randbytes(rng.randint(0, 10))
        entries = [(b, k, b"changed") for b, k in rng.sample(existing, 3)]
        kind = number % 8
        if kind == 0:
            full = wire.encode_put_many(request_id, client, DHT_ID, entries)
            data = full[:rng.randrange(len(full))]
        elif kind == 1:
            data = wire.encode_put_many(request_id, client, DHT_ID, entries) + rng.randbytes(
                rng.randint(1, 9))
        elif kind == 2:
            full = wire.encode_keyed(wire.OP_DELETE, request_id, client, DHT_ID, bucket, key)
            data = full[:rng.randrange(len(full))]
        elif kind == 3:
            data = wire.encode_keyed(wire.OP_DELETE, request_id, client, DHT_ID, bucket,
                                     key) + rng.randbytes(rng.randint(1, 9))
        elif kind == 4:
            full = wire.encode_keyed(wire.OP_PUT, request_id, client, DHT_ID, bucket, key, value)
            data = full[:rng.randrange(len(full))]  # cut anywhere, the value included
        elif kind == 5:
            other = rng.choice([4, 5, 6, 7, 8, 1 << 31])
            op = rng.choice([wire.OP_PUT, wire.OP_DELETE])
            data = wire.encode_keyed(op, request_id, client, DHT_ID, other, key,
                                     value if op == wire.OP_PUT else b"")
        elif kind == 6:
            spot = rng.randint(0, len(entries))
            data = wire.encode_put_many(request_id, client, DHT_ID,
                                        entries[:spot] + [(6, key, value)] + entries[spot:])
        else:
            data = bytearray(wire.encode_keyed(wire.OP_PUT, request_id, client,
                                               rng.choice([DHT_ID + 1, 0]), bucket, key, value))
            if rng.random() < 0.5:
                data[1] = rng.choice([0, 2, 255])
            data = bytes(data)
        answer = handler.handle(data)
        if answer is not None:
            assert parse(answer)[0] in refused
    assert stored(handler) == snapshot
    assert handler.counters["replayed"] == 0
    assert handler.counters["internal_errors"] == 0


@settings(deadline=None, max_examples=300)
@given(st.randoms(use_true_random=False))
def test_hostile_request_sequences_match_the_protocol_model(rng):
    handler = filled_handler(per_bucket=3)
    model = stored(handler)
    existing = [key for records in model.values() for key in records]
    seen_tokens = set()
    history = []
    for _ in range(6):
        check_hostile_request(handler, hostile_request(rng, existing, history), model,
                              seen_tokens)


def test_bucket_load_finds_the_hot_buckets_from_samples():
    """One request in SAMPLE_EVERY is sampled; bucket_load turns the samples
    into requests per second per bucket, busiest first, and starts again."""
    from domus.service.handler import SAMPLE_EVERY

    handler = make_handler()
    hot, warm = key_in(1), key_in(2)
    rng = random.Random(4)
    for _ in range(SAMPLE_EVERY * 200):
        get(handler, hot if rng.random() < 0.75 else warm)
    load = handler.bucket_load(2.0)["t"]
    assert list(load) == [1, 2]                            # the hottest first
    total = SAMPLE_EVERY * 200 / 2.0                       # requests per second
    assert abs(load[1] - 0.75 * total) < 0.1 * total
    assert abs(load[2] - 0.25 * total) < 0.1 * total
    assert handler.bucket_load(1.0) == {}                  # taken: afresh


def test_the_reply_cache_takes_as_many_changes_as_the_service_is_told():
    # (--reply-cache-entries N: N/2 changes per 15 s, then BUSY, nothing applied)
    handler = make_handler(limits=Limits(reply_cache_entries=8))
    keys = keys_in(2, 6)
    statuses = [put(handler, key, b"v")[0] for key in keys]
    assert statuses == [wire.ST_OK] * 4 + [wire.ST_BUSY] * 2
    assert sorted(stored(handler)[2]) == sorted(keys[:4])
    assert make_handler().reply_cache.current_limit == 4_000_000      # (the default)
    with pytest.raises(ValueError, match="reply_cache_entries"):
        Limits(reply_cache_entries=0)
