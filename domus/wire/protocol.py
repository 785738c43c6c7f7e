"""The Domus wire format, version 1 (docs/protocol.md is its specification).

Every message is a fixed header and a body.  All integers are big-endian.

Request header, 16 bytes::

    u8 magic 0xD0 | u8 version | u8 op | u8 numbering | u32 request id | u64 client id

Reply header, 8 bytes::

    u8 magic 0xD1 | u8 version | u8 status | u8 layout | u32 request id

``numbering`` says how many buckets the client numbered the request's
buckets with (``numbering(bucket_count)``: 1 + log2 of the count; 0: not
said); ``layout`` is the tag of the layout version the answering service
holds of the request's DHT (``layout_tag(version)``; 0: none), which tells
a client whose layout is older to fetch it again.

Over UDP one datagram carries one message; over TCP each message is preceded
by its length as a u32.  This module encodes and decodes; it opens no socket.
Decoders raise ``ProtocolError`` and nothing else on bad bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import msgpack
import xxhash

from domus.errors import ProtocolError

VERSION = 1
REQUEST_MAGIC = 0xD0
REPLY_MAGIC = 0xD1

# Operations.
OP_PUT = 0x01
OP_GET = 0x02
OP_DELETE = 0x03
OP_CONTAINS = 0x04
OP_PUT_MANY = 0x05
OP_GET_MANY = 0x06
OP_LENGTH = 0x07
OP_SCAN = 0x08
OP_PING = 0x09
OP_STATS = 0x0A
OP_RANGE = 0x0B
OP_LOOKUP = 0x0C
OP_REPLICATE = 0x0D
OP_PUT_IF_ABSENT = 0x0E
OP_DELETE_IF = 0x0F
OP_CONTROL = 0x20

OP_NAMES = {
    OP_PUT: "put", OP_GET: "get", OP_DELETE: "delete", OP_CONTAINS: "contains",
    OP_PUT_MANY: "put_many", OP_GET_MANY: "get_many", OP_LENGTH: "length",
    OP_SCAN: "scan", OP_PING: "ping", OP_STATS: "stats", OP_RANGE: "range",
    OP_LOOKUP: "lookup", OP_REPLICATE: "replicate", OP_PUT_IF_ABSENT: "put_if_absent",
    OP_DELETE_IF: "delete_if", OP_CONTROL: "control",
}
# Operations that change stored data: a service answers a retry of one of
# these from its reply cache instead of applying it again.
CHANGING_OPS = frozenset({OP_PUT, OP_DELETE, OP_PUT_MANY, OP_PUT_IF_ABSENT, OP_DELETE_IF})
# The keyed requests whose key is followed by a u32 length and that many
# bytes: a PUT's and a PUT_IF_ABSENT's value, a DELETE_IF's digest.
VALUED_OPS = frozenset({OP_PUT, OP_PUT_IF_ABSENT, OP_DELETE_IF})
# DELETE_IF deletes a key only while its stored value's digest is the one
# it carries: XXH64 (seed 0) of the value's bytes as stored, big-endian.
DIGEST_BYTES = 8

# Reply statuses.
ST_OK = 0x00
ST_NOT_FOUND = 0x01
ST_MALFORMED = 0x10
ST_BAD_VERSION = 0x11
ST_UNKNOWN_OP = 0x12
ST_UNKNOWN_DHT = 0x13
ST_NOT_OWNER = 0x14
ST_TOO_LARGE = 0x15
ST_INACTIVE = 0x16
ST_STORAGE_ERROR = 0x17
ST_REPLY_TOO_LARGE = 0x18
ST_UNSUPPORTED = 0x19
ST_MOVING = 0x1A
ST_STALE_LAYOUT = 0x1B
ST_DATA_LOST = 0x1C
ST_STALE_REQUEST = 0x1D
ST_STORAGE_FULL = 0x1E
ST_INTERNAL = 0x1F
ST_CONTROL_ERROR = 0x20
ST_BUSY = 0x21

STATUS_NAMES = {
    ST_OK: "ok", ST_NOT_FOUND: "not found", ST_MALFORMED: "malformed request",
    ST_BAD_VERSION: "unsupported protocol version", ST_UNKNOWN_OP: "unknown operation",
    ST_UNKNOWN_DHT: "unknown DHT", ST_NOT_OWNER: "bucket not held here",
    ST_TOO_LARGE: "key or value too large", ST_INACTIVE: "DHT inactive",
    ST_STORAGE_ERROR: "storage error", ST_REPLY_TOO_LARGE: "reply too large for UDP",
    ST_UNSUPPORTED: "not supported by the DHT's storage platform",
    ST_MOVING: "bucket moving to another service; retry shortly",
    ST_STALE_LAYOUT: "the request's bucket numbering is not the DHT's: fetch its layout",
    ST_DATA_LOST: "every copy of the bucket was lost",
    ST_STALE_REQUEST: "the request's time is too far from the service's clock",
    ST_STORAGE_FULL: "the service's disk is at its reserve (or its cache is full)",
    ST_BUSY: "the service is overloaded; back off and retry",
    ST_INTERNAL: "internal error", ST_CONTROL_ERROR: "control error",
}

# Retries.  A client stops retrying a request MAX_DEADLINE seconds after its
# first send; a service keeps the reply to a change for at least
# REPLY_CACHE_TTL / 2 seconds (domus.service.replycache), so a retry never
# arrives after its reply is forgotten and applies the change again.
REPLY_CACHE_TTL = 30.0
MAX_DEADLINE = REPLY_CACHE_TTL / 2
# Statuses a reply to a request that could not be parsed has: it is never
# larger than the request (domus.service.udp trims it), so that a spoofed
# source gains nothing by sending junk.
MALFORMED_STATUSES = frozenset({ST_MALFORMED, ST_BAD_VERSION, ST_UNKNOWN_OP})
# BUSY: the service is behind (a full reply cache, too many open scans, or a
# request that waited too long in its queue) and did nothing; the client
# backs off (BUSY_BACKOFF, doubling to BUSY_BACKOFF_MAX, with jitter) and
# sends the same request again, within its deadline.  (The first wait is
# of the order of the queue a shedding service keeps, --shed-after: sooner
# would find the same queue.)
BUSY_BACKOFF = 0.05
BUSY_BACKOFF_MAX = 1.0


def busy_retry_after(reply: bytes) -> float:
    """The retry-after a BUSY reply carries, in seconds (its body: u16
    milliseconds, from a service shedding load; 0 without one)."""
    if len(reply) >= REPLY_HEADER_SIZE + 2:
        return int.from_bytes(reply[REPLY_HEADER_SIZE:REPLY_HEADER_SIZE + 2], "big") / 1000
    return 0.0

# Moves.  A frozen bucket is a lease, not a lock: its source thaws it by
# itself FREEZE_LEASE seconds after freezing it, so a supervisor that dies
# mid-move leaves nothing frozen for long.  Two rules keep that safe: the
# supervisor gives up a move whose last catch-up is staged more than
# FREEZE_LEASE / 4 after it asked for the freeze, and a target adopts a
# staged bucket only within FREEZE_LEASE / 2 of its last stage, so a target
# never serves a bucket that its source may be serving again.
FREEZE_LEASE = 30.0

# Resizing.  A request carries in its header byte 3 the bucket count its
# buckets are numbered with (NUMBERING); a service whose DHT has another
# count translates, or answers STALE_LAYOUT where it cannot.  A reply
# carries in its byte 3 the tag of the service's layout version of the
# DHT (LAYOUT_TAGS values, cycling), so clients learn of a new layout from
# any reply.
LAYOUT_TAGS = 255


def numbering(bucket_count: int) -> int:
    """Request byte 3 for buckets numbered out of ``bucket_count`` (a power
    of two): 1 + log2 of it."""
    return bucket_count.bit_length()


def numbered_count(numbering_byte: int) -> int:
    """The bucket count a request's byte 3 says (0: not said)."""
    return 1 << (numbering_byte - 1) if numbering_byte else 0


def layout_tag(version: int) -> int:
    """Reply byte 3 for a DHT whose layout version is ``version``: 1 to
    255, cycling; 0 for version 0 (a layout that was never versioned)."""
    return 1 + (version - 1) % LAYOUT_TAGS if version > 0 else 0


def layout_newer(tag: int, mine: int) -> bool:
    """Whether a reply's layout tag is newer than the client's own (within
    half the cycle ahead of it)."""
    if not tag or not mine:
        return bool(tag) and not mine
    ahead = (tag - mine) % LAYOUT_TAGS
    return 0 < ahead < LAYOUT_TAGS // 2


# Limits.  Keys are limited by domus.wire.keys.MAX_KEY_BYTES as well.
MAX_KEY_BYTES = 8192
MAX_VALUE_BYTES = 16 * 1024 * 1024
MAX_FRAME_BYTES = MAX_VALUE_BYTES + 64 * 1024   # one TCP message
# A TCP frame of at most this many bytes is read whole by its receiver, not
# piece by piece as it comes (domus.wire.control.MessageProtocol._wake_at),
# and so is best sent whole (domus.client.aio._send_large).
READ_WHOLE_BYTES = 2 * 1024 * 1024 + 64 * 1024
MAX_UDP_PAYLOAD = 65507                          # what IPv4 UDP can carry
DEFAULT_MAX_DATAGRAM = 60000                     # what clients put in one
MAX_BATCH = 0xFFFF                               # entries in one *_MANY
SCAN_END = 0xFFFFFFFF
MISSING = 0xFFFFFFFF
NO_BUCKET = 0xFFFFFFFF                           # LOOKUP: no current bucket

# LOOKUP reply kinds.
LOOKUP_FOUND = 0   # the target is routed here: the service storing it follows
LOOKUP_NEXT = 1    # ask next: the bucket, and the service routing it, follow

REQUEST_HEADER = struct.Struct(">BBBBIQ")
REPLY_HEADER = struct.Struct(">BBBBI")
KEYED = struct.Struct(">IIH")        # dht id, bucket, key length
BATCH = struct.Struct(">IH")         # dht id, entry count
PUT_ENTRY = struct.Struct(">IHI")    # bucket, key length, value length
GET_ENTRY = struct.Struct(">IH")     # bucket, key length
DHT_ONLY = struct.Struct(">I")
SCAN = struct.Struct(">IIII")        # dht id, bucket, scan id, offset
SCAN_REPLY = struct.Struct(">IIH")   # scan id, next offset, entry count
SCAN_ENTRY = struct.Struct(">HI")    # key length, value length
RANGE = struct.Struct(">IBH")        # dht id, flags, max entries
RANGE_REPLY = struct.Struct(">HB")   # entry count, more
LOOKUP = struct.Struct(">III")       # dht id, target bucket, current bucket (or NO_BUCKET)
LOOKUP_REPLY = struct.Struct(">BI")  # kind, bucket; then a service reference
U8 = struct.Struct(">B")
U16 = struct.Struct(">H")
U16X2 = struct.Struct(">HH")
U32 = struct.Struct(">I")
U64 = struct.Struct(">Q")

# RANGE request flags.
RANGE_LOW = 0x01             # a low bound is given
RANGE_HIGH = 0x02            # a high bound is given
RANGE_LOW_INCLUSIVE = 0x04   # the low bound belongs to the range
RANGE_HIGH_INCLUSIVE = 0x08  # the high bound belongs to the range
RANGE_REVERSE = 0x10         # descending key order
RANGE_KEYS_ONLY = 0x20       # entries carry no values
RANGE_FLAGS = 0x3F           # every defined bit; the others must be 0

REQUEST_HEADER_SIZE = REQUEST_HEADER.size
REPLY_HEADER_SIZE = REPLY_HEADER.size
KEYED_END = REQUEST_HEADER_SIZE + KEYED.size


# ---------------------------------------------------------------- requests

def request_header(op: int, request_id: int, client_id: int, numbered: int = 0) -> bytes:
    """``numbered``: the request's NUMBERING byte (0: none said)."""
    return REQUEST_HEADER.pack(REQUEST_MAGIC, VERSION, op, numbered, request_id, client_id)


def encode_keyed(op: int, request_id: int, client_id: int, dht_id: int,
                 bucket: int, key: bytes, value: bytes = b"", numbered: int = 0) -> bytes:
    """PUT, PUT_IF_ABSENT, DELETE_IF (``value``, a value or a digest, goes
    after the key, preceded by its u32 length), GET, DELETE or CONTAINS (no
    value)."""
    message = (REQUEST_HEADER.pack(REQUEST_MAGIC, VERSION, op, numbered, request_id,
                                   client_id)
               + KEYED.pack(dht_id, bucket, len(key)) + key)
    if op in VALUED_OPS:
        return message + U32.pack(len(value)) + value
    if value:
        raise ValueError(f"only PUT, PUT_IF_ABSENT and DELETE_IF carry bytes after the "
                         f"key, not op 0x{op:02x}")
    return message


class Gathered:
    """A message kept as the two pieces it is made of, never joined: its
    ``head`` (every byte up to a large value's payload) and the
    ``payload`` (the caller's own bytes).  Joining them copied the payload
    before the first byte could be sent, 35 us a MiB here.  It reads like
    bytes where a client reads a message (its length, a byte, a slice);
    it is not a buffer, so a sender that is not written for it fails
    loudly, and those written for it send ``parts`` (``parts_of``)."""

    __slots__ = ("head", "payload")

    def __init__(self, head: bytes, payload: bytes) -> None:
        self.head = head
        self.payload = payload

    @property
    def parts(self) -> tuple[bytes, bytes]:
        return self.head, self.payload

    def __len__(self) -> int:
        return len(self.head) + len(self.payload)

    def __getitem__(self, index: int | slice) -> Any:
        head = self.head
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step == 1 and stop <= len(head):
                return head[start:stop]
            if step == 1 and start >= len(head):
                return self.payload[start - len(head):stop - len(head)]
            return bytes(self)[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("index out of range")
        return head[index] if index < len(head) else self.payload[index - len(head)]

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Gathered):
            return self.parts == other.parts or bytes(self) == bytes(other)
        if isinstance(other, (bytes, bytearray, memoryview)):
            return len(other) == len(self) and bytes(self) == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"Gathered({self.head!r}, <{len(self.payload)} bytes>)"


def parts_of(message: Any) -> tuple[Any, ...]:
    """The buffers ``message`` (bytes, or a Gathered) is made of, in order."""
    return message.parts if type(message) is Gathered else (message,)


def value_digest(*pieces: Any) -> bytes:
    """What DELETE_IF carries for a value stored as the bytes ``pieces``
    make in order: XXH64 of them, seed 0, big-endian."""
    hasher = xxhash.xxh64()
    for piece in pieces:
        hasher.update(piece)
    return hasher.digest()


def encode_put_many(request_id: int, client_id: int, dht_id: int,
                    entries: Sequence[tuple[int, bytes, bytes]], numbered: int = 0) -> bytes:
    parts = [request_header(OP_PUT_MANY, request_id, client_id, numbered),
             BATCH.pack(dht_id, len(entries))]
    for bucket, key, value in entries:
        parts.append(PUT_ENTRY.pack(bucket, len(key), len(value)))
        parts.append(key)
        parts.append(value)
    return b"".join(parts)


def encode_get_many(request_id: int, client_id: int, dht_id: int,
                    entries: Sequence[tuple[int, bytes]], numbered: int = 0) -> bytes:
    parts = [request_header(OP_GET_MANY, request_id, client_id, numbered),
             BATCH.pack(dht_id, len(entries))]
    for bucket, key in entries:
        parts.append(GET_ENTRY.pack(bucket, len(key)))
        parts.append(key)
    return b"".join(parts)


def encode_length(request_id: int, client_id: int, dht_id: int) -> bytes:
    return request_header(OP_LENGTH, request_id, client_id) + DHT_ONLY.pack(dht_id)


def encode_scan(request_id: int, client_id: int, dht_id: int, bucket: int,
                scan_id: int, offset: int, numbered: int = 0) -> bytes:
    return (request_header(OP_SCAN, request_id, client_id, numbered)
            + SCAN.pack(dht_id, bucket, scan_id, offset))


class RangeQuery(NamedTuple):
    """The body of a RANGE request.  ``low``/``high`` are encoded-key
    bounds (None: unbounded); ``max_entries`` 0 means as many as fit."""

    dht_id: int
    low: bytes | None
    high: bytes | None
    low_inclusive: bool = True
    high_inclusive: bool = True
    reverse: bool = False
    keys_only: bool = False
    max_entries: int = 0


def encode_range(request_id: int, client_id: int, query: RangeQuery) -> bytes:
    """A RANGE request.  A bound that is given must not be empty."""
    low = b"" if query.low is None else query.low
    high = b"" if query.high is None else query.high
    if (query.low is not None and not low) or (query.high is not None and not high):
        raise ValueError("a range bound that is given must not be empty (use None)")
    flags = ((RANGE_LOW if query.low is not None else 0)
             | (RANGE_HIGH if query.high is not None else 0)
             | (RANGE_LOW_INCLUSIVE if query.low_inclusive else 0)
             | (RANGE_HIGH_INCLUSIVE if query.high_inclusive else 0)
             | (RANGE_REVERSE if query.reverse else 0)
             | (RANGE_KEYS_ONLY if query.keys_only else 0))
    return (request_header(OP_RANGE, request_id, client_id)
            + RANGE.pack(query.dht_id, flags, query.max_entries)
            + U16.pack(len(low)) + low + U16.pack(len(high)) + high)


def encode_lookup(request_id: int, client_id: int, dht_id: int, target: int,
                  current: int | None = None, numbered: int = 0) -> bytes:
    """A LOOKUP for bucket ``target``, addressed to the routing service of
    bucket ``current`` (None: to the service as a whole)."""
    return (request_header(OP_LOOKUP, request_id, client_id, numbered)
            + LOOKUP.pack(dht_id, target, NO_BUCKET if current is None else current))


def encode_replicate(request_id: int, client_id: int, request: bytes) -> bytes:
    """A REPLICATE: a change a bucket's primary sends to its backups, the
    client's request as it came (its request and client ids, so that the
    backup's reply cache knows a retry of it)."""
    return request_header(OP_REPLICATE, request_id, client_id) + request


def encode_control(request_id: int, client_id: int, body: dict[str, Any]) -> bytes:
    return request_header(OP_CONTROL, request_id, client_id) + pack(body)


def put_entry_size(key: bytes, value: bytes) -> int:
    return PUT_ENTRY.size + len(key) + len(value)


def get_entry_size(key: bytes) -> int:
    return GET_ENTRY.size + len(key)


BATCH_OVERHEAD = REQUEST_HEADER_SIZE + BATCH.size


def decode_request_header(data: bytes) -> tuple[int, int, int]:
    """Return (op, request id, client id) of a request, checking magic and
    version."""
    if len(data) < REQUEST_HEADER_SIZE:
        raise ProtocolError(f"request of {len(data)} bytes is shorter than its "
                            f"{REQUEST_HEADER_SIZE}-byte header")
    magic, version, op, _flags, request_id, client_id = REQUEST_HEADER.unpack_from(data)
    if magic != REQUEST_MAGIC:
        raise ProtocolError(f"bad request magic 0x{magic:02x}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported "
                            f"(this side speaks {VERSION})")
    return op, request_id, client_id


def decode_keyed(data: bytes) -> tuple[int, int, bytes, bytes]:
    """Body of PUT/GET/DELETE/CONTAINS: (dht id, bucket, key, rest)."""
    if len(data) < KEYED_END:
        raise ProtocolError("keyed request truncated before its key length")
    dht_id, bucket, key_length = KEYED.unpack_from(data, REQUEST_HEADER_SIZE)
    key_end = KEYED_END + key_length
    if key_end > len(data):
        raise ProtocolError(f"key of {key_length} bytes runs past the end of "
                            f"a {len(data)}-byte request")
    if key_length == 0:
        raise ProtocolError("empty key")
    return dht_id, bucket, data[KEYED_END:key_end], data[key_end:]


def decode_put(data: bytes) -> tuple[int, int, bytes, bytes]:
    """Body of PUT: (dht id, bucket, key, value).  The value's length is
    explicit, so a message cut short is refused rather than stored short."""
    dht_id, bucket, key, rest = decode_keyed(data)
    return dht_id, bucket, key, put_value(rest)


def put_value(rest: bytes) -> bytes:
    """The value of a PUT (or PUT_IF_ABSENT), or the digest of a DELETE_IF,
    from the bytes after its key."""
    if len(rest) < U32.size:
        raise ProtocolError("put truncated before its value length")
    (length,) = U32.unpack_from(rest)
    if length != len(rest) - U32.size:
        raise ProtocolError(f"put says its value has {length} bytes but carries "
                            f"{len(rest) - U32.size}")
    return rest[U32.size:]


def decode_put_many(data: bytes) -> tuple[int, list[tuple[int, bytes, bytes]]]:
    """Body of PUT_MANY: (dht id, [(bucket, key, value), ...])."""
    size = len(data)
    if size < BATCH_OVERHEAD:
        raise ProtocolError("put_many truncated before its entry count")
    dht_id, count = BATCH.unpack_from(data, REQUEST_HEADER_SIZE)
    offset = BATCH_OVERHEAD
    entries = []
    unpack_entry = PUT_ENTRY.unpack_from
    for _ in range(count):
        if offset + PUT_ENTRY.size > size:
            raise ProtocolError(f"put_many truncated: {len(entries)} of {count} entries")
        bucket, key_length, value_length = unpack_entry(data, offset)
        offset += PUT_ENTRY.size
        key_end = offset + key_length
        value_end = key_end + value_length
        if value_end > size:
            raise ProtocolError(f"put_many entry {len(entries)} runs past the end")
        if key_length == 0:
            raise ProtocolError(f"put_many entry {len(entries)} has an empty key")
        entries.append((bucket, data[offset:key_end], data[key_end:value_end]))
        offset = value_end
    if offset != size:
        raise ProtocolError(f"put_many has {size - offset} stray bytes after its entries")
    return dht_id, entries


def decode_get_many(data: bytes) -> tuple[int, list[tuple[int, bytes]]]:
    """Body of GET_MANY: (dht id, [(bucket, key), ...])."""
    size = len(data)
    if size < BATCH_OVERHEAD:
        raise ProtocolError("get_many truncated before its entry count")
    dht_id, count = BATCH.unpack_from(data, REQUEST_HEADER_SIZE)
    offset = BATCH_OVERHEAD
    entries = []
    for _ in range(count):
        if offset + GET_ENTRY.size > size:
            raise ProtocolError(f"get_many truncated: {len(entries)} of {count} entries")
        bucket, key_length = GET_ENTRY.unpack_from(data, offset)
        offset += GET_ENTRY.size
        key_end = offset + key_length
        if key_end > size:
            raise ProtocolError(f"get_many entry {len(entries)} runs past the end")
        if key_length == 0:
            raise ProtocolError(f"get_many entry {len(entries)} has an empty key")
        entries.append((bucket, data[offset:key_end]))
        offset = key_end
    if offset != size:
        raise ProtocolError(f"get_many has {size - offset} stray bytes after its entries")
    return dht_id, entries


def decode_length(data: bytes) -> int:
    if len(data) != REQUEST_HEADER_SIZE + DHT_ONLY.size:
        raise ProtocolError("length request must carry exactly a DHT id")
    return DHT_ONLY.unpack_from(data, REQUEST_HEADER_SIZE)[0]


def decode_scan(data: bytes) -> tuple[int, int, int, int]:
    """Body of SCAN: (dht id, bucket, scan id, offset)."""
    if len(data) != REQUEST_HEADER_SIZE + SCAN.size:
        raise ProtocolError("scan request must carry dht id, bucket, scan id, offset")
    return SCAN.unpack_from(data, REQUEST_HEADER_SIZE)


def decode_range(data: bytes) -> RangeQuery:
    """Body of RANGE.  Strict: unknown flag bits, a given bound that is
    empty, a bound not given that carries bytes, a length past the end or
    bytes after the high bound are all ProtocolError."""
    size = len(data)
    offset = REQUEST_HEADER_SIZE + RANGE.size
    if size < offset:
        raise ProtocolError("range request truncated before its flags and max entries")
    dht_id, flags, max_entries = RANGE.unpack_from(data, REQUEST_HEADER_SIZE)
    if flags & ~RANGE_FLAGS:
        raise ProtocolError(f"range request has unknown flag bits 0x{flags & ~RANGE_FLAGS:02x}")
    bounds = []
    for name, given in (("low", flags & RANGE_LOW), ("high", flags & RANGE_HIGH)):
        if offset + U16.size > size:
            raise ProtocolError(f"range request truncated before its {name} bound's length")
        (length,) = U16.unpack_from(data, offset)
        offset += U16.size
        if offset + length > size:
            raise ProtocolError(f"range {name} bound of {length} bytes runs past the end of "
                                f"a {size}-byte request")
        if given and not length:
            raise ProtocolError(f"range {name} bound is flagged as given but is empty")
        if not given and length:
            raise ProtocolError(f"range {name} bound is not flagged as given but carries "
                                f"{length} bytes")
        bounds.append(data[offset:offset + length] if given else None)
        offset += length
    if offset != size:
        raise ProtocolError(f"range request has {size - offset} stray bytes after its bounds")
    return RangeQuery(dht_id, bounds[0], bounds[1], bool(flags & RANGE_LOW_INCLUSIVE),
                      bool(flags & RANGE_HIGH_INCLUSIVE), bool(flags & RANGE_REVERSE),
                      bool(flags & RANGE_KEYS_ONLY), max_entries)


def decode_lookup(data: bytes) -> tuple[int, int, int | None]:
    """Body of LOOKUP: (dht id, target bucket, current bucket or None)."""
    end = REQUEST_HEADER_SIZE + LOOKUP.size
    if len(data) != end:
        raise ProtocolError(f"lookup request is {len(data)} bytes, not {end}")
    dht_id, target, current = LOOKUP.unpack_from(data, REQUEST_HEADER_SIZE)
    return dht_id, target, None if current == NO_BUCKET else current


# A control request's msgpack body is bounded before it costs memory: in
# bytes (by whoever receives it: MAX_FRAME_BYTES at most), in the length of
# each array and map (checked by msgpack before it allocates one), in the
# number of arrays and maps in all (an empty one is one byte on the wire and
# some 64 bytes in memory), and in depth (msgpack's own stack, 1024).
MAX_CONTROL_ELEMENTS = 1 << 22      # items of one array (a page of records: 2 per record)
MAX_CONTROL_MAP = 1 << 20           # entries of one map
MAX_CONTROL_CONTAINERS = 1 << 20    # arrays and maps in one body


def decode_control(data: bytes, *, max_body: int = MAX_FRAME_BYTES,
                   max_containers: int = MAX_CONTROL_CONTAINERS) -> dict[str, Any]:
    """A control request's body (a map with a string ``op``), or
    ProtocolError: malformed, or over ``max_body`` bytes, an array or map
    too long, more than ``max_containers`` arrays and maps, too deep."""
    size = len(data) - REQUEST_HEADER_SIZE
    if size > max_body:
        raise ProtocolError(f"control request body of {size} bytes is over the {max_body}-"
                            f"byte limit of this connection")
    containers = 0

    def count(container: Any) -> Any:
        nonlocal containers
        containers += 1
        if containers > max_containers:
            raise ValueError(f"more than {max_containers} arrays and maps")
        return container

    try:
        body = msgpack.unpackb(data[REQUEST_HEADER_SIZE:], raw=False, strict_map_key=False,
                               max_array_len=MAX_CONTROL_ELEMENTS,
                               max_map_len=MAX_CONTROL_MAP, list_hook=count,
                               object_hook=count)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"bad control request body: {exc or type(exc).__name__}") \
            from None
    if not isinstance(body, dict) or not isinstance(body.get("op"), str):
        raise ProtocolError("control request body must be a map with a string 'op'")
    return body


def decode_control_error(body: bytes) -> tuple[str, str]:
    """(class name, message) of a CONTROL_ERROR reply's body, a msgpack map
    ``{"error": str, "message": str}`` (a missing name is "DomusError", a
    missing message ""); ProtocolError for anything else."""
    error = unpack(body)
    kind = error.get("error", "DomusError") if isinstance(error, dict) else None
    message = error.get("message", "") if isinstance(error, dict) else None
    if not isinstance(kind, str) or not isinstance(message, str):
        raise ProtocolError(f"a control error must be a map of the strings 'error' and "
                            f"'message', not {error!r:.200}")
    return kind, message


# ---------------------------------------------------------------- replies

def reply(status: int, request_id: int, body: bytes = b"") -> bytes:
    return REPLY_HEADER.pack(REPLY_MAGIC, VERSION, status, 0, request_id) + body


def reply_prefix(status: int) -> bytes:
    """The first 4 bytes of a reply with this status; the request id (the
    request's bytes 4..8, echoed as they are) follows."""
    return bytes((REPLY_MAGIC, VERSION, status, 0))


def error_reply(status: int, request_id: int, message: str) -> bytes:
    return reply(status, request_id, message.encode("utf-8", "replace")[:1024])


def service_ref(name: str, address: str) -> bytes:
    """A service named in a reply: u8 name length, name, u8 address length,
    address (UTF-8; both at most 255 bytes)."""
    name_bytes, address_bytes = name.encode(), address.encode()
    if len(name_bytes) > 255 or len(address_bytes) > 255:
        raise ValueError(f"service name or address over 255 bytes: {name!r} {address!r}")
    return bytes((len(name_bytes),)) + name_bytes + bytes((len(address_bytes),)) + address_bytes


def decode_service_ref(data: bytes, offset: int) -> tuple[str, str, int]:
    """(name, address, offset after them) of a service reference; name and
    address are "" in an empty reference (two zero lengths)."""
    try:
        name_end = offset + 1 + data[offset]
        address_end = name_end + 1 + data[name_end]
        if address_end > len(data):
            raise IndexError
        return (data[offset + 1:name_end].decode(), data[name_end + 1:address_end].decode(),
                address_end)
    except (IndexError, UnicodeDecodeError):
        raise ProtocolError("service reference truncated or not UTF-8") from None


def encode_lookup_reply(request_id: bytes, kind: int, bucket: int, name: str,
                        address: str) -> bytes:
    """An OK reply to LOOKUP (``request_id``: the request's 4 id bytes)."""
    return (reply_prefix(ST_OK) + request_id + LOOKUP_REPLY.pack(kind, bucket)
            + service_ref(name, address))


def decode_lookup_reply(data: bytes) -> tuple[int, int, str, str]:
    """(kind, bucket, service name, service address) of an OK LOOKUP reply."""
    if len(data) < REPLY_HEADER_SIZE + LOOKUP_REPLY.size:
        raise ProtocolError("lookup reply truncated")
    kind, bucket = LOOKUP_REPLY.unpack_from(data, REPLY_HEADER_SIZE)
    if kind not in (LOOKUP_FOUND, LOOKUP_NEXT):
        raise ProtocolError(f"lookup reply of unknown kind {kind}")
    name, address, end = decode_service_ref(data, REPLY_HEADER_SIZE + LOOKUP_REPLY.size)
    if end != len(data) or not name or not address:
        raise ProtocolError("lookup reply must name one service and nothing more")
    return kind, bucket, name, address


def not_owner_reply(request_id: bytes, name: str, address: str, message: str) -> bytes:
    """NOT_OWNER with a redirect: the service that does store the bucket
    (empty name and address if the replier does not know it), then why."""
    return (reply_prefix(ST_NOT_OWNER) + request_id + service_ref(name, address)
            + message.encode("utf-8", "replace")[:1024])


def decode_redirect(data: bytes) -> tuple[str, str, str]:
    """(owner name, owner address, message) of a NOT_OWNER reply; name and
    address are "" when the service did not know the owner."""
    name, address, end = decode_service_ref(data, REPLY_HEADER_SIZE)
    return name, address, data[end:].decode("utf-8", "replace")


def decode_reply_header(data: bytes) -> tuple[int, int]:
    """Return (status, request id) of a reply."""
    if len(data) < REPLY_HEADER_SIZE:
        raise ProtocolError(f"reply of {len(data)} bytes is shorter than its header")
    magic, version, status, _flags, request_id = REPLY_HEADER.unpack_from(data)
    if magic != REPLY_MAGIC:
        raise ProtocolError(f"bad reply magic 0x{magic:02x}")
    if version != VERSION:
        raise ProtocolError(f"reply in protocol version {version}, expected {VERSION}")
    return status, request_id


def encode_get_many_reply(request_id: int, values: Iterable[bytes | None]) -> bytes:
    parts = [reply(ST_OK, request_id), b""]
    answered = 0
    for value in values:
        if value is None:
            parts.append(U32.pack(MISSING))
        else:
            parts.append(U32.pack(len(value)))
            parts.append(value)
        answered += 1
    parts[1] = U16.pack(answered)
    return b"".join(parts)


def decode_get_many_reply(data: bytes) -> list[bytes | None]:
    """Values in request order (None: absent).  A reply may answer fewer
    entries than were asked for; the caller asks again for the rest."""
    size = len(data)
    offset = REPLY_HEADER_SIZE
    if size < offset + U16.size:
        raise ProtocolError("get_many reply truncated before its count")
    (count,) = U16.unpack_from(data, offset)
    offset += U16.size
    values: list[bytes | None] = []
    for _ in range(count):
        if offset + U32.size > size:
            raise ProtocolError("get_many reply truncated")
        (length,) = U32.unpack_from(data, offset)
        offset += U32.size
        if length == MISSING:
            values.append(None)
            continue
        end = offset + length
        if end > size:
            raise ProtocolError("get_many reply value runs past the end")
        values.append(data[offset:end])
        offset = end
    if offset != size:
        raise ProtocolError("get_many reply has stray bytes")
    return values


def encode_scan_reply(request_id: int, scan_id: int, next_offset: int,
                      entries: Sequence[tuple[bytes, bytes]]) -> bytes:
    parts = [reply(ST_OK, request_id), SCAN_REPLY.pack(scan_id, next_offset, len(entries))]
    for key, value in entries:
        parts.append(SCAN_ENTRY.pack(len(key), len(value)))
        parts.append(key)
        parts.append(value)
    return b"".join(parts)


def decode_scan_reply(data: bytes) -> tuple[int, int, list[tuple[bytes, bytes]]]:
    """(scan id, next offset or SCAN_END, [(key, value), ...])."""
    size = len(data)
    offset = REPLY_HEADER_SIZE
    if size < offset + SCAN_REPLY.size:
        raise ProtocolError("scan reply truncated")
    scan_id, next_offset, count = SCAN_REPLY.unpack_from(data, offset)
    offset += SCAN_REPLY.size
    entries = []
    for _ in range(count):
        if offset + SCAN_ENTRY.size > size:
            raise ProtocolError("scan reply truncated")
        key_length, value_length = SCAN_ENTRY.unpack_from(data, offset)
        offset += SCAN_ENTRY.size
        key_end = offset + key_length
        value_end = key_end + value_length
        if value_end > size:
            raise ProtocolError("scan reply entry runs past the end")
        entries.append((data[offset:key_end], data[key_end:value_end]))
        offset = value_end
    if offset != size:
        raise ProtocolError("scan reply has stray bytes")
    return scan_id, next_offset, entries


RANGE_REPLY_OVERHEAD = REPLY_HEADER_SIZE + RANGE_REPLY.size


def range_entry_size(key: bytes, value: bytes) -> int:
    """What one entry adds to a RANGE reply."""
    return SCAN_ENTRY.size + len(key) + len(value)


def encode_range_reply(request_id: int, entries: Sequence[tuple[bytes, bytes]],
                       more: bool) -> bytes:
    """An OK RANGE reply: the entries in range order (a keys-only range
    gives each an empty value); ``more``: the range goes on past them."""
    parts = [reply(ST_OK, request_id), RANGE_REPLY.pack(len(entries), 1 if more else 0)]
    for key, value in entries:
        parts.append(SCAN_ENTRY.pack(len(key), len(value)))
        parts.append(key)
        parts.append(value)
    return b"".join(parts)


def decode_range_reply(data: bytes) -> tuple[list[tuple[bytes, bytes]], bool]:
    """([(key, value), ...], more) of an OK RANGE reply."""
    size = len(data)
    offset = RANGE_REPLY_OVERHEAD
    if size < offset:
        raise ProtocolError("range reply truncated before its entry count")
    count, more = RANGE_REPLY.unpack_from(data, REPLY_HEADER_SIZE)
    if more > 1:
        raise ProtocolError(f"range reply has a 'more' byte of {more}, not 0 or 1")
    if more and not count:
        raise ProtocolError("range reply says more entries follow but carries none")
    entries = []
    for _ in range(count):
        if offset + SCAN_ENTRY.size > size:
            raise ProtocolError(f"range reply truncated: {len(entries)} of {count} entries")
        key_length, value_length = SCAN_ENTRY.unpack_from(data, offset)
        offset += SCAN_ENTRY.size
        key_end = offset + key_length
        value_end = key_end + value_length
        if value_end > size:
            raise ProtocolError(f"range reply entry {len(entries)} runs past the end")
        entries.append((data[offset:key_end], data[key_end:value_end]))
        offset = value_end
    if offset != size:
        raise ProtocolError(f"range reply has {size - offset} stray bytes after its entries")
    return entries, bool(more)


# ---------------------------------------------------------------- msgpack

def pack(obj: Any) -> bytes:
    """msgpack for control bodies and (client side) values."""
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    """msgpack decoding that raises ProtocolError on bad bytes."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"bad msgpack body: {exc}") from None
