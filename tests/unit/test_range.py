"""Key ranges: the RANGE wire format, and the handler's answers on ordered
(domus-rbt) and unordered (python-dict) DHTs, checked against a sorted model."""

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domus.errors import ProtocolError
from domus.service import hotpath
from domus.service.handler import RequestHandler
from domus.storage import DictRepository, RBTreeRepository, Repository
from domus.wire import protocol as wire
from domus.wire.keys import bucket_of, encode_key

RangeQuery = wire.RangeQuery
DHT_ID = 1
BUCKETS = 8
HELD = range(0, 4)          # s1 stores buckets 0..3; s2 stores 4..7
CLIENT_A = 0xA
_request_ids = itertools.count(1)


def next_id():
    return next(_request_ids) & 0xFFFFFFFF


def descriptor(**changes):
    base = {
        "id": DHT_ID, "name": "t", "buckets": BUCKETS, "hash": "xxh3", "storage": "ram",
        "platform": "domus-rbt", "routing": "chord", "lookup": "D", "state": "active",
        "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 8}],
        "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 4},
                             {"name": "s2", "address": "127.0.0.1:2", "count": 4}],
    }
    return {**base, **changes}


def keyed(op, key, value=b""):
    return wire.encode_keyed(op, next_id(), CLIENT_A, DHT_ID, bucket_of(key, "xxh3", BUCKETS),
                             key, value)


def parse(answer, request=None):
    """(status, body) of a reply; checks the reply echoes the request id."""
    assert isinstance(answer, bytes)
    status, _request_id = wire.decode_reply_header(answer)
    if request is not None:
        assert answer[4:8] == request[4:8]
    return status, answer[wire.REPLY_HEADER_SIZE:]

# ------------------------------------------------------------ the wire format

bounds = st.one_of(st.none(), st.binary(min_size=1, max_size=40))
queries = st.builds(RangeQuery, st.integers(0, 0xFFFFFFFF), bounds, bounds, st.booleans(),
                    st.booleans(), st.booleans(), st.booleans(), st.integers(0, 0xFFFF))
entries = st.lists(st.tuples(st.binary(min_size=1, max_size=30), st.binary(max_size=60)),
                   max_size=20)


@given(queries, st.integers(0, 0xFFFFFFFF), st.integers(0, 2**64 - 1))
def test_a_range_request_round_trips(query, request_id, client_id):
    message = wire.encode_range(request_id, client_id, query)
    assert wire.decode_request_header(message) == (wire.OP_RANGE, request_id, client_id)
    assert wire.decode_range(message) == query


@given(entries, st.booleans(), st.integers(0, 0xFFFFFFFF))
def test_a_range_reply_round_trips(page, more, request_id):
    more = more and bool(page)
    data = wire.encode_range_reply(request_id, page, more)
    assert wire.decode_reply_header(data) == (wire.ST_OK, request_id)
    assert wire.decode_range_reply(data) == (page, more)
    assert len(data) == wire.RANGE_REPLY_OVERHEAD + sum(
        wire.range_entry_size(key, value) for key, value in page)


def test_the_request_layout_is_the_documented_one():
    query = RangeQuery(7, b"\x03a", None, True, False, True, True, 300)
    body = wire.encode_range(1, 2, query)[wire.REQUEST_HEADER_SIZE:]
    # dht u32, flags u8 (low given | low inclusive | reverse | keys only), max u16,
    # low (u16 length, bytes), high (u16 length 0)
    assert body == (b"\x00\x00\x00\x07" + bytes([0x01 | 0x04 | 0x10 | 0x20]) + b"\x01\x2c"
                    + b"\x00\x02\x03a" + b"\x00\x00")
    reply = wire.encode_range_reply(9, [(b"\x03a", b"v")], True)[wire.REPLY_HEADER_SIZE:]
    assert reply == b"\x00\x01" + b"\x01" + b"\x00\x02\x00\x00\x00\x01" + b"\x03a" + b"v"


@given(queries)
def test_every_truncation_or_extension_of_a_request_is_refused(query):
    message = wire.encode_range(1, 2, query)
    for end in range(wire.REQUEST_HEADER_SIZE, len(message)):
        with pytest.raises(ProtocolError):
            wire.decode_range(message[:end])
    with pytest.raises(ProtocolError):
        wire.decode_range(message + b"\x00")


def raw_range(flags, low=b"", high=b"", dht=DHT_ID, max_entries=0, request_id=None):
    """A RANGE request built by hand (no checks), for malformed ones."""
    return (wire.request_header(wire.OP_RANGE, request_id or next_id(), CLIENT_A)
            + wire.RANGE.pack(dht, flags, max_entries)
            + wire.U16.pack(len(low)) + low + wire.U16.pack(len(high)) + high)


MALFORMED_BODIES = {
    "unknown flag bit 6": raw_range(0x40),
    "unknown flag bit 7": raw_range(0x80 | wire.RANGE_LOW, b"\x03a"),
    "low given but empty": raw_range(wire.RANGE_LOW),
    "high given but empty": raw_range(wire.RANGE_HIGH),
    "low not given but carried": raw_range(0, b"\x03a"),
    "high not given but carried": raw_range(wire.RANGE_LOW, b"\x03a", b"\x03b"),
    "no body": wire.request_header(wire.OP_RANGE, 1, CLIENT_A),
    "no bounds": wire.request_header(wire.OP_RANGE, 1, CLIENT_A) + wire.RANGE.pack(1, 0, 0),
    "no high bound": (wire.request_header(wire.OP_RANGE, 1, CLIENT_A)
                      + wire.RANGE.pack(1, 0, 0) + b"\x00\x00"),
    "low runs past the end": (wire.request_header(wire.OP_RANGE, 1, CLIENT_A)
                              + wire.RANGE.pack(1, wire.RANGE_LOW, 0) + b"\x00\x09\x03abc"),
    "stray byte": raw_range(0) + b"\x00",
}


@pytest.mark.parametrize("name", sorted(MALFORMED_BODIES))
def test_malformed_request_bodies_do_not_decode(name):
    with pytest.raises(ProtocolError):
        wire.decode_range(MALFORMED_BODIES[name])


def test_an_empty_given_bound_cannot_be_encoded():
    with pytest.raises(ValueError):
        wire.encode_range(1, 2, RangeQuery(1, b"", None))


@pytest.mark.parametrize("data", [
    wire.reply(wire.ST_OK, 1),                                       # no count
    wire.reply(wire.ST_OK, 1, b"\x00\x00"),                          # no more byte
    wire.reply(wire.ST_OK, 1, b"\x00\x00\x02"),                      # more is 0 or 1
    wire.reply(wire.ST_OK, 1, b"\x00\x00\x01"),                      # more, yet no entry
    wire.reply(wire.ST_OK, 1, b"\x00\x01\x00"),                      # entry missing
    wire.reply(wire.ST_OK, 1, b"\x00\x01\x00\x00\x02\x00\x00\x00\x01\x03a"),  # value cut
    wire.encode_range_reply(1, [(b"\x03a", b"v")], False) + b"!",   # stray byte
])
def test_malformed_replies_do_not_decode(data):
    with pytest.raises(ProtocolError):
        wire.decode_range_reply(data)


# ------------------------------------------------------------ the handler

def range_handler(platform="domus-rbt", records=300, seed=7, data_dir=None):
    """A handler storing buckets 0..3 of an 8-bucket DHT, filled through PUT
    requests with ``records`` records of mixed keys (ints of both signs and
    beyond 64 bits, str, bytes) and values of 0..400 bytes; and the records
    (encoded key -> value)."""
    handler = RequestHandler("s1", data_dir=data_dir)
    handler.assign(descriptor(platform=platform))
    rng = random.Random(seed)
    stored = {}
    while len(stored) < records:
        kind = rng.randrange(5)
        if kind == 0:
            key = rng.randint(-1000, 1000)
        elif kind == 1:
            key = rng.choice((1, -1)) * rng.getrandbits(rng.randint(60, 90))
        elif kind == 2:
            key = "".join(rng.choice("abcxyz é中") for _ in range(rng.randint(0, 6)))
        else:
            key = rng.randbytes(rng.randint(0, 6))
        encoded = encode_key(key)
        if bucket_of(encoded, "xxh3", BUCKETS) not in HELD:
            continue
        value = rng.randbytes(rng.choice([0, 1, 20, 150, 400]))
        status, _body = parse(handler.handle(keyed(wire.OP_PUT, encoded, value)))
        assert status == wire.ST_OK
        stored[encoded] = value
    return handler, stored


def model_range(records, query):
    """What the range holds, in order: the sorted model's answer."""
    def inside(key):
        if query.low is not None and (key < query.low
                                      or (key == query.low and not query.low_inclusive)):
            return False
        if query.high is not None and (key > query.high
                                       or (key == query.high and not query.high_inclusive)):
            return False
        return True

    keys = sorted(key for key in records if inside(key))
    if query.reverse:
        keys.reverse()
    return [(key, b"" if query.keys_only else records[key]) for key in keys]


def range_page(handler, query, limit=wire.MAX_UDP_PAYLOAD, fast=False):
    request = wire.encode_range(next_id(), CLIENT_A, query)
    answer = (handler.handle_fast if fast else handler.handle)(request, limit)
    status, body = parse(answer, request)
    if status != wire.ST_OK:
        return status, body
    assert len(answer) <= limit
    return status, wire.decode_range_reply(answer)


def continue_after(query, last_key):
    if query.reverse:
        return query._replace(high=last_key, high_inclusive=False)
    return query._replace(low=last_key, low_inclusive=False)


def whole_range(handler, query, limit=wire.MAX_UDP_PAYLOAD, between_pages=None):
    """Every page of a range as a client walks it: the last key of each page
    is the next one's exclusive bound; a page too large for ``limit`` is asked
    for again with a TCP frame's limit."""
    got, pages = [], 0
    while True:
        status, answer = range_page(handler, query, limit)
        if status == wire.ST_REPLY_TOO_LARGE:
            status, answer = range_page(handler, query, wire.MAX_FRAME_BYTES)
        assert status == wire.ST_OK, answer
        page, more = answer
        got.extend(page)
        pages += 1
        if not more:
            return got, pages
        query = continue_after(query, page[-1][0])
        if between_pages is not None:
            between_pages(pages)


FILLED, RECORDS = range_handler()
STORED_KEYS = sorted(RECORDS)


@st.composite
def range_queries(draw):
    def bound():
        shape = draw(st.integers(0, 4))
        if shape == 0:
            return None
        if shape in (1, 2):
            return draw(st.sampled_from(STORED_KEYS))      # exactly a stored key
        if shape == 3:
            key = draw(st.sampled_from(STORED_KEYS))
            return key[:draw(st.integers(1, len(key)))]     # a prefix of one
        return draw(st.binary(min_size=1, max_size=10))

    return RangeQuery(DHT_ID, bound(), bound(), draw(st.booleans()), draw(st.booleans()),
                      draw(st.booleans()), draw(st.booleans()),
                      draw(st.sampled_from([0, 0, 1, 2, 7, 50, 1000, 0xFFFF])))


LIMITS = [wire.RANGE_REPLY_OVERHEAD + 20, 200, 1000, 5000, wire.MAX_UDP_PAYLOAD]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(range_queries(), st.sampled_from(LIMITS))
def test_a_page_is_the_longest_prefix_of_the_model_that_fits(query, limit):
    expected = model_range(RECORDS, query)
    status, answer = range_page(FILLED, query, limit)
    if status == wire.ST_REPLY_TOO_LARGE:
        # Only when not even the first entry fits.
        first_key, first_value = expected[0]
        assert (wire.RANGE_REPLY_OVERHEAD + wire.range_entry_size(first_key, first_value)
                > limit)
        assert b"TCP" in answer
        return
    assert status == wire.ST_OK, answer
    page, more = answer
    assert page == expected[:len(page)]
    assert more == (len(page) < len(expected))
    if query.max_entries:
        assert len(page) <= query.max_entries
    if more:   # the page stopped for a reason: the count, or the next entry's size
        size = wire.RANGE_REPLY_OVERHEAD + sum(wire.range_entry_size(*entry) for entry in page)
        next_size = wire.range_entry_size(*expected[len(page)])
        assert len(page) == query.max_entries or size + next_size > limit


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(range_queries(), st.sampled_from(LIMITS))
def test_paging_by_continuation_gives_exactly_the_model(query, limit):
    got, _pages = whole_range(FILLED, query, limit)
    assert got == model_range(RECORDS, query)


def test_a_whole_range_in_small_pages_walks_every_record_in_order():
    query = RangeQuery(DHT_ID, None, None, max_entries=7)
    got, pages = whole_range(FILLED, query)
    assert [key for key, _value in got] == STORED_KEYS
    assert pages == -(-len(RECORDS) // 7)
    backwards, _pages = whole_range(FILLED, query._replace(reverse=True, keys_only=True))
    assert backwards == [(key, b"") for key in reversed(STORED_KEYS)]


def test_the_range_merges_every_bucket_stored_here():
    repos = FILLED.dhts[DHT_ID].repos
    assert sorted(repos) == list(HELD)
    assert all(len(repo) > 10 for repo in repos.values()), "every bucket should hold records"
    got, _pages = whole_range(FILLED, RangeQuery(DHT_ID, None, None))
    assert dict(got) == {key: value for repo in repos.values() for key, value in repo.items()}


def test_bounds_out_of_order_or_excluding_each_other_give_an_empty_range():
    key = STORED_KEYS[10]
    for query in (RangeQuery(DHT_ID, STORED_KEYS[20], STORED_KEYS[5]),
                  RangeQuery(DHT_ID, key, key, True, False),
                  RangeQuery(DHT_ID, key, key, False, True),
                  RangeQuery(DHT_ID, b"\xff", None)):
        assert range_page(FILLED, query) == (wire.ST_OK, ([], False))
    assert range_page(FILLED, RangeQuery(DHT_ID, key, key)) == (
        wire.ST_OK, ([(key, RECORDS[key])], False))


def test_a_service_storing_no_bucket_of_the_dht_answers_an_empty_range():
    handler = RequestHandler("s3")            # not among the DHT's storage services
    handler.assign(descriptor(platform="domus-rbt"))
    assert handler.dhts[DHT_ID].repos == {}
    assert range_page(handler, RangeQuery(DHT_ID, None, None)) == (wire.ST_OK, ([], False))


def test_a_record_too_large_for_a_datagram_is_reply_too_large_then_fits_a_frame():
    handler, _records = range_handler(records=0)
    key = next(key for key in (encode_key(f"big-{n}") for n in itertools.count())
               if bucket_of(key, "xxh3", BUCKETS) in HELD)
    big = b"x" * 70_000
    assert parse(handler.handle(keyed(wire.OP_PUT, key, big), wire.MAX_FRAME_BYTES))[0] == 0
    status, message = range_page(handler, RangeQuery(DHT_ID, None, None))
    assert status == wire.ST_REPLY_TOO_LARGE
    assert b"TCP" in message
    assert range_page(handler, RangeQuery(DHT_ID, None, None), wire.MAX_FRAME_BYTES) == (
        wire.ST_OK, ([(key, big)], False))
    # Keys only: it fits a datagram.
    assert range_page(handler, RangeQuery(DHT_ID, None, None, keys_only=True)) == (
        wire.ST_OK, ([(key, b"")], False))


def test_each_stable_key_once_and_in_order_while_others_are_written_between_pages():
    handler, records = range_handler(records=400, seed=11)
    stable = set(records)
    rng = random.Random(3)
    churned = []

    def churn(_pages):
        # New keys everywhere in the key space, and deletes of earlier new ones.
        for _ in range(15):
            key = encode_key(f"churn-{rng.random()}") if rng.random() < 0.5 else encode_key(
                rng.randint(-10**6, 10**6) * 1000 + 1)
            if key in stable or bucket_of(key, "xxh3", BUCKETS) not in HELD:
                continue
            assert parse(handler.handle(keyed(wire.OP_PUT, key, b"c")))[0] == wire.ST_OK
            churned.append(key)
        if len(churned) > 30:
            victim = churned.pop(rng.randrange(len(churned)))
            assert parse(handler.handle(keyed(wire.OP_DELETE, victim)))[0] == wire.ST_OK

    for reverse in (False, True):
        query = RangeQuery(DHT_ID, None, None, reverse=reverse, keys_only=True, max_entries=9)
        got, pages = whole_range(handler, query, between_pages=churn)
        keys = [key for key, _value in got]
        assert pages > 40
        assert keys == sorted(keys, reverse=reverse)
        assert len(keys) == len(set(keys)), "a key came twice"
        assert stable <= set(keys), "a key present all along was missed"


# ------------------------------------------------------------ errors

def snapshot(handler):
    return {dht_id: {bucket: dict(repo.items()) for bucket, repo in hosted.repos.items()}
            for dht_id, hosted in handler.dhts.items()}


@pytest.mark.parametrize("name", sorted(MALFORMED_BODIES))
def test_a_malformed_range_is_answered_malformed_and_changes_nothing(name):
    handler, _records = range_handler(records=40)
    before = snapshot(handler)
    request = MALFORMED_BODIES[name]
    status, message = parse(handler.handle(request), request)
    assert status == wire.ST_MALFORMED
    assert message.startswith(b"malformed range: ")
    assert handler.counters["malformed"] == 1
    assert snapshot(handler) == before


@settings(max_examples=100, deadline=None)
@given(range_queries(), st.data())
def test_truncated_ranges_are_answered_malformed(query, data):
    request = wire.encode_range(next_id(), CLIENT_A, query)
    end = data.draw(st.integers(wire.REQUEST_HEADER_SIZE, len(request) - 1))
    status, _message = parse(FILLED.handle(request[:end]), request)
    assert status == wire.ST_MALFORMED


def test_a_range_on_an_unordered_platform_says_why_and_what_to_use():
    handler, _records = range_handler(platform="python-dict", records=20)
    status, message = range_page(handler, RangeQuery(DHT_ID, None, None))
    assert status == wire.ST_UNSUPPORTED
    assert message.decode() == ("DHT 't' uses platform python-dict, which keeps no key order; "
                                "key ranges need domus-rbt or domus-bsddb-btree")
    assert handler.counters["errors"] == 1
    assert wire.STATUS_NAMES[wire.ST_UNSUPPORTED]


def test_a_range_on_an_unknown_dht_is_unknown_dht():
    status, message = range_page(FILLED, RangeQuery(99, None, None))
    assert status == wire.ST_UNKNOWN_DHT
    assert b"no DHT with id 99" in message


def test_a_range_on_an_inactive_dht_is_inactive(tmp_path):
    handler, _records = range_handler(records=5, data_dir=str(tmp_path))
    handler.assign(descriptor(platform="domus-rbt", state="inactive"))
    status, message = range_page(handler, RangeQuery(DHT_ID, None, None))
    assert status == wire.ST_INACTIVE
    assert b"inactive" in message


def test_ranges_are_counted_by_op():
    handler, _records = range_handler(records=5)
    range_page(handler, RangeQuery(DHT_ID, None, None))
    range_page(handler, RangeQuery(DHT_ID, b"\x03", None))
    assert handler.stats()["by_op"]["range"] == 2


# ------------------------------------------------------------ repositories

def test_only_ordered_repositories_walk_key_ranges():
    assert Repository.ordered is False and DictRepository.ordered is False
    assert RBTreeRepository.ordered is True
    with pytest.raises(NotImplementedError, match="keeps no key order"):
        DictRepository().key_range(None, None)
    tree = RBTreeRepository()
    for number in range(10):
        tree.put(bytes([number]), bytes([number]) * 2)
    assert list(tree.key_range(b"\x02", b"\x05", inclusive=(False, True), reverse=True,
                               items=True)) == [(bytes([n]), bytes([n]) * 2) for n in (5, 4, 3)]
    assert list(tree.key_range(None, b"\x01")) == [b"\x00", b"\x01"]


# ------------------------------------------------------------ the C path

@pytest.mark.skipif(hotpath.FastPath is None,
                    reason="the C hot path is not built or DOMUS_PURE_PYTHON=1")
@pytest.mark.parametrize("platform", ["domus-rbt", "python-dict"])
def test_the_c_path_declines_range_and_python_answers_it(platform):
    handler, _records = range_handler(platform=platform, records=50)
    requests = [wire.encode_range(next_id(), CLIENT_A, RangeQuery(DHT_ID, None, None)),
                wire.encode_range(next_id(), CLIENT_A,
                                  RangeQuery(DHT_ID, b"\x03", None, False, True, True, True, 3)),
                wire.encode_range(next_id(), CLIENT_A, RangeQuery(99, None, None)),
                MALFORMED_BODIES["stray byte"]]
    for request in requests:
        fallbacks = handler.fast.fallbacks
        assert handler.fast.handle(request) is None
        assert handler.fast.fallbacks == fallbacks + 1
        assert handler.handle_fast(request) == handler.handle(request)
