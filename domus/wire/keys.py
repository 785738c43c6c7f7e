"""Keys: their canonical bytes, the hash functions, and key -> bucket.

A key is an int (of any size), a str, bytes, or a tuple of keys.  Its
canonical encoding is a one-byte type tag followed by the payload, so ``1``,
``"1"`` and ``b"1"`` are three different keys, while ``True`` and ``1`` are
the same key (and ``(True, "a")`` and ``(1, "a")``), exactly as in a Python
dict.  Services only ever see the encoded bytes.

A tuple (tag 0x05) is each element's own encoding with every 0x00 byte
followed by 0xFF, and a 0x00 after each element; so an element ends at the
first 0x00 not followed by 0xFF, and tuples compare as Python compares them
(element by element, a prefix first).  Tuples nest up to MAX_TUPLE_DEPTH
deep.  (A namedtuple is the tuple of its fields, as in a dict.)

The encoding preserves order: for two ints, two strs or two bytes keys,
``a < b`` exactly when ``encode_key(a) < encode_key(b)`` compared as bytes,
and every int sorts before every str, every str before every bytes.  Ordered
storage platforms (``domus-rbt``) keep their records in encoded-key order, so
a key range is a range of encoded bytes.  Ints get that order from the tags:
negative big ints (0x00) < 64-bit ints (0x01) < positive big ints (0x02); a
64-bit int is ``key + 2**63`` as 8 unsigned bytes; a big int carries a
2-byte length before its magnitude (a longer magnitude is a bigger number),
and a negative one stores the length and the magnitude inverted, so a bigger
magnitude sorts first.  Every int has exactly one encoding (the magnitude has
no leading zero byte) and decode_key refuses any other.

A DHT's hash function maps encoded keys to 64-bit integers; a DHT with
``2**k`` buckets puts a key in bucket ``hash >> (64 - k)`` (its top k bits),
so when the bucket count doubles, bucket ``b`` splits into ``2b`` and
``2b + 1``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable
from typing import NoReturn

import xxhash

from domus.errors import KeyTooLarge, KeyTypeError, ProtocolError
from domus.wire.protocol import MAX_KEY_BYTES

TAG_NEGBIG = 0x00   # int < -2**63: u16 (0xFFFF - L), then NOT of the L-byte magnitude
TAG_INT64 = 0x01    # int in [-2**63, 2**63): key + 2**63, 8 bytes big-endian unsigned
TAG_POSBIG = 0x02   # int >= 2**63: u16 L, then the L-byte magnitude
TAG_STR = 0x03      # UTF-8 (lone surrogates kept with surrogatepass)
TAG_BYTES = 0x04    # raw bytes
TAG_TUPLE = 0x05    # each element's encoding, 0x00 escaped as 0x00 0xFF, then 0x00
MAX_TUPLE_DEPTH = 32
# A big int's magnitude is minimal big-endian unsigned: no leading zero byte.

_INT64 = struct.Struct(">BQ")
_INT64_KEY_BYTES = _INT64.size
_BIGINT_HEADER = struct.Struct(">BH")
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1
_INT64_OFFSET = 1 << 63
_INVERT = bytes(0xFF - byte for byte in range(256))   # bytes.translate table: bitwise NOT


def encode_key(key: object) -> bytes:
    """Return the canonical bytes of ``key``; raise KeyTypeError or
    KeyTooLarge for keys Domus cannot store."""
    return _encode_key(key, 0)


def _encode_key(key: object, depth: int) -> bytes:
    """encode_key of ``key``, an element of tuples ``depth`` deep."""
    kind = type(key)
    if kind is int or kind is bool:
        if _INT64_MIN <= key <= _INT64_MAX:  # type: ignore[operator]
            return _INT64.pack(TAG_INT64, key + _INT64_OFFSET)  # type: ignore[operator]
        return _encode_bigint(key)  # type: ignore[arg-type]
    if kind is str:
        encoded = b"\x03" + key.encode("utf-8", "surrogatepass")  # type: ignore[union-attr]
    elif kind is bytes:
        encoded = b"\x04" + key  # type: ignore[operator]
    elif isinstance(key, int):
        # The int itself, not __int__/__str__ overrides: IntEnum.A is its value.
        return encode_key(int.__int__(key))
    elif isinstance(key, str):
        return encode_key(str.__str__(key))
    elif isinstance(key, (bytearray, memoryview)):
        return encode_key(bytes(key))
    elif isinstance(key, tuple):
        return _encode_tuple(key, depth)
    else:
        raise KeyTypeError(
            f"a Domus key must be int, str, bytes or a tuple of those, not "
            f"{type(key).__name__}; convert it first (for example str(key))")
    if len(encoded) > MAX_KEY_BYTES:
        _raise_too_large(len(encoded))
    return encoded


def _encode_tuple(key: tuple, depth: int) -> bytes:
    """Tag 0x05: each element escaped and ended (see the module)."""
    if depth >= MAX_TUPLE_DEPTH:
        raise KeyTypeError(f"a tuple key may hold tuples {MAX_TUPLE_DEPTH} deep at most")
    parts = [b"\x05"]
    for element in key:
        parts.append(_encode_key(element, depth + 1).replace(b"\x00", b"\x00\xff"))
        parts.append(b"\x00")
    encoded = b"".join(parts)
    if len(encoded) > MAX_KEY_BYTES:
        _raise_too_large(len(encoded))
    return encoded


def _encode_bigint(key: int) -> bytes:
    """Tag 0x02 or 0x00 for an int outside the 64-bit range."""
    magnitude = abs(key)
    length = (magnitude.bit_length() + 7) // 8
    if _BIGINT_HEADER.size + length > MAX_KEY_BYTES:
        # Sized before the bytes are made: a huge int fails without them.
        _raise_too_large(_BIGINT_HEADER.size + length)
    payload = magnitude.to_bytes(length, "big")
    if key > 0:
        return _BIGINT_HEADER.pack(TAG_POSBIG, length) + payload
    return _BIGINT_HEADER.pack(TAG_NEGBIG, 0xFFFF - length) + payload.translate(_INVERT)


def _raise_too_large(encoded_size: int) -> NoReturn:
    raise KeyTooLarge(
        f"key is {encoded_size} bytes encoded, over the limit of "
        f"{MAX_KEY_BYTES}; hash long keys down (e.g. hashlib.sha256) first")


def decode_key(encoded: bytes) -> int | str | bytes:
    """Inverse of encode_key; ProtocolError for bytes it never produces."""
    try:
        return _decode_key(encoded)
    except IndexError:   # only encoded[0] indexes: checked here, off the common path
        raise ProtocolError("bad encoded key b'': an encoded key has at least its "
                            "tag byte") from None
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"bad encoded key {encoded[:16]!r}: {exc}") from None


def _decode_key(encoded: bytes) -> int | str | bytes:
    tag = encoded[0]
    if tag == TAG_INT64:
        if len(encoded) != _INT64_KEY_BYTES:
            raise ValueError(f"a 64-bit int key is {_INT64_KEY_BYTES} bytes, "
                             f"not {len(encoded)}")
        return _INT64.unpack(encoded)[1] - _INT64_OFFSET
    if len(encoded) > MAX_KEY_BYTES:
        raise ValueError(f"{len(encoded)} bytes, over the limit of {MAX_KEY_BYTES}")
    if tag == TAG_POSBIG or tag == TAG_NEGBIG:
        return _decode_bigint(encoded)
    if tag == TAG_STR:
        return encoded[1:].decode("utf-8", "surrogatepass")
    if tag == TAG_BYTES:
        return encoded[1:]
    if tag == TAG_TUPLE:
        return _decode_tuple(encoded)
    raise ValueError(f"unknown key tag 0x{tag:02x}")


def _decode_tuple(encoded: bytes) -> tuple:
    elements = []
    start, at, end = 1, 1, len(encoded)
    while at < end:
        zero = encoded.find(b"\x00", at)
        if zero < 0:
            raise ValueError("a tuple element is not ended by 0x00")
        if zero + 1 < end and encoded[zero + 1] == 0xFF:
            at = zero + 2                       # an escaped 0x00 inside the element
            continue
        elements.append(_decode_key(encoded[start:zero].replace(b"\x00\xff", b"\x00")))
        start = at = zero + 1
    decoded = tuple(elements)
    if _encode_tuple(decoded, 0) != encoded:   # one encoding per key, no other
        raise ValueError("not the canonical encoding of a tuple key")
    return decoded


def _decode_bigint(encoded: bytes) -> int:
    if len(encoded) < _BIGINT_HEADER.size:
        raise ValueError("a big int key is cut short in its 2-byte length")
    tag, length_field = _BIGINT_HEADER.unpack_from(encoded)
    length = length_field if tag == TAG_POSBIG else 0xFFFF - length_field
    payload = encoded[_BIGINT_HEADER.size:]
    if len(payload) != length:
        raise ValueError(f"the length field says {length} magnitude bytes, "
                         f"but {len(payload)} follow")
    if tag == TAG_POSBIG:
        if payload[:1] == b"\x00":
            raise ValueError("non-minimal big int: its magnitude starts with a zero byte")
        value = int.from_bytes(payload, "big")
        if value <= _INT64_MAX:
            raise ValueError(f"big int tag 0x{tag:02x} on {value}, which must use "
                             f"tag 0x{TAG_INT64:02x} (64-bit)")
    else:
        if payload[:1] == b"\xff":
            raise ValueError("non-minimal negative big int: its inverted magnitude "
                             "starts with a 0xff byte")
        value = -int.from_bytes(payload.translate(_INVERT), "big")
        if value >= _INT64_MIN:
            raise ValueError(f"big int tag 0x{tag:02x} on {value}, which must use "
                             f"tag 0x{TAG_INT64:02x} (64-bit)")
    return value


def _blake2b64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def _sha256_64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big")


# name -> function from encoded key to an unsigned 64-bit int.
HASH_FUNCTIONS: dict[str, Callable[[bytes], int]] = {
    "xxh3": xxhash.xxh3_64_intdigest,   # fast, non-cryptographic (default)
    "xxh64": xxhash.xxh64_intdigest,    # fast, non-cryptographic
    "blake2b": _blake2b64,              # cryptographic
    "sha256": _sha256_64,               # cryptographic
}
DEFAULT_HASH = "xxh3"


def bucket_shift(bucket_count: int) -> int:
    """How far to shift a 64-bit hash right to get its bucket (64 for a
    single bucket, which sends every hash to bucket 0)."""
    return 64 - (bucket_count.bit_length() - 1)


def bucket_of(encoded_key: bytes, hash_name: str, bucket_count: int) -> int:
    """The bucket of an encoded key in a DHT with these attributes."""
    return HASH_FUNCTIONS[hash_name](encoded_key) >> bucket_shift(bucket_count)
