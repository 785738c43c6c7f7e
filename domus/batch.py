"""put_many and get_many, without a transport: how keys are packed into
messages (one per service where they fit a datagram) and how replies are
taken in.  The synchronous and the Twisted clients both use these; each
only sends the messages its own way.

"Channel" below is anything naming one service (a ServiceChannel or a
TxChannel); groups map a channel to its members (position, bucket, key).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from domus import protocol as wire
from domus.errors import DomusError, ValueTooLarge

Channel = TypeVar("Channel")
Member = tuple[int, int, bytes]  # (position in the caller's list, bucket, encoded key)
ErrorFor = Callable[[bytes, Any], DomusError]


def chunks(entries: list[Any], sizes: list[int],
           limit: int = wire.MAX_BATCH) -> Iterator[list[Any]]:
    """Split entries (with their encoded sizes) into runs that fit one
    datagram and hold at most ``limit`` entries; an entry too big for a
    datagram gets a run of its own (it travels over TCP)."""
    chunk: list[Any] = []
    size = wire.BATCH_OVERHEAD
    for entry, entry_size in zip(entries, sizes):
        if chunk and (size + entry_size > wire.DEFAULT_MAX_DATAGRAM or len(chunk) >= limit):
            yield chunk
            chunk, size = [], wire.BATCH_OVERHEAD
        chunk.append(entry)
        size += entry_size
    if chunk:
        yield chunk


def check_values(encoded: list[tuple[bytes, bytes]]) -> None:
    """Refuse the whole batch if any value is over the limit."""
    for _key, value in encoded:
        if len(value) > wire.MAX_VALUE_BYTES:
            raise ValueTooLarge(f"a value of {len(value)} bytes is over the "
                                f"{wire.MAX_VALUE_BYTES}-byte limit; nothing was stored")


def put_requests(groups: dict[Channel, list[Member]], encoded: list[tuple[bytes, bytes]],
                 dht_id: int, ids: Any) -> list[tuple[Channel, bytes]]:
    """PUT_MANY messages for (encoded key, encoded value) pairs."""
    requests = []
    for channel, members in groups.items():
        entries = [(bucket, key, encoded[position][1]) for position, bucket, key in members]
        sizes = [wire.put_entry_size(key, value) for _bucket, key, value in entries]
        for chunk in chunks(entries, sizes):
            requests.append((channel, wire.encode_put_many(ids.next(), ids.client_id,
                                                           dht_id, chunk)))
    return requests


def put_replies(requests: list[tuple[Channel, bytes]], replies: list[bytes],
                error: ErrorFor, last_try: bool) -> tuple[int, int, bool]:
    """(records applied, keys created, whether a service said a bucket moved)."""
    applied = created = 0
    moved = False
    for (channel, _message), reply in zip(requests, replies):
        if reply[2] == wire.ST_OK:
            done, new = wire.U16X2.unpack_from(reply, wire.REPLY_HEADER_SIZE)
            applied += done
            created += new
        elif reply[2] == wire.ST_NOT_OWNER and not last_try:
            moved = True
        else:
            raise error(reply, channel)
    return applied, created, moved


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

    def requests(self, groups: dict[Channel, list[Member]], dht_id: int,
                 ids: Any) -> tuple[list[tuple[Channel, bytes]], list[list[int]]]:
        """GET_MANY messages for the pending keys (grouped from
        ``self.pending_keys()``), and the positions each one asks for."""
        requests, batches = [], []
        for channel, members in groups.items():
            limit = self.per_request.get(channel, wire.MAX_BATCH)
            sizes = [wire.get_entry_size(key) for _local, _bucket, key in members]
            for chunk in chunks(members, sizes, limit):
                requests.append((channel, wire.encode_get_many(
                    ids.next(), ids.client_id, dht_id,
                    [(bucket, key) for _local, bucket, key in chunk])))
                batches.append([self.pending[local] for local, _bucket, _key in chunk])
        return requests, batches

    def pending_keys(self) -> Iterator[bytes]:
        return (self.encoded[position] for position in self.pending)

    def take(self, requests: list[tuple[Channel, bytes]], batches: list[list[int]],
             replies: list[bytes], error: ErrorFor,
             unpack: Callable[[bytes], Any]) -> bool:
        """Take in one round of replies; True if a service said a bucket
        moved (the caller refreshes the layout before the next round)."""
        still: list[int] = []
        moved = False
        for (channel, _message), batch, reply in zip(requests, batches, replies):
            if reply[2] == wire.ST_NOT_OWNER:
                moved = True
                still.extend(batch)
                continue
            if reply[2] != wire.ST_OK:
                raise error(reply, channel)
            values = wire.decode_get_many_reply(reply)
            self.answered += len(values)
            for position, value in zip(batch, values):
                if value is not None:
                    self.found[self.wanted[position]] = unpack(value)
            if len(values) < len(batch):  # the rest did not fit the reply
                self.per_request[channel] = max(1, len(values))
                still.extend(batch[len(values):])
        self.pending = still
        return moved
