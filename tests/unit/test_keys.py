"""domus.keys: canonical key bytes, hash functions, key -> bucket."""

import enum

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domus.errors import KeyTooLarge, KeyTypeError, ProtocolError
from domus.keys import (
    DEFAULT_HASH,
    HASH_FUNCTIONS,
    TAG_BIGINT,
    TAG_BYTES,
    TAG_INT64,
    TAG_STR,
    bucket_of,
    bucket_shift,
    decode_key,
    encode_key,
)
from domus.protocol import MAX_KEY_BYTES

HASH_NAMES = sorted(HASH_FUNCTIONS)
INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1

# Any str, lone surrogates included (hypothesis' text() leaves them out).
any_str = st.lists(st.integers(0, 0x10FFFF), max_size=40).map(
    lambda code_points: "".join(map(chr, code_points)))
boundary_ints = st.sampled_from([
    0, 1, -1, INT64_MIN, INT64_MAX, INT64_MIN - 1, INT64_MAX + 1,
    1 << 64, -(1 << 64), (1 << 64) - 1, -(1 << 71), (1 << 71) - 1, 1 << 71,
    -(1 << 72), 1 << 1000, -(1 << 1000), 255, 256, -128, -129,
])
any_int = st.one_of(st.integers(), boundary_ints,
                    st.integers(-(1 << 600), 1 << 600))
any_key = st.one_of(any_int, any_str, st.binary(max_size=64))


# ------------------------------------------------------------ encoding

def test_int_str_and_bytes_of_the_same_text_are_three_keys():
    encoded = {encode_key(1), encode_key("1"), encode_key(b"1")}
    assert len(encoded) == 3


def test_true_and_false_are_the_keys_1_and_0_as_in_a_dict():
    assert encode_key(True) == encode_key(1)
    assert encode_key(False) == encode_key(0)
    assert decode_key(encode_key(True)) == 1


def test_int_subclass_is_the_key_of_its_value():
    class Level(enum.IntEnum):
        HIGH = 7

    assert encode_key(Level.HIGH) == encode_key(7)


def test_bytearray_and_memoryview_are_the_bytes_key():
    assert encode_key(bytearray(b"abc")) == encode_key(b"abc")
    assert encode_key(memoryview(b"abc")) == encode_key(b"abc")


def test_encoding_follows_the_documented_layout():
    # docs/protocol.md: a tag byte, then the payload.
    assert encode_key(1) == bytes([TAG_INT64]) + (1).to_bytes(8, "big")
    assert encode_key(-1) == bytes([TAG_INT64]) + b"\xff" * 8
    assert encode_key(INT64_MAX + 1) == bytes([TAG_BIGINT, 0x00, 0x80]) + bytes(7)
    assert encode_key(INT64_MIN - 1) == bytes([TAG_BIGINT, 0xFF, 0x7F]) + b"\xff" * 7
    assert encode_key(-(1 << 71)) == bytes([TAG_BIGINT, 0x80]) + bytes(8)
    assert encode_key("apple") == bytes([TAG_STR]) + b"apple"
    assert encode_key("\u00e9") == bytes([TAG_STR]) + "\u00e9".encode()
    assert encode_key(b"\x00\xff") == bytes([TAG_BYTES]) + b"\x00\xff"


@pytest.mark.parametrize("value", [INT64_MIN, INT64_MAX, 0, -1, 1])
def test_ints_in_64_bit_range_use_the_fixed_width_tag(value):
    encoded = encode_key(value)
    assert encoded[0] == TAG_INT64
    assert len(encoded) == 9


@pytest.mark.parametrize("value", [INT64_MIN - 1, INT64_MAX + 1, 1 << 64, -(1 << 64),
                                   1 << 1000, -(1 << 1000)])
def test_ints_beyond_64_bits_use_the_bigint_tag(value):
    encoded = encode_key(value)
    assert encoded[0] == TAG_BIGINT
    assert decode_key(encoded) == value


@settings(deadline=None, max_examples=200)
@given(st.one_of(st.integers(min_value=INT64_MAX + 1), st.integers(max_value=INT64_MIN - 1),
                 st.integers(0, 600).map(lambda power: -(1 << power)),
                 boundary_ints).filter(lambda value: not INT64_MIN <= value <= INT64_MAX))
def test_bigint_payload_is_minimal_twos_complement(value):
    # docs/protocol.md: "minimal signed two's complement".  A redundant
    # leading 0x00 (or 0xff) byte would give the same int different bytes
    # than another client computes, so its hash and bucket would differ.
    payload = encode_key(value)[1:]
    assert len(payload) >= 2
    redundant_zero = payload[0] == 0x00 and payload[1] < 0x80
    redundant_ones = payload[0] == 0xFF and payload[1] >= 0x80
    assert not redundant_zero and not redundant_ones
    assert int.from_bytes(payload, "big", signed=True) == value


def test_lone_surrogates_are_keys_and_distinct():
    lone_high, lone_low = "\ud800", "\udfff"
    assert decode_key(encode_key(lone_high)) == lone_high
    assert decode_key(encode_key(lone_low)) == lone_low
    assert encode_key(lone_high) != encode_key(lone_low)
    assert encode_key("a\ud800b") != encode_key("ab")


@settings(deadline=None, max_examples=300)
@given(any_key)
def test_decode_inverts_encode(key):
    decoded = decode_key(encode_key(key))
    assert type(decoded) is type(key)
    assert decoded == key


@settings(deadline=None, max_examples=300)
@given(any_key, any_key)
def test_encoding_is_injective(first, second):
    # Two keys share their bytes exactly when a dict sees them as one key
    # (same type family and equal value).
    same_key = type(first) is type(second) and first == second
    assert (encode_key(first) == encode_key(second)) == same_key


@settings(deadline=None, max_examples=200)
@given(any_key)
def test_encoding_is_deterministic(key):
    assert encode_key(key) == encode_key(key)


@pytest.mark.parametrize("corrupt", [b"", b"\x01\x00", b"\x03\xff\xfe", b"\x7fabc"])
def test_decode_key_raises_protocol_error_on_bytes_encode_key_never_makes(corrupt):
    with pytest.raises(ProtocolError):
        decode_key(corrupt)


def test_enum_members_are_stored_under_their_values():
    class Colour(str, enum.Enum):  # noqa: UP042 (the mix-in form users write)
        RED = "red"

    class Size(enum.IntEnum):
        BIG = 7

    assert encode_key(Colour.RED) == encode_key("red")
    assert encode_key(Size.BIG) == encode_key(7)


def test_decode_key_rejects_an_unknown_tag():
    with pytest.raises(ValueError, match="0x7f"):
        decode_key(b"\x7fabc")


# ------------------------------------------------------------ refused keys

@pytest.mark.parametrize("key, type_name", [
    (1.0, "float"), (None, "NoneType"), ((1, 2), "tuple"), ([1], "list"),
    ({"a": 1}, "dict"), (1j, "complex"), ({1}, "set"), (object(), "object"),
])
def test_keys_of_other_types_raise_key_type_error_naming_the_type(key, type_name):
    with pytest.raises(KeyTypeError) as raised:
        encode_key(key)
    assert type_name in str(raised.value)
    assert isinstance(raised.value, TypeError)


def test_keys_up_to_the_limit_are_accepted():
    assert len(encode_key(b"x" * (MAX_KEY_BYTES - 1))) == MAX_KEY_BYTES
    assert len(encode_key("x" * (MAX_KEY_BYTES - 1))) == MAX_KEY_BYTES


@pytest.mark.parametrize("key", [
    b"x" * MAX_KEY_BYTES,
    "x" * MAX_KEY_BYTES,
    "\u00e9" * (MAX_KEY_BYTES // 2),     # 2 UTF-8 bytes per character
    1 << (8 * MAX_KEY_BYTES),
    -(1 << (8 * MAX_KEY_BYTES)),
], ids=["bytes", "str", "utf8-str", "int", "negative-int"])
def test_keys_over_the_limit_raise_key_too_large(key):
    with pytest.raises(KeyTooLarge) as raised:
        encode_key(key)
    assert str(MAX_KEY_BYTES) in str(raised.value)
    assert isinstance(raised.value, ValueError)


# ------------------------------------------------------------ hashing

def test_default_hash_is_a_known_function():
    assert DEFAULT_HASH in HASH_FUNCTIONS


# Pinned values: every client and service must put a key in the same bucket,
# across processes, machines and releases.  A change here strands stored data.
PINNED = {
    "xxh3": [9928055618716677202, 10971357638593500668, 17670260348152390384],
    "xxh64": [9362151781533529038, 5082679805501745136, 11933185941951441433],
    "blake2b": [5351447070390878911, 248243071049900257, 14059684525775898178],
    "sha256": [1042765823455652860, 17667404134902744421, 327955184544369383],
}


def test_every_hash_function_is_pinned():
    assert set(PINNED) == set(HASH_FUNCTIONS)


@pytest.mark.parametrize("hash_name", HASH_NAMES)
def test_hash_values_are_stable(hash_name):
    keys = [b"\x03apple", b"\x01" + (1).to_bytes(8, "big"), b"\x04apple"]
    assert [HASH_FUNCTIONS[hash_name](key) for key in keys] == PINNED[hash_name]


@settings(deadline=None, max_examples=200)
@given(any_key)
def test_hashes_are_deterministic_unsigned_64_bit_ints(key):
    encoded = encode_key(key)
    for hash_function in HASH_FUNCTIONS.values():
        value = hash_function(encoded)
        assert type(value) is int
        assert 0 <= value < 1 << 64
        assert hash_function(bytes(encoded)) == value


@pytest.mark.parametrize("hash_name", HASH_NAMES)
def test_hash_uses_the_full_64_bits(hash_name):
    values = [HASH_FUNCTIONS[hash_name](encode_key(i)) for i in range(2000)]
    assert len(set(values)) == len(values)
    assert max(values) >= 1 << 63          # the top bit is used
    assert any(value & 1 for value in values)


# ------------------------------------------------------------ buckets

def test_bucket_shift_takes_the_top_bits():
    assert bucket_shift(1) == 64
    assert bucket_shift(2) == 63
    assert bucket_shift(1 << 20) == 44


def test_a_single_bucket_holds_every_key():
    for hash_name in HASH_NAMES:
        assert {bucket_of(encode_key(i), hash_name, 1) for i in range(500)} == {0}


@settings(deadline=None, max_examples=200)
@given(any_key, st.sampled_from(HASH_NAMES), st.integers(0, 20))
def test_bucket_is_in_range_and_is_the_top_bits_of_the_hash(key, hash_name, power):
    encoded = encode_key(key)
    bucket = bucket_of(encoded, hash_name, 1 << power)
    assert 0 <= bucket < 1 << power
    assert bucket == HASH_FUNCTIONS[hash_name](encoded) >> (64 - power)


@settings(deadline=None, max_examples=200)
@given(any_key, st.sampled_from(HASH_NAMES))
def test_doubling_the_buckets_splits_bucket_b_into_2b_and_2b_plus_1(key, hash_name):
    encoded = encode_key(key)
    for power in range(20):
        before = bucket_of(encoded, hash_name, 1 << power)
        after = bucket_of(encoded, hash_name, 2 << power)
        assert after in (2 * before, 2 * before + 1)


@pytest.mark.parametrize("hash_name", HASH_NAMES)
@pytest.mark.parametrize("make_key", [int, lambda i: f"user:{i}", lambda i: b"k%d" % i],
                         ids=["int", "str", "bytes"])
def test_buckets_are_roughly_uniform(hash_name, make_key):
    key_count, bucket_count = 100_000, 64
    counts = [0] * bucket_count
    for i in range(key_count):
        counts[bucket_of(encode_key(make_key(i)), hash_name, bucket_count)] += 1
    expected = key_count / bucket_count
    chi_square = sum((count - expected) ** 2 / expected for count in counts)
    # 63 degrees of freedom: mean 63, standard deviation ~11.  The inputs are
    # fixed, so this is deterministic; 200 is far out in the tail anyway.
    assert chi_square < 200
    assert min(counts) > 0.85 * expected
    assert max(counts) < 1.15 * expected
