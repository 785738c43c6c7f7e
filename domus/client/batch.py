"""put_many and get_many, without a transport: how keys are packed into
messages (one per service where they fit a datagram) and how replies are
taken in.  The synchronous and the Twisted clients both use these; each
only sends the messages its own way.

"Channel" below is anything naming one service (a ServiceChannel or a
TxChannel).  The per-key work (encoding keys, hashing them to buckets,
grouping them by channel, packing entries, decoding replies) is done by
domus.client.codec, in C when it is built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from domus.client import codec
from domus.client.codec import Hasher, Member, chunks
from domus.errors import DomusError, ValueTooLarge
from domus.wire import protocol as wire
from domus.wire.keys import encode_key
from domus.wire.values import pack_value

Channel = TypeVar("Channel")
ErrorFor = Callable[[bytes, Any], DomusError]

__all__ = ["Member", "chunks", "encode_pairs", "check_values", "put_requests",
           "GetMany"]

# Replies that leave a batch's keys to its next round.
_NOT_FINAL = frozenset({wire.ST_NOT_OWNER, wire.ST_MOVING, wire.ST_UNKNOWN_DHT})


def encode_pairs(pairs: list[Any], values: codec.ValueCodec | None = None
                 ) -> tuple[list[bytes], list[bytes]]:
    """Encoded keys and values packed by ``values`` (default msgpack) of
    (key, value) pairs.  Of several bad pairs, the error raised is the
    first one a pair-by-pair loop (key, then value) meets."""
    pack = values.pack if values is not None else pack_value
    pack_many = values.pack_many if values is not None else codec.pack_values
    try:
        keys = codec.encode_keys([key for key, _value in pairs])
    except Exception:
        for key, value in pairs:  # find the first bad pair, the slow way
            encode_key(key)
            pack(value)
        raise
    return keys, pack_many([value for _key, value in pairs])


def check_values(values: list[bytes]) -> None:
    """Refuse the whole batch if any value is over the limit."""
    if values and max(map(len, values)) > wire.MAX_VALUE_BYTES:
        first = next(len(value) for value in values if len(value) > wire.MAX_VALUE_BYTES)
        raise ValueTooLarge(f"a value of {first} bytes is over the "
                            f"{wire.MAX_VALUE_BYTES}-byte limit; nothing was stored")


def put_requests(keys: list[bytes], values: list[bytes], hasher: Hasher, shift: int,
                 owners: Sequence[Channel], dht_id: int, ids: Any) -> list[tuple[Channel, bytes]]:
    """PUT_MANY messages for encoded keys and packed values, one per
    service where they fit a datagram: (channel, message) pairs."""
    return codec.put_many_requests(keys, values, hasher, shift, owners, dht_id, ids.next,
                                   ids.client_id, wire.DEFAULT_MAX_DATAGRAM, wire.MAX_BATCH)


class GetMany:
    """The state of one get_many: what is found, what is still to ask.

    Entries per request are tracked per service: a reply that could carry
    only n values makes the next requests to that service ask for n, so
    large values cost one more round trip rather than one round per reply's
    worth of values."""

    def __init__(self, wanted: list[Any], encoded: list[bytes]) -> None:
        self.wanted = wanted
        self.encoded = encoded
        self.pending = list(range(len(encoded)))
        self.found: dict[Any, Any] = {}
        self.per_request: dict[Any, int] = {}
        self.answered = 0
        self.moving = False     # the last round met a bucket being moved

    def requests(self, hasher: Hasher, shift: int, owners: Sequence[Channel], dht_id: int,
                 ids: Any) -> tuple[list[tuple[Channel, bytes]], list[list[int]]]:
        """GET_MANY messages for the pending keys, and the positions each
        one asks for."""
        return codec.get_many_requests(self.encoded, self.pending, hasher, shift, owners,
                                       dht_id, ids.next, ids.client_id, self.per_request,
                                       wire.DEFAULT_MAX_DATAGRAM)

    def take(self, requests: list[tuple[Channel, bytes]], batches: list[list[int]],
             replies: list[bytes], error: ErrorFor,
             unpack: Callable[[bytes], Any] | None = None) -> bool:
        """Take in one round of replies (values decoded by ``unpack``, by
        default domus.wire.values.unpack_value); True if a service said a bucket
        moved (the caller refreshes the layout before the next round).
        Keys of a bucket being moved are asked again (``moving`` says so:
        the caller pauses first)."""
        still: list[int] = []
        moved = False
        self.moving = False
        for (channel, _message), batch, reply in zip(requests, batches, replies):
            if reply[2] in _NOT_FINAL:       # (UNKNOWN_DHT: a service that left it)
                moved = moved or reply[2] != wire.ST_MOVING
                self.moving = self.moving or reply[2] == wire.ST_MOVING
                still.extend(batch)
                continue
            if reply[2] != wire.ST_OK:
                raise error(reply, channel)
            answered = codec.get_many_take(reply, batch, self.wanted, self.found, unpack)
            self.answered += answered
            if answered < len(batch):  # the rest did not fit the reply
                self.per_request[channel] = max(1, answered)
                still.extend(batch[answered:])
        self.pending = still
        return moved
