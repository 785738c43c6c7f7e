"""domus.client.batch: how batches are cut into datagrams and replies taken in."""

import collections

import pytest

from domus.client import batch
from domus.client.lookup import DirectLookup
from domus.errors import StorageError, ValueTooLarge
from domus.wire import protocol as wire


class Ids:
    client_id = 7

    def __init__(self):
        self.counter = 0

    def next(self):
        self.counter += 1
        return self.counter


def test_chunks_fill_datagrams_without_exceeding_them():
    sizes = [1000] * 200
    runs = list(batch.chunks(list(range(200)), sizes))
    assert [entry for run in runs for entry in run] == list(range(200))
    for run in runs:
        assert wire.BATCH_OVERHEAD + 1000 * len(run) <= wire.DEFAULT_MAX_DATAGRAM
    # Full runs: adding the next entry would not have fitted.
    for run in runs[:-1]:
        assert wire.BATCH_OVERHEAD + 1000 * (len(run) + 1) > wire.DEFAULT_MAX_DATAGRAM


def test_chunks_respect_the_entry_limit():
    runs = list(batch.chunks(list(range(10)), [1] * 10, limit=3))
    assert runs == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]


def test_an_entry_larger_than_a_datagram_gets_a_run_of_its_own():
    sizes = [10, wire.DEFAULT_MAX_DATAGRAM * 2, 10]
    assert list(batch.chunks(["a", "big", "b"], sizes)) == [["a"], ["big"], ["b"]]


def test_no_entries_no_runs():
    assert list(batch.chunks([], [])) == []


def test_check_values_refuses_the_whole_batch():
    with pytest.raises(ValueTooLarge, match="nothing was stored"):
        batch.check_values([b"ok", b"x" * (wire.MAX_VALUE_BYTES + 1)])


def bucket_from_key_number(encoded):
    """A hash function for keys b"\x03k<n>": bucket n % 16 of 16."""
    return (int(encoded[2:]) % 16) << 60


def test_put_requests_decode_back_to_every_entry():
    keys = [b"\x03k%d" % i for i in range(5000)]
    values = [b"v%d" % i for i in range(5000)]
    owners = ["s1", "s2"] * 8  # even buckets on s1, odd ones on s2
    requests = batch.put_requests(keys, values, bucket_from_key_number, 60, owners,
                                  dht_id=9, ids=Ids())
    seen = {}
    for channel, message in requests:
        assert len(message) <= wire.DEFAULT_MAX_DATAGRAM
        dht_id, entries = wire.decode_put_many(message)
        assert dht_id == 9
        for bucket, key, value in entries:
            seen[key] = (channel, bucket, value)
    assert len(seen) == 5000
    for position, (key, value) in enumerate(zip(keys, values)):
        assert seen[key] == ("s1" if position % 2 == 0 else "s2", position % 16, value)


def ok_put_many_reply(applied, created):
    return wire.reply(wire.ST_OK, 1, wire.U16X2.pack(applied, created))


class Channels:
    """A cluster stand-in for DirectLookup: channels are (name, address)."""

    ids = None

    def channel(self, name, address):
        return Channel(name, address)


Channel = collections.namedtuple("Channel", "name address")
TWO_SERVICES = {
    "id": 5, "name": "words", "buckets": 16, "hash": "xxh3", "routing": "chord",
    "lookup": "D",
    "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 8},
                         {"name": "s2", "address": "127.0.0.1:2", "count": 8}],
    "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 16}],
}


def test_a_put_round_adds_up_and_sends_again_what_was_not_applied():
    lookup = DirectLookup(Channels(), TWO_SERVICES)
    s1, s2, s3 = (Channel(f"s{n}", f"127.0.0.1:{n}") for n in (1, 2, 3))
    moved = wire.encode_put_many(2, 9, 5, [(9, b"\x03a", b"1"), (10, b"\x03b", b"2")])
    moving = wire.encode_put_many(3, 9, 5, [(3, b"\x03c", b"3")])
    requests = [(s1, b""), (s2, moved), (s3, moving), (s1, b"")]
    replies = [ok_put_many_reply(10, 4), wire.error_reply(wire.ST_NOT_OWNER, 2, "moved"),
               wire.error_reply(wire.ST_MOVING, 3, "moving"), ok_put_many_reply(5, 5)]
    created, keys, values, not_owner, is_moving = lookup._put_round(requests, replies)
    assert (created, not_owner, is_moving) == (9, 1, True)
    assert keys == [b"\x03a", b"\x03b", b"\x03c"] and values == [b"1", b"2", b"3"]


def test_a_put_round_raises_the_error_of_a_failed_message():
    lookup = DirectLookup(Channels(), TWO_SERVICES)
    requests = [(Channel("s1", "127.0.0.1:1"), b"")]
    with pytest.raises(StorageError, match="s1"):
        lookup._put_round(requests, [wire.error_reply(wire.ST_STORAGE_ERROR, 1, "disk full")])


def test_get_many_asks_again_for_what_did_not_fit_and_shrinks_its_requests():
    wanted = list(range(100))
    encoded = [b"\x03%d" % key for key in wanted]
    state = batch.GetMany(wanted, encoded)
    requests, batches = state.requests(lambda _key: 0, 64, ["s1"], dht_id=1, ids=Ids())
    assert len(requests) == 1 and batches == [wanted]
    # The service could only answer 30; 10 of those are absent.
    values = [None if key < 10 else b"v%d" % key for key in range(30)]
    reply = wire.encode_get_many_reply(1, values)
    assert state.take(requests, batches, [reply], None, lambda raw: raw.decode()) is False
    assert state.found == {key: f"v{key}" for key in range(10, 30)}
    assert state.pending == list(range(30, 100)) and state.answered == 30
    # The next round asks for at most 30 per request.
    requests, batches = state.requests(lambda _key: 0, 64, ["s1"], dht_id=1, ids=Ids())
    assert [len(positions) for positions in batches] == [30, 30, 10]
    assert [position for positions in batches for position in positions] == state.pending
