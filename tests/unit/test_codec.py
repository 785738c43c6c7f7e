"""domus.client.codec: the C functions (domus._codec) against their pure-Python
references, on random and on malformed inputs.

Every comparison runs both implementations on the same input and asserts the
same outcome: the same bytes (or objects), or the same exception type with
the same message.  ``make check-c`` runs this file under AddressSanitizer.
"""

from __future__ import annotations

import collections
import enum
import gc
import itertools
import math
import os
import signal
import socket
import sys
import threading
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scale import examples

from domus.client import codec
from domus.errors import (
    KeyTooLarge,
    KeyTypeError,
    ProtocolError,
    ValueDecodeError,
    ValueTypeError,
)
from domus.placement.bucketmap import BucketMap
from domus.wire import auth, keys
from domus.wire import protocol as wire

try:  # directly: the comparisons run under DOMUS_PURE_PYTHON=1 too
    from domus import _codec as C
except ImportError:
    C = None
P = codec.reference
pytestmark = pytest.mark.skipif(C is None, reason="domus._codec is not built")

HASHES = sorted(keys.HASH_FUNCTIONS)
SHIFTS = [keys.bucket_shift(1 << power) for power in range(0, 25)]
ANY_SETTINGS = settings(max_examples=examples(300), deadline=None,
                        suppress_health_check=[HealthCheck.too_slow])


def outcome(function, *args):
    """("ok", result) or ("error", exception type, message)."""
    try:
        return ("ok", function(*args))
    except Exception as exc:  # noqa: BLE001 - every exception is compared
        return ("error", type(exc), str(exc))


def same(function_name, *args):
    """The C and the reference function agree on args; returns the outcome."""
    expected = outcome(getattr(P, function_name), *args)
    got = outcome(getattr(C, function_name), *args)
    assert got == expected, (function_name, args)
    return got


def short_id(value):
    """A test id for a parameter too long to print."""
    if isinstance(value, int) and int.bit_length(value) > 64:
        sign = "negative_" if value < 0 else ""
        return f"{sign}int_of_{int.bit_length(value)}_bits"
    if isinstance(value, (str, bytes, bytearray, list, dict)) and len(value) > 20:
        return f"{type(value).__name__}_of_{len(value)}"
    return None


def c_hasher(name):
    return {"xxh3": C.HASH_XXH3, "xxh64": C.HASH_XXH64}.get(name) or keys.HASH_FUNCTIONS[name]


# ------------------------------------------------------------ strategies

class Color(enum.IntEnum):
    RED = 1
    HUGE = 1 << 80
    DEEP = -(1 << 80)
    LOW = -(1 << 63)


class Text(str):
    def __str__(self):
        return "not the value"


class Number(int):
    def __int__(self):
        return 0


class Raw(bytes):
    pass


class Buffer(bytearray):
    pass


characters = st.one_of(st.characters(),
                       st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
                       st.characters(min_codepoint=0x10000))
texts = st.text(characters, max_size=40)
huge_ints = st.integers(min_value=-(1 << 70000), max_value=1 << 70000)
valid_keys = st.one_of(
    st.integers(), st.integers(min_value=-(1 << 64), max_value=1 << 64), huge_ints,
    st.booleans(), st.sampled_from(list(Color)), texts, st.binary(max_size=40),
    texts.map(Text), st.integers().map(Number), st.binary(max_size=20).map(bytearray),
    st.binary(max_size=20).map(Buffer), st.binary(max_size=20).map(memoryview),
)
wrong_keys = st.one_of(st.floats(), st.none(), st.tuples(st.floats()), st.lists(st.integers()),
                       st.binary(max_size=8).map(Raw), st.just(object()), st.just({1: 2}))
# Tuples of keys (nested, with a wrong key somewhere now and then).
zero_led = st.binary(max_size=4).map(lambda raw: b"\x00" + raw)
tuple_keys = st.recursive(st.one_of(valid_keys, zero_led),
                          lambda inner: st.lists(inner, max_size=5).map(tuple), max_leaves=12)
any_keys = st.one_of(valid_keys, wrong_keys, tuple_keys,
                     st.tuples(tuple_keys, wrong_keys), st.tuples(wrong_keys, tuple_keys))


# ------------------------------------------------------------ keys

@ANY_SETTINGS
@given(any_keys)
def test_encode_key_is_byte_identical(key):
    same("encode_key", key)


Point = collections.namedtuple("Point", "x y")


class Huge(int):
    def __abs__(self):
        return 0

    def __int__(self):
        return 0

    def bit_length(self):
        return 0


@pytest.mark.parametrize("key", [
    0, 1, -1, 2, -2, (1 << 63) - 1, (1 << 63) - 2, -(1 << 63), -(1 << 63) + 1, 1 << 63,
    (1 << 63) + 1, -(1 << 63) - 1, -(1 << 63) - 2, 1 << 64, -(1 << 64), (1 << 64) - 1,
    (1 << 64) + 1, -(1 << 64) + 1, -(1 << 64) - 1, 1 << 71, -(1 << 71), -(1 << 71) - 1,
    (1 << 72) - 1, -(1 << 72) + 1, 255 << 64, -(255 << 64), True, False, *Color, Number(7),
    Number(1 << 90), Number(-(1 << 90)), Huge(1 << 100), Huge(-(1 << 100)),
    "", "a", "é", "\ud800", "\udfff\ud800", "😀", Text("t"), b"", b"\x00", bytearray(b"x"),
    Buffer(b"y"), memoryview(b"z"), memoryview(bytes(range(16)))[::3],
    memoryview(b"abcd").cast("B", (2, 2)), Raw(b"r"), 1.0, None, [1], (1,), object(), {},
    (), ((),), (1, "a"), (True, Color.RED, Text("a")), ("a\x00", b"\x00\xff"), (1.0,),
    ((1, 2), [3]), Point(1, "a"), (1 << 100, -(1 << 100)), (memoryview(b"\x00"),),
])
def test_encode_key_edge_cases(key):
    same("encode_key", key)


def nested(depth):
    key = ()
    for _ in range(depth):
        key = (key,)
    return key


@pytest.mark.parametrize("key", [
    ("x" * 8188,), ("x" * 8189,), (b"\x00" * 4094,), (b"\x00" * 4095,), ("x" * 8192,),
    (1,) * 400, (0,) * 1000, tuple(["y" * 100] * 100), nested(31), nested(32), nested(33),
    nested(1000),
], ids=short_id)
def test_tuple_keys_at_and_over_the_limits(key):
    result = same("encode_key", key)
    if result[0] == "ok":
        assert len(result[1]) <= wire.MAX_KEY_BYTES
    else:
        assert result[1] in (KeyTooLarge, KeyTypeError)


@pytest.mark.parametrize("key", [
    "x" * 8190, "x" * 8191, "x" * 8192, "é" * 4095, "é" * 4096, "😀" * 2047, "😀" * 2048,
    b"y" * 8191, b"y" * 8192, bytearray(8192), 1 << (8 * 8190 - 1), -(1 << (8 * 8190 - 1)),
    1 << (8 * 8190 - 1) - 1, -(1 << (8 * 8190 - 1)) - 1, 1 << (8 * 8191), 1 << 1_000_000,
    -(1 << 1_000_000),
    # Ints: tag, u16 length and at most 8189 magnitude bytes.
    (1 << (8 * 8189)) - 1, -(1 << (8 * 8189)) + 1, 1 << (8 * 8189), -(1 << (8 * 8189)),
    1 << (8 * 8188), -(1 << (8 * 8188)), (1 << (8 * 8188)) - 1, -(1 << (8 * 8188)) + 1,
    Huge(1 << (8 * 8189)), Huge(-(1 << (8 * 8189))),
], ids=short_id)
def test_keys_at_and_over_the_limit(key):
    result = same("encode_key", key)
    if result[0] == "ok":
        assert len(result[1]) <= wire.MAX_KEY_BYTES
    else:
        assert result[1] is KeyTooLarge


def test_key_errors_are_the_documented_ones():
    with pytest.raises(KeyTypeError, match="not float; convert it first"):
        C.encode_key(1.5)
    with pytest.raises(KeyTypeError, match="not Raw"):
        C.encode_key(Raw(b"x"))
    with pytest.raises(KeyTooLarge, match="8193 bytes encoded"):
        C.encode_key("x" * 8192)
    released = memoryview(b"x")
    released.release()
    same("encode_key", released)


@ANY_SETTINGS
@given(st.lists(any_keys, max_size=20))
def test_encode_keys_is_the_list_of_encode_key(key_list):
    same("encode_keys", key_list)
    same("encode_keys", tuple(key_list))


def test_encode_keys_takes_only_lists_and_tuples():
    same("encode_keys", iter([1]))
    same("encode_keys", "abc")


# ------------------------------------------------------------ buckets

@settings(max_examples=60, deadline=None)
@given(st.lists(st.binary(max_size=64), min_size=1, max_size=20))
def test_buckets_are_identical_for_every_hash_and_bucket_count(encoded_keys):
    for name in HASHES:
        for power in range(0, 17):
            bucket_count = 1 << power
            shift = keys.bucket_shift(bucket_count)
            for encoded in encoded_keys:
                expected = keys.bucket_of(encoded, name, bucket_count)
                assert P.bucket_of(P.hasher(name), shift, encoded) == expected
                assert C.bucket_of(c_hasher(name), shift, encoded) == expected
                # A hash given as a callable goes through the same path.
                assert C.bucket_of(keys.HASH_FUNCTIONS[name], shift, encoded) == expected
                assert 0 <= expected < bucket_count


@pytest.mark.parametrize("name", ["xxh3", "xxh64"])
def test_the_c_hashes_equal_the_xxhash_package_for_every_length(name):
    # cext/hashes.h is written from the xxHash specification; the `xxhash`
    # package (the pure-Python path's hash) is the reference.  Every length
    # up to 2,100 bytes covers each of XXH3's size classes and several of its
    # 1 KiB blocks; unaligned starts, and long random inputs, do the rest.
    import random

    rng = random.Random(20261125)
    data = rng.randbytes(2_200)
    reference = keys.HASH_FUNCTIONS[name]
    for length in range(2_101):
        for start in (0, 3):
            piece = data[start:start + length]
            # (shift 32: the top half of the 64-bit hash, the most a bucket takes)
            assert C.bucket_of(c_hasher(name), 32, piece) == reference(piece) >> 32, length
    for _ in range(300):
        piece = rng.randbytes(rng.randrange(2_100, 70_000))
        assert C.bucket_of(c_hasher(name), 32, piece) == reference(piece) >> 32, len(piece)


def test_codec_hasher_names_what_its_implementation_takes():
    for name in HASHES:
        hasher = codec.hasher(name)
        assert codec.bucket_of(hasher, 50, b"\x03k") == keys.bucket_of(b"\x03k", name, 1 << 14)
    with pytest.raises(KeyError):
        codec.hasher("md5")


@pytest.mark.parametrize("shift", [-1, 0, 31, 65, 1 << 70, "40"])
def test_shifts_outside_a_u32_bucket_are_refused(shift):
    result = outcome(C.bucket_of, C.HASH_XXH3, shift, b"k")
    assert result[0] == "error" and result[1] in (ValueError, TypeError)
    assert outcome(P.bucket_of, P.hasher("xxh3"), shift, b"k")[1] is result[1]


def test_a_hash_callable_that_misbehaves_raises():
    def raises(_encoded):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        C.bucket_of(raises, 60, b"k")
    with pytest.raises(TypeError):
        C.bucket_of(lambda _encoded: "no", 60, b"k")
    with pytest.raises(OverflowError):
        C.bucket_of(lambda _encoded: -1, 60, b"k")
    with pytest.raises(ValueError, match="unknown hash code"):
        C.bucket_of(99, 60, b"k")


# ------------------------------------------------------------ keyed requests

keyed_ops = st.sampled_from([wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS,
                             wire.OP_PUT_IF_ABSENT, wire.OP_DELETE_IF])
u32 = st.integers(min_value=0, max_value=0xFFFFFFFF)
u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)


@ANY_SETTINGS
@given(keyed_ops, u32, u64, u32, st.sampled_from(HASHES), st.sampled_from(SHIFTS), any_keys,
       st.one_of(st.none(), st.binary(max_size=100)))
def test_keyed_messages_are_byte_identical(op, request_id, client_id, dht_id, hash_name,
                                           shift, key, value):
    expected = outcome(P.keyed, op, request_id, client_id, dht_id, P.hasher(hash_name), shift,
                       key, value)
    got = outcome(C.keyed, op, request_id, client_id, dht_id, c_hasher(hash_name), shift,
                  key, value)
    assert got == expected
    if got[0] == "ok":
        message, bucket = got[1]
        assert wire.decode_request_header(message) == (op, request_id, client_id)
        parsed_dht, parsed_bucket, encoded, rest = wire.decode_keyed(message)
        assert (parsed_dht, parsed_bucket) == (dht_id, bucket)
        assert encoded == keys.encode_key(key)
        if op in wire.VALUED_OPS:
            assert wire.put_value(rest) == (value or b"")


def test_keyed_refuses_bytes_after_the_key_for_anything_but_a_valued_op():
    for implementation, hasher in ((C, C.HASH_XXH3), (P, P.hasher("xxh3"))):
        for op in (wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS):
            with pytest.raises(ValueError, match=f"only PUT, PUT_IF_ABSENT and DELETE_IF carry "
                                                 f"bytes after the key, not op 0x{op:02x}"):
                implementation.keyed(op, 1, 2, 3, hasher, 60, "k", b"v")


def test_keyed_checks_its_integer_arguments():
    for args in [(256, 1, 2, 3), (1, 1 << 32, 2, 3), (1, 1, 1 << 64, 3), (1, 1, 2, 1 << 32),
                 (1, -1, 2, 3)]:
        with pytest.raises(OverflowError):
            C.keyed(*args, C.HASH_XXH3, 60, "k", None)
    with pytest.raises(TypeError):
        C.keyed(1, "1", 2, 3, C.HASH_XXH3, 60, "k", None)
    with pytest.raises(TypeError):
        C.keyed(1, 1, 2, 3, C.HASH_XXH3, 60, "k", "not bytes")
    with pytest.raises(TypeError):
        C.keyed(1, 1, 2, 3)


# ------------------------------------------------------------ batches

class Channel:
    """A channel as the clients have them: hashed by identity."""

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Channel({self.name})"


class NamedChannel(Channel):
    """Channels equal by name: a dict groups two of them together."""

    def __eq__(self, other):
        return isinstance(other, NamedChannel) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


@st.composite
def batch_layouts(draw):
    power = draw(st.integers(min_value=0, max_value=6))
    bucket_count = 1 << power
    service_count = draw(st.integers(min_value=1, max_value=5))
    kind = draw(st.sampled_from(["str", "identity", "named"]))
    if kind == "str":
        channels = [f"s{index}" for index in range(service_count)]
    elif kind == "identity":
        channels = [Channel(f"s{index}") for index in range(service_count)]
    else:  # distinct objects, some of them equal
        channels = [NamedChannel(f"s{index % 2}") for index in range(service_count)]
    owners = [draw(st.sampled_from(channels)) for _bucket in range(bucket_count)]
    # Clients with many buckets look owners up in a BucketMap, not a list
    # (its ranges merge equal neighbours, so only owners equal by identity).
    if kind != "named" and draw(st.booleans()):
        bucket_map = BucketMap(bucket_count)
        for bucket, owner in enumerate(owners):
            bucket_map.assign(bucket, bucket + 1, owner)
        assert bucket_map.dense() == owners
        return bucket_map, keys.bucket_shift(bucket_count)
    return owners, keys.bucket_shift(bucket_count)


encoded_keys = st.lists(st.binary(min_size=1, max_size=30), max_size=120)


def _counter_from(start):
    """next_id for a batch call, and the ids it gave."""
    ids = itertools.count(start)
    calls = []

    def next_id():
        request_id = next(ids) & 0xFFFFFFFF
        calls.append(request_id)
        return request_id

    return next_id, calls


@ANY_SETTINGS
@given(encoded_keys, st.data(), batch_layouts(), st.sampled_from(HASHES),
       st.integers(min_value=0, max_value=3000), st.sampled_from([1, 2, 3, 7, 65535]))
def test_put_many_requests_are_byte_identical(key_list, data, layout, hash_name, max_datagram,
                                              limit):
    owners, shift = layout
    values = data.draw(st.lists(st.binary(max_size=400), min_size=len(key_list),
                                max_size=len(key_list)))
    start = int.from_bytes(os.urandom(3), "big")
    python_ids, python_calls = _counter_from(start)
    c_ids, c_calls = _counter_from(start)
    expected = outcome(P.put_many_requests, key_list, values, P.hasher(hash_name), shift, owners,
                       9, python_ids, 77, max_datagram, limit)
    got = outcome(C.put_many_requests, key_list, values, c_hasher(hash_name), shift, owners, 9,
                  c_ids, 77, max_datagram, limit)
    assert _same_requests(got, expected)
    assert c_calls == python_calls
    if got[0] == "ok":
        seen = []
        for _channel, message in got[1]:
            if len(message) > max(max_datagram, wire.BATCH_OVERHEAD):
                assert len(wire.decode_put_many(message)[1]) == 1  # alone: too big
            dht_id, entries = wire.decode_put_many(message)
            assert dht_id == 9 and len(entries) <= limit
            seen.extend(key for _bucket, key, _value in entries)
        assert sorted(seen) == sorted(key_list)


def _same_requests(got, expected):
    """Outcomes equal, channels compared by identity where they are objects."""
    if got[0] != expected[0]:
        return False
    if got[0] == "error":
        return got == expected
    got_value, expected_value = got[1], expected[1]
    if isinstance(got_value, tuple):  # get_many: (requests, batches)
        return (_same_pairs(got_value[0], expected_value[0])
                and got_value[1] == expected_value[1])
    return _same_pairs(got_value, expected_value)


def _same_pairs(got, expected):
    return len(got) == len(expected) and all(
        got_channel is expected_channel and got_message == expected_message
        for (got_channel, got_message), (expected_channel, expected_message)
        in zip(got, expected))


@ANY_SETTINGS
@given(encoded_keys, st.data(), batch_layouts(), st.sampled_from(HASHES),
       st.integers(min_value=0, max_value=600))
def test_get_many_requests_are_byte_identical(key_list, data, layout, hash_name, max_datagram):
    owners, shift = layout
    pending = data.draw(st.lists(st.integers(min_value=-len(key_list),
                                             max_value=max(len(key_list) - 1, 0)),
                                 max_size=len(key_list))) if key_list else []
    limits = {channel: data.draw(st.integers(min_value=1, max_value=5))
              for channel in data.draw(st.lists(st.sampled_from(
                  owners.dense() if isinstance(owners, BucketMap) else owners), max_size=2))}
    start = int.from_bytes(os.urandom(3), "big")
    python_ids, python_calls = _counter_from(start)
    c_ids, c_calls = _counter_from(start)
    expected = outcome(P.get_many_requests, key_list, pending, P.hasher(hash_name), shift,
                       owners, 4, python_ids, 5, limits, max_datagram)
    got = outcome(C.get_many_requests, key_list, pending, c_hasher(hash_name), shift, owners,
                  4, c_ids, 5, limits, max_datagram)
    assert _same_requests(got, expected)
    assert c_calls == python_calls
    if got[0] == "ok":
        requests, batches = got[1]
        asked = [position for batch in batches for position in batch]
        assert sorted(asked) == sorted(pending)
        for (_channel, message), batch in zip(requests, batches):
            entries = wire.decode_get_many(message)[1]
            assert [key for _bucket, key in entries] == [key_list[p] for p in batch]


def test_batch_argument_errors_match():
    owners = ["a"]
    next_id = itertools.count().__next__
    cases = [
        ("put_many_requests", ([b"k"], [b"v", b"w"], None, 64, owners, 1, next_id, 2, 100, 5)),
        ("put_many_requests", ([b"k"], [b"v"], None, 64, owners, 1, next_id, 2, 100, 0)),
        ("put_many_requests", ([b"k"], [b"v"], None, 64, owners, 1, next_id, 2, 100, 1 << 16)),
        ("put_many_requests", ([b"k"], [b"v"], None, 63, owners, 1, next_id, 2, 100, 5)),
        ("put_many_requests", ([b"k"], [b"v"], None, 64, [[]], 1, next_id, 2, 100, 5)),
        ("put_many_requests", ([b"k"], [b"v"], None, 64, [], 1, next_id, 2, 100, 5)),
        ("get_many_requests", ([b"k"], [1], None, 64, owners, 1, next_id, 2, {}, 100)),
        ("get_many_requests", ([b"k"], [-2], None, 64, owners, 1, next_id, 2, {}, 100)),
        ("get_many_requests", ([b"k"], [0], None, 64, owners, 1, next_id, 2, {"a": 0}, 100)),
        ("get_many_requests", ([b"k"], [0], None, 63, owners, 1, next_id, 2, {}, 100)),
        ("get_many_requests", ([b"k"], [0], None, 64, [[]], 1, next_id, 2, {}, 100)),
    ]
    for name, args in cases:
        python_args = tuple(P.hasher("xxh3") if arg is None else arg for arg in args)
        c_args = tuple(C.HASH_XXH3 if arg is None else arg for arg in args)
        expected = outcome(getattr(P, name), *python_args)
        got = outcome(getattr(C, name), *c_args)
        assert expected[0] == got[0] == "error", (name, args, expected, got)
        assert got[1] is expected[1], (name, args, expected, got)


def test_a_failing_next_id_fails_the_call():
    def broken():
        raise RuntimeError("no ids")

    with pytest.raises(RuntimeError, match="no ids"):
        C.put_many_requests([b"k"], [b"v"], C.HASH_XXH3, 64, ["a"], 1, broken, 2, 100, 5)
    with pytest.raises(OverflowError):
        C.get_many_requests([b"k"], [0], C.HASH_XXH3, 64, ["a"], 1, lambda: -1, 2, {}, 100)


def test_a_hash_callable_that_changes_the_owner_list_cannot_break_grouping():
    owners = ["a", "b"]

    def evil(encoded):
        owners.clear()  # the C code re-reads the list: an IndexError, no crash
        return 0

    for implementation in (C, P):
        owners[:] = ["a", "b"]
        with pytest.raises(IndexError):
            implementation.put_many_requests([b"k"], [b"v"], evil, 63, owners, 1,
                                             itertools.count().__next__, 2, 100, 5)


# ------------------------------------------------------------ replies

def get_many_replies():
    values = st.lists(st.one_of(st.none(), st.binary(max_size=50)), max_size=20)
    return values.map(lambda found: wire.encode_get_many_reply(7, found))


def scan_replies():
    entries = st.lists(st.tuples(st.binary(max_size=20), st.binary(max_size=50)), max_size=10)
    return st.builds(lambda scan_id, offset, found: wire.encode_scan_reply(3, scan_id, offset,
                                                                           found),
                     u32, u32, entries)


@st.composite
def damaged(draw, replies):
    """A valid reply, possibly cut short, padded, bit-flipped or replaced."""
    reply = bytearray(draw(replies))
    damage = draw(st.sampled_from(["none", "truncate", "pad", "flip", "random", "count"]))
    if damage == "truncate":
        del reply[draw(st.integers(min_value=0, max_value=len(reply))):]
    elif damage == "pad":
        reply += draw(st.binary(min_size=1, max_size=8))
    elif damage == "flip":
        for _ in range(draw(st.integers(min_value=1, max_value=4))):
            bit = draw(st.integers(min_value=0, max_value=len(reply) * 8 - 1))
            reply[bit // 8] ^= 1 << (bit % 8)
    elif damage == "random":
        reply = bytearray(draw(st.binary(max_size=80)))
    elif damage == "count" and len(reply) >= 10:
        reply[8:10] = draw(st.binary(min_size=2, max_size=2))
    return bytes(reply)


@ANY_SETTINGS
@given(damaged(get_many_replies()))
def test_get_many_replies_decode_identically(reply):
    result = same("decode_get_many_reply", reply)
    assert result[0] == "ok" or result[1] is ProtocolError


@ANY_SETTINGS
@given(damaged(scan_replies()))
def test_scan_replies_decode_identically(reply):
    result = same("decode_scan_reply", reply)
    assert result[0] == "ok" or result[1] is ProtocolError


@pytest.mark.parametrize("reply", [
    b"", b"\xd1\x01\x00\x00\x00\x00\x00\x01", b"\xd1\x01\x00\x00\x00\x00\x00\x01\x00",
    b"\xd1\x01\x00\x00\x00\x00\x00\x01\x00\x01", b"\xd1" * 8 + b"\x00\x01\xff\xff\xff\xfe",
    b"\xd1" * 8 + b"\x00\x01\xff\xff\xff\xff", b"\xd1" * 8 + b"\x00\x01\xff\xff\xff\xff\x00",
    b"\xd1" * 8 + b"\xff\xff" + b"\xff\xff\xff\xff" * 3,
])
def test_malformed_get_many_replies(reply):
    same("decode_get_many_reply", reply)


@pytest.mark.parametrize("reply", [
    b"", b"\xd1" * 17, b"\xd1" * 8 + b"\x00" * 9 + b"\x01",
    b"\xd1" * 8 + b"\x00" * 8 + b"\x00\x01" + b"\xff\xff\xff\xff\xff\xff",
    b"\xd1" * 8 + b"\x00" * 8 + b"\x00\x01" + b"\x00\x00\x00\x00\x00\x00\x00",
])
def test_malformed_scan_replies(reply):
    same("decode_scan_reply", reply)


def test_decoders_take_bytes_only():
    for name in ("decode_get_many_reply", "decode_scan_reply"):
        with pytest.raises(TypeError):
            getattr(C, name)(bytearray(20))


# Values msgpack encodes (and some it refuses: ints out of 64-bit range, lone
# surrogates), and values it always encodes.
packable = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 64), max_value=1 << 64),
              st.floats(), texts, st.binary(max_size=300)),
    lambda children: st.one_of(st.lists(children, max_size=5),
                               st.tuples(children, children),
                               st.dictionaries(st.one_of(texts, st.integers(), st.binary()),
                                               children, max_size=5)),
    max_leaves=20)
msgpackable = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1),
              st.floats(), st.text(max_size=40), st.binary(max_size=300)),
    lambda children: st.one_of(st.lists(children, max_size=5),
                               st.dictionaries(st.one_of(st.text(max_size=5), st.integers(-9, 9)),
                                               children, max_size=5)),
    max_leaves=20)


@ANY_SETTINGS
@given(damaged(st.lists(st.one_of(st.none(), msgpackable.map(codec.reference.pack_value)),
                        max_size=8).map(lambda found: wire.encode_get_many_reply(1, found))),
       st.booleans())
def test_get_many_take_fills_the_same_dict(reply, own_unpack):
    count = max(0, len(reply) - 10)
    batch = list(range(count))
    wanted = [f"key{index}" for index in range(count)]
    unpack = (lambda raw: raw[::-1]) if own_unpack else None
    found_c, found_python = {}, {}
    got = outcome(C.get_many_take, reply, batch, wanted, found_c, unpack)
    expected = outcome(P.get_many_take, reply, batch, wanted, found_python, unpack)
    assert _same_repr(got, expected)
    assert repr(found_c) == repr(found_python)
    if got[0] == "error" and got[1] is ProtocolError:
        assert found_c == {}  # a malformed reply takes nothing


def test_get_many_take_with_a_short_batch_and_bad_positions():
    reply = wire.encode_get_many_reply(1, [b"\x01", b"\x02", None, b"\x03"])
    for batch in ([0, 1], [5, 0], [-1, 0, 1, 2], ["x"]):
        found_c, found_python = {}, {}
        got = outcome(C.get_many_take, reply, batch, ["a", "b", "c"], found_c, None)
        expected = outcome(P.get_many_take, reply, batch, ["a", "b", "c"], found_python, None)
        assert got == expected and found_c == found_python


# ------------------------------------------------------------ values

def _same_repr(got, expected):
    """Outcomes equal, results compared by repr (NaN != NaN; 1 == 1.0 == True)."""
    if got[0] != expected[0]:
        return False
    if got[0] == "error":
        return got[1] is expected[1] and got[2] == expected[2]
    return repr(got[1]) == repr(expected[1])


class Subclass(int):
    pass


deep = []
for _ in range(40):
    deep = [deep]
deeper = []
for _ in range(600):
    deeper = [deeper]

unpackable = st.one_of(packable, st.sets(st.integers(), max_size=2), st.just(object()),
                       st.integers().map(Subclass), st.floats().map(lambda x: type("F", (float,),
                                                                                  {})(x)),
                       texts.map(Text), st.binary(max_size=5).map(bytearray),
                       st.integers(min_value=1 << 64, max_value=1 << 100),
                       st.integers(min_value=-(1 << 100), max_value=-(1 << 63) - 1),
                       st.just(deep), st.just(deeper),
                       st.builds(msgpack.ExtType, st.integers(0, 127), st.binary(max_size=20)),
                       st.dictionaries(st.integers(), st.just(object()), min_size=1, max_size=2))


@ANY_SETTINGS
@given(st.one_of(packable, unpackable))
def test_pack_value_is_byte_identical_to_msgpack(value):
    got = outcome(C.pack_value, value)
    expected = outcome(P.pack_value, value)
    assert got == expected
    if got[0] == "ok":
        assert got[1] == msgpack.packb(value, use_bin_type=True)
    else:
        assert got[1] is ValueTypeError


@pytest.mark.parametrize("value", [
    0, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 63) - 1, 1 << 63,
    (1 << 64) - 1, 1 << 64, -1, -32, -33, -128, -129, -32768, -32769, -(1 << 31),
    -(1 << 31) - 1, -(1 << 63), -(1 << 63) - 1, 0.0, -0.0, math.inf, -math.inf, math.nan,
    "", "x" * 31, "x" * 32, "x" * 255, "x" * 256, "x" * 65535, "x" * 65536, "\ud800",
    "é" * 20, b"", b"x" * 255, b"x" * 256, b"x" * 65536, [], [0] * 15, [0] * 16, [0] * 65536,
    {}, {i: i for i in range(15)}, {i: i for i in range(16)}, (1, 2), [(1,), {"a": [b""]}],
    deep, deeper, True, False, None,
], ids=short_id)
def test_pack_value_edge_cases(value):
    got = outcome(C.pack_value, value)
    assert got == outcome(P.pack_value, value)


@ANY_SETTINGS
@given(st.lists(st.one_of(packable, unpackable), max_size=6))
def test_pack_values_is_the_list_of_pack_value(values):
    assert outcome(C.pack_values, values) == outcome(P.pack_values, values)


@st.composite
def value_bytes(draw):
    """msgpack bytes: valid encodings (msgpack's own), damaged ones, noise."""
    kind = draw(st.sampled_from(["valid", "valid", "damaged", "random", "ext", "float32"]))
    if kind == "random":
        return draw(st.binary(max_size=40))
    if kind == "ext":
        return msgpack.packb(msgpack.ExtType(draw(st.integers(0, 127)), draw(st.binary())))
    if kind == "float32":
        return msgpack.packb(draw(st.floats(width=32)), use_single_float=True)
    encoded = bytearray(msgpack.packb(draw(msgpackable), use_bin_type=True))
    if kind == "damaged" and encoded:
        action = draw(st.sampled_from(["cut", "flip", "pad"]))
        if action == "cut":
            del encoded[draw(st.integers(min_value=0, max_value=len(encoded) - 1)):]
        elif action == "flip":
            encoded[draw(st.integers(0, len(encoded) - 1))] ^= draw(st.integers(1, 255))
        else:
            encoded += draw(st.binary(min_size=1, max_size=4))
    return bytes(encoded)


@settings(max_examples=examples(600), deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(value_bytes(), st.integers(min_value=0, max_value=3))
def test_unpack_value_matches_msgpack(data, offset):
    padded = b"\xd1" * offset + data
    assert _same_repr(outcome(C.unpack_value, padded, offset),
                      outcome(P.unpack_value, padded, offset))


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\xc0\xc0", b"\xa1", b"\xa1\xff", b"\xd9\x01", b"\xdc\xff\xff",
    b"\xdd\xff\xff\xff\xff\x00", b"\xdf\xff\xff\xff\xff", b"\x81\x90\x01", b"\x81\x80\x01",
    b"\x82\x01\x02\x01\x03", b"\x82\x01\x02\xc3\x03", b"\xcf" + b"\xff" * 8, b"\xd3" + b"\x80" +
    b"\x00" * 7, b"\xd3" + b"\xff" * 8, b"\xd2\x80\x00\x00\x00", b"\xd1\x80\x00", b"\xd0\x80",
    b"\xca\x7f\xc0\x00\x00", b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00", b"\x91" * 40 + b"\xc0",
    b"\x91" * 2000 + b"\xc0", b"\xd6\xff\x00\x00\x00\x01", b"\xc7\x01\x05\x00",
], ids=short_id)
def test_unpack_value_edge_cases(data):
    assert _same_repr(outcome(C.unpack_value, data, 0), outcome(P.unpack_value, data, 0))


@pytest.mark.parametrize(("data", "why"), [
    (b"\x81\x90\x01", "TypeError: unhashable type: 'list'"),      # a map keyed by a list
    (b"\x81\x80\x01", "TypeError: unhashable type: 'dict'"),      # ... by a map
    (b"\xa5ab", "ValueError: Unpack failed: incomplete input"),    # cut short
    (b"\x01\x02", "ExtraData: unpack(b) received extra data."),  # two values
    (b"\xc1", "(FormatError)"),                                    # never used by msgpack
    (b"\xa2\xff\xfe", "UnicodeDecodeError"),                        # not UTF-8
    (b"", "incomplete input"),
])
def test_a_value_that_is_not_msgpack_is_a_value_decode_error(data, why):
    for unpack_value in (C.unpack_value, P.unpack_value):
        with pytest.raises(ValueDecodeError) as raised:
            unpack_value(b"\xd1" * 8 + data, 8)
        error = raised.value
        assert isinstance(error, ValueError)
        assert str(error).startswith(f"the stored value ({len(data)} byte")
        assert "could not be decoded" in str(error) and why in str(error)
        assert (error.dht, error.key) == ("", None)
    assert outcome(C.unpack_value, data, 0) == outcome(P.unpack_value, data, 0)


def test_a_value_decode_error_names_the_dht_and_the_key_it_is_given():
    error = outcome(P.unpack_value, b"\xc1", 0)
    located = ValueDecodeError(error[2]).with_key(("t", 1)).with_dht("words")
    assert (located.dht, located.key) == ("words", ("t", 1))
    assert str(located) == f"DHT 'words', key ('t', 1): {error[2]}"
    assert str(ValueDecodeError("why", key="k" * 100)) == f"key {repr('k' * 100)[:77]}...: why"
    # What the clients call for one value (with whichever unpack_value is in use).
    with pytest.raises(ValueDecodeError, match=r"^DHT 'words', key 'apple': the stored"):
        codec.value_of("words", "apple", b"\xd1" * 8 + b"\x81\x90\x01", 8)
    assert codec.value_of("words", "apple", b"\xd1" * 8 + b"\x81\xa1a\x01", 8) == {"a": 1}


@pytest.mark.parametrize("position", [0, 1, 3])
def test_get_many_take_names_the_key_whose_value_it_cannot_decode(position):
    values = [codec.reference.pack_value(number) for number in range(4)]
    values[position] = b"\x81\x90\x01"
    reply = wire.encode_get_many_reply(1, values)
    wanted = ["a", ("b", 2), "c", "d"]
    outcomes = []
    for get_many_take in (C.get_many_take, P.get_many_take):
        found = {}
        with pytest.raises(ValueDecodeError) as raised:
            get_many_take(reply, [0, 1, 2, 3], wanted, found, None)
        assert raised.value.key == wanted[position]
        assert str(raised.value).startswith(f"key {wanted[position]!r}: the stored value")
        assert found == {wanted[index]: index for index in range(position)}   # those before
        outcomes.append(str(raised.value))
    assert outcomes[0] == outcomes[1]
    # A position that names no wanted key fails as the reference does.
    assert outcome(C.get_many_take, reply, [0, 9, 9, 9], wanted, {}, None) == \
        outcome(P.get_many_take, reply, [0, 9, 9, 9], wanted, {}, None)


def test_unpack_value_arguments():
    assert _same_repr(outcome(C.unpack_value, b"\x01", 5), outcome(P.unpack_value, b"\x01", 5))
    with pytest.raises(TypeError):
        C.unpack_value(bytearray(b"\x01"), 0)
    with pytest.raises(OverflowError):
        C.unpack_value(b"\x01", -1)


# ------------------------------------------------------------ round trips

def udp_pair():
    """A service socket bound on loopback and a client socket connected to it."""
    service = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    service.bind(("127.0.0.1", 0))
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.connect(service.getsockname())
    client.settimeout(0.25)  # as a ServiceChannel leaves it: non-blocking fd
    service.settimeout(5)
    return service, client


def request(request_id):
    return wire.request_header(wire.OP_GET, request_id, 42) + b"body"


def answer(service, replies_for):
    """Answer one request with replies_for(request) (a list of datagrams)."""
    def run():
        data, peer = service.recvfrom(65536)
        for datagram in replies_for(data):
            service.sendto(datagram, peer)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# Every round trip behaves the same whether it sleeps at once (no spin
# argument, or 0) or first spins for the reply (what clients do by default).
SPINS = [None, 0.0, 0.002, 0.01]


def roundtrip(fd, message, timeout, spin):
    if spin is None:
        return C.roundtrip(fd, message, timeout)
    return C.roundtrip(fd, message, timeout, spin)


@pytest.mark.parametrize("spin", SPINS)
def test_roundtrip_returns_the_reply(spin):
    service, client = udp_pair()
    with service, client:
        thread = answer(service, lambda data: [wire.reply(wire.ST_OK, 7, b"value")])
        reply = roundtrip(client.fileno(), request(7), 2.0, spin)
        thread.join(5)
        assert reply == wire.reply(wire.ST_OK, 7, b"value")


@pytest.mark.parametrize("spin", SPINS)
def test_roundtrip_skips_stale_replies(spin):
    service, client = udp_pair()
    with service, client:
        thread = answer(service, lambda data: [b"\xd1\x01\x00", wire.reply(wire.ST_OK, 6),
                                               wire.reply(wire.ST_OK, 8, b"right")])
        reply = roundtrip(client.fileno(), request(8), 2.0, spin)
        thread.join(5)
        assert reply == wire.reply(wire.ST_OK, 8, b"right")


@pytest.mark.parametrize("spin", SPINS)
def test_roundtrip_times_out_with_none(spin):
    service, client = udp_pair()
    with service, client:
        started = time.monotonic()
        assert roundtrip(client.fileno(), request(9), 0.1, spin) is None
        assert 0.1 <= time.monotonic() - started < 1.0
        assert service.recv(100) == request(9)  # it was sent
        started = time.monotonic()
        assert roundtrip(client.fileno(), request(10), 0, spin) is None
        assert time.monotonic() - started < 0.5      # a spin never outlasts the timeout


@pytest.mark.parametrize("spin", SPINS)
def test_roundtrip_times_out_even_under_a_stream_of_stale_replies(spin):
    service, client = udp_pair()
    with service, client:
        thread = answer(service, lambda data: [wire.reply(wire.ST_OK, 1)] * 200)
        started = time.monotonic()
        assert roundtrip(client.fileno(), request(2), 0.2, spin) is None
        thread.join(5)
        assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("spin", SPINS)
def test_roundtrip_to_nothing_listening_is_refused(spin):
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    address = probe.getsockname()
    probe.close()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    with client:
        client.connect(address)
        with pytest.raises(ConnectionRefusedError):
            roundtrip(client.fileno(), request(1), 2.0, spin)


def test_roundtrip_spin_must_be_a_short_time():
    service, client = udp_pair()
    with service, client:
        for bad in (-0.001, 0.0101, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="spin must be in"):
                C.roundtrip(client.fileno(), request(1), 1.0, bad)
        with pytest.raises(TypeError):
            C.roundtrip(client.fileno(), request(1), 1.0, "fast")
        with pytest.raises(TypeError):
            C.roundtrip(client.fileno(), request(1), 1.0, 0.0, None, None, "extra")
        service.settimeout(0.05)
        with pytest.raises(OSError):
            service.recv(100)                          # nothing was sent


def test_roundtrip_argument_errors():
    service, client = udp_pair()
    with service, client:
        with pytest.raises(ValueError):
            C.roundtrip(client.fileno(), b"short", 1.0)
        with pytest.raises(ValueError):
            C.roundtrip(client.fileno(), request(1), -1.0)
        with pytest.raises(TypeError):
            C.roundtrip(client.fileno(), bytearray(request(1)), 1.0)
        with pytest.raises(OverflowError):
            C.roundtrip(-1, request(1), 1.0)
    closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    fd = closed.fileno()
    closed.close()
    with pytest.raises(OSError):
        C.roundtrip(fd, request(1), 0.1)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs setitimer")
def test_a_signal_during_a_roundtrip_runs_its_handler():
    class Interrupted(Exception):
        pass

    def handler(_signum, _frame):
        raise Interrupted

    service, client = udp_pair()
    previous = signal.signal(signal.SIGALRM, handler)
    try:
        with service, client:
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            started = time.monotonic()
            with pytest.raises(Interrupted):
                C.roundtrip(client.fileno(), request(3), 5.0)
            assert time.monotonic() - started < 2.0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_other_threads_run_while_a_roundtrip_waits():
    service, client = udp_pair()
    with service, client:
        ticks = []
        stop = threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(1)
                time.sleep(0.005)

        ticker = threading.Thread(target=tick)
        ticker.start()
        try:
            C.roundtrip(client.fileno(), request(4), 0.2)
        finally:
            stop.set()
            ticker.join()
        assert len(ticks) >= 5  # the GIL was released while waiting


# ------------------------------------------------------------ sealed round trips
#
# A secure deployment's round trip: C seals the request and opens the reply
# (roundtrip's key and seconds); codec.roundtrip_reference is its twin.
# Both are given the same datagrams back, and must put the same bytes on the
# wire and take the same reply, skipping the same forgeries.

DATA_KEY = bytes(range(16))
OTHER_KEY = bytes(range(1, 17))
STAMP_SECONDS = 0x5EED0000


def sealed_answer(request_id, body=b"value", key=DATA_KEY, client_id=None, seconds=None):
    """What a secure service sends back for request(request_id) sealed at
    STAMP_SECONDS (or as told otherwise)."""
    reply = wire.reply(wire.ST_OK, request_id, body)
    client = request(request_id)[8:16] if client_id is None else client_id
    stamp = (STAMP_SECONDS if seconds is None else seconds).to_bytes(4, "big")
    return auth.seal_reply(key, reply, client, stamp)


def forgeries(request_id):
    """Datagrams with the request's id that are not its reply."""
    honest = sealed_answer(request_id)
    flipped = bytearray(honest)
    flipped[-3] ^= 0x10
    return [wire.reply(wire.ST_OK, request_id, b"unsealed"),         # no MAC at all
            sealed_answer(request_id, key=OTHER_KEY),                 # another deployment's
            sealed_answer(request_id, seconds=STAMP_SECONDS - 1),     # another try's time
            sealed_answer(request_id, client_id=b"\0" * 8),           # another client's
            bytes(flipped), honest[:-1], honest[:15],                 # changed, cut short
            auth.seal_reply(DATA_KEY, wire.reply(wire.ST_OK, request_id)[:7],
                            request(request_id)[8:16],
                            STAMP_SECONDS.to_bytes(4, "big")),        # sealed, but too short
            sealed_answer(request_id + 1)]                            # a stale reply, sealed


def sealed_exchange(function, request_id, replies, timeout=2.0, spin=0.0):
    """(what function's round trip returned, the bytes the service got)."""
    service, client = udp_pair()
    received = []
    with service, client:
        thread = answer(service, lambda data: (received.append(data), replies)[1])
        result = outcome(function, client.fileno(), request(request_id), timeout, spin,
                         DATA_KEY, STAMP_SECONDS)
        thread.join(5)
        return result, received


@pytest.mark.parametrize("spin", [0.0, 0.002])
def test_a_sealed_roundtrip_sends_the_bytes_python_seals_and_takes_the_reply(spin):
    for function in (C.roundtrip, P.roundtrip):
        result, received = sealed_exchange(function, 31, [sealed_answer(31)], spin=spin)
        assert received == [auth.seal_request_reference(DATA_KEY, request(31), STAMP_SECONDS)]
        assert result == ("ok", wire.reply(wire.ST_OK, 31, b"value"))    # (opened)


@pytest.mark.parametrize("spin", [0.0, 0.002])
def test_a_sealed_roundtrip_skips_every_forgery_as_the_reference_does(spin):
    for forged in forgeries(32):
        replies = [forged, sealed_answer(32, b"mine")]
        c_result, c_sent = sealed_exchange(C.roundtrip, 32, replies, spin=spin)
        p_result, p_sent = sealed_exchange(P.roundtrip, 32, replies, spin=spin)
        assert c_sent == p_sent
        assert c_result == p_result == ("ok", wire.reply(wire.ST_OK, 32, b"mine")), forged


def test_a_sealed_roundtrip_given_only_forgeries_times_out_with_none():
    for function in (C.roundtrip, P.roundtrip):
        started = time.monotonic()
        result, _sent = sealed_exchange(function, 33, forgeries(33), timeout=0.2)
        assert result == ("ok", None)
        assert 0.2 <= time.monotonic() - started < 2.0


def test_a_sealed_roundtrip_seals_with_this_clock_when_not_given_a_time():
    service, client = udp_pair()
    with service, client:
        for _attempt in range(5):
            before = int(time.time())
            assert C.roundtrip(client.fileno(), request(34), 0, 0.0, DATA_KEY) is None
            if int(time.time()) == before:
                assert service.recv(100) == auth.seal_request_reference(DATA_KEY, request(34),
                                                                        before)
                return
            service.recv(100)
    raise AssertionError("the clock ticked during every attempt")


def test_a_large_request_is_sealed_whole():
    # (past the C round trip's stack buffer: sealed in memory of its own)
    message = request(35) + os.urandom(5000)
    service, client = udp_pair()
    with service, client:
        assert C.roundtrip(client.fileno(), message, 0, 0.0, DATA_KEY, 7) is None
        assert service.recv(65536) == auth.seal_request_reference(DATA_KEY, message, 7)


@pytest.mark.parametrize("arguments", [
    (request(1), 1.0, 0.0, b"short key"), (request(1), 1.0, 0.0, "k" * 16),
    (request(1), 1.0, 0.0, DATA_KEY, -1), (request(1), 1.0, 0.0, DATA_KEY, 1 << 32),
    (request(1), 1.0, 0.0, DATA_KEY, 1.5), (request(1), 1.0, 0.0, None, -1),
    (b"short", 1.0, 0.0, DATA_KEY), (request(1), -1.0, 0.0, DATA_KEY),
    (request(1), 1.0, 0.5, DATA_KEY), (request(1), 1.0, "fast", DATA_KEY),
    (bytearray(request(1)), 1.0, 0.0, DATA_KEY),
])
def test_a_sealed_roundtrip_refuses_what_the_reference_refuses(arguments):
    service, client = udp_pair()
    with service, client:
        c_result = outcome(C.roundtrip, client.fileno(), *arguments)
        assert c_result[0] == "error"
        assert c_result[:2] == outcome(P.roundtrip, client.fileno(), *arguments)[:2]
        service.settimeout(0.05)
        with pytest.raises(OSError):
            service.recv(100)                          # nothing was sent


# ------------------------------------------------------------ leaks

def _blocks_after(function, rounds):
    for _ in range(rounds // 4):
        function()
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(rounds):
        function()
    gc.collect()
    return sys.getallocatedblocks() - before


@pytest.mark.skipif(os.environ.get("PYTHONMALLOC", "").startswith("malloc")
                    or sys.getallocatedblocks() == 0,
                    reason="allocated blocks are only counted by pymalloc")
@pytest.mark.parametrize("fill", ["c", "reference"])
def test_bytes_to_fill_are_filled_through_their_buffer(fill):
    """What a receive writes through the buffer is the value's, whichever
    function made the two; the C value is bytes filled in place (the
    reference's a bytearray, made bytes by the caller), and its buffer keeps
    it alive on its own."""
    made = (C if fill == "c" else P).bytes_to_fill
    value, buffer = made(5)
    with memoryview(buffer) as view:
        assert not view.readonly and view.nbytes == 5
        view[:] = b"abcde"
    assert value == b"abcde"
    assert type(value) is (bytes if fill == "c" else bytearray)
    value, buffer = made(3)
    del value
    with memoryview(buffer) as view:
        view[:] = b"xyz"
        assert view.tobytes() == b"xyz"
    assert made(0)[0] == b""
    with pytest.raises(ValueError, match="size must be >= 0"):
        made(-1)
    with pytest.raises(TypeError):
        made("3")


def test_no_references_leak():
    owners = [Channel("a"), Channel("b")] * 8
    encoded = [keys.encode_key(index) for index in range(300)]
    values = [b"v" * (index % 40) for index in range(300)]
    get_reply = wire.encode_get_many_reply(1, [None, b"\x01", b"\xa1x", b"\xc1"] * 10)
    scan_reply = wire.encode_scan_reply(1, 2, 3, [(b"k", b"v")] * 10)
    bad_key = object()
    ids = itertools.count()
    service, client = udp_pair()

    def catch(function, *args):
        try:
            function(*args)
        except Exception:  # noqa: BLE001 - error paths must not leak either
            pass

    calls = [
        lambda: C.encode_key(1 << 200),
        lambda: C.encode_key(-(1 << 200)),
        lambda: catch(C.encode_key, -(1 << 70000)),
        lambda: C.encode_key("é" * 10),
        lambda: C.encode_key(bytearray(b"x")),
        lambda: catch(C.encode_key, bad_key),
        lambda: catch(C.encode_key, "x" * 9000),
        lambda: C.encode_keys([1, "a", b"b"]),
        lambda: catch(C.encode_keys, [1, bad_key]),
        lambda: C.keyed(1, 2, 3, 4, C.HASH_XXH3, 60, "key", b"value"),
        lambda: C.keyed(2, 2, 3, 4, keys.HASH_FUNCTIONS["sha256"], 60, 5, None),
        lambda: catch(C.keyed, 2, 2, 3, 4, C.HASH_XXH3, 60, 5, b"v"),
        lambda: C.put_many_requests(encoded, values, C.HASH_XXH64, 60, owners, 1,
                                    ids.__next__, 2, 500, 20),
        lambda: C.get_many_requests(encoded, list(range(0, 300, 2)), C.HASH_XXH3, 60, owners,
                                    1, ids.__next__, 2, {owners[0]: 3}, 500),
        lambda: catch(C.put_many_requests, encoded, values, C.HASH_XXH3, 60, [], 1,
                      ids.__next__, 2, 500, 20),
        lambda: C.decode_get_many_reply(get_reply),
        lambda: catch(C.decode_get_many_reply, get_reply[:-1]),
        lambda: C.decode_scan_reply(scan_reply),
        lambda: catch(C.decode_scan_reply, scan_reply + b"x"),
        lambda: catch(C.get_many_take, get_reply, list(range(40)), list(range(40)), {}, None),
        lambda: C.pack_value({"a": [1, 2.5, "é", b"x", None, (1 << 64) - 1]}),
        lambda: catch(C.pack_value, {1: object()}),
        lambda: C.pack_values([1, "x", [2]]),
        lambda: catch(C.pack_values, [1, "x", [1 << 70]]),
        lambda: C.unpack_value(msgpack.packb({"a": [1, 2.5, "é", b"x"]}), 0),
        lambda: catch(C.unpack_value, b"\x82\x90\x01\x01\x01", 0),
        lambda: catch(C.unpack_value, b"\xa2\xff\xfe", 0),
        lambda: C.roundtrip(client.fileno(), request(1), 0),
        lambda: C.roundtrip(client.fileno(), request(1), 0, 0.0, DATA_KEY, 5),
        lambda: C.roundtrip(client.fileno(), request(1) + bytes(2000), 0, 0.0, DATA_KEY, 5),
        lambda: catch(C.roundtrip, client.fileno(), request(1), 0, 0.0, b"bad key"),
        lambda: C.seal_request(DATA_KEY, request(1), 5),
        lambda: C.seal_request(DATA_KEY, request(1), seconds=5),
        lambda: catch(C.seal_request, DATA_KEY, request(1), -5),
        lambda: C.open_reply(DATA_KEY, sealed_answer(1), request(1)[8:16], b"\x5e\xed\0\0"),
        lambda: C.open_reply(DATA_KEY, sealed_answer(2), request(1)[8:16], b"\x5e\xed\0\0"),
        lambda: C.open_reply_to(DATA_KEY, sealed_answer(1), request(1),
                                [b"\0\0\0\0", b"\x5e\xed\0\0"]),
        lambda: catch(C.open_reply_to, DATA_KEY, sealed_answer(1), request(1), [None]),
        lambda: memoryview(C.bytes_to_fill(300)[1])[:3].tobytes(),
        lambda: catch(C.bytes_to_fill, -1),
    ]
    with service, client:
        service.setblocking(False)
        for call in calls:
            # A leak grows by a block per call at least, every time; a
            # single unlucky measurement (a cache filling up) does not
            # repeat, so only a call that grew is measured again.
            growth = _blocks_after(call, 2000)
            for _attempt in range(2):
                if growth < 100:
                    break
                growth = min(growth, _blocks_after(call, 2000))
            assert growth < 100, (f"line {call.__code__.co_firstlineno}", growth)


# ------------------------------------------------------------ selection

def test_the_codec_uses_c_unless_told_not_to():
    expected = "python" if os.environ.get("DOMUS_PURE_PYTHON") == "1" else "c"
    assert codec.IMPLEMENTATION == expected
    if expected == "c":
        assert codec.keyed is C.keyed and codec.roundtrip is C.roundtrip
        assert codec.accelerated is C
    else:
        assert codec.keyed is P.keyed and codec.roundtrip is None


# ------------------------------------------------------------ large values in pieces

@pytest.mark.parametrize("length", [0, 1, 0xFF, 0x100, 0xFFFF, 0x10000, 0x10001, 1 << 20])
def test_the_bin_header_is_msgpacks(length):
    from domus.wire.values import msgpack_bin_header

    value = bytes(length)
    assert msgpack_bin_header(length) + value == msgpack.packb(value, use_bin_type=True)


@pytest.mark.parametrize("length", [0, 70_000, 1 << 20])
def test_a_value_in_pieces_makes_the_message_the_packed_value_makes(length):
    from domus.wire.values import msgpack_bin_header, pack_value

    value = os.urandom(length)
    hasher = codec.hasher("xxh3")
    whole = codec.keyed(wire.OP_PUT, 7, 8, 9, hasher, 60, "key", pack_value(value))
    pieces = codec.keyed_message(wire.OP_PUT, 7, 8, 9, hasher, 60, "key",
                                 (msgpack_bin_header(length), value))
    assert pieces == whole
    message = pieces[0]
    assert type(message) is wire.Gathered and message.payload is value     # (not copied)
    assert bytes(message) == whole[0] and len(message) == len(whole[0])
    assert codec.keyed_message(wire.OP_GET, 7, 8, 9, hasher, 60, "key", None) == \
        codec.keyed(wire.OP_GET, 7, 8, 9, hasher, 60, "key", None)
