"""domus.wire.protocol: every encoder/decoder pair, and decoders on hostile bytes."""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domus.errors import ProtocolError
from domus.wire import protocol as wire

u32 = st.integers(0, 0xFFFFFFFF)
u64 = st.integers(0, 0xFFFFFFFFFFFFFFFF)
key = st.binary(min_size=1, max_size=40)
value = st.binary(max_size=80)
keyed_ops = st.sampled_from([wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS])
control_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False, width=64) | st.text(max_size=10) | st.binary(max_size=10),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=6)
control_body = st.dictionaries(st.text(max_size=8), control_value, max_size=4).flatmap(
    lambda extra: st.text(max_size=16).map(lambda op: {**extra, "op": op}))


# ------------------------------------------------------------ headers

@settings(deadline=None, max_examples=100)
@given(st.integers(0, 255), u32, u64)
def test_request_header_round_trip(op, request_id, client_id):
    data = wire.request_header(op, request_id, client_id)
    assert len(data) == wire.REQUEST_HEADER_SIZE == 16
    assert wire.decode_request_header(data) == (op, request_id, client_id)


@pytest.mark.parametrize("data, message", [
    (b"", "shorter"),
    (wire.request_header(wire.OP_GET, 1, 2)[:15], "shorter"),
    (b"\xd1" + wire.request_header(wire.OP_GET, 1, 2)[1:], "magic"),
    (b"\xd0\x02" + wire.request_header(wire.OP_GET, 1, 2)[2:], "version 2"),
])
def test_bad_request_headers_raise_protocol_error(data, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode_request_header(data)


@settings(deadline=None, max_examples=100)
@given(st.integers(0, 255), u32, st.binary(max_size=30))
def test_reply_header_round_trip(status, request_id, body):
    data = wire.reply(status, request_id, body)
    assert data[wire.REPLY_HEADER_SIZE:] == body
    assert wire.decode_reply_header(data) == (status, request_id)


def test_reply_prefix_and_echoed_request_id_make_a_reply_header():
    request = wire.request_header(wire.OP_GET, 0xDEADBEEF, 5)
    assert wire.reply_prefix(wire.ST_NOT_FOUND) + request[4:8] == wire.reply(
        wire.ST_NOT_FOUND, 0xDEADBEEF)


@pytest.mark.parametrize("data, message", [
    (b"\xd1\x01\x00", "shorter"),
    (b"\xd0\x01\x00\x00\x00\x00\x00\x01", "magic"),
    (b"\xd1\x07\x00\x00\x00\x00\x00\x01", "version 7"),
])
def test_bad_reply_headers_raise_protocol_error(data, message):
    with pytest.raises(ProtocolError, match=message):
        wire.decode_reply_header(data)


def test_error_reply_carries_a_bounded_utf8_message():
    data = wire.error_reply(wire.ST_NOT_OWNER, 9, "bucket 3 is elsewhere \u00e9")
    assert wire.decode_reply_header(data) == (wire.ST_NOT_OWNER, 9)
    assert data[wire.REPLY_HEADER_SIZE:].decode() == "bucket 3 is elsewhere \u00e9"
    long = wire.error_reply(wire.ST_INTERNAL, 9, "x" * 5000)
    assert len(long) == wire.REPLY_HEADER_SIZE + 1024


def test_error_reply_survives_lone_surrogates():
    data = wire.error_reply(wire.ST_MALFORMED, 1, "bad \ud800 key")
    assert wire.decode_reply_header(data) == (wire.ST_MALFORMED, 1)


# ------------------------------------------------------------ request bodies

@settings(deadline=None, max_examples=200)
@given(keyed_ops, u32, u64, u32, u32, key, value)
def test_keyed_round_trip(op, request_id, client_id, dht_id, bucket, key_bytes, value_bytes):
    if op != wire.OP_PUT:
        value_bytes = b""
    data = wire.encode_keyed(op, request_id, client_id, dht_id, bucket, key_bytes, value_bytes)
    assert wire.decode_request_header(data) == (op, request_id, client_id)
    if op == wire.OP_PUT:
        assert wire.decode_put(data) == (dht_id, bucket, key_bytes, value_bytes)
    else:
        assert wire.decode_keyed(data) == (dht_id, bucket, key_bytes, b"")


@settings(deadline=None, max_examples=200)
@given(key, st.binary(min_size=1, max_size=64), st.data())
def test_a_put_cut_short_or_padded_is_refused_not_stored_short(key_bytes, value_bytes, data):
    message = wire.encode_keyed(wire.OP_PUT, 1, 2, 3, 4, key_bytes, value_bytes)
    end = wire.KEYED_END + len(key_bytes)
    cut = data.draw(st.integers(end, len(message) - 1))
    with pytest.raises(ProtocolError):
        wire.decode_put(message[:cut])
    with pytest.raises(ProtocolError):
        wire.decode_put(message + b"x")


def test_keyed_rejects_an_empty_key():
    data = wire.encode_keyed(wire.OP_GET, 1, 1, 1, 0, b"")
    with pytest.raises(ProtocolError, match="empty key"):
        wire.decode_keyed(data)


def test_keyed_rejects_a_key_running_past_the_end():
    data = wire.encode_keyed(wire.OP_GET, 1, 1, 1, 0, b"abcdef")
    with pytest.raises(ProtocolError, match="past the end"):
        wire.decode_keyed(data[:-1])
    with pytest.raises(ProtocolError, match="truncated"):
        wire.decode_keyed(data[:wire.KEYED_END - 1])


@settings(deadline=None, max_examples=150)
@given(u32, u64, u32, st.lists(st.tuples(u32, key, value), max_size=20))
def test_put_many_round_trip(request_id, client_id, dht_id, entries):
    data = wire.encode_put_many(request_id, client_id, dht_id, entries)
    assert wire.decode_request_header(data) == (wire.OP_PUT_MANY, request_id, client_id)
    assert wire.decode_put_many(data) == (dht_id, entries)
    # Clients size datagrams with put_entry_size; it must be exact.
    assert len(data) == wire.BATCH_OVERHEAD + sum(
        wire.put_entry_size(k, v) for _bucket, k, v in entries)


@settings(deadline=None, max_examples=150)
@given(u32, u64, u32, st.lists(st.tuples(u32, key), max_size=20))
def test_get_many_round_trip(request_id, client_id, dht_id, entries):
    data = wire.encode_get_many(request_id, client_id, dht_id, entries)
    assert wire.decode_request_header(data) == (wire.OP_GET_MANY, request_id, client_id)
    assert wire.decode_get_many(data) == (dht_id, entries)
    assert len(data) == wire.BATCH_OVERHEAD + sum(
        wire.get_entry_size(k) for _bucket, k in entries)


@pytest.mark.parametrize("decode, encode", [
    (wire.decode_put_many, lambda: wire.encode_put_many(1, 2, 3, [(0, b"k", b"v")])),
    (wire.decode_get_many, lambda: wire.encode_get_many(1, 2, 3, [(0, b"k")])),
])
def test_batches_reject_stray_bytes_and_truncation(decode, encode):
    data = encode()
    with pytest.raises(ProtocolError, match="stray"):
        decode(data + b"\x00")
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:cut])


def test_batches_reject_empty_keys():
    with pytest.raises(ProtocolError, match="empty key"):
        wire.decode_put_many(wire.encode_put_many(1, 2, 3, [(0, b"", b"v")]))
    with pytest.raises(ProtocolError, match="empty key"):
        wire.decode_get_many(wire.encode_get_many(1, 2, 3, [(0, b"")]))


@settings(deadline=None, max_examples=100)
@given(u32, u64, u32)
def test_length_round_trip(request_id, client_id, dht_id):
    data = wire.encode_length(request_id, client_id, dht_id)
    assert wire.decode_request_header(data) == (wire.OP_LENGTH, request_id, client_id)
    assert wire.decode_length(data) == dht_id
    with pytest.raises(ProtocolError):
        wire.decode_length(data + b"\x00")
    with pytest.raises(ProtocolError):
        wire.decode_length(data[:-1])


@settings(deadline=None, max_examples=100)
@given(u32, u64, u32, u32, u32, u32)
def test_scan_round_trip(request_id, client_id, dht_id, bucket, scan_id, offset):
    data = wire.encode_scan(request_id, client_id, dht_id, bucket, scan_id, offset)
    assert wire.decode_request_header(data) == (wire.OP_SCAN, request_id, client_id)
    assert wire.decode_scan(data) == (dht_id, bucket, scan_id, offset)
    with pytest.raises(ProtocolError):
        wire.decode_scan(data + b"\x00")
    with pytest.raises(ProtocolError):
        wire.decode_scan(data[:-1])


@settings(deadline=None, max_examples=60)
@given(u32, u64, control_body)
def test_control_round_trip(request_id, client_id, body):
    data = wire.encode_control(request_id, client_id, body)
    assert wire.decode_request_header(data) == (wire.OP_CONTROL, request_id, client_id)
    assert wire.decode_control(data) == body


@pytest.mark.parametrize("body", [[], {"name": "x"}, {"op": 5}, "ping", None])
def test_control_body_must_be_a_map_with_a_string_op(body):
    data = wire.request_header(wire.OP_CONTROL, 1, 1) + wire.pack(body)
    with pytest.raises(ProtocolError, match="op"):
        wire.decode_control(data)


def test_pack_keeps_bytes_and_str_apart():
    assert wire.unpack(wire.pack({"k": b"raw", "s": "text"})) == {"k": b"raw", "s": "text"}


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", b"\x81\x91\x01\x01",
                                  b"\xd9\x02\xff\xfe", b"\x01\x02"])
def test_unpack_raises_only_protocol_error(data):
    # empty, reserved byte, truncated array, unhashable map key, bad UTF-8,
    # extra data
    with pytest.raises(ProtocolError, match="msgpack"):
        wire.unpack(data)


# ------------------------------------------------------------ replies

@settings(deadline=None, max_examples=150)
@given(u32, st.lists(st.none() | value, max_size=30))
def test_get_many_reply_round_trip(request_id, values):
    data = wire.encode_get_many_reply(request_id, values)
    assert wire.decode_reply_header(data) == (wire.ST_OK, request_id)
    assert wire.decode_get_many_reply(data) == values


def test_get_many_reply_tells_an_empty_value_from_a_missing_one():
    data = wire.encode_get_many_reply(1, [b"", None, b"x"])
    assert wire.decode_get_many_reply(data) == [b"", None, b"x"]


@settings(deadline=None, max_examples=150)
@given(u32, u32, u32, st.lists(st.tuples(key, value), max_size=30))
def test_scan_reply_round_trip(request_id, scan_id, next_offset, entries):
    data = wire.encode_scan_reply(request_id, scan_id, next_offset, entries)
    assert wire.decode_reply_header(data) == (wire.ST_OK, request_id)
    assert wire.decode_scan_reply(data) == (scan_id, next_offset, entries)


@pytest.mark.parametrize("decode, data", [
    (wire.decode_get_many_reply, wire.encode_get_many_reply(1, [b"abc", None])),
    (wire.decode_scan_reply, wire.encode_scan_reply(1, 2, wire.SCAN_END, [(b"k", b"v")])),
    (wire.decode_range_reply, wire.encode_range_reply(1, [(b"k", b"v"), (b"l", b"")], True)),
])
def test_replies_reject_stray_bytes_and_truncation(decode, data):
    with pytest.raises(ProtocolError, match="stray"):
        decode(data + b"\x00")
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            decode(data[:cut])


# ------------------------------------------------------------ fuzz

def valid_messages():
    """One valid message of every kind the protocol has."""
    return st.one_of(
        st.builds(wire.encode_keyed, st.sampled_from([wire.OP_GET, wire.OP_DELETE,
                                                      wire.OP_CONTAINS]), u32, u64, u32, u32, key),
        st.builds(wire.encode_keyed, st.just(wire.OP_PUT), u32, u64, u32, u32, key, value),
        st.builds(wire.encode_put_many, u32, u64, u32,
                  st.lists(st.tuples(u32, key, value), max_size=6)),
        st.builds(wire.encode_get_many, u32, u64, u32, st.lists(st.tuples(u32, key), max_size=6)),
        st.builds(wire.encode_length, u32, u64, u32),
        st.builds(wire.encode_scan, u32, u64, u32, u32, u32, u32),
        st.builds(wire.encode_range, u32, u64,
                  st.builds(wire.RangeQuery, u32, st.none() | key, st.none() | key,
                            st.booleans(), st.booleans(), st.booleans(), st.booleans(),
                            st.integers(0, 0xFFFF))),
        st.builds(wire.encode_control, u32, u64, control_body),
        st.builds(wire.request_header, st.sampled_from([wire.OP_PING, wire.OP_STATS]), u32, u64),
        st.builds(wire.reply, st.sampled_from(sorted(wire.STATUS_NAMES)), u32,
                  st.binary(max_size=20)),
        st.builds(wire.encode_get_many_reply, u32, st.lists(st.none() | value, max_size=6)),
        st.builds(wire.encode_scan_reply, u32, u32, u32,
                  st.lists(st.tuples(key, value), max_size=6)),
        st.builds(lambda request_id, entries: wire.encode_range_reply(
            request_id, entries, bool(entries)), u32,
            st.lists(st.tuples(key, value), max_size=6)),
    )


@st.composite
def mutated_messages(draw):
    data = bytearray(draw(valid_messages()))
    for _ in range(draw(st.integers(1, 4))):
        how = draw(st.sampled_from(["set", "flip", "truncate", "extend", "splice", "insert",
                                    "delete", "length-max"]))
        if how in ("set", "flip", "length-max") and data:
            position = draw(st.integers(0, len(data) - 1))
            if how == "set":
                data[position] = draw(st.integers(0, 255))
            elif how == "flip":
                data[position] ^= 1 << draw(st.integers(0, 7))
            else:  # make a length or count field huge
                data[position:position + 2] = b"\xff\xff"
        elif how == "truncate":
            del data[draw(st.integers(0, len(data))):]
        elif how == "extend":
            data += draw(st.binary(min_size=1, max_size=40))
        elif how == "splice":
            other = draw(valid_messages())
            data = data[:draw(st.integers(0, len(data)))] + other[draw(
                st.integers(0, len(other))):]
        elif how == "insert":
            position = draw(st.integers(0, len(data)))
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        elif how == "delete" and data:
            position = draw(st.integers(0, len(data) - 1))
            del data[position:position + draw(st.integers(1, 8))]
    return bytes(data)


DECODERS = [
    wire.decode_request_header, wire.decode_keyed, wire.decode_put, wire.decode_put_many,
    wire.decode_get_many, wire.decode_length, wire.decode_scan, wire.decode_range,
    wire.decode_control, wire.decode_reply_header, wire.decode_get_many_reply,
    wire.decode_scan_reply, wire.decode_range_reply, wire.unpack, wire.decode_control_error,
]


def decode_everything(data):
    for decode in DECODERS:
        try:
            decode(data)
        except ProtocolError:
            pass
        # Anything else (IndexError, struct.error, UnicodeDecodeError,
        # msgpack's exceptions...) fails the test.


@settings(deadline=None, max_examples=300)
@given(mutated_messages())
def test_decoders_raise_only_protocol_error_on_mutated_messages(data):
    decode_everything(data)


@settings(deadline=None, max_examples=500)
@given(st.binary(max_size=200))
def test_decoders_raise_only_protocol_error_on_random_bytes(data):
    decode_everything(data)


@settings(deadline=None, max_examples=300)
@given(valid_messages())
def test_decoders_raise_only_protocol_error_on_valid_messages_of_other_kinds(data):
    decode_everything(data)


@pytest.mark.parametrize("body", [
    wire.pack(5), wire.pack(["UnknownDht", "gone"]), wire.pack({"error": 1, "message": "m"}),
    wire.pack({"error": "UnknownDht", "message": [1]}), wire.pack({"error": None}), b"\xc1",
])
def test_a_control_error_that_is_not_a_map_of_strings_is_a_protocol_error(body):
    # Both ends read it so: the blocking client (from the supervisor) and
    # domus.wire.control (the Twisted client, services, the supervisor).
    from domus.client.transport import _control_result as blocking_result
    from domus.wire.control import _control_result as twisted_result

    reply = wire.reply(wire.ST_CONTROL_ERROR, 1, body)
    for read in (lambda: blocking_result("stats", wire.ST_CONTROL_ERROR, reply),
                 lambda: twisted_result((wire.ST_CONTROL_ERROR, reply)),
                 lambda: wire.decode_control_error(body)):
        with pytest.raises(ProtocolError, match="control error must be a map|bad msgpack"):
            read()


def test_a_control_error_names_its_class_and_message():
    from domus.client.transport import _control_result as blocking_result
    from domus.errors import SupervisorError, UnknownDht
    from domus.wire.control import RemoteControlError
    from domus.wire.control import _control_result as twisted_result

    assert wire.decode_control_error(wire.pack({"error": "UnknownDht", "message": "gone"})) == \
        ("UnknownDht", "gone")
    assert wire.decode_control_error(wire.pack({})) == ("DomusError", "")
    reply = wire.reply(wire.ST_CONTROL_ERROR, 1, wire.pack({"error": "UnknownDht",
                                                            "message": "no DHT 'w'"}))
    with pytest.raises(UnknownDht, match="no DHT 'w'"):
        blocking_result("open_dht", wire.ST_CONTROL_ERROR, reply)
    with pytest.raises(RemoteControlError) as raised:
        twisted_result((wire.ST_CONTROL_ERROR, reply))
    assert (raised.value.kind, raised.value.message) == ("UnknownDht", "no DHT 'w'")
    unnamed = wire.reply(wire.ST_CONTROL_ERROR, 1, wire.pack({"error": "Whatever"}))
    with pytest.raises(SupervisorError, match="'open_dht' failed"):
        blocking_result("open_dht", wire.ST_CONTROL_ERROR, unnamed)


def test_protocol_error_is_a_value_error():
    # Generic handlers (except ValueError) keep working.
    assert issubclass(wire.ProtocolError, ValueError)


def test_msgpack_extension_types_do_not_escape_as_other_errors():
    # A timestamp extension (type -1) of 1 byte makes msgpack raise ValueError.
    data = wire.request_header(wire.OP_CONTROL, 1, 1) + b"\xd4\xff\x00"
    with pytest.raises(ProtocolError):
        wire.decode_control(data)


def random_valid_message(rng):
    def blob(low, high):
        return rng.randbytes(rng.randint(low, high))

    kind = rng.randrange(10)
    rid, cid, dht = rng.getrandbits(32), rng.getrandbits(64), rng.getrandbits(32)
    if kind == 0:
        op = rng.choice([1, 2, 3, 4])
        return wire.encode_keyed(op, rid, cid, dht, rng.getrandbits(32), blob(1, 20),
                                 blob(0, 30) if op == wire.OP_PUT else b"")
    if kind == 1:
        return wire.encode_put_many(rid, cid, dht, [(rng.getrandbits(32), blob(1, 9), blob(0, 9))
                                                    for _ in range(rng.randint(0, 5))])
    if kind == 2:
        return wire.encode_get_many(rid, cid, dht, [(rng.getrandbits(32), blob(1, 9))
                                                    for _ in range(rng.randint(0, 5))])
    if kind == 3:
        return wire.encode_length(rid, cid, dht)
    if kind == 4:
        return wire.encode_scan(rid, cid, dht, rng.getrandbits(32), rng.getrandbits(32),
                                rng.getrandbits(32))
    if kind == 5:
        return wire.encode_control(rid, cid, {"op": "assign", "dht": {"id": dht, "n": [1, "x"]},
                                              "raw": blob(0, 9), "f": rng.random()})
    if kind == 6:
        return wire.reply(rng.randrange(256), rid, blob(0, 20))
    if kind == 7:
        return wire.encode_get_many_reply(rid, [rng.choice([None, blob(0, 9)])
                                                for _ in range(rng.randint(0, 5))])
    if kind == 8:
        return wire.encode_scan_reply(rid, rng.getrandbits(32), rng.getrandbits(32),
                                      [(blob(1, 9), blob(0, 9)) for _ in range(rng.randint(0, 5))])
    return blob(0, 60)


def random_mutation(rng, data):
    data = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        how = rng.randrange(6)
        if how == 0 and data:
            data[rng.randrange(len(data))] = rng.randrange(256)
        elif how == 1:
            del data[rng.randint(0, len(data)):]
        elif how == 2:
            data += rng.randbytes(rng.randint(1, 30))
        elif how == 3:
            other = random_valid_message(rng)
            data = data[:rng.randint(0, len(data))] + other[rng.randint(0, len(other)):]
        elif how == 4 and data:
            position = rng.randrange(len(data))
            data[position:position + 2] = rng.choice([b"\xff\xff", b"\x00\x00", b"\x7f"])
        elif how == 5 and data:
            position = rng.randrange(len(data))
            del data[position:position + rng.randint(1, 6)]
    return bytes(data)


def test_decoders_raise_only_protocol_error_on_20000_seeded_mutations():
    rng = random.Random(20240601)
    for _ in range(20_000):
        decode_everything(random_mutation(rng, random_valid_message(rng)))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), st.binary(max_size=40),
       st.one_of(st.integers(-100, 100),
                 st.tuples(st.none() | st.integers(-100, 100), st.none() | st.integers(-100, 100),
                           st.none() | st.integers(-3, 3).filter(bool))))
def test_a_gathered_message_reads_as_its_bytes_joined(head, payload, index):
    """A message kept as (head, payload) answers its length, a byte and
    a slice as the joined bytes do (and IndexError where they do)."""
    message, joined = wire.Gathered(head, payload), head + payload
    assert len(message) == len(joined) and bytes(message) == joined
    assert message == joined and message == wire.Gathered(b"", joined)
    assert message != joined + b"!"
    if isinstance(index, tuple):
        assert message[slice(*index)] == joined[slice(*index)]
        return
    try:
        expected = joined[index]
    except IndexError:
        with pytest.raises(IndexError):
            message[index]
    else:
        assert message[index] == expected


def test_a_gathered_message_is_not_a_buffer():
    """Code not written for one fails loudly, never sends its head alone."""
    message = wire.Gathered(b"head", b"payload")
    with pytest.raises(TypeError):
        memoryview(message)
    assert wire.parts_of(message) == (b"head", b"payload")
    assert wire.parts_of(b"whole") == (b"whole",)
