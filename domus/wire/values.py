"""Values: what clients store, encoded with msgpack.

Services keep values as opaque bytes and never decode them; only clients
do, with these two functions.  Anything msgpack encodes is a value: bytes,
str, int (64-bit), float, bool, None, and lists and dicts of those.  Tuples
come back as lists.
"""

from __future__ import annotations

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
