"""Fuzz targets of the service's request handling.

``service``: one request, as a datagram or TCP frame brings it, to two
identical services: the Python handler (``RequestHandler.handle``, the
reference) and the C hot path (``FastPath.handle``, falling back to the
Python handler when it declines).  An input is one settings byte, then the
request:

    bits 0-2  the storage technology (``TECHNOLOGIES``, modulo its length)
    bits 3-4  the reply limit: a datagram, a TCP frame, 200 or 30 bytes
    bit 5     a reply cache of 8 entries (C declines what would fill it)

Each service hosts, in the same state before every input:

- DHT 1, active: buckets 0-3 stored here (a few records each), 4-7 on
  another service; requests for them are NOT_OWNER with a redirect;
- DHT 2, inactive;
- DHT 3, active, with repositories C must leave to Python (a list-based
  one, a dict subclass with state of its own);
- DHT 4, active, bucket 0 being moved (tracked: Python serves it and notes
  the keys changed) and bucket 1 frozen (MOVING);
- DHT 5, active and replicated: this service is the primary of buckets 0-3
  and keeps the backups of buckets 4-7, which a primary elsewhere changes
  with REPLICATE requests (the reference service applies them in Python,
  the other with the C path for backups);
- a reply cache holding the replies of earlier changes (in both
  generations, one a refusal) and an open scan.

``service_udp``: the same, but the request is a real datagram that
``FastPath.serve`` reads from a UDP socket on loopback, falling back to
the Python handler with the peer's address, as a service's reactor does.

What each input must show: the C path's reply is the Python handler's,
byte for byte; a request C declines changed nothing; afterwards both hold
the same records, reply cache, tracked keys and counters; a reply is
well-formed (the reply magic and version, the request's id, a status of
docs/protocol.md, never INTERNAL), a datagram's fits a datagram, and a
request answered with an error changed no record.  Only a request too
short for its header, or without the request magic, goes unanswered.
"""

from __future__ import annotations

import atexit
import copy
import itertools
import shutil
import socket
import tempfile
import time
from typing import Any

from domus.service.handler import RequestHandler
from domus.service.replycache import DEFAULT_MAX_ENTRIES, CompactReplyCache, ReplyCache
from domus.storage import DictRepository, Repository, available_platforms
from domus.storage.base import TrackedRepository
from domus.wire import protocol as wire
from domus.wire.keys import encode_key
from fuzz.harness import Finding, fenced, target

MAIN, INACTIVE, ODD, MOVING, REPLICATED, UNKNOWN = 1, 2, 3, 4, 5, 99
CLIENT_A, CLIENT_B = 0xA, 0xB
BUCKETS = 8
SMALL_CACHE = 8
# A handler's scan bookkeeping (domus.service.handler): scans, their count
# per client, the shared snapshots, the keys those hold.
SCAN_STATE = ("_scans", "_scans_of", "_snapshots", "_scan_keys")
CACHE_SEED = 0x5EED_D0_5EED  # the reply caches' key seed, one for both services

# name -> (platform, medium, durability)
ALL_TECHNOLOGIES = {
    "python-dict": ("python-dict", "ram", None),
    "domus-rbt": ("domus-rbt", "ram", None),
    "bsddb-btree-ram": ("domus-bsddb-btree", "ram", "none"),
    "bsddb-hash-ram": ("domus-bsddb-hash", "ram", "none"),
    "bsddb-btree-disk": ("domus-bsddb-btree", "disk", "async"),
}
TECHNOLOGIES = [name for name, (platform, _medium, _durability) in ALL_TECHNOLOGIES.items()
                if platform in available_platforms()]
LIMITS = [wire.MAX_UDP_PAYLOAD, wire.MAX_FRAME_BYTES, 200, 30]
UDP, TCP = 0, 1

APPLE = encode_key("apple")
SEVEN, EIGHT = encode_key("seven"), encode_key("eight")
SCANNED = [encode_key(f"k{number}") for number in range(3)]
LONG_KEY = encode_key("x" * 300)
SENTINEL_ID = b"\xff\xff\xff\xff"  # service_udp's own request


def settings(technology: int, limit: int = UDP, small_cache: bool = False) -> bytes:
    return bytes((technology | limit << 3 | small_cache << 5,))


def parse_settings(byte: int) -> tuple[str, int, bool]:
    return (TECHNOLOGIES[(byte & 7) % len(TECHNOLOGIES)], LIMITS[(byte >> 3) & 3],
            bool(byte & 0x20))


# ------------------------------------------------------------ odd repositories

class ListRepository(Repository):
    """A repository that is not a dict: C must leave it to Python."""

    def __init__(self) -> None:
        self.items: list[tuple[bytes, bytes]] = []

    def put(self, key: bytes, value: bytes) -> bool:
        for index, (stored, _value) in enumerate(self.items):
            if stored == key:
                self.items[index] = (key, value)
                return False
        self.items.append((key, value))
        return True

    def get(self, key: bytes) -> bytes | None:
        return next((value for stored, value in self.items if stored == key), None)

    def delete(self, key: bytes) -> bool:
        before = len(self.items)
        self.items = [(stored, value) for stored, value in self.items if stored != key]
        return len(self.items) < before

    def contains(self, key: bytes) -> bool:
        return self.get(key) is not None

    def __len__(self) -> int:
        return len(self.items)

    def key_snapshot(self) -> list[bytes]:
        return [key for key, _value in self.items]

    def records(self) -> Any:
        return iter(list(self.items))


class CountingRepository(DictRepository):
    """A dict subclass with state beside the dict: C must leave it to Python."""

    def __init__(self) -> None:
        super().__init__()
        self.puts = 0

    def put(self, key: bytes, value: bytes) -> bool:
        self.puts += 1
        return super().put(key, value)


# ------------------------------------------------------------ two services

class FixedClock:
    """Time stands still: scans and cache entries never expire mid-input."""

    now = 10_000.0

    def __call__(self) -> float:
        return self.now


def descriptor(dht_id: int, technology: str, state: str = "active",
               replicated: bool = False) -> dict[str, Any]:
    platform, medium, durability = ALL_TECHNOLOGIES[technology]
    services = [{"name": "s1", "address": "127.0.0.1:1", "count": 4},
                {"name": "s2", "address": "127.0.0.1:2", "count": 4}]
    described = {"id": dht_id, "name": f"t{dht_id}", "buckets": BUCKETS, "hash": "xxh3",
                 "storage": medium, "platform": platform, "routing": "chord", "lookup": "D",
                 "state": state, "durability": durability, "routing_services": services,
                 "storage_services": services}
    if replicated:       # the backups: s1 keeps those of s2's buckets, s2 those of s1's
        described.update(replicas=2, storage_backups=[[[0, 4, "s2"], [4, 8, "s1"]]])
    return described


def make_service(technology: str, small_cache: bool, data_dir: str | None,
                 reference: bool, data_key: bytes | None = None) -> RequestHandler:
    """A service in the state every input starts from (the module's doc);
    the ``reference`` applies REPLICATE requests in Python too.  With a
    ``data_key`` it is a secure deployment's (sealed datagrams)."""
    ids = itertools.count(1000)

    def _put(handler: RequestHandler, dht: int, bucket: int, key: bytes, value: bytes,
             request_id: int | None = None) -> bytes:
        request_id = next(ids) if request_id is None else request_id
        if cache.full():        # (a small cache: room for the set-up's changes)
            cache.rotate()
        return handler.handle(wire.encode_keyed(wire.OP_PUT, request_id, CLIENT_B, dht, bucket,
                                                key, value))

    clock = FixedClock()
    # (one seed for both services: their caches' keys must be alike to be
    # compared; a service draws its own at random.  The reference keeps the
    # pure-Python cache, the accelerated one the C cache its C path fills.)
    cache_type = ReplyCache if reference or CompactReplyCache is None else CompactReplyCache
    cache = cache_type(max_entries=SMALL_CACHE if small_cache else DEFAULT_MAX_ENTRIES,
                       clock=clock, seed=CACHE_SEED)
    handler = RequestHandler("s1", reply_cache=cache, clock=clock, data_dir=data_dir,
                             data_key=data_key)
    if reference:
        handler.backup_fast = None
    handler.assign(descriptor(MAIN, technology))
    handler.assign(descriptor(INACTIVE, technology, "inactive"))
    handler.assign(descriptor(ODD, technology))
    handler.assign(descriptor(MOVING, technology))
    handler.assign(descriptor(REPLICATED, technology, replicated=True))
    odd = handler.dhts[ODD].repos
    odd[0], odd[1] = ListRepository(), CountingRepository()
    # An open scan: the first page of a bucket of three equal-sized records
    # holds one record, so the scan (id 1) stays open at offset 1.
    for number, key in enumerate(SCANNED):
        _put(handler, MAIN, 0, key, b"v%d" % number)
    first_page = (wire.REPLY_HEADER_SIZE + wire.SCAN_REPLY.size
                  + wire.SCAN_ENTRY.size + len(SCANNED[0]) + 2)
    reply = handler.handle(wire.encode_scan(next(ids), CLIENT_B, MAIN, 0, 0, 0), first_page)
    assert wire.decode_scan_reply(reply)[:2] == (1, 1), reply
    # Records of every size class, in every bucket held.
    _put(handler, MAIN, 0, APPLE, wire.pack("red"))
    _put(handler, MAIN, 1, encode_key(1), b"")
    _put(handler, MAIN, 2, encode_key(b"blob"), bytes(range(256)) * 2)
    _put(handler, MAIN, 3, LONG_KEY, b"long key")
    for dht in (ODD, MOVING, REPLICATED):
        for bucket in (0, 1, 2):
            _put(handler, dht, bucket, APPLE, b"%d" % dht)
    for bucket in (4, 5):       # backups, as their primary sends them
        change = wire.encode_keyed(wire.OP_PUT, next(ids), CLIENT_B, REPLICATED, bucket, APPLE,
                                   b"backed up")
        if cache.full():
            cache.rotate()
        reply = handler.handle(wire.encode_replicate(next(ids), 0x5A, change))
        assert reply[2] == wire.ST_OK and reply[8:] == wire.reply(wire.ST_OK, 0)[:4] \
            + change[4:8] + b"\x01", reply
    # Replies kept: a put in the previous generation and one in the current
    # (a refusal, here of an inactive DHT, is not kept: it changed nothing).
    cache.rotate()
    cache.rotate()
    _put(handler, MAIN, 0, SEVEN, b"7", request_id=7)
    cache.rotate()
    _put(handler, MAIN, 1, EIGHT, b"8", request_id=8)
    assert _put(handler, INACTIVE, 0, EIGHT, b"9", request_id=9)[2] == wire.ST_INACTIVE
    moving = handler.dhts[MOVING]
    moving.track(0)
    moving.freeze(1)
    return handler


def records(handler: RequestHandler) -> dict[Any, Any]:
    """Every record a service holds (frozen buckets' too), with each
    repository's count, and the keys a tracked bucket noted as changed."""
    def contents(repo: Repository) -> tuple[Any, ...]:
        keys = repo.key_snapshot()
        changed = sorted(repo.changed) if isinstance(repo, TrackedRepository) else None
        return len(repo), {key: repo.get(key) for key in keys}, changed

    return {place: contents(repo) for place, repo in repositories(handler).items()}


def repositories(handler: RequestHandler) -> dict[Any, Repository]:
    """Every repository of a service: stored buckets, frozen ones, backups."""
    found: dict[Any, Repository] = {}
    for dht_id, hosted in handler.dhts.items():
        for bucket, repo in hosted.repos.items():
            found[dht_id, bucket] = repo
        for bucket, (repo, _keys) in hosted.frozen.items():
            found[dht_id, "frozen", bucket] = repo
        for bucket, repo in hosted.backups.items():
            found[dht_id, "backup", bucket] = repo
    return found


def counters(handler: RequestHandler) -> tuple[Any, ...]:
    """What the service's stats count (requests by op, replays, errors...),
    whichever path counted it: the parts of ``handler.stats()`` that
    requests change, without the rest of its work."""
    by_op = handler.by_op
    replayed = handler.counters["replayed"]
    unauthenticated = handler.counters["unauthenticated"]
    replicated = handler.counters["replicated"]
    if handler.fast is not None:
        by_op = [mine + theirs for mine, theirs in zip(by_op, handler.fast.by_op)]
        replicated += handler.fast.replicated   # (REPLICATEs the C path applied)
    for fast in (handler.fast, handler.backup_fast):
        if fast is not None:
            replayed += fast.replayed
            unauthenticated += fast.unauthenticated
    cache = handler.reply_cache
    return (handler.requests, by_op, {**handler.counters, "replayed": replayed,
                                      "unauthenticated": unauthenticated,
                                      "replicated": replicated},
            len(cache), cache.refused)


def counter_gap(mine: tuple[Any, ...], theirs: tuple[Any, ...]) -> dict[str, int]:
    """How far two ``counters`` are apart, count by count (only those that
    differ)."""
    def flat(found: tuple[Any, ...]) -> dict[str, int]:
        requests, by_op, named, cache, refused = found
        return {"requests": requests, "reply_cache": cache, "cache_refused": refused,
                **{f"op {op}": count for op, count in enumerate(by_op)}, **named}

    mine_flat, theirs_flat = flat(mine), flat(theirs)
    return {name: mine_flat[name] - theirs_flat.get(name, 0) for name in mine_flat
            if mine_flat[name] != theirs_flat.get(name, 0)}


class Pair:
    """A reference service and an accelerated one, in the same state."""

    def __init__(self, technology: str, small_cache: bool,
                 data_key: bytes | None = None) -> None:
        self.data_dir = tempfile.mkdtemp(prefix="domus-fuzz-") \
            if ALL_TECHNOLOGIES[technology][1] == "disk" else None
        self.reference = make_service(technology, small_cache, self._home("reference"),
                                      reference=True, data_key=data_key)
        self.accelerated = make_service(technology, small_cache, self._home("accelerated"),
                                        reference=False, data_key=data_key)
        if self.accelerated.fast is None:
            raise RuntimeError("domus._hotpath is not built (or DOMUS_PURE_PYTHON=1): "
                               "there is no C path to fuzz")
        self.records = records(self.reference)
        # How far the two services' counters are known to be apart (only
        # after an input whose outcome depended on a clock that ticked
        # while it ran: fuzz/sealed.py), which compare() allows.
        self.counter_gap: dict[str, int] = {}
        self.cache = self.reference.reply_cache.snapshot()
        # Each service's open scans and their shared key snapshots, as set
        # up (restored whole before every input).
        self.scans = {id(handler): copy.deepcopy(tuple(getattr(handler, name)
                                                        for name in SCAN_STATE))
                      for handler in (self.reference, self.accelerated)}
        self.next_scan = 2
        self.compare(None, None)

    def _home(self, name: str) -> str | None:
        return None if self.data_dir is None else f"{self.data_dir}/{name}"

    # -------------------------------------------------------- one request
    def send(self, message: bytes, limit: int) -> bytes | None:
        """The request to both services (C first, then Python if C
        declines); every check of the module's doc."""
        expected = self.reference.handle(message, limit)
        with fenced(message):
            answer = self.accelerated.fast.handle(message, limit)
        if answer is None:
            if records(self.accelerated) != self.records:
                self.restore()
                raise Finding(f"C declined {shown(message)} but changed records")
            if self.accelerated.reply_cache.snapshot() != self.cache:
                self.restore()
                raise Finding(f"C declined {shown(message)} but changed the reply cache")
            answer = self.accelerated.handle(message, limit)
        self.judge(message, limit, expected, answer)
        return answer

    def judge(self, message: bytes, limit: int, expected: bytes | None,
              answer: bytes | None) -> None:
        """Both services answered (or not): compare them, check the reply,
        then put both back as they were."""
        held = None
        try:
            if is_stats(message) and answer is not None and expected is not None \
                    and answer[2] == wire.ST_OK:
                # Both answered in Python; only the C path's own count of the
                # requests it declined may differ.
                if without_fallbacks(answer) != without_fallbacks(expected):
                    raise Finding(f"STATS differs: {shown(answer, 400)} / "
                                  f"{shown(expected, 400)}")
            elif answer != expected:
                raise Finding(f"the C path answered {shown(answer)}, the Python handler "
                              f"{shown(expected)}, to {shown(message)} (limit {limit})")
            check_reply(message, limit, expected)
            held = self.compare(expected, message)
        finally:
            self.restore(held)

    def compare(self, reply: bytes | None, message: bytes | None) -> dict[Any, Any]:
        """Finding unless both services hold the same records, reply cache
        and counters, and (after an error reply) the records they held
        before; returns the records."""
        held = records(self.reference)
        if records(self.accelerated) != held:
            raise Finding(f"after {shown(message)}: the services hold different records")
        if self.accelerated.reply_cache.snapshot() != self.reference.reply_cache.snapshot():
            raise Finding(f"after {shown(message)}: the reply caches differ")
        mine, theirs = counters(self.accelerated), counters(self.reference)
        if counter_gap(mine, theirs) != self.counter_gap:
            raise Finding(f"after {shown(message)}: the counters differ: C path {mine}, "
                          f"Python {theirs}")
        if reply is not None and reply[2] not in (wire.ST_OK, wire.ST_NOT_FOUND) \
                and held != self.records:
            raise Finding(f"{shown(message)} was answered status 0x{reply[2]:02x} "
                          f"({reply[8:200]!r}) but changed records")
        return held

    def accept_counters(self) -> None:
        """Take the counters' gap as it is now (an input whose outcome the
        harness could not pin down moved them apart)."""
        self.counter_gap = counter_gap(counters(self.accelerated), counters(self.reference))

    def restore(self, held: dict[Any, Any] | None = None) -> None:
        """Both services back to the state every input starts from
        (``held``: what both hold now, if known)."""
        for handler in (self.reference, self.accelerated):
            now = records(handler) if held is None else held
            cache = handler.reply_cache
            if now != self.records:
                for place, repo in repositories(handler).items():
                    _count, stored, _changed = now[place]
                    _count, wanted, _changed = self.records[place]
                    for key in stored.keys() - wanted.keys():
                        repo.delete(key)
                    for key, value in wanted.items():
                        if stored.get(key) != value:
                            repo.put(key, value)
                    if isinstance(repo, TrackedRepository):
                        repo.take_changes()
            if cache.snapshot() != self.cache:
                cache.restore(self.cache)
            cache.refused = 0
            # (The handler has no public way to forget its scans: a harness
            # may reach in, to start every input from the same scans.)
            for name, value in zip(SCAN_STATE, copy.deepcopy(self.scans[id(handler)])):
                setattr(handler, name, value)
            handler._scan_ids = itertools.count(self.next_scan)

    # -------------------------------------------------------- over UDP
    def serve(self, message: bytes, sockets: UdpPair) -> bytes | None:
        """The request as a datagram that FastPath.serve reads from a real
        socket (a sentinel GET behind it marks the end of its answer)."""
        expected = self.reference.handle(message, wire.MAX_UDP_PAYLOAD)
        sentinel = wire.encode_keyed(wire.OP_GET, 0xFFFFFFFF, 0x5E, MAIN, 0, APPLE)
        after = self.reference.handle(sentinel, wire.MAX_UDP_PAYLOAD)
        server, client = sockets.server, sockets.client
        accelerated = self.accelerated
        peers = []

        def fallback(data: bytes, peer: Any, stamp: bytes | None) -> None:
            if stamp is not None:
                raise Finding(f"an unkeyed FastPath passed the stamp {stamp!r} to Python")
            peers.append(peer)
            reply = accelerated.handle(data, wire.MAX_UDP_PAYLOAD)
            if reply is not None:
                server.sendto(reply, peer)

        try:
            client.send(message)
            client.send(sentinel)
            read, deadline = 0, time.monotonic() + 10
            while read < 2:
                if time.monotonic() > deadline:
                    raise Finding("serve() did not read two datagrams in 10 s")
                read += accelerated.fast.serve(server.fileno(), fallback, 2 - read)
            replies = []
            while True:
                reply = client.recv(65536)
                if reply[4:8] == SENTINEL_ID:
                    break
                replies.append(reply)
            if any(peer != client.getsockname() for peer in peers):
                raise Finding(f"C fell back with the peers {peers}, not "
                              f"{client.getsockname()}")
            if reply != after:
                raise Finding(f"the sentinel GET after {shown(message)} was answered "
                              f"{shown(reply)} in C, {shown(after)} in Python")
            if len(replies) > 1:
                raise Finding(f"{shown(message)} got {len(replies)} replies")
        except BaseException:
            self.restore()
            raise
        answer = replies[0] if replies else None
        self.judge(message, wire.MAX_UDP_PAYLOAD, expected, answer)
        return answer

    def close(self) -> None:
        for handler in (self.reference, self.accelerated):
            handler.close()
        if self.data_dir is not None:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def is_stats(message: bytes) -> bool:
    return message[:3] == bytes((wire.REQUEST_MAGIC, wire.VERSION, wire.OP_STATS))


def without_fallbacks(reply: bytes) -> tuple[bytes, Any]:
    """A STATS reply without what says which path serves (the sealed
    target's reference service has no C path)."""
    stats = wire.unpack(reply[wire.REPLY_HEADER_SIZE:])
    stats.pop("hot_path_fallbacks", None)
    stats.pop("hot_path", None)
    return reply[:wire.REPLY_HEADER_SIZE], stats


def shown(data: bytes | None, limit: int = 96) -> str:
    if data is None:
        return "nothing"
    text = repr(data[:limit])
    return text + (f"... ({len(data)} bytes)" if len(data) > limit else "")


def check_reply(message: bytes, limit: int, reply: bytes | None) -> None:
    """A reply follows docs/protocol.md: only a request with no request id
    to answer to goes unanswered; the reply carries the reply magic, the
    version, the request's id and a documented status other than INTERNAL,
    and a datagram's reply fits a datagram."""
    answerable = len(message) >= wire.REQUEST_HEADER_SIZE and message[0] == wire.REQUEST_MAGIC
    if reply is None:
        if answerable:
            raise Finding(f"no reply to {shown(message)}")
        return
    if not answerable:
        raise Finding(f"a reply to {shown(message)}, which has no request id to answer to")
    if len(reply) < wire.REPLY_HEADER_SIZE or reply[0] != wire.REPLY_MAGIC \
            or reply[1] != wire.VERSION or reply[4:8] != message[4:8]:
        raise Finding(f"malformed reply {shown(reply)} to {shown(message)}")
    status = reply[2]
    if status not in wire.STATUS_NAMES:
        raise Finding(f"undocumented status 0x{status:02x}: {shown(reply)}")
    if status == wire.ST_INTERNAL:
        raise Finding(f"INTERNAL (a bug) for {shown(message)}: "
                      f"{reply[8:400].decode('utf-8', 'replace')}")
    if wire.REPLY_HEADER_SIZE + 2048 <= limit <= wire.MAX_UDP_PAYLOAD and len(reply) > limit:
        raise Finding(f"a {len(reply)}-byte reply to {shown(message)} does not fit the "
                      f"{limit}-byte limit")


_pairs: dict[tuple[str, bool], Pair] = {}


def pair_for(technology: str, small_cache: bool) -> Pair:
    pair = _pairs.get((technology, small_cache))
    if pair is None:
        pair = _pairs[technology, small_cache] = Pair(technology, small_cache)
    return pair


@atexit.register
def _close_pairs() -> None:
    while _pairs:
        _pairs.popitem()[1].close()


# ------------------------------------------------------------ seeds

def messages() -> list[bytes]:
    """Requests of every kind, built by domus.wire.protocol, aimed at the
    state every input starts from."""
    keyed = wire.encode_keyed
    put, get, delete, contains = wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS
    big = bytes(range(256)) * 256              # a put that just fits a datagram
    big = big[:wire.MAX_UDP_PAYLOAD - wire.KEYED_END - len(APPLE) - 4]
    longest = encode_key(b"k" * (wire.MAX_KEY_BYTES - 1))
    found = [
        keyed(put, 1, CLIENT_A, MAIN, 0, APPLE, wire.pack("green")),
        keyed(put, 2, CLIENT_A, MAIN, 1, encode_key("new"), b""),
        keyed(put, 3, CLIENT_A, MAIN, 3, encode_key(2**70), b"v"),
        keyed(put, 4, CLIENT_A, MAIN, 5, APPLE, b"elsewhere"),
        keyed(put, 5, CLIENT_A, MAIN, 0, APPLE, big),
        keyed(put, 6, CLIENT_A, MAIN, 0, longest, b"v"),
        keyed(put, 7, CLIENT_B, MAIN, 0, SEVEN, b"7"),            # a retry (previous generation)
        keyed(put, 8, CLIENT_B, MAIN, 2, APPLE, b"other body"),   # a retry, another body
        keyed(put, 9, CLIENT_B, INACTIVE, 0, EIGHT, b"9"),        # a retry of a refusal
        keyed(delete, 8, CLIENT_B, MAIN, 1, EIGHT),               # ... of another op
        keyed(put, 10, CLIENT_A, INACTIVE, 0, APPLE, b"v"),
        keyed(put, 11, CLIENT_A, ODD, 0, APPLE, b"list"),
        keyed(put, 12, CLIENT_A, ODD, 1, APPLE, b"counted"),
        keyed(put, 13, CLIENT_A, MOVING, 0, APPLE, b"tracked"),
        keyed(put, 14, CLIENT_A, MOVING, 1, APPLE, b"frozen"),
        keyed(put, 15, CLIENT_A, UNKNOWN, 0, APPLE, b"v"),
        keyed(get, 16, CLIENT_A, MAIN, 0, APPLE),
        keyed(get, 17, CLIENT_A, MAIN, 2, encode_key(b"blob")),
        keyed(get, 18, CLIENT_A, MAIN, 3, LONG_KEY),
        keyed(get, 19, CLIENT_A, MAIN, 1, encode_key("absent")),
        keyed(get, 20, CLIENT_A, MOVING, 0, APPLE),
        keyed(get, 21, CLIENT_A, ODD, 1, APPLE),
        keyed(contains, 22, CLIENT_A, MAIN, 1, encode_key(1)),
        keyed(contains, 23, CLIENT_A, MAIN, 6, encode_key(1)),
        keyed(delete, 24, CLIENT_A, MAIN, 0, APPLE),
        keyed(delete, 25, CLIENT_A, MAIN, 0, encode_key("absent")),
        keyed(delete, 26, CLIENT_A, MOVING, 0, APPLE),
        keyed(delete, 27, CLIENT_A, ODD, 0, APPLE),
        wire.encode_put_many(28, CLIENT_A, MAIN, [(0, APPLE, b"a"), (3, encode_key(3), b"b"),
                                                  (0, APPLE, b"twice")]),
        wire.encode_put_many(29, CLIENT_A, MAIN, []),
        wire.encode_put_many(30, CLIENT_A, MAIN, [(1, encode_key(1), b""), (6, APPLE, b"x")]),
        wire.encode_put_many(31, CLIENT_A, MOVING, [(0, APPLE, b"t"), (2, APPLE, b"u")]),
        wire.encode_put_many(32, CLIENT_A, ODD, [(2, APPLE, b"d"), (1, APPLE, b"c")]),
        wire.encode_get_many(33, CLIENT_A, MAIN, [(0, APPLE), (2, encode_key(b"blob")),
                                                  (1, encode_key("absent")), (0, APPLE)]),
        wire.encode_get_many(34, CLIENT_A, MAIN, []),
        wire.encode_get_many(35, CLIENT_A, MAIN, [(0, APPLE), (7, APPLE)]),
        wire.encode_get_many(36, CLIENT_A, MOVING, [(0, APPLE), (2, APPLE)]),
        wire.encode_length(37, CLIENT_A, MAIN),
        wire.encode_length(38, CLIENT_A, INACTIVE),
        wire.encode_scan(39, CLIENT_A, MAIN, 0, 0, 0),
        wire.encode_scan(40, CLIENT_A, MAIN, 0, 1, 1),            # the open scan, page 2
        wire.encode_scan(41, CLIENT_A, MAIN, 0, 77, 0),           # an unknown scan
        wire.encode_scan(42, CLIENT_A, MOVING, 1, 0, 0),
        wire.encode_range(43, CLIENT_A, wire.RangeQuery(MAIN, None, None)),
        wire.encode_range(44, CLIENT_A, wire.RangeQuery(MAIN, APPLE, encode_key(b"z"), False,
                                                        True, True, False, 2)),
        wire.encode_range(45, CLIENT_A, wire.RangeQuery(MAIN, None, APPLE, keys_only=True,
                                                        max_entries=1)),
        wire.encode_range(46, CLIENT_A, wire.RangeQuery(MOVING, APPLE, None)),
        wire.encode_lookup(47, CLIENT_A, MAIN, 6, None),
        wire.encode_lookup(48, CLIENT_A, MAIN, 2, 1),
        wire.encode_lookup(49, CLIENT_A, MAIN, 100, None),
        wire.request_header(wire.OP_PING, 50, CLIENT_A),
        wire.request_header(wire.OP_STATS, 51, CLIENT_A),
        wire.encode_control(52, CLIENT_A, {"op": "stats"}),
        # A replicated DHT: a change at the primary, changes from the
        # primary of the buckets backed up here (and of one that is not).
        keyed(put, 55, CLIENT_A, REPLICATED, 1, APPLE, b"primary"),
        wire.encode_replicate(56, 0x5A, keyed(put, 57, CLIENT_A, REPLICATED, 4, APPLE, b"b")),
        wire.encode_replicate(58, 0x5A, keyed(delete, 59, CLIENT_A, REPLICATED, 5, APPLE)),
        wire.encode_replicate(60, 0x5A, wire.encode_put_many(61, CLIENT_A, REPLICATED, [
            (4, APPLE, b"x"), (6, SEVEN, b"y"), (1, EIGHT, b"not backed up here")])),
        wire.encode_replicate(62, 0x5A, keyed(put, 63, CLIENT_A, MAIN, 0, APPLE, b"m")),
        wire.encode_replicate(64, 0x5A, keyed(get, 65, CLIENT_A, REPLICATED, 4, APPLE)),
        wire.encode_replicate(66, 0x5A, wire.encode_replicate(67, 0x5A, keyed(
            put, 68, CLIENT_A, REPLICATED, 4, APPLE, b"nested"))),
        # Requests numbered out of other bucket counts (a client that has
        # not seen a resize): translated, or refused as a stale layout.
        keyed(get, 69, CLIENT_A, MAIN, 1, APPLE, numbered=wire.numbering(BUCKETS * 2)),
        keyed(put, 70, CLIENT_A, MAIN, 0, APPLE, b"n", numbered=wire.numbering(BUCKETS // 2)),
        wire.encode_put_many(71, CLIENT_A, MAIN, [(0, APPLE, b"a"), (3, SEVEN, b"b")],
                             numbered=wire.numbering(BUCKETS)),
        wire.encode_get_many(72, CLIENT_A, MAIN, [(1, APPLE), (9, SEVEN)],
                             numbered=wire.numbering(BUCKETS * 4)),
        # Conditional changes (the Python path only): where the key is and
        # is not, the digest of the value there and of another, a digest of
        # the wrong size, on a moving bucket, at a primary and from one.
        keyed(wire.OP_PUT_IF_ABSENT, 73, CLIENT_A, MAIN, 0, APPLE, b"kept"),
        keyed(wire.OP_PUT_IF_ABSENT, 74, CLIENT_A, MAIN, 1, encode_key("fresh"), b"new"),
        keyed(wire.OP_DELETE_IF, 75, CLIENT_A, MAIN, 0, APPLE,
              wire.value_digest(wire.pack("green"))),
        keyed(wire.OP_DELETE_IF, 76, CLIENT_A, MAIN, 0, APPLE, wire.value_digest(b"other")),
        keyed(wire.OP_DELETE_IF, 77, CLIENT_A, MAIN, 1, encode_key("absent"), bytes(8)),
        keyed(wire.OP_DELETE_IF, 78, CLIENT_A, MAIN, 0, APPLE, bytes(16)),
        keyed(wire.OP_PUT_IF_ABSENT, 79, CLIENT_A, MOVING, 0, APPLE, b"tracked"),
        keyed(wire.OP_DELETE_IF, 80, CLIENT_A, MOVING, 1, APPLE, bytes(8)),
        keyed(wire.OP_PUT_IF_ABSENT, 81, CLIENT_A, REPLICATED, 1, SEVEN, b"primary"),
        wire.encode_replicate(82, 0x5A, keyed(wire.OP_DELETE_IF, 83, CLIENT_A, REPLICATED, 4,
                                              APPLE, wire.value_digest(b"b"))),
        wire.request_header(0x7F, 53, CLIENT_A) + b"body",        # an unknown op
    ]
    other_version = bytearray(keyed(get, 54, CLIENT_A, MAIN, 0, APPLE))
    other_version[1] = wire.VERSION + 1
    found.append(bytes(other_version))
    return found


def service_seeds() -> list[bytes]:
    """Every request on every technology, as a datagram; the small ones as
    TCP frames, into a small reply cache and under tight reply limits too."""
    seeds = []
    for index, message in enumerate(messages()):
        for technology in range(len(TECHNOLOGIES)):
            seeds.append(settings(technology, UDP) + message)
        if len(message) < 1024:
            seeds.append(settings(index % len(TECHNOLOGIES), TCP, small_cache=True) + message)
            seeds.append(settings(index % len(TECHNOLOGIES), 2 + index % 2) + message)
    return seeds


def sweep_seeds() -> list[bytes]:
    """Each request once, as a datagram, the technologies taking turns (the
    parsing swept is the same on all of them; the fuzzer and the smoke mix
    requests and technologies)."""
    return [settings(index % len(TECHNOLOGIES)) + message
            for index, message in enumerate(messages())]


# ------------------------------------------------------------ the targets

@target("service", seeds=service_seeds, sweep_seeds=sweep_seeds, fixed=1, smoke=2000,
        max_len=wire.MAX_UDP_PAYLOAD + 1, c_sources=("cext/hotpath.c", "cext/rbtree.c"))
def fuzz_service(data: bytes) -> None:
    """FastPath.handle against RequestHandler.handle: one settings byte (the
    technology, the reply limit, the cache size), then one request."""
    if not data:
        return
    technology, limit, small_cache = parse_settings(data[0])
    pair_for(technology, small_cache).send(data[1:], limit)


class UdpPair:
    """A non-blocking service socket and a client socket connected to it,
    on loopback."""

    def __init__(self) -> None:
        self.server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.server.setblocking(False)
        self.server.bind(("127.0.0.1", 0))
        self.client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.client.settimeout(10)
        self.client.connect(self.server.getsockname())
        for sock in (self.server, self.client):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)

    def close(self) -> None:
        self.server.close()
        self.client.close()


_udp: list[UdpPair] = []


def udp_seeds() -> list[bytes]:
    return [settings(index % len(TECHNOLOGIES)) + message
            for index, message in enumerate(messages())]


def udp_sweep_seeds() -> list[bytes]:
    """One request of each kind C answers, and the largest datagram, on
    python-dict: the parsing is the service target's; here what is swept is
    how serve() reads a datagram of each size."""
    wanted = {wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS, wire.OP_PUT_MANY,
              wire.OP_GET_MANY}
    seeds, seen = [], set()
    for message in messages():
        kind = (message[2], len(message) > 60000)
        if message[2] in wanted and kind not in seen:
            seen.add(kind)
            seeds.append(settings(TECHNOLOGIES.index("python-dict")) + message)
    return seeds


@target("service_udp", seeds=udp_seeds, sweep_seeds=udp_sweep_seeds, fixed=1, smoke=500,
        max_len=wire.MAX_UDP_PAYLOAD + 1, c_sources=("cext/hotpath.c",))
def fuzz_service_udp(data: bytes) -> None:
    """FastPath.serve reading a real datagram (and falling back to the
    Python handler with the peer's address) against RequestHandler.handle:
    one settings byte (the technology), then the datagram."""
    if not data:
        return
    technology, _limit, small_cache = parse_settings(data[0])
    if not _udp:
        _udp.append(UdpPair())
        atexit.register(_udp[0].close)
    message = data[1:1 + wire.MAX_UDP_PAYLOAD]
    if message[4:8] == SENTINEL_ID:     # the harness's own request id
        message = message[:4] + b"\xff\xff\xff\xfe" + message[8:]
    pair_for(technology, small_cache).serve(message, _udp[0])


__all__ = ["Finding", "Pair", "messages", "service_seeds", "fuzz_service", "fuzz_service_udp"]
