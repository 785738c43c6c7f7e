"""The client's per-request work: keys to messages, replies to values.

Everything a client does for one request between its caller and the socket
is here: encode the key, hash it to a bucket, build the message (one call
for a single-key request), group the keys of a batch by service and cut
them into datagrams, decode GET_MANY and SCAN replies, pack and unpack
values (msgpack, as domus.wire.values), and the UDP round trip (sealed and
opened on a secure deployment).

Each function has a pure-Python reference below, built on
``domus.wire.keys`` and ``domus.wire.protocol``.  ``domus._codec`` (cext/codec.c)
implements the same functions in C, byte for byte and error for error;
tests/unit/test_codec.py runs both on random inputs.  The C module is used
when it is built, unless ``DOMUS_PURE_PYTHON=1`` is set; ``IMPLEMENTATION``
says which one this process uses, ``reference`` holds the Python functions
and ``accelerated`` the C module (or None).

A *hasher* is what ``hasher(name)`` returns for a DHT's hash function: the
function itself, or (C only) a code for a hash the C module computes
(xxh3, xxh64).  A *shift* is ``domus.wire.keys.bucket_shift(bucket_count)``.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple, TypeVar

from domus.errors import ValueDecodeError
from domus.wire import auth as _auth
from domus.wire import keys as _keys
from domus.wire import protocol as wire
from domus.wire import values as _values

Channel = TypeVar("Channel", bound=Hashable)
Member = tuple[int, int, bytes]  # (position among the keys, bucket, encoded key)
Hasher = Any                     # a hash function, or a C hash code
MIN_SHIFT = 32                   # buckets are u32 on the wire
MAX_SHIFT = 64                   # one bucket


def _check_shift(shift: int) -> None:
    if not MIN_SHIFT <= shift <= MAX_SHIFT:
        raise ValueError(f"shift must be in [{MIN_SHIFT}, {MAX_SHIFT}] (a bucket is a u32)")


# ------------------------------------------------------------ keys

encode_key = _keys.encode_key


def encode_keys(keys: Sequence[Any]) -> list[bytes]:
    """[encode_key(key) for key in keys], for a list or tuple."""
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"keys must be a list or a tuple, not {type(keys).__name__}")
    return [_keys.encode_key(key) for key in keys]


def bucket_of(hasher: Hasher, shift: int, encoded_key: bytes) -> int:
    """The bucket of an encoded key: its hash >> shift."""
    _check_shift(shift)
    return hasher(encoded_key) >> shift


# ------------------------------------------------------------ key ranges

def range_query(dht_id: int, lo: Any, hi: Any, inclusive: Any, reverse: bool,
                items: bool) -> wire.RangeQuery:
    """The RANGE query of ``irange(lo, hi, inclusive=, reverse=, items=)``
    (every client's): bounds encoded as keys (None: unbounded), values asked
    for only with ``items``.  KeyTypeError for a bound that is not a key,
    TypeError for an ``inclusive`` that is not a tuple of two bools."""
    low = None if lo is None else _keys.encode_key(lo)
    high = None if hi is None else _keys.encode_key(hi)
    if not (isinstance(inclusive, tuple) and len(inclusive) == 2):
        raise TypeError("irange(): inclusive must be a tuple of two bools, "
                        "e.g. (True, False)")
    return wire.RangeQuery(dht_id, low, high, bool(inclusive[0]), bool(inclusive[1]),
                           bool(reverse), not items)


def next_range_page(query: wire.RangeQuery, last: bytes) -> wire.RangeQuery:
    """The query of a service's next page of a range, whose page before
    ended at key ``last``: it starts just after ``last``."""
    if query.reverse:
        return query._replace(high=last, high_inclusive=False)
    return query._replace(low=last, low_inclusive=False)


# ------------------------------------------------------------ single keys

def keyed(op: int, request_id: int, client_id: int, dht_id: int, hasher: Hasher, shift: int,
          key: Any, value: bytes | None) -> tuple[bytes, int]:
    """(message, bucket) of a PUT, GET, DELETE or CONTAINS request for
    ``key``; ``value`` is the packed value of a PUT (its u32 length is
    added), None or b"" otherwise."""
    _check_shift(shift)
    encoded = _keys.encode_key(key)
    bucket = hasher(encoded) >> shift
    return (wire.encode_keyed(op, request_id, client_id, dht_id, bucket, encoded,
                              b"" if value is None else value, numbered(shift)), bucket)


def keyed_message(op: int, request_id: int, client_id: int, dht_id: int, hasher: Hasher,
                  shift: int, key: Any, value: bytes | tuple[bytes, bytes] | None,
                  ) -> tuple[bytes | wire.Gathered, int]:
    """``keyed``, where a PUT's packed value may also be given in two
    pieces, (header, payload), as a client packs a large value: the
    message is then a wire.Gathered, the payload never copied into it (the
    clients send its parts as they are)."""
    if type(value) is not tuple:
        return keyed(op, request_id, client_id, dht_id, hasher, shift, key, value)
    header, payload = value
    message, bucket = keyed(op, request_id, client_id, dht_id, hasher, shift, key, b"")
    # (A PUT's value is last, after its u32 length: 0 in ``message``.)
    return wire.Gathered(b"".join((memoryview(message)[:-4],
                                   (len(header) + len(payload)).to_bytes(4, "big"), header)),
                         payload), bucket


def numbered(shift: int) -> int:
    """The NUMBERING byte of requests whose buckets are ``hash >> shift``."""
    return 65 - shift


# ------------------------------------------------------------ batches

def group(keys: Sequence[bytes], hasher: Hasher, shift: int,
          owners: Sequence[Channel]) -> dict[Channel, list[Member]]:
    """Encoded keys grouped by the channel storing their bucket
    (``owners[bucket]``), channels in order of first appearance."""
    _check_shift(shift)
    groups: dict[Channel, list[Member]] = {}
    for position, encoded in enumerate(keys):
        bucket = hasher(encoded) >> shift
        groups.setdefault(owners[bucket], []).append((position, bucket, encoded))
    return groups


def chunks(entries: list[Any], sizes: list[int], limit: int = wire.MAX_BATCH,
           max_datagram: int = wire.DEFAULT_MAX_DATAGRAM) -> Iterator[list[Any]]:
    """Split entries (with their encoded sizes) into runs that fit one
    datagram and hold at most ``limit`` entries; an entry too big for a
    datagram gets a run of its own (it travels over TCP)."""
    chunk: list[Any] = []
    size = wire.BATCH_OVERHEAD
    for entry, entry_size in zip(entries, sizes):
        if chunk and (size + entry_size > max_datagram or len(chunk) >= limit):
            yield chunk
            chunk, size = [], wire.BATCH_OVERHEAD
        chunk.append(entry)
        size += entry_size
    if chunk:
        yield chunk


def _check_limit(limit: int) -> None:
    if not 1 <= limit <= wire.MAX_BATCH:
        raise ValueError(f"limit must be in [1, {wire.MAX_BATCH}]")


def put_many_requests(keys: Sequence[bytes], values: Sequence[bytes], hasher: Hasher,
                      shift: int, owners: Sequence[Channel], dht_id: int,
                      next_id: Callable[[], int], client_id: int, max_datagram: int,
                      limit: int) -> list[tuple[Channel, bytes]]:
    """PUT_MANY messages for encoded keys and packed values: (channel,
    message) pairs, the keys grouped by ``owners[bucket]`` and cut into runs
    that fit ``max_datagram`` bytes and ``limit`` entries.  ``next_id()``
    gives each message's request id, in order."""
    _check_limit(limit)
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} values")
    requests = []
    for channel, members in group(keys, hasher, shift, owners).items():
        entries = [(bucket, key, values[position]) for position, bucket, key in members]
        sizes = [wire.put_entry_size(key, value) for _bucket, key, value in entries]
        for chunk in chunks(entries, sizes, limit, max_datagram):
            requests.append((channel, wire.encode_put_many(next_id(), client_id, dht_id,
                                                           chunk, numbered(shift))))
    return requests


def get_many_requests(keys: Sequence[bytes], pending: Sequence[int], hasher: Hasher,
                      shift: int, owners: Sequence[Channel], dht_id: int,
                      next_id: Callable[[], int], client_id: int,
                      limits: dict[Channel, int], max_datagram: int,
                      ) -> tuple[list[tuple[Channel, bytes]], list[list[int]]]:
    """GET_MANY messages for ``keys[p] for p in pending``: (requests,
    batches), where ``batches[i]`` are the positions (items of ``pending``)
    that request i asks for.  ``limits`` maps a channel to the most entries
    per message (default 65535)."""
    groups = group([keys[position] for position in pending], hasher, shift, owners)
    requests, batches = [], []
    for channel, members in groups.items():
        limit = limits.get(channel, wire.MAX_BATCH)
        _check_limit(limit)
        sizes = [wire.get_entry_size(key) for _local, _bucket, key in members]
        for chunk in chunks(members, sizes, limit, max_datagram):
            request_id = next_id()
            batches.append([pending[local] for local, _bucket, _key in chunk])
            requests.append((channel, wire.encode_get_many(
                request_id, client_id, dht_id, [(bucket, key) for _local, bucket, key in chunk],
                numbered(shift))))
    return requests, batches


# ------------------------------------------------------------ replies

decode_get_many_reply = wire.decode_get_many_reply
decode_scan_reply = wire.decode_scan_reply

def get_many_take(reply: bytes, batch: list[int], wanted: Sequence[Any], found: Any,
                  unpack: Callable[[bytes], Any] | None) -> int:
    """Take in an OK GET_MANY reply: for each value present, in order,
    ``found[wanted[batch[i]]] = unpack(value)`` (``unpack`` None:
    unpack_value).  Returns how many entries the reply answers;
    ProtocolError (and nothing taken) if it is malformed.  A value that
    cannot be decoded stops the taking with its ValueDecodeError, naming
    its key (the values before it are taken)."""
    values = decode_get_many_reply(reply)
    unpack = _values.unpack_value if unpack is None else unpack
    for position, value in zip(batch, values):
        if value is not None:
            try:
                decoded = unpack(value)
            except ValueDecodeError as exc:
                raise exc.with_key(wanted[position]) from None
            found[wanted[position]] = decoded
    return len(values)


# ------------------------------------------------------------ values

pack_value = _values.pack_value


def value_of(dht: str, key: Any, data: bytes, offset: int) -> Any:
    """``unpack_value(data, offset)``, the value of ``key`` in DHT ``dht``: a
    ValueDecodeError names them (the clients' way to decode one value)."""
    try:
        return unpack_value(data, offset)
    except ValueDecodeError as exc:
        raise exc.with_key(key).with_dht(dht) from None


def pack_values(values: Sequence[Any]) -> list[bytes]:
    """[pack_value(value) for value in values], for a list or tuple."""
    if not isinstance(values, (list, tuple)):
        raise TypeError(f"values must be a list or a tuple, not {type(values).__name__}")
    return [_values.pack_value(value) for value in values]


def unpack_value(data: bytes, offset: int) -> Any:
    """The value stored as ``data[offset:]``."""
    return _values.unpack_value(data[offset:])


# ------------------------------------------------------------ round trips

MAX_SPIN = 0.01                 # seconds a round trip may spin for its reply


def _real(value: Any) -> float:
    """A number as C's PyFloat_AsDouble takes it (not a str)."""
    if isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"must be real number, not {type(value).__name__}")
    return float(value)


def roundtrip_reference(fd: int, message: bytes, timeout: float, spin: float = 0.0,
                        key: bytes | None = None, seconds: int | None = None) -> bytes | None:
    """Send ``message`` on the connected UDP socket ``fd`` and wait up to
    ``timeout`` seconds for its reply: the first datagram of
    REPLY_HEADER_SIZE bytes or more with the request's id (bytes 4..8);
    others (stale replies to earlier requests) are skipped.  With ``key`` (a
    secure deployment's data key) the message goes sealed at ``seconds``
    (None: this clock's) by ``auth.seal_request``, and a datagram is the
    reply only if it opens with ``auth.open_reply_to`` for that try: a
    forged, unsealed or short one is skipped; the reply is returned opened.
    None on timeout; OSError (e.g. ConnectionRefusedError) as the socket
    reports it.  ``spin`` (at most 0.01 s) is how long the C twin polls
    before it sleeps; it changes no outcome, and this one sleeps at once.

    The reference of domus._codec.roundtrip (which does all of this without
    the GIL); the Python transport does its own round trips with socket
    methods (domus.client.transport), so this serves the tests."""
    spin = _real(spin)
    if not 0.0 <= spin <= MAX_SPIN:
        raise ValueError("spin must be in [0, 0.01] seconds")
    if not isinstance(fd, int):
        raise TypeError(f"fd must be an int, not {type(fd).__name__}")
    if not 0 <= fd <= 0x7FFFFFFF:
        raise OverflowError("fd must be in [0, 2147483647]")
    if not isinstance(message, bytes):
        raise TypeError(f"message must be bytes, not {type(message).__name__}")
    timeout = _real(timeout)
    if not 0.0 <= timeout <= 1e6:
        raise ValueError("timeout must be in [0, 1e6] seconds")
    if len(message) < 8:
        raise ValueError("a request has at least 8 bytes")
    if key is not None:
        _auth.seal_request_reference(key, b"", seconds)      # (its checks: key, seconds)
    elif seconds is not None:
        _auth.seal_request_reference(bytes(16), b"", seconds)
    deadline = time.monotonic() + timeout
    sent = message
    stamps: list[bytes] = []
    if key is not None:
        sent = _auth.seal_request_reference(key, message, seconds)
        stamps.append(sent[-12:-8])
    request_id = message[4:8]
    with socket.socket(fileno=os.dup(fd)) as sock:
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLOUT)
        while True:
            try:
                sock.send(sent, socket.MSG_DONTWAIT)
                break
            except (BlockingIOError, InterruptedError):
                poller.poll(max(0.0, deadline - time.monotonic()) * 1000)
                if time.monotonic() >= deadline:
                    return None
        poller.modify(sock.fileno(), select.POLLIN)
        while True:
            try:
                data = sock.recv(65536, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                left = deadline - time.monotonic()
                if not poller.poll(max(0.0, left) * 1000 + 1) and \
                        time.monotonic() >= deadline:
                    return None
                continue
            if key is not None:
                data = _auth.open_reply_to_reference(key, data, message, stamps) or b""
            if len(data) >= wire.REPLY_HEADER_SIZE and data[4:8] == request_id:
                return data
            if time.monotonic() >= deadline:
                return None


# roundtrip(fd, message, timeout[, spin, key, seconds]) -> reply | None: the
# transport uses it when it is C (None here: the Python transport does its
# round trips with socket methods); roundtrip_reference is its twin.
roundtrip: Callable[..., bytes | None] | None = None


# ------------------------------------------------------------ selection

def bytes_to_fill(size: int) -> tuple[Any, Any]:
    """(a value of ``size`` bytes not yet written, a writable buffer over
    it): what a receive fills piece by piece.  This reference's value is a
    bytearray, which the caller makes bytes once filled (a copy); the C
    function's is a bytes object filled in place."""
    if size < 0:
        raise ValueError("bytes_to_fill: size must be >= 0")
    buffer = bytearray(size)
    return buffer, buffer


_ACCELERATED_NAMES = ("encode_key", "encode_keys", "bucket_of", "keyed", "put_many_requests",
                      "get_many_requests", "decode_get_many_reply", "decode_scan_reply",
                      "get_many_take", "pack_value", "pack_values", "unpack_value", "roundtrip",
                      "bytes_to_fill")
reference = SimpleNamespace(hasher=_keys.HASH_FUNCTIONS.__getitem__,
                            **{name: globals()[name] for name in _ACCELERATED_NAMES})
reference.roundtrip = roundtrip_reference

PURE_PYTHON = os.environ.get("DOMUS_PURE_PYTHON") == "1"
IMPLEMENTATION = "python"
accelerated: Any = None
_C_HASHES: dict[str, int] = {}
if not PURE_PYTHON:
    try:
        from domus import _codec as accelerated
    except ImportError:  # not built: the references serve
        accelerated = None
if accelerated is not None:
    from domus._codec import (  # noqa: F811  (the C functions replace the references)
        bucket_of,
        bytes_to_fill,
        decode_get_many_reply,
        decode_scan_reply,
        encode_key,
        encode_keys,
        get_many_requests,
        get_many_take,
        keyed,
        pack_value,
        pack_values,
        put_many_requests,
        roundtrip,
        unpack_value,
    )

    IMPLEMENTATION = "c"
    _C_HASHES = {"xxh3": accelerated.HASH_XXH3, "xxh64": accelerated.HASH_XXH64}


def hasher(name: str) -> Hasher:
    """What the functions above take for the DHT hash function ``name``:
    a code for the C module's own (xxh3, xxh64), else the function."""
    code = _C_HASHES.get(name)
    return code if code is not None else _keys.HASH_FUNCTIONS[name]


class ValueCodec(NamedTuple):
    """How a DHT's values are packed and unpacked (its ``codec``
    attribute): ``pack(value)``, ``pack_many(values)``, ``unpack_at(data,
    offset)``, and ``take`` for get_many_take (None: msgpack's, in C)."""

    name: str
    pack: Callable[[Any], bytes]
    pack_many: Callable[[Sequence[Any]], list[bytes]]
    unpack_at: Callable[[bytes, int], Any]
    take: Callable[[bytes], Any] | None


def _many(pack: Callable[[Any], bytes]) -> Callable[[Sequence[Any]], list[bytes]]:
    def pack_many(values: Sequence[Any]) -> list[bytes]:
        return [pack(value) for value in values]

    return pack_many


VALUE_CODECS = {
    "msgpack": ValueCodec("msgpack", pack_value, pack_values, unpack_value, None),
    "pickle": ValueCodec("pickle", _values.pack_pickle, _many(_values.pack_pickle),
                         lambda data, offset: _values.unpack_pickle(data[offset:]),
                         _values.unpack_pickle),
    "raw": ValueCodec("raw", _values.pack_raw, _many(_values.pack_raw),
                      lambda data, offset: data[offset:], _values.unpack_raw),
}


def value_codec(name: str | None) -> ValueCodec:
    """The ValueCodec of a DHT whose ``codec`` attribute is ``name``
    (None: a DHT made before codecs, msgpack)."""
    return VALUE_CODECS[name or "msgpack"]


__all__ = ["IMPLEMENTATION", "PURE_PYTHON", "reference", "accelerated", "hasher", "chunks",
           "bytes_to_fill",
           "group", "encode_key", "encode_keys", "bucket_of", "keyed", "keyed_message",
           "put_many_requests",
           "get_many_requests", "decode_get_many_reply", "decode_scan_reply", "get_many_take",
           "pack_value", "pack_values", "unpack_value", "value_of", "roundtrip",
           "roundtrip_reference", "ValueCodec", "value_codec"]
