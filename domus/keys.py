"""Keys: their canonical bytes, the hash functions, and key -> bucket.

A key is an int (of any size), a str or bytes.  Its canonical encoding is a
one-byte type tag followed by the payload, so ``1``, ``"1"`` and ``b"1"`` are
three different keys, while ``True`` and ``1`` are the same key, exactly as in
a Python dict.  Services only ever see the encoded bytes.

A DHT's hash function maps encoded keys to 64-bit integers; a DHT with
``2**k`` buckets puts a key in bucket ``hash >> (64 - k)`` (its top k bits),
so when the bucket count doubles, bucket ``b`` splits into ``2b`` and
``2b + 1``.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable

import xxhash

from domus.errors import KeyTooLarge, KeyTypeError, ProtocolError
from domus.protocol import MAX_KEY_BYTES

TAG_INT64 = 0x01    # int in [-2**63, 2**63): 8 bytes, big-endian, signed
TAG_BIGINT = 0x02   # any other int: minimal big-endian two's complement
TAG_STR = 0x03      # UTF-8 (lone surrogates kept with surrogatepass)
TAG_BYTES = 0x04    # raw bytes

_INT64 = struct.Struct(">Bq")
_INT64_MIN = -(1 << 63)
_INT64_MAX = (1 << 63) - 1


def encode_key(key: object) -> bytes:
    """Return the canonical bytes of ``key``; raise KeyTypeError or
    KeyTooLarge for keys Domus cannot store."""
    kind = type(key)
    if kind is int or kind is bool:
        if _INT64_MIN <= key <= _INT64_MAX:  # type: ignore[operator]
            return _INT64.pack(TAG_INT64, key)
        # Minimal: -2**71 fits 9 bytes though its bit_length (72) says 10.
        magnitude = key if key >= 0 else ~key  # type: ignore[operator]
        length = (magnitude.bit_length() + 8) // 8  # type: ignore[union-attr]
        encoded = bytes((TAG_BIGINT,)) + key.to_bytes(length, "big", signed=True)  # type: ignore[union-attr]
    elif kind is str:
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
    else:
        raise KeyTypeError(
            f"a Domus key must be int, str or bytes, not {type(key).__name__}; "
            f"convert it first (for example str(key))")
    if len(encoded) > MAX_KEY_BYTES:
        raise KeyTooLarge(
            f"key is {len(encoded)} bytes encoded, over the limit of "
            f"{MAX_KEY_BYTES}; hash long keys down (e.g. hashlib.sha256) first")
    return encoded


def decode_key(encoded: bytes) -> int | str | bytes:
    """Inverse of encode_key; ProtocolError for bytes it never produces."""
    try:
        return _decode_key(encoded)
    except (IndexError, struct.error, UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"bad encoded key {encoded[:16]!r}: {exc}") from None


def _decode_key(encoded: bytes) -> int | str | bytes:
    tag = encoded[0]
    if tag == TAG_INT64:
        return _INT64.unpack(encoded)[1]
    if tag == TAG_BIGINT:
        return int.from_bytes(encoded[1:], "big", signed=True)
    if tag == TAG_STR:
        return encoded[1:].decode("utf-8", "surrogatepass")
    if tag == TAG_BYTES:
        return encoded[1:]
    raise ValueError(f"unknown key tag 0x{tag:02x}")


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
