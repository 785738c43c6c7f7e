"""Values: what clients store, encoded by the DHT's codec.

Services keep values as opaque bytes and never decode them; only clients
do, with these functions.  A DHT's ``codec`` attribute
(domus.wire.attributes.CODECS) chooses how:

- ``msgpack`` (the default, what every language reads): bytes, str, int
  (64-bit), float, bool, None, and lists and dicts of those.  Tuples come
  back as lists.
- ``pickle``: any object pickle can encode, protocol 5.  Unpickling runs
  code, so clients use it only on a deployment with a secret, and every
  holder of the secret is trusted with code execution in every client that
  reads the DHT.
- ``raw``: bytes (or a bytes-like object) in, the same bytes out.
"""

from __future__ import annotations

import pickle
from typing import Any

import msgpack

from domus.errors import ValueDecodeError, ValueTypeError


def pack_value(value: Any) -> bytes:
    """The bytes stored for ``value``; ValueTypeError if it has none."""
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueTypeError(
            f"cannot store a value of type {type(value).__name__}: {exc}. Values must be "
            f"bytes, str, int, float, bool, None, or lists/dicts of those") from None


def msgpack_bin_header(length: int) -> bytes:
    """The msgpack header of a ``length``-byte bytes value (bin 8, 16 or
    32): ``msgpack_bin_header(len(value)) + value`` is
    ``pack_value(value)`` for bytes, which lets a client put the header
    and a large value into its message side by side, the value copied once."""
    if length < 0x100:
        return bytes((0xC4, length))
    if length < 0x10000:
        return b"\xc5" + length.to_bytes(2, "big")
    if length < 0x100000000:
        return b"\xc6" + length.to_bytes(4, "big")
    raise ValueError(f"msgpack bin holds at most 4 GiB, not {length} bytes")


def unpack_value(data: bytes) -> Any:
    """The value stored as ``data``; ValueDecodeError (and nothing else) if
    the bytes are not a msgpack value: cut short, padded, a map with a
    list or map as a key, invalid UTF-8, an unknown type byte..."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, OverflowError) as exc:   # msgpack's ways of refusing
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        size = f"{len(data)} byte{'' if len(data) == 1 else 's'}"
        raise ValueDecodeError(
            f"the stored value ({size}) could not be decoded: it is not the msgpack a "
            f"Domus client writes ({detail}); another program wrote it or it is corrupt, "
            f"so overwrite or delete the key") from None


def pack_pickle(value: Any) -> bytes:
    """The bytes stored for ``value`` on a ``pickle`` DHT; ValueTypeError
    if pickle cannot encode it."""
    try:
        return pickle.dumps(value, protocol=5)
    except (pickle.PicklingError, TypeError, AttributeError, ValueError,
            RecursionError) as exc:
        raise ValueTypeError(f"cannot pickle a value of type {type(value).__name__}: "
                             f"{exc}") from None


def unpack_pickle(data: bytes) -> Any:
    """The value stored as ``data`` on a ``pickle`` DHT (pickle's own errors
    for a class this process cannot import)."""
    return pickle.loads(data)


def pack_raw(value: Any) -> bytes:
    """``value`` itself on a ``raw`` DHT: bytes, or a bytes-like object's
    bytes; ValueTypeError for anything else."""
    if type(value) is bytes:
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise ValueTypeError(f"a DHT with codec 'raw' stores bytes, not {type(value).__name__}; "
                         f"encode the value first, or create the DHT with codec 'msgpack' "
                         f"or 'pickle'")


def unpack_raw(data: bytes) -> bytes:
    return bytes(data)
