"""The service's request handler: a function of (state, request bytes) that
returns the reply bytes.  No sockets, no reactor: transports call
``handle_fast`` (or ``handle``) with each datagram or TCP frame, and tests
call them directly.

``handle`` is the pure-Python reference.  ``handle_fast`` asks the C hot
path (domus.service.hotpath) first, which answers the common successful requests
byte for byte as ``handle`` would, and hands everything else to ``handle``.
The C path reads ``fast_table`` (active DHT id -> (bucket -> repository,
numbering << 8 | layout tag)), which this handler keeps in step with
``dhts`` on every assign and drop, and the reply cache's generations.

Every reply to a request on a DHT hosted here carries in its header byte 3
the tag of the layout version this service holds of it (clients fetch the
layout again when it is newer than theirs); a request numbered out of
another bucket count than the DHT's now (a resize) is translated
(HostedDht.local_bucket), or answered STALE_LAYOUT where it cannot be.

Guarantees:
- ``handle`` never raises.  Anything it cannot parse gets a MALFORMED (or
  BAD_VERSION / UNKNOWN_OP) reply when the request id can be read, and is
  dropped otherwise; either way it is counted and nothing is stored.
- A request is checked whole before it changes anything: a put_many with one
  bad entry changes no record.
- A record is only ever stored in a bucket this service stores.
"""

from __future__ import annotations

import heapq
import itertools
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from twisted.logger import Logger

from domus.errors import ProtocolError
from domus.service import holdings, hotpath
from domus.service.hosted import MAX_NUMBERING, HostedDht
from domus.service.limits import DEFAULT as DEFAULT_LIMITS
from domus.service.limits import Limits
from domus.service.replycache import ReplyCache, new_reply_cache
from domus.storage import PLATFORMS, Repository, StorageFault, StorageFullFault
from domus.storage.base import apply_batch, set_bdb_ram_cache
from domus.storage.headroom import OK as ROOM_OK
from domus.storage.headroom import SAMPLE_INTERVAL, Headroom, describe_bytes
from domus.wire import auth, identities
from domus.wire import protocol as wire

log = Logger(namespace="domus.service")

_OK = wire.reply_prefix(wire.ST_OK)
_NOT_FOUND = wire.reply_prefix(wire.ST_NOT_FOUND)
_CREATED = b"\x01"
_REPLACED = b"\x00"
_KEYED_END = wire.KEYED_END
_KEYED_UNPACK = wire.KEYED.unpack_from
_CHANGING = wire.CHANGING_OPS
_APPLIED = (wire.ST_OK, wire.ST_NOT_FOUND)
# The changes a disk DHT refuses once its service's disk is at its reserve
# (deletes go on: they are how space comes back).
_FILLING = frozenset({wire.OP_PUT, wire.OP_PUT_MANY, wire.OP_PUT_IF_ABSENT})
# A store that failed to open is tried again after these many seconds,
# doubling up to the last.
RETRY_DELAYS = (0.5, 1.0, 2.0, 4.0)
FULL_LOG_INTERVAL = 10.0     # at most one log line a while of writes refused for room
RECLAIM_INTERVAL = 1.0       # seconds between two reclaims at the reserve
CHECKPOINT_BYTES = 256 << 10  # of log between two checkpoints near the reserve
# Every op whose request names a DHT (its id at byte 16).
_DHT_OPS = frozenset({wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS,
                      wire.OP_PUT_MANY, wire.OP_GET_MANY, wire.OP_LENGTH, wire.OP_SCAN,
                      wire.OP_RANGE, wire.OP_LOOKUP, wire.OP_PUT_IF_ABSENT, wire.OP_DELETE_IF})

# Each reply status by its short name ("ok", "not_found", "not_owner", ...),
# as stats() and the metrics name them.
STATUS_KEYS = {value: name[3:].lower() for name, value in vars(wire).items()
               if name.startswith("ST_") and isinstance(value, int)}


def status_name(status: int) -> str:
    """A reply status's short name; ``0x..`` for a byte no status has."""
    return STATUS_KEYS.get(status) or f"0x{status:02x}"


SCAN_TTL = 120.0
# Which buckets are hot: one request in SAMPLE_EVERY is sampled, as the C
# path does (domus._hotpath.FastPath.take_samples), keeping SAMPLE_RING.
SAMPLE_EVERY = 16
SAMPLE_RING = 4096
_SAMPLED_AT = {wire.OP_PUT: 20, wire.OP_GET: 20, wire.OP_DELETE: 20, wire.OP_CONTAINS: 20,
               wire.OP_PUT_MANY: 22, wire.OP_GET_MANY: 22, wire.OP_PUT_IF_ABSENT: 20,
               wire.OP_DELETE_IF: 20}


class RequestFailed(Exception):
    """A request that is well formed but cannot be served; becomes an error
    reply with ``status``."""

    def __init__(self, status: int, message: str, prefix: bytes = b"") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.prefix = prefix      # what goes before the message (a NOT_OWNER's redirect)


# A replicated write's primary forwards it to each backup of its bucket(s)
# with ``replicator(service, address, request, done, *args)``, which calls
# ``done(result, *args)`` once, with the backup's reply bytes or the
# exception that kept it from answering (the service's links to its peers;
# tests give their own), and tells the supervisor of a backup that failed
# with ``copy_failed(dht, service, why)``.
Replicator = Callable[..., None]


class Later:
    """A reply that comes later (a replicated change, once its backups
    answer): what ``handle`` returns instead of bytes then.  The transport
    adds a callback, fired once with the reply bytes.  Lighter than a
    Deferred, which the data path cannot afford per request."""

    __slots__ = ("_callbacks", "result", "done")

    def __init__(self) -> None:
        self._callbacks: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
        self.done = False
        self.result: bytes = b""

    def addCallback(self, callback: Callable[..., Any], *args: Any) -> Later:  # noqa: N802
        if self.done:
            callback(self.result, *args)
        else:
            self._callbacks.append((callback, args))
        return self

    def fire(self, result: bytes) -> None:
        self.done, self.result = True, result
        callbacks, self._callbacks = self._callbacks, []
        for callback, args in callbacks:
            callback(result, *args)


class _Join:
    """The backups' answers to one replicated change, counted as they
    come; the handler takes over once the last has."""

    __slots__ = ("handler", "hosted", "data", "token", "limit", "left", "failed", "claim")

    def __init__(self, handler: RequestHandler, hosted: HostedDht, holders: list[str],
                 data: bytes, token: bytes, limit: int) -> None:
        self.handler, self.hosted, self.data = handler, hosted, data
        self.token, self.limit = token, limit
        self.left = len(holders)
        self.failed: dict[str, str] = {}
        self.claim: int | None = None     # its turn in its buckets' lines (FastPath.claim)

    def took(self, reply: bytes | BaseException, holder: str) -> None:
        if isinstance(reply, BaseException):
            self.failed[holder] = str(reply) or type(reply).__name__
        elif len(reply) < wire.REPLY_HEADER_SIZE:
            self.failed[holder] = "a short reply"
        elif reply[2] not in (wire.ST_OK, wire.ST_NOT_FOUND):
            self.failed[holder] = (wire.STATUS_NAMES.get(reply[2], "bad reply") + ": "
                                   + reply[wire.REPLY_HEADER_SIZE:].decode("utf-8", "replace"))
        self.left -= 1
        if self.left == 0:
            self.handler._replicated(self)


def _packed_address(address: str) -> bytes | None:
    """"host:port" as 4 bytes of IPv4 address and 2 of port (big-endian),
    or None if the host is not an IPv4 address."""
    host, _, port = address.rpartition(":")
    try:
        return socket.inet_pton(socket.AF_INET, host) + int(port).to_bytes(2, "big")
    except (OSError, ValueError, OverflowError):
        return None


class _Snapshot:
    """A bucket's keys as a scan's first page found them, shared by the
    scans that started while the bucket was unchanged."""

    __slots__ = ("version", "keys", "count", "users")

    def __init__(self, version: tuple[int, ...], keys: list[bytes], count: int) -> None:
        self.version, self.keys, self.count = version, keys, count
        self.users = 0


class _Scan:
    __slots__ = ("expires", "dht_id", "bucket", "snapshot", "client")

    def __init__(self, expires: float, dht_id: int, bucket: int, snapshot: _Snapshot,
                 client: bytes) -> None:
        self.expires, self.dht_id, self.bucket = expires, dht_id, bucket
        self.snapshot, self.client = snapshot, client


class RequestHandler:
    def __init__(self, service_name: str, reply_cache: ReplyCache | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 data_dir: str | None = None, data_key: bytes | None = None,
                 limits: Limits = DEFAULT_LIMITS) -> None:
        self.service_name = service_name
        self.data_dir = data_dir      # where disk DHTs keep their files
        self.dhts: dict[int, HostedDht] = {}
        # (An empty cache is falsy: it has a length.)
        self.reply_cache = reply_cache if reply_cache is not None else new_reply_cache(
            clock=clock, max_entries=max(limits.reply_cache_entries, 2))
        self._clock = clock
        self._requests = 0
        self._samples: list[int] = []      # dht id << 32 | bucket
        self._sampled = 0
        self.by_op = [0] * 256
        self.by_status = [0] * 256      # replies given, by status (as the C path counts)
        self.counters: dict[str, int] = {"malformed": 0, "errors": 0, "replayed": 0,
                                         "internal_errors": 0, "storage_errors": 0,
                                         "replicated": 0, "replication_failures": 0,
                                         "unauthenticated": 0, "stale": 0, "busy": 0,
                                         "shed": 0, "scans_forgotten": 0,
                                         "storage_full": 0}
        self.limits = limits
        # (one service a process: its RAM Berkeley DB DHTs' cache is its own)
        set_bdb_ram_cache(limits.bdb_ram_cache)
        # Open scans, least recently used first; their number per client
        # id; the shared snapshots by (DHT id, bucket); the keys held by
        # all snapshots in use.
        self._scans: OrderedDict[int, _Scan] = OrderedDict()
        self._scans_of: dict[bytes, int] = {}
        self._snapshots: dict[tuple[int, int], _Snapshot] = {}
        self._scan_keys = 0
        self._scan_ids = itertools.count(1)
        self._changed = 0           # changes applied by the Python path
        self._ops: dict[int, Callable[[bytes, bytes, int], bytes]] = {
            wire.OP_PUT: self._put,
            wire.OP_GET: self._get,
            wire.OP_DELETE: self._delete,
            wire.OP_CONTAINS: self._contains,
            wire.OP_PUT_MANY: self._put_many,
            wire.OP_GET_MANY: self._get_many,
            wire.OP_LENGTH: self._length,
            wire.OP_SCAN: self._scan,
            wire.OP_PING: self._ping,
            wire.OP_STATS: self._stats,
            wire.OP_RANGE: self._range,
            wire.OP_LOOKUP: self._lookup,
            wire.OP_REPLICATE: self._replicate_in,
            wire.OP_PUT_IF_ABSENT: self._put_if_absent,
            wire.OP_DELETE_IF: self._delete_if,
        }
        # What the C path serves from: the repositories of active DHTs only.
        self.fast_table: dict[int, tuple[dict[int, Repository], int]] = {}
        # The data plane's MAC key (a secure deployment; None: insecure):
        # the UDP transport checks and strips each datagram's trailer
        # (domus.wire.auth), in C for what C serves.
        self.data_key = data_key
        self.fast = hotpath.make_fast_path(self.fast_table, self.reply_cache, data_key)
        # Replication: the backup copies held here, which only REPLICATE
        # changes (a C path of their own, sharing the reply cache, so that
        # a client's retry at a promoted backup is answered from it); the
        # primary's side (see Replicator); the writes waiting for their
        # backups, by token.
        self.backup_table: dict[int, tuple[dict[int, Repository], int]] = {}
        self.backup_fast = hotpath.make_fast_path(self.backup_table, self.reply_cache)
        if self.fast is not None and self.backup_fast is not None:
            # (a REPLICATE the serving thread reads is applied by C too)
            self.fast.backup = self.backup_fast
        self.replicator: Replicator | None = None
        self.copy_failed: Callable[[HostedDht, str, str], None] | None = None
        self._in_flight: dict[bytes, Later] = {}
        # Changes waiting for their turn in their buckets' lines (those C
        # sends itself go first: see "replication"), by claim.
        self._parked: dict[int, tuple[_Join, list[str]]] = {}
        self._as_backup = False
        # What is held here and whose (domus.service.holdings): DHTs found
        # on disk at start that are not hosted (id -> identity), and the ids
        # the supervisor has told this service to host since it registered.
        self.unloaded: dict[int, dict[str, Any]] = holdings.on_disk(data_dir)
        self.claimed: set[int] = set()
        # The free space kept under the data dir (domus.storage.headroom);
        # None: no disk to watch.  Set by the service.
        self.headroom: Headroom | None = None
        self._full_logged = -FULL_LOG_INTERVAL
        self._reclaimed = -RECLAIM_INTERVAL

    @property
    def requests(self) -> int:
        """Requests received, whichever path answered them (a REPLICATE's
        change is not one: the C path for backups counts the changes it
        applies, which the stats leave out, as handle leaves them)."""
        return self._requests + (self.fast.requests if self.fast is not None else 0)

    def _fast_paths(self) -> list[Any]:
        return [fast for fast in (self.fast, self.backup_fast) if fast is not None]

    # ------------------------------------------------------------ dispatch
    def handle(self, data: bytes, reply_limit: int = wire.MAX_UDP_PAYLOAD,
               forward: bool = True) -> bytes | Later | None:
        """Answer one request.  ``reply_limit`` is the largest reply the
        transport can carry (a datagram, or a TCP frame).  A change to a
        replicated bucket is answered later: a ``Later`` that fires with the
        reply once every backup has taken it (``forward`` False: applied
        here at once, as its backups have it).

        Counts the request (``requests``, ``by_op``) and its reply's status
        (``by_status``), as the C path counts those it answers; a change
        applied here again with ``forward`` False (the primary's, once its
        backups took it; a backup's, from its primary's REPLICATE) was
        counted when its request came, and is not counted again."""
        if forward:
            self._requests += 1
        if len(data) < wire.REQUEST_HEADER_SIZE or data[0] != wire.REQUEST_MAGIC:
            self.counters["malformed"] += 1
            return None  # not even a request id to answer to
        request_id = data[4:8]
        if data[1] != wire.VERSION:
            self.counters["malformed"] += 1
            self.by_status[wire.ST_BAD_VERSION] += 1
            return self._error(wire.ST_BAD_VERSION, request_id,
                               f"protocol version {data[1]} is not supported; "
                               f"this service speaks version {wire.VERSION}")
        op = data[2]
        if forward:
            self.by_op[op] += 1
            if not self._requests % SAMPLE_EVERY:
                self._sample(op, data)
        changing = op in _CHANGING
        if changing:
            token = self.reply_cache.key(data)
            cached = self.reply_cache.get(token)
            if cached is not None:
                self.counters["replayed"] += 1
                if forward:
                    self.by_status[cached[2]] += 1
                return cached
            if self.reply_cache.full():
                # (Every entry may still be retried: none is dropped for
                # this one, which is not applied; the client backs off.)
                self.counters["busy"] += 1
                if forward:
                    self.by_status[wire.ST_BUSY] += 1
                return bytes((wire.REPLY_MAGIC, wire.VERSION, wire.ST_BUSY, 0)) + request_id
            if op in _FILLING and self.headroom is not None \
                    and self.headroom.state != ROOM_OK and not self._as_backup:
                refused = self._short_of_room(data, request_id)
                if refused is not None:
                    return refused      # (not cached: nothing was applied)
            if forward and self.replicator is not None and len(data) >= 20:
                hosted = self.dhts.get(wire.U32.unpack_from(data, 16)[0])
                if hosted is not None and hosted.replicated and hosted.active:
                    waiting = self._replicate_out(hosted, data, token, reply_limit)
                    if waiting is not None:
                        return waiting.addCallback(self._count_reply)
        operation = self._ops.get(op)
        if operation is None:
            self.counters["malformed"] += 1
            self.by_status[wire.ST_UNKNOWN_OP] += 1
            return self._error(wire.ST_UNKNOWN_OP, request_id,
                               f"unknown operation 0x{op:02x}")
        try:
            answer = operation(data, request_id, reply_limit)
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            answer = self._error(wire.ST_MALFORMED, request_id,
                                 f"malformed {wire.OP_NAMES.get(op, 'request')}: {exc}")
        except RequestFailed as exc:
            self.counters["errors"] += 1
            answer = self._error(exc.status, request_id, exc.message, exc.prefix)
        except StorageFullFault as exc:
            self.counters["storage_full"] += 1
            self._log_full(str(exc))
            answer = self._error(wire.ST_STORAGE_FULL, request_id, str(exc))
        except StorageFault as exc:
            self.counters["storage_errors"] += 1
            log.error("service {service}: {op} failed: {problem}", service=self.service_name,
                      op=wire.OP_NAMES.get(op, op), problem=str(exc))
            answer = self._error(wire.ST_STORAGE_ERROR, request_id, str(exc))
        except Exception as exc:  # a bug: report it, keep serving
            self.counters["internal_errors"] += 1
            log.failure("service {service}: internal error in {op}", service=self.service_name,
                        op=wire.OP_NAMES.get(op, op))
            answer = self._error(wire.ST_INTERNAL, request_id, f"internal error: {exc!r}")
        if op in _DHT_OPS and len(data) >= 20:
            hosted = self.dhts.get(wire.U32.unpack_from(data, 16)[0])
            if hosted is not None and hosted.layout_tag:
                answer = answer[:3] + bytes((hosted.layout_tag,)) + answer[4:]
        if changing and answer[2] in _APPLIED:
            # (Only what was applied: a refused change -- junk, MOVING, a
            # bucket not here -- changed nothing, and its retry is judged
            # afresh, never told an old refusal once it could succeed.)
            self.reply_cache.put(token, answer)
            self._changed += 1
        if forward:
            self.by_status[answer[2]] += 1
        return answer

    # ------------------------------------------------------------ room
    def _short_of_room(self, data: bytes, request_id: bytes) -> bytes | None:
        """The STORAGE_FULL answer to a put on a disk DHT while this
        service's disk is at its reserve; None to go ahead."""
        if len(data) < 20:
            return None
        hosted = self.dhts.get(wire.U32.unpack_from(data, 16)[0])
        if hosted is None or hosted.medium != "disk" or not hosted.active:
            return None
        assert self.headroom is not None
        why = self.headroom.refusal(f"a put on {hosted.label}")
        if why is None:
            if hosted.store is not None:
                # What a checkpoint must write before it can let log files
                # go stays small near the reserve: one each CHECKPOINT_BYTES
                # of log (asking is cheap).
                try:
                    hosted.store.checkpoint(CHECKPOINT_BYTES)
                except StorageFault as exc:
                    self._log_full(str(exc))
            return None
        self.counters["storage_full"] += 1
        self._log_full(why)
        answer = self._error(wire.ST_STORAGE_FULL, request_id, why)
        return answer[:3] + bytes((hosted.layout_tag,)) + answer[4:]

    def _log_full(self, why: str) -> None:
        now = self._clock()
        if now - self._full_logged >= FULL_LOG_INTERVAL:
            self._full_logged = now
            log.warn("service {service}: writes refused for want of room ({count} so far): "
                     "{why}", service=self.service_name, count=self.counters["storage_full"],
                     why=why)

    def room_changed(self) -> None:
        """The headroom's state changed: the C path leaves changes of disk
        DHTs to Python while the disk is near or at its reserve (so that
        each put looks at the free space), and serves them again once it is
        not."""
        for dht_id, hosted in self.dhts.items():
            if hosted.medium == "disk":
                self._update_fast_table(dht_id)
        if self.headroom is not None:
            log.info("service {service}: disk {state}: {free} free under {path}, reserve "
                     "{reserve}", service=self.service_name, state=self.headroom.state,
                     free=describe_bytes(self.headroom.free), path=self.headroom.path,
                     reserve=describe_bytes(self.headroom.reserve_bytes))

    def _checkpoint(self) -> None:
        """Checkpoint the disk DHTs' stores (near the reserve, each tick:
        deletes are logged, and only a checkpoint lets old log files go)."""
        for hosted in self.dhts.values():
            if hosted.medium == "disk" and hosted.store is not None:
                try:
                    hosted.store.checkpoint()
                except StorageFault as exc:
                    self.counters["storage_errors"] += 1
                    self._log_full(str(exc))

    def reclaim(self, start: bool = False) -> int:
        """Give the space deleted records freed in disk DHTs' files back to
        the filesystem (see Store.reclaim); returns the bytes given back.
        A DHT whose store fails is logged; the others are reclaimed."""
        given = 0
        for hosted in self.dhts.values():
            if hosted.medium != "disk" or hosted.store is None:
                continue
            try:
                given += hosted.store.reclaim(start)
            except StorageFault as exc:
                self.counters["storage_errors"] += 1
                log.error("service {service}: giving space back failed: {problem}",
                          service=self.service_name, problem=str(exc))
        return given

    def storage_interval(self) -> float:
        """How long until tend_storage should run again: the headroom's
        next look, or SAMPLE_INTERVAL while a store waits to be opened
        again."""
        if self.headroom is None or any(hosted.needs_retry() for hosted in self.dhts.values()):
            return SAMPLE_INTERVAL
        return self.headroom.next_interval()

    def tend_storage(self, released: Callable[[], AbstractContextManager[Any]] = nullcontext,
                     held: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
        """What the service does on a short timer (storage_interval): look at
        the free space (the C path follows its state), give space back
        while the disk is at its reserve (what deletes free there, at most
        each RECLAIM_INTERVAL), and
        open again what failed to open when its time has come.
        ``released``: a context in which looking runs (the service's
        UdpServer.released: asking the filesystem and comparing change
        nothing the C path reads), so that a timer with nothing to do
        never stops the serving thread; ``held``: the context in which
        acting runs (UdpServer.held, for a caller that runs it released)."""
        headroom = self.headroom
        with released():
            space = headroom.measure() if headroom is not None else None
            acting = any(hosted.needs_retry() for hosted in self.dhts.values()) or (
                headroom is not None and (headroom.state != ROOM_OK
                                          or headroom.state_for(space) != headroom.state))
            if not acting:
                if headroom is not None:
                    headroom.take(space)        # (the state stays: only the figures move)
                return
        with held():
            if headroom is not None:
                was_full = headroom.full
                if headroom.take(space):
                    self.room_changed()
                now = self._clock()
                if headroom.state != ROOM_OK:
                    self._checkpoint()
                if headroom.full and (not was_full or now - self._reclaimed >= RECLAIM_INTERVAL):
                    self._reclaimed = now
                    given = self.reclaim(start=not was_full)
                    if given:
                        log.info("service {service}: gave {bytes} back to the filesystem from "
                                 "deleted records", service=self.service_name,
                                 bytes=describe_bytes(given))
                        if headroom.sample():
                            self.room_changed()
            self.retry_storage()

    def retry_storage(self) -> list[str]:
        """Open again, when their time has come (RETRY_DELAYS, from the
        last try), the stores of DHTs whose activation failed and the
        buckets whose repository failed to open; returns the names of the
        DHTs that serve again (wholly).  What still fails is logged once
        per new reason."""
        now = self._clock()
        recovered = []
        for dht_id, hosted in list(self.dhts.items()):
            if not hosted.needs_retry() or now < hosted.retry_at:
                continue
            hosted.retries += 1
            try:
                hosted.retry()
            except StorageFault as exc:
                hosted.retry_at = now + RETRY_DELAYS[min(hosted.retries, len(RETRY_DELAYS) - 1)]
                if str(exc) != hosted.last_retry_problem:
                    hosted.last_retry_problem = str(exc)
                    log.error("service {service}: still cannot serve {dht} (try {tries}; "
                              "trying again with backoff): {problem}",
                              service=self.service_name, dht=hosted.label,
                              tries=hosted.retries, problem=str(exc))
                continue
            finally:
                self._update_fast_table(dht_id)
            if not hosted.needs_retry():
                log.info("service {service}: {dht} serves again: its storage opened after "
                         "{tries} tries", service=self.service_name, dht=hosted.label,
                         tries=hosted.retries)
                hosted.retries = 0
                hosted.last_retry_problem = None
                recovered.append(hosted.name)
        return recovered

    def _count_reply(self, answer: bytes) -> None:
        """(A replicated change's reply, given once its backups answered.)"""
        self.by_status[answer[2]] += 1

    # ------------------------------------------------------------ replication
    # A replicated DHT's bucket has a primary (which clients talk to) and
    # backups.  A change reaches the primary; before applying it, the
    # primary sends the request, as it came, to every backup of the
    # bucket(s) it changes (REPLICATE, over one TCP link per backup, so
    # each backup applies them in the primary's order); only once every
    # backup has applied it does the primary apply it, cache the reply and
    # answer.  So an acknowledged write is on every copy, and a read at the
    # primary after it sees it.  A backup that fails to answer makes the
    # write fail with MOVING (the client retries: nothing was acknowledged)
    # and is reported to the supervisor, which takes it off the bucket.  A
    # retry that comes while its first try waits for the backups waits with
    # it.  A backup caches its reply under the client's own request id, so a
    # client that retries at a backup promoted meanwhile gets that reply,
    # and the change is not applied twice.
    def _replicate_out(self, hosted: HostedDht, data: bytes, token: bytes,
                       limit: int) -> Later | None:
        """The reply, later, of a change to replicated buckets, or None to
        answer it here at once (its buckets have no backup left, or it is
        refused: the ordinary path says why)."""
        waiting = self._in_flight.get(token)
        if waiting is not None:
            return waiting
        try:
            buckets = self._changed_buckets(hosted, data)
        except (ProtocolError, RequestFailed, StorageFault):
            return None
        if len(buckets) == 1:
            holders = hosted.backups_of(buckets[0])
        else:
            holders = list(dict.fromkeys(holder for bucket in buckets
                                         for holder in hosted.backups_of(bucket)))
        if not holders:
            return None                     # (degraded: this copy alone)
        assert self.replicator is not None
        fast = self.fast
        ticket = None
        if fast is not None and fast.forwarding:
            # (C sends changes to backups too: this one takes its turn in
            # its buckets' lines, so that the backups see one order)
            try:
                ticket = fast.claim(hosted.id, buckets)
            except BufferError:
                self.counters["busy"] += 1
                busy = Later()
                busy.fire(bytes((wire.REPLY_MAGIC, wire.VERSION, wire.ST_BUSY, 0)) + data[4:8])
                return busy
        waiting = self._in_flight[token] = Later()
        join = _Join(self, hosted, holders, data, token, limit)
        if ticket is not None:
            join.claim = ticket[0]
            if not ticket[1]:
                self._parked[ticket[0]] = (join, holders)
                return waiting
        self._send_replicas(join, holders)
        return waiting

    def claim_ready(self, claim: int) -> None:
        """A parked change's turn has come (the serving thread's queue says
        so, or the thread stopped): sent to its backups now."""
        parked = self._parked.pop(claim, None)
        if parked is not None:
            self._send_replicas(*parked)

    def _send_replicas(self, join: _Join, holders: list[str]) -> None:
        hosted, data = join.hosted, join.data
        assert self.replicator is not None
        for holder in holders:
            try:
                self.replicator(holder, hosted.addresses.get(holder, ""), data, join.took,
                                holder)
            except Exception as exc:
                # (A replicator that raises at once is a backup that failed,
                # not a handler that raises, nor a token left in flight.)
                join.took(exc, holder)

    def _replicated(self, join: _Join) -> None:
        """Every backup of a change has answered (``join.failed``: those
        that did not take it)."""
        data = join.data
        if join.failed:
            answer = self._failed_copies(join)
        else:
            try:
                answer = self.handle(data, join.limit, forward=False)  # applied, cached
            except Exception as exc:  # (handle never raises; a bug if it did)
                log.failure("service {service}: applying a replicated change failed",
                            service=self.service_name)
                answer = self._error(wire.ST_INTERNAL, data[4:8], f"internal error: {exc!r}")
        waiting = self._in_flight.pop(join.token, None)
        if waiting is not None:
            waiting.fire(answer)            # type: ignore[arg-type]
        if join.claim is not None and self.fast is not None:
            self.fast.release(join.claim)   # (the changes it held back go)

    def forwarded(self, data: bytes, outcome: tuple[list[str], str] | None,
                  limit: int) -> bytes:
        """The reply to a replicated change C sent to its backups and handed
        back (domus.service.udp reads it from the serving thread's queue):
        with ``outcome`` None every backup took it, and it is applied here
        as handle(forward=False) applies it; else (the backups, as host:port,
        that did not take it, and why) it failed as _replicated fails one:
        reported to the supervisor, answered MOVING."""
        hosted = self.dhts.get(wire.U32.unpack_from(data, 16)[0]) if len(data) >= 20 else None
        if outcome is None or hosted is None:
            answer = self.handle(data, limit, forward=False)
            if answer is None or isinstance(answer, Later):   # (neither can be)
                answer = self._error(wire.ST_INTERNAL, data[4:8], "a replicated change "
                                     "was lost on its way back")
        elif not outcome[0]:
            # (no backup failed: the serving thread stopped with it in flight)
            answer = self._error(wire.ST_MOVING, data[4:8],
                                 f"DHT {hosted.name!r}: the change was not acknowledged "
                                 f"({outcome[1]}); retry shortly")
        else:
            named = {address: name for name, address in hosted.addresses.items()}
            holders, why = outcome
            join = _Join(self, hosted, [], data, b"", limit)
            join.failed = {named.get(address, address): why for address in holders}
            answer = self._failed_copies(join)
        self.by_status[answer[2]] += 1
        return answer

    def _failed_copies(self, join: _Join) -> bytes:
        """A change some backups did not take (``join.failed``): each is
        reported to the supervisor, which takes it off the bucket; the
        answer is MOVING (nothing was acknowledged: the client retries)."""
        hosted, data, failed = join.hosted, join.data, join.failed
        self.counters["replication_failures"] += 1
        for holder, why in sorted(failed.items()):
            log.warn("service {service}: DHT {dht!r}: the backup on {holder} did not take "
                     "a change: {why}", service=self.service_name, dht=hosted.name,
                     holder=holder, why=why)
            if self.copy_failed is not None:
                self.copy_failed(hosted, holder, why)
        answer = self._error(wire.ST_MOVING, data[4:8],
                             f"a backup of DHT {hosted.name!r} on {sorted(failed)} did not "
                             f"take the change; retry shortly (it was not acknowledged)")
        if hosted.layout_tag:
            answer = answer[:3] + bytes((hosted.layout_tag,)) + answer[4:]
        return answer

    def _changed_buckets(self, hosted: HostedDht, data: bytes) -> list[int]:
        """The buckets (this DHT's numbering) a change writes to, each one
        a primary here; raises as the change itself would be refused."""
        op = data[2]
        # (Checked as the change itself is: a request every copy would refuse
        # is answered here, not forwarded to fail at the backups, which would
        # be reported and taken off the bucket for it.)
        if op == wire.OP_PUT_MANY:
            dht_id, entries = wire.decode_put_many(data)
            if any(len(key) > wire.MAX_KEY_BYTES or len(value) > wire.MAX_VALUE_BYTES
                   for _bucket, key, value in entries):
                raise RequestFailed(wire.ST_TOO_LARGE, "over a limit")
            buckets = [self._local(hosted, data[3], bucket, key) for bucket, key, _ in entries]
        else:
            dht_id, bucket, key, rest = wire.decode_keyed(data)
            if len(key) > wire.MAX_KEY_BYTES:
                raise RequestFailed(wire.ST_TOO_LARGE, "over a limit")
            if op in wire.VALUED_OPS:
                # (wire.put_value's checks, without copying the value again)
                if (len(rest) < wire.U32.size
                        or wire.U32.unpack_from(rest)[0] != len(rest) - wire.U32.size):
                    raise ProtocolError("a put's value length does not match its value")
                if len(rest) - wire.U32.size > wire.MAX_VALUE_BYTES:
                    raise RequestFailed(wire.ST_TOO_LARGE, "over a limit")
                if (op == wire.OP_DELETE_IF
                        and len(rest) - wire.U32.size != wire.DIGEST_BYTES):
                    raise ProtocolError(f"a delete_if's digest is not "
                                        f"{wire.DIGEST_BYTES} bytes")
            elif rest:
                raise ProtocolError("bytes after the key")
            buckets = [self._local(hosted, data[3], bucket, key)]
        for bucket in buckets:
            if bucket not in hosted.repos:
                raise RequestFailed(wire.ST_NOT_OWNER, "not a primary here")
        return list(dict.fromkeys(buckets))

    def _local(self, hosted: HostedDht, numbered: int, bucket: int, key: bytes) -> int:
        return self._local_bucket(hosted, numbered, bucket, key) if numbered else bucket

    def _replicate_in(self, data: bytes, request_id: bytes, limit: int) -> bytes:
        """REPLICATE: a change from the primary of buckets backed up here:
        applied to the backups (entries of buckets not backed up here are
        left out), cached under the client's own request id; the reply is
        the change's own, after this request's header."""
        inner = data[wire.REQUEST_HEADER_SIZE:]
        if (len(inner) < 20 or inner[0] != wire.REQUEST_MAGIC or inner[1] != wire.VERSION
                or inner[2] not in _CHANGING):
            raise ProtocolError("replicate must carry a change: a put, delete, put_many, "
                                "put_if_absent or delete_if request")
        hosted = self._hosted(wire.U32.unpack_from(inner, 16)[0])
        answer = self.backup_fast.handle(inner, limit) if self.backup_fast is not None else None
        if answer is None:
            # (A retry is answered from the reply cache by handle, and
            # counted there as the C path counts it.)
            self._as_backup = True
            try:
                answer = self.handle(inner, limit, forward=False)
            finally:
                self._as_backup = False
        self.counters["replicated"] += 1
        del hosted
        return _OK + request_id + answer            # type: ignore[operator]

    def stale(self, data: bytes) -> bytes | None:
        """The answer to a request whose MAC checks but whose time is more
        than domus.wire.auth.TIME_WINDOW seconds from this service's clock:
        a replay, or a clock that is off (the message says which time this
        service has).  Counted as a request (``by_op``) refused with
        STALE_REQUEST (``by_status``), and in ``stale``; the C path hands
        these over uncounted."""
        self.counters["stale"] += 1
        self._requests += 1
        if len(data) < wire.REQUEST_HEADER_SIZE or data[0] != wire.REQUEST_MAGIC:
            return None     # (as handle: no request id to answer to)
        self.by_op[data[2]] += 1
        self.by_status[wire.ST_STALE_REQUEST] += 1
        return self._error(wire.ST_STALE_REQUEST, data[4:8],
                           f"the request's time is more than {auth.TIME_WINDOW}s from service "
                           f"{self.service_name}'s clock ({int(time.time())}); a replay, or a "
                           f"clock that is off: check the clocks of the client's and the "
                           f"service's hosts")

    def _sample(self, op: int, data: bytes) -> None:
        at = _SAMPLED_AT.get(op)
        if at is not None and len(data) >= at + 4:
            sample = wire.U32.unpack_from(data, 16)[0] << 32 | wire.U32.unpack_from(data, at)[0]
            if len(self._samples) < SAMPLE_RING:
                self._samples.append(sample)
            else:
                self._samples[self._sampled % SAMPLE_RING] = sample
            self._sampled += 1

    def bucket_load(self, seconds: float, top: int = 16) -> dict[str, dict[int, float]]:
        """Requests per second on the busiest ``top`` buckets of each DHT
        hosted here, estimated from the requests sampled (by the C path and
        this one) over the last ``seconds``; starts the sampling afresh."""
        taken = [(self._samples, self._sampled, SAMPLE_EVERY)]
        if self.fast is not None:
            samples, count = self.fast.take_samples()
            taken.append((samples, count, hotpath.SAMPLE_EVERY))
        self._samples, self._sampled = [], 0
        rates: dict[int, float] = {}
        for samples, count, every in taken:
            if samples:
                weight = every * count / len(samples) / max(seconds, 1e-3)
                for sample in samples:
                    rates[sample] = rates.get(sample, 0.0) + weight
        by_dht: dict[str, dict[int, float]] = {}
        for sample, rate in sorted(rates.items(), key=lambda item: -item[1]):
            hosted = self.dhts.get(sample >> 32)
            if hosted is None:
                continue
            buckets = by_dht.setdefault(hosted.name, {})
            if len(buckets) < top:
                buckets[sample & 0xFFFFFFFF] = round(rate, 1)
        return by_dht

    def handle_fast(self, data: bytes, reply_limit: int = wire.MAX_UDP_PAYLOAD
                    ) -> bytes | Later | None:
        """``handle``, with the C path answering what it can."""
        fast = self.fast
        if fast is not None:
            try:
                answer = fast.handle(data, reply_limit)
            except Exception:  # MemoryError, or a bug: the Python path answers
                self.counters["internal_errors"] += 1
                log.failure("service {service}: the C hot path failed; answering in Python",
                            service=self.service_name)
                answer = None
            if answer is not None:
                return answer
        return self.handle(data, reply_limit)

    @staticmethod
    def _error(status: int, request_id: bytes, message: str, prefix: bytes = b"") -> bytes:
        return (bytes((wire.REPLY_MAGIC, wire.VERSION, status, 0)) + request_id + prefix
                + message.encode("utf-8", "replace")[:1024])

    # ------------------------------------------------------------ lookup
    def _hosted(self, dht_id: int, bucket: int | None = None) -> HostedDht:
        hosted = self.dhts.get(dht_id)
        if hosted is None:
            raise RequestFailed(wire.ST_UNKNOWN_DHT,
                                f"service {self.service_name} holds no DHT with id {dht_id} "
                                f"(destroyed, or never created); reopen it by name")
        if not hosted.active:
            if hosted.problem is not None:
                raise RequestFailed(wire.ST_STORAGE_ERROR, hosted.problem_message(bucket))
            raise RequestFailed(wire.ST_INACTIVE, f"DHT {hosted.name!r} is inactive; "
                                f"activate it (`domus dht activate {hosted.name}`) to use it")
        return hosted

    def _repo(self, dht_id: int, bucket: int, numbered: int = 0,
              key: bytes | None = None) -> Repository:
        """The repository of a request's bucket (``numbered``: its header
        byte 3, for a request numbered out of another bucket count)."""
        hosted = self.dhts.get(dht_id)
        if hosted is not None and hosted.active:
            if numbered:
                bucket = self._local_bucket(hosted, numbered, bucket, key)
            repo = (hosted.backups if self._as_backup else hosted.repos).get(bucket)
            if repo is not None:
                return repo
        hosted = self._hosted(dht_id, bucket)
        if bucket in hosted.lost:
            raise RequestFailed(wire.ST_DATA_LOST, hosted.loss_message(bucket))
        if self._as_backup:
            return None         # type: ignore[return-value]  (a put_many entry not backed here)
        if bucket in hosted.frozen:
            raise RequestFailed(wire.ST_MOVING, f"bucket {bucket} of DHT {hosted.name!r} is "
                                f"moving to another service; retry shortly")
        owner = hosted.storage_owner(bucket)
        if owner is None or owner == self.service_name:
            # (Out of range; or, briefly, a bucket this service is taking
            # over before its repository is open.)
            raise RequestFailed(wire.ST_NOT_OWNER,
                                f"service {self.service_name} does not store bucket {bucket} "
                                f"of DHT {hosted.name!r}", wire.service_ref("", ""))
        raise RequestFailed(wire.ST_NOT_OWNER,
                            f"service {self.service_name} does not store bucket {bucket} "
                            f"of DHT {hosted.name!r}; service {owner} does",
                            wire.service_ref(owner, hosted.addresses.get(owner, "")))

    @staticmethod
    def _local_bucket(hosted: HostedDht, numbered: int, bucket: int,
                      key: bytes | None) -> int:
        try:
            return hosted.local_bucket(numbered, bucket, key)
        except ValueError as exc:
            if key is None and numbered <= MAX_NUMBERING:
                raise RequestFailed(wire.ST_STALE_LAYOUT,
                                    f"DHT {hosted.name!r} has {hosted.bucket_count} buckets "
                                    f"now, not {wire.numbered_count(numbered)}: fetch its "
                                    f"layout again") from None
            raise ProtocolError(str(exc)) from None

    def _numbered_as(self, hosted: HostedDht, data: bytes) -> None:
        """A request on whole buckets (SCAN, LOOKUP) must number them as the
        DHT does now: STALE_LAYOUT otherwise."""
        if data[3] and data[3] != hosted.numbering:
            self._local_bucket(hosted, data[3], 0, None)
            raise RequestFailed(wire.ST_STALE_LAYOUT,
                                f"DHT {hosted.name!r} has {hosted.bucket_count} buckets now, "
                                f"not {wire.numbered_count(data[3])}: fetch its layout again")

    def _lookup(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        """One hop of a distributed lookup (docs/protocol.md, "Distributed
        lookup"): this service as an AS."""
        dht_id, target, current = wire.decode_lookup(data)
        hosted = self._hosted(dht_id)
        self._numbered_as(hosted, data)
        if not 0 <= target < hosted.graph.bucket_count:
            raise ProtocolError(f"bucket {target} is not a bucket of DHT {hosted.name!r} "
                                f"(0 to {hosted.graph.bucket_count - 1})")
        if not hosted.routed:
            owner = hosted.routing_layout.get(target) or ""
            raise RequestFailed(wire.ST_NOT_OWNER,
                                f"service {self.service_name} routes no bucket of DHT "
                                f"{hosted.name!r}",
                                wire.service_ref(owner, hosted.addresses.get(owner, "")))
        kind, bucket, service = hosted.lookup(target, current)
        return wire.encode_lookup_reply(request_id, kind, bucket, service,
                                        hosted.addresses[service])

    # ------------------------------------------------------------ single-key ops
    def _keyed(self, data: bytes) -> tuple[Repository, bytes, bytes]:
        if len(data) < _KEYED_END:
            raise ProtocolError("keyed request truncated before its key length")
        dht_id, bucket, key_length = _KEYED_UNPACK(data, 16)
        key_end = _KEYED_END + key_length
        if key_end > len(data) or key_length == 0:
            raise ProtocolError(f"key length {key_length} does not fit a "
                                f"{len(data)}-byte request")
        if key_length > wire.MAX_KEY_BYTES:
            raise RequestFailed(wire.ST_TOO_LARGE, f"key of {key_length} bytes is over "
                                f"the {wire.MAX_KEY_BYTES}-byte limit")
        key = data[_KEYED_END:key_end]
        return self._repo(dht_id, bucket, data[3], key), key, data[key_end:]

    def _keyed_change(self, data: bytes) -> tuple[Repository, bytes, bytes]:
        """``_keyed`` of a change: a REPLICATE's for a bucket not backed up
        here is refused."""
        repo, key, rest = self._keyed(data)
        if repo is None:
            raise RequestFailed(wire.ST_NOT_OWNER, f"service {self.service_name} has no "
                                f"backup of that bucket", wire.service_ref("", ""))
        return repo, key, rest

    @staticmethod
    def _value(rest: bytes) -> bytes:
        """The value of a PUT or PUT_IF_ABSENT, within the limit."""
        value = wire.put_value(rest)
        if len(value) > wire.MAX_VALUE_BYTES:
            raise RequestFailed(wire.ST_TOO_LARGE, f"value of {len(value)} bytes is over "
                                f"the {wire.MAX_VALUE_BYTES}-byte limit")
        return value

    def _put(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        repo, key, rest = self._keyed_change(data)
        value = self._value(rest)
        return _OK + request_id + (_CREATED if repo.put(key, value) else _REPLACED)

    def _get(self, data: bytes, request_id: bytes, limit: int) -> bytes:
        repo, key, rest = self._keyed(data)
        if rest:
            raise ProtocolError("get carries bytes after its key")
        value = repo.get(key)
        if value is None:
            return _NOT_FOUND + request_id
        if len(value) + wire.REPLY_HEADER_SIZE > limit:
            raise RequestFailed(wire.ST_REPLY_TOO_LARGE,
                                f"value of {len(value)} bytes does not fit a datagram; "
                                f"ask over TCP")
        return _OK + request_id + value

    def _delete(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        repo, key, rest = self._keyed_change(data)
        if rest:
            raise ProtocolError("delete carries bytes after its key")
        return (_OK if repo.delete(key) else _NOT_FOUND) + request_id

    def _put_if_absent(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        """PUT_IF_ABSENT: the value stored only if the key is not there
        (``u8 stored``: 1 if it was absent and is now stored, 0 if it was
        there and was left as it was); as PUT otherwise."""
        repo, key, rest = self._keyed_change(data)
        value = self._value(rest)
        if repo.contains(key):
            return _OK + request_id + _REPLACED
        repo.put(key, value)
        return _OK + request_id + _CREATED

    def _delete_if(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        """DELETE_IF: the key deleted only if its value is the one whose
        digest (wire.value_digest) the request carries (``u8 deleted``: 1
        if it was deleted, 0 if its value is another and was left);
        NOT_FOUND if it is not there."""
        repo, key, rest = self._keyed_change(data)
        digest = wire.put_value(rest)
        if len(digest) != wire.DIGEST_BYTES:
            raise ProtocolError(f"a digest is {wire.DIGEST_BYTES} bytes, not {len(digest)}")
        value = repo.get(key)
        if value is None:
            return _NOT_FOUND + request_id
        if wire.value_digest(value) != digest:
            return _OK + request_id + _REPLACED
        repo.delete(key)
        return _OK + request_id + _CREATED

    def _contains(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        repo, key, rest = self._keyed(data)
        if rest:
            raise ProtocolError("contains carries bytes after its key")
        return (_OK if repo.contains(key) else _NOT_FOUND) + request_id

    # ------------------------------------------------------------ batches
    def _put_many(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        dht_id, entries = wire.decode_put_many(data)
        # Check every entry before changing anything.
        groups: dict[int, tuple[Repository, list[tuple[bytes, bytes | None]]]] = {}
        applied = 0
        for bucket, key, value in entries:
            if len(key) > wire.MAX_KEY_BYTES or len(value) > wire.MAX_VALUE_BYTES:
                raise RequestFailed(wire.ST_TOO_LARGE, "an entry of put_many is over the "
                                    "key or value limit")
            repo = self._repo(dht_id, bucket, data[3], key)
            if repo is None:
                continue            # (a backup: an entry of a bucket not backed up here)
            groups.setdefault(id(repo), (repo, []))[1].append((key, value))
            applied += 1
        # All or nothing, a storage fault included (one transaction on a
        # sync Berkeley DB store).
        created = apply_batch(list(groups.values()))
        return _OK + request_id + wire.U16X2.pack(applied, created)

    def _get_many(self, data: bytes, request_id: bytes, limit: int) -> bytes:
        dht_id, entries = wire.decode_get_many(data)
        repos = [self._repo(dht_id, bucket, data[3], key) for bucket, key in entries]
        values = []
        size = wire.REPLY_HEADER_SIZE + wire.U16.size
        for repo, (_bucket, key) in zip(repos, entries):
            value = repo.get(key)
            size += wire.U32.size + (len(value) if value is not None else 0)
            if size > limit:
                break  # answer what fits; the client asks again for the rest
            values.append(value)
        if entries and not values:
            raise RequestFailed(wire.ST_REPLY_TOO_LARGE,
                                "the first value asked for does not fit a datagram; "
                                "ask over TCP")
        return wire.encode_get_many_reply(wire.U32.unpack(request_id)[0], values)

    def _length(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        hosted = self._hosted(wire.decode_length(data))
        if hosted.lost:
            bucket = min(hosted.lost)
            raise RequestFailed(wire.ST_DATA_LOST, hosted.loss_message(bucket))
        return _OK + request_id + wire.U64.pack(hosted.records())

    # ------------------------------------------------------------ scans
    # A scan walks a snapshot of its bucket's keys (references to the key
    # objects, 8 bytes a key), taken by its first page.  Scans that start
    # while a bucket is unchanged share one snapshot: its version is the
    # bucket's repository, the count of changes applied to it (by C, per
    # bucket; by Python, all together) and the DHT's bucket count, and a
    # scan that starts when the version moved on takes a new one.  Bounds:
    # MAX_SCANS open scans and MAX_SCAN_KEYS keys held in snapshots, in
    # total (past either, a first page gets BUSY: nothing live is dropped),
    # and MAX_SCANS_PER_CLIENT per client id (past it, that client's own
    # least recently used scan is forgotten); a scan idle for SCAN_TTL is
    # forgotten.
    def _scan(self, data: bytes, request_id: bytes, limit: int) -> bytes:
        """One page of a bucket's records.  The first page (scan id 0) takes a
        snapshot of the bucket's keys (or shares one); later pages walk it,
        so a scan sees every key present for its whole duration exactly
        once, skips keys deleted meanwhile, and may miss keys added
        meanwhile."""
        dht_id, bucket, scan_id, offset = wire.decode_scan(data)
        hosted = self._hosted(dht_id)
        now = self._clock()
        self._expire_scans(now)
        if scan_id == 0:
            self._numbered_as(hosted, data)
            repo = self._repo(dht_id, bucket)              # (NOT_OWNER, MOVING...)
            snapshot = self._snapshot(hosted, dht_id, bucket, repo)
            client = data[8:16]
            self._forget_clients_oldest_scan(client)
            scan_id = next(self._scan_ids) & 0xFFFFFFFF or next(self._scan_ids)
            snapshot.users += 1
            self._scans[scan_id] = _Scan(now + SCAN_TTL, dht_id, bucket, snapshot, client)
            self._scans_of[client] = self._scans_of.get(client, 0) + 1
            session = self._scans[scan_id]
        else:
            session = self._scans.get(scan_id)
            if session is None or (session.dht_id, session.bucket) != (dht_id, bucket):
                raise RequestFailed(wire.ST_MALFORMED, f"scan {scan_id} of bucket {bucket} "
                                    f"expired or unknown; start the iteration again")
            session.expires = now + SCAN_TTL
            self._scans.move_to_end(scan_id)
        keys, count_then = session.snapshot.keys, session.snapshot.count
        if hosted.bucket_count == count_then:
            repo = self._repo(dht_id, bucket)
            value_of = repo.get
        else:
            # Resized since the scan began: each key is in the bucket its
            # hash says now, on this service; one that moved away since
            # fails the scan (NOT_OWNER or MOVING), as the bucket itself
            # would, rather than end it without that bucket's keys.
            def value_of(key: bytes) -> bytes | None:
                now = hosted.bucket_of(key)
                found = hosted.repos.get(now)
                if found is None:
                    found = self._repo(dht_id, now)
                return found.get(key)
        entries = []
        size = wire.REPLY_HEADER_SIZE + wire.SCAN_REPLY.size
        position = offset
        while position < len(keys):
            key = keys[position]
            value = value_of(key)
            if value is not None:
                if len(entries) == wire.MAX_BATCH:
                    break  # the page's entry count is a u16 (a TCP frame holds more)
                entry_size = wire.SCAN_ENTRY.size + len(key) + len(value)
                if size + entry_size > limit:
                    if not entries:
                        raise RequestFailed(wire.ST_REPLY_TOO_LARGE,
                                            "a record does not fit a datagram; scan over TCP")
                    break
                size += entry_size
                entries.append((key, value))
            position += 1
        if position >= len(keys):
            self._end_scan(scan_id)
            position = wire.SCAN_END
        return wire.encode_scan_reply(wire.U32.unpack(request_id)[0], scan_id, position, entries)

    def _snapshot(self, hosted: HostedDht, dht_id: int, bucket: int,
                  repo: Repository) -> _Snapshot:
        """The snapshot a scan starting now walks: the bucket's shared one
        if the bucket has not changed since it was taken, else a new one;
        BUSY if a new one would pass a bound."""
        limits = self.limits
        if len(self._scans) >= limits.max_scans:
            self.counters["busy"] += 1
            raise RequestFailed(wire.ST_BUSY, "")
        version = (id(repo), self._changed, hosted.bucket_count,
                   self.fast.generation(dht_id, bucket) if self.fast is not None else 0)
        shared = self._snapshots.get((dht_id, bucket))
        if shared is not None and shared.version == version:
            return shared
        try:
            expected = len(repo)        # (a part holding several buckets: more)
        except TypeError:
            expected = 0
        if self._scan_keys + expected > limits.max_scan_keys:
            self.counters["busy"] += 1
            raise RequestFailed(wire.ST_BUSY, "")
        keys = hosted.bucket_keys(bucket)
        snapshot = _Snapshot(version, keys, hosted.bucket_count)
        self._scan_keys += len(keys)
        self._snapshots[(dht_id, bucket)] = snapshot
        return snapshot

    def _forget_clients_oldest_scan(self, client: bytes) -> None:
        if self._scans_of.get(client, 0) < self.limits.max_scans_per_client:
            return
        for scan_id, session in self._scans.items():
            if session.client == client:
                self.counters["scans_forgotten"] += 1
                self._end_scan(scan_id)
                return

    def _end_scan(self, scan_id: int) -> None:
        session = self._scans.pop(scan_id, None)
        if session is None:
            return
        left = self._scans_of[session.client] - 1
        if left:
            self._scans_of[session.client] = left
        else:
            del self._scans_of[session.client]
        snapshot = session.snapshot
        snapshot.users -= 1
        if not snapshot.users:
            self._scan_keys -= len(snapshot.keys)
            place = (session.dht_id, session.bucket)
            if self._snapshots.get(place) is snapshot:
                del self._snapshots[place]

    def _expire_scans(self, now: float) -> None:
        while self._scans:
            scan_id, session = next(iter(self._scans.items()))
            if session.expires > now:
                break
            self._end_scan(scan_id)

    # ------------------------------------------------------------ key ranges
    def _range(self, data: bytes, request_id: bytes, limit: int) -> bytes:
        """One page of a key range: the records of every bucket of the DHT
        stored here whose keys lie between the bounds, merged in key order
        (descending if reversed), as many as fit ``limit`` and the request's
        max entries.

        Stateless: the whole page is read within this call (the trees'
        iterators never see a change), and the client asks for the next page
        with the page's last key as its new exclusive bound.  So each key
        present for a whole iteration is returned exactly once and in order,
        whatever else is written meanwhile; a key added or deleted meanwhile
        is returned if the page that reaches its place sees it."""
        query = wire.decode_range(data)
        hosted = self._hosted(query.dht_id)
        if not hosted.ordered():
            raise RequestFailed(wire.ST_UNSUPPORTED,
                                f"DHT {hosted.name!r} uses platform {hosted.platform}, which "
                                f"keeps no key order; key ranges need domus-rbt or "
                                f"domus-bsddb-btree")
        if hosted.lost:
            # (Any lost bucket may have held keys of the range: a page
            # without them would be a silent loss.)
            raise RequestFailed(wire.ST_DATA_LOST, hosted.loss_message(min(hosted.lost)))
        if hosted.frozen:
            raise RequestFailed(wire.ST_MOVING, f"a bucket of DHT {hosted.name!r} is moving "
                                f"to another service; retry shortly")
        inclusive = (query.low_inclusive, query.high_inclusive)
        keys_only = query.keys_only
        walks = [repo.key_range(query.low, query.high, inclusive=inclusive,
                                reverse=query.reverse, items=not keys_only)
                 for repo in hosted.distinct_repos()]
        most = query.max_entries or wire.MAX_BATCH
        entries: list[tuple[bytes, bytes]] = []
        size = wire.RANGE_REPLY_OVERHEAD
        more = False
        for entry in heapq.merge(*walks, reverse=query.reverse):
            key, value = (entry, b"") if keys_only else entry
            entry_size = wire.range_entry_size(key, value)
            if len(entries) == most or size + entry_size > limit:
                if not entries:
                    raise RequestFailed(wire.ST_REPLY_TOO_LARGE,
                                        f"a record of {entry_size} bytes does not fit a "
                                        f"datagram; ask for the range over TCP")
                more = True
                break
            size += entry_size
            entries.append((key, value))
        return wire.encode_range_reply(wire.U32.unpack(request_id)[0], entries, more)

    # ------------------------------------------------------------ service info
    def _ping(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        return _OK + request_id + wire.pack({"name": self.service_name,
                                             "protocol": wire.VERSION})

    def _stats(self, data: bytes, request_id: bytes, _limit: int) -> bytes:
        return _OK + request_id + wire.pack(self.stats())

    def stats(self) -> dict[str, Any]:
        fast = self.fast
        by_op, by_status = self.by_op, self.by_status
        counters = dict(self.counters)
        if fast is not None:
            by_op = [mine + theirs for mine, theirs in zip(by_op, fast.by_op)]
            by_status = [mine + theirs for mine, theirs in zip(by_status, fast.by_status)]
            counters["busy"] += fast.busy
            counters["shed"] += fast.shed
            counters["replicated"] += fast.replicated
        for path in self._fast_paths():     # (a retried REPLICATE is a replay either way)
            counters["replayed"] += path.replayed
            counters["unauthenticated"] += path.unauthenticated
        return {
            "name": self.service_name,
            "requests": self.requests,
            "by_op": {wire.OP_NAMES[op]: by_op[op] for op in wire.OP_NAMES if by_op[op]},
            "by_status": {status_name(status): count
                          for status, count in enumerate(by_status) if count},
            **counters,
            "hot_path": "c" if fast is not None else "python",
            "serving_thread": bool(fast is not None and fast.threaded),
            "kernel_drops": fast.kernel_drops if fast is not None else 0,
            # (replicated changes C sent to their backups, and sent again)
            "forwarded": fast.forwarded if fast is not None else 0,
            "forward_resends": fast.forward_resends if fast is not None else 0,
            # (answers to REPLICATEs no longer waited for: to a resend)
            "late_answers": fast.late_answers if fast is not None else 0,
            "hot_path_fallbacks": sum(path.fallbacks for path in self._fast_paths()),
            "reply_cache": len(self.reply_cache),
            "reply_cache_limit": self.reply_cache.current_limit,
            "scans": len(self._scans),
            "scan_keys": self._scan_keys,
            "dhts": {hosted.name: self._dht_stats(hosted) for hosted in self.dhts.values()},
        }

    @staticmethod
    def _dht_stats(hosted: HostedDht) -> dict[str, Any]:
        """A DHT's part of the stats; ``storage_bytes`` (what its records
        occupy here) only where its platform can tell."""
        stats: dict[str, Any] = {"records": hosted.records(), "active": hosted.active,
                                 "buckets": hosted.bucket_count,
                                 "storage_buckets": len(hosted.repos),
                                 "routing_buckets": hosted.routing_bucket_count,
                                 "lookups": dict(hosted.lookups),
                                 "layout_version": hosted.descriptor.get("version", 0)}
        shared = hosted.shared_buckets()
        if shared:
            stats["unregrouped_buckets"] = shared
        storage_bytes = hosted.storage_bytes()
        if storage_bytes is not None:
            stats["storage_bytes"] = storage_bytes
        if hosted.problem is not None:
            stats["problem"] = hosted.problem
        failed = hosted.failed_buckets()
        if failed:
            stats["failed_buckets"] = failed
        return stats

    # ------------------------------------------------------------ assignment
    def _record_identity(self, descriptor: dict[str, Any]) -> None:
        """Write the DHT's identity beside its files (holdings.write); a
        home that cannot be written (a full disk, a file in the way) is
        logged and tried again at the next assign or sync: the DHT's store
        says itself why it will not open."""
        try:
            holdings.write(self.data_dir, descriptor)
        except OSError as exc:
            log.warn("service {service}: cannot record the identity of DHT {dht!r} (id {id}) "
                     "with its files yet: {error}", service=self.service_name,
                     dht=descriptor["name"], id=descriptor["id"], error=exc)

    def assign(self, descriptor: dict[str, Any]) -> dict[str, Any]:
        """Host (or re-host) a DHT as the supervisor describes it, active or
        inactive.  Returns its state here and the records a change of state
        saved or loaded; a change that fails raises StorageFault and leaves
        the DHT as it was.  A descriptor that is not valid, or that names
        the id of another DHT held here (domus.service.holdings), raises
        ValueError before anything is opened."""
        holdings.check_descriptor(descriptor, PLATFORMS)
        dht_id = descriptor["id"]
        hosted = self.dhts.get(dht_id)
        recorded = (holdings.identity_of(hosted.descriptor) if hosted is not None
                    else self.unloaded.get(dht_id))
        refusal = holdings.conflict(recorded, descriptor)
        if refusal is not None:
            raise ValueError(refusal)
        try:
            if hosted is None:
                hosted = HostedDht(descriptor, self.service_name, self.data_dir)
                self._record_identity(descriptor)
                hosted.headroom = self.headroom
                self.dhts[dht_id] = hosted
                self.unloaded.pop(dht_id, None)
                moved = hosted.apply(descriptor)
                log.info("service {service}: now hosting DHT {dht!r} (id {id}, {state})",
                         service=self.service_name, dht=descriptor["name"], id=dht_id,
                         state="active" if hosted.active else "inactive")
            else:
                self._record_identity(descriptor)
                moved = hosted.apply(descriptor)
        finally:
            self._update_fast_table(dht_id)
        self.claimed.add(dht_id)
        return {"state": "active" if hosted.active else "inactive", "records": moved}

    def refresh_fast_table(self, dht_id: int) -> None:
        self._update_fast_table(dht_id)

    def _update_fast_table(self, dht_id: int) -> None:
        """The C path sees a DHT's repositories while, and only while, the DHT
        is hosted here and active (an inactive one gets INACTIVE from Python)."""
        hosted = self.dhts.get(dht_id)
        if hosted is not None and hosted.active:
            layout = hosted.numbering << 8 | hosted.layout_tag
            # (Bit 16: C leaves changes to Python, see room_changed; bit 17:
            # replicated, C sends changes to the backups named by bucket.)
            guarded = (hosted.medium == "disk" and self.headroom is not None
                       and self.headroom.state != ROOM_OK)
            if hosted.replicated:
                self.fast_table[dht_id] = (hosted.repos, layout | guarded << 16 | 1 << 17,
                                           self._backup_addresses(hosted))
            else:
                self.fast_table[dht_id] = (hosted.repos, layout | guarded << 16)
            self.backup_table[dht_id] = (hosted.backups, layout)
            if self.fast is not None and hosted.replicated:
                self.fast.recheck(dht_id)
        else:
            self.fast_table.pop(dht_id, None)
            self.backup_table.pop(dht_id, None)

    def _backup_addresses(self, hosted: HostedDht) -> dict[int, bytes | None]:
        """For each bucket stored here, its backups' UDP addresses as C
        sends REPLICATEs to them (IPv4 address and port, 6 bytes each;
        b"" for none left), or None where one is not an IPv4 address (the
        Python path forwards those over TCP)."""
        packed: dict[str, bytes | None] = {}
        table: dict[int, bytes | None] = {}
        for bucket in hosted.repos:
            holders = hosted.backups_of(bucket)
            parts = []
            for holder in holders:
                address = hosted.addresses.get(holder, "")
                if address not in packed:
                    packed[address] = _packed_address(address)
                parts.append(packed[address])
            table[bucket] = None if None in parts else b"".join(parts)  # type: ignore[arg-type]
        return table

    def drop(self, named: dict[str, Any]) -> bool:
        """Delete a DHT held here, memory and files, as the supervisor says:
        ``named`` gives its id, deployment and stamp, which must be those
        the DHT was created with (ValueError otherwise, and nothing is
        touched).  False if no DHT of that id is held here."""
        named = identities.checked(named, required=False)
        dht_id = named["id"]
        hosted = self.dhts.get(dht_id)
        recorded = (holdings.identity_of(hosted.descriptor) if hosted is not None
                    else self.unloaded.get(dht_id))
        if recorded is None:
            return False
        if not identities.same(recorded, named):
            raise ValueError(f"service {self.service_name} refuses to drop DHT id {dht_id}: "
                             f"the deployment and stamp named ({named['deployment']}, "
                             f"{named['stamp']}) are not those of the DHT held under that id "
                             f"({recorded.get('name')!r}: {recorded.get('deployment')}, "
                             f"{recorded.get('stamp')}); it is kept")
        self._forget_dht(dht_id)
        return True

    def discard(self, named: dict[str, Any]) -> dict[str, Any]:
        """Delete a DHT held here that the supervisor has not told this
        service to host (an orphan; see domus.wire.identities), named by its
        id, deployment and stamp; an operator's decision."""
        named = identities.checked(named, required=False)
        dht_id = named["id"]
        if dht_id in self.claimed:
            raise ValueError(f"DHT id {dht_id} is one the supervisor has this service host; "
                             f"destroy it with `domus dht destroy`")
        if not self.drop(named):
            raise ValueError(f"service {self.service_name} holds no DHT with id {dht_id}")
        return {"discarded": dht_id}

    def _forget_dht(self, dht_id: int) -> None:
        hosted = self.dhts.pop(dht_id, None)
        self._update_fast_table(dht_id)
        self.unloaded.pop(dht_id, None)
        self.claimed.discard(dht_id)
        if hosted is None:
            log.info("service {service}: deleting the files of DHT id {id}",
                     service=self.service_name, id=dht_id)
            holdings.remove(self.data_dir, dht_id)
            return
        log.info("service {service}: dropping DHT {dht!r} ({records} records)",
                 service=self.service_name, dht=hosted.name, records=hosted.records())
        hosted.destroy()

    def holdings(self, *, unclaimed: bool = False) -> list[dict[str, Any]]:
        """Every DHT held here (hosted, or only on disk), with its identity;
        ``unclaimed``: only those the supervisor has not told this service
        to host since it registered (what a heartbeat reports)."""
        held = [holdings.report(holdings.identity_of(hosted.descriptor), loaded=True,
                                records=hosted.records())
                for dht_id, hosted in sorted(self.dhts.items())
                if not (unclaimed and dht_id in self.claimed)]
        held += [holdings.report(identity, loaded=False, records=None)
                 for dht_id, identity in sorted(self.unloaded.items())
                 if dht_id not in self.dhts and not (unclaimed and dht_id in self.claimed)]
        return held

    def flush(self) -> None:
        """Write what the DHTs hosted here have buffered to their media."""
        for hosted in self.dhts.values():
            try:
                hosted.flush()
            except StorageFault as exc:
                self.counters["storage_errors"] += 1
                log.error("service {service}: flushing to disk failed: {problem}",
                          service=self.service_name, problem=str(exc))

    def close(self) -> None:
        """Close every DHT, keeping what its medium holds (the service stops)."""
        for dht_id in list(self.dhts):
            hosted = self.dhts.pop(dht_id)
            self._update_fast_table(dht_id)
            try:
                hosted.close()
            except StorageFault as exc:
                self.counters["storage_errors"] += 1
                log.error("service {service}: {problem}", service=self.service_name,
                          problem=str(exc))

    def sync(self, descriptors: list[dict[str, Any]]) -> None:
        """Host the DHTs the supervisor lists, as it describes them.  A DHT
        held here that it does not list is kept, not deleted (it may be of
        another deployment, or one a supervisor restarted on the wrong data
        dir no longer knows): it is reported as unclaimed, and only a
        ``drop`` or ``discard`` naming it deletes it.  A DHT whose change of
        state fails (or whose descriptor is refused) is logged and left as
        it was; the others are still synced.  Bucket moves under way are
        abandoned (see HostedDht, "Moving a bucket"): the supervisor sends
        this when the service registers, on a link no move was driven over."""
        if not isinstance(descriptors, list):
            raise ValueError("sync needs a list of DHT descriptors")
        self.claimed = set()
        for hosted in self.dhts.values():
            hosted.abandon_moves()
        for descriptor in descriptors:
            try:
                self.assign(descriptor)
            except StorageFault as exc:
                self.counters["storage_errors"] += 1
                log.error("service {service}: {problem}", service=self.service_name,
                          problem=str(exc))
            except ValueError as exc:
                log.error("service {service}: refused a DHT of the supervisor's: {problem}",
                          service=self.service_name, problem=str(exc))
        for hosted in self.dhts.values():
            if hosted.id not in self.claimed:
                log.warn("service {service}: keeps DHT {dht!r} (id {id}), which its "
                         "supervisor does not list (`domus status` shows it; `domus service "
                         "discard` deletes it)", service=self.service_name, dht=hosted.name,
                         id=hosted.id)
