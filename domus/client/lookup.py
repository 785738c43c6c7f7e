"""Lookup: from a key's bucket to the service that stores it.

A client looks buckets up by a *strategy*, an ordered fall-back list of
methods (DESIGN.md, "Lookup"):

- **D, direct**: the layout rebuilt from the descriptor: the placement of
  its per-service counts (domus.placement.layout.initial) and the few
  buckets moved since (its ``storage_moves``).  One hop, no routing.  It
  misses only when the layout changed after this client fetched it; after
  ``direct_cutoff`` misses a client whose strategy has other methods stops
  using it, until it fetches the layout again.
- **C, cached**: an LRU of (bucket -> routing service, storage service) fed
  by distributed lookups, with ``cache`` x buckets entries at most.  A
  bucket not in it is looked up starting at the cached entry nearest the
  target in the routing graph (aggregated routing), so most misses take
  one hop to an AS and one to the storage service.
- **R, random**: a distributed lookup from a routing service picked at
  random, weighted by the buckets it routes (a uniformly random bucket's
  router).

A *distributed lookup* (docs/protocol.md, "Distributed lookup") is a chain
of LOOKUP requests that the client sends itself, hop by hop, each AS naming
the next from its own routing tables, until one names the storage service.
A dead hop is a ServiceUnavailable after the transport's usual retries; a
chain longer than the graph's hop bound (plus slack for layouts changing
meanwhile) is abandoned; either way the strategy falls back to its next
method.

Every reply carries the tag of the layout version the answering service
holds (docs/protocol.md, "Resizing"); a client that sees a newer one than
its own fetches the layout again (at most every REFRESH_INTERVAL), so it
learns of moves, and of a new bucket count, from its ordinary replies.

When every method of the strategy has missed, the client follows the
redirect in the last NOT_OWNER reply (the service that does store the
bucket, as the refusing service knows it); failing that, it fetches the
DHT's layout from the supervisor (the only time the supervisor is asked).
A bucket being moved answers MOVING: the request is sent again after a
short, growing pause, for up to ``MOVING_PATIENCE`` seconds.

The decisions live here, with no I/O: a request's course is a generator
that yields instructions (send this message to this channel; pause; fetch
the layout) and receives their results.  The synchronous and the Twisted
clients each drive it their own way (domus.client.blocking, domus.client.tx); the
common case, the first method answering at once, never enters it.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterable
from typing import Any, Generic, TypeVar

from domus.client import codec
from domus.errors import (
    AuthenticationError,
    DataLost,
    DhtInactive,
    DomusError,
    InvalidAttribute,
    ProtocolError,
    RemoteError,
    StorageError,
    StorageFull,
    UnknownDht,
    ValueTooLarge,
    WrongService,
)
from domus.placement import layout
from domus.placement.bucketmap import BucketMap
from domus.routing import RoutingGraph, make_graph
from domus.wire import protocol as wire
from domus.wire.attributes import check_strategy
from domus.wire.keys import bucket_shift
from domus.wire.values import msgpack_bin_header

Channel = TypeVar("Channel")

# Bucket counts up to this get dense bucket -> channel lists (512 KiB at
# most); larger ones are looked up in the BucketMap itself.
DENSE_TABLE_LIMIT = 1 << 16

DEFAULT_CACHE = 0.5          # cache entries per bucket
DEFAULT_DIRECT_CUTOFF = 8    # direct misses before a client stops using D
HOP_SLACK = 4                # hops allowed beyond the graph's bound
NEAR_PROBES = 64             # cache probes for the entry nearest a target
MOVING_FIRST_PAUSE = 0.002   # seconds before asking a MOVING bucket again
MOVING_MAX_PAUSE = 0.1
MOVING_PATIENCE = 60.0       # seconds a bucket may answer MOVING before giving up
# Rounds of a batch answered NOT_OWNER, each after the layout is fetched
# again (from the fourth on after a pause), before the batch gives up.
MAX_BATCH_REFRESHES = 12
# A request whose course meets a service that is gone is sent again where
# the supervisor's layout says its bucket is now, at most this many times.
MAX_REROUTES = 8
# A bytes value at least this long is put as (msgpack header, value), joined
# into the message, not packed first (DirectLookup._packed).
LARGE_VALUE = 64 * 1024
# A Dht's pop without a default (KeyError for a missing key): blocking,
# asyncio and Twisted clients alike.
MISSING: Any = object()

# A client that followed this many redirects since it last fetched its
# DHT's layout fetches it again, at most once every REFRESH_INTERVAL s.
REFRESH_AFTER_REDIRECTS = 32
REFRESH_INTERVAL = 0.25

# Replies the fast path leaves to a request's course: a service that does
# not (or no longer) hold the bucket, or the DHT, and a bucket being moved.
_NOT_FINAL = frozenset({wire.ST_NOT_OWNER, wire.ST_MOVING, wire.ST_UNKNOWN_DHT,
                        wire.ST_STALE_LAYOUT})


class Encoder:
    """A request's messages: ``encode()`` gives the next one to send (a
    given first one, then new request ids); ``last`` is the one sent last
    and when it was first made, so that a change is sent again *as it was*
    where a copy of it may have been applied (its request id is what the
    services' reply caches know it by)."""

    __slots__ = ("_make", "_pending", "last", "made_at")

    def __init__(self, make: Callable[[], bytes], first: bytes | None = None,
                 sent: bytes | None = None) -> None:
        self._make = make
        self._pending = first
        self.last = sent if sent is not None else first
        self.made_at = time.monotonic()

    def __call__(self) -> bytes:
        if self._pending is not None:
            message, self._pending = self._pending, None
        else:
            message = self._make()
            self.made_at = time.monotonic()
        self.last = message
        return message

    def again(self) -> bytes:
        """The last message again, while its reply may still be cached
        (MAX_DEADLINE after it was made); a new one after."""
        if self.last is not None and time.monotonic() - self.made_at < wire.MAX_DEADLINE:
            return self.last
        return self()


class Renumbered(Exception):
    """Raised inside a request's course when the layout fetched meanwhile
    has another bucket count: the request starts again, hashed anew."""

# Instructions a request's course yields to its driver.
SEND = 0      # (SEND, channel, message, bucket) -> the reply; ServiceUnavailable thrown in
PAUSE = 1     # (PAUSE, seconds) -> None
REFRESH = 2   # (REFRESH, mark) -> None: a layout fetched after ``mark``; DomusError thrown in

Course = Generator[tuple[Any, ...], Any, bytes]
_LOOKUP_REPLY = wire.LOOKUP_REPLY.unpack_from
_AS_MISS = bytes([wire.REPLY_MAGIC, wire.VERSION, wire.ST_NOT_OWNER])
_NO_REF = wire.service_ref("", "")
_REF_AT = wire.REPLY_HEADER_SIZE + wire.LOOKUP_REPLY.size   # the service reference
METHOD_NAMES = {"D": "direct", "C": "cached", "R": "random"}


class MethodStats:
    """One lookup method's counters on one client."""

    __slots__ = ("lookups", "hits", "misses", "fallbacks", "walks", "hops", "max_hops")

    def __init__(self) -> None:
        self.lookups = self.hits = self.misses = self.fallbacks = 0
        self.walks = self.hops = self.max_hops = 0

    def resolved(self, lookups: int) -> None:
        """A request this method found the storage service for, after
        ``lookups`` LOOKUP messages (0: a hit, no distributed lookup)."""
        if lookups:
            self.walks += 1
        else:
            self.hits += 1
        hops = lookups + 1          # messages, the request itself included
        self.hops += hops
        if hops > self.max_hops:
            self.max_hops = hops

    def as_dict(self) -> dict[str, Any]:
        served = self.hits + self.walks
        return {"lookups": self.lookups, "hits": self.hits, "misses": self.misses,
                "fallbacks": self.fallbacks, "distributed": self.walks,
                "mean_hops": round(self.hops / served, 3) if served else 0.0,
                "max_hops": self.max_hops}


class DirectLookup(Generic[Channel]):
    """A DHT's layout and lookup strategy as a client sees it.
    ``cluster.channel(name, address)`` must return the (shared) channel to a
    service; ``cluster.ids`` the request ids."""

    cluster: Any

    def __init__(self, cluster: Any, descriptor: dict[str, Any], *, lookup: str | None = None,
                 cache: float | None = None, direct_cutoff: int | None = None) -> None:
        self.cluster = cluster
        self.strategy = tuple(check_strategy(lookup if lookup is not None
                                             else descriptor.get("lookup") or "D").split(","))
        if cache is None:
            cache = DEFAULT_CACHE
        if isinstance(cache, bool) or not isinstance(cache, int | float) or not 0 < cache <= 1:
            raise InvalidAttribute(f"cache must be a fraction of the bucket count in (0, 1], "
                                   f"such as 0.5; not {cache!r}")
        if direct_cutoff is None:
            direct_cutoff = DEFAULT_DIRECT_CUTOFF
        if isinstance(direct_cutoff, bool) or not isinstance(direct_cutoff, int) \
                or direct_cutoff < 1:
            raise InvalidAttribute(f"direct_cutoff must be an int >= 1, not {direct_cutoff!r}")
        self.cache_fraction = float(cache)
        self.direct_cutoff = direct_cutoff
        self.direct_misses = 0
        self._direct_on = "D" in self.strategy
        self._method_stats = {method: MethodStats() for method in self.strategy}
        # "messages": requests and LOOKUPs sent for single keys (each try
        # once), so that messages per request can be measured
        self._counters = {"messages": 0, "refreshes": 0, "redirects": 0, "moving_waits": 0,
                          "lookup_failures": 0}
        # bucket -> (routing channel, storage channel), least recent first.
        self._cache: OrderedDict[int, tuple[Channel, Channel]] = OrderedDict()
        self._random = random.Random()
        self._caching = "C" in self.strategy
        self._first_hops = 0          # what the fast path's channel cost to find
        self._named: dict[bytes, Channel] = {}    # service reference -> channel
        self._tag_refreshed_at = -REFRESH_INTERVAL  # when a reply's layout tag made it refresh
        self.last_lookup_failure: str | None = None
        self._load(descriptor)

    # ------------------------------------------------------------ layout
    def _load(self, descriptor: dict[str, Any]) -> None:
        known = getattr(self, "id", None)
        if known is not None and descriptor["id"] != known:
            # A handle stays on the DHT it was opened on, never a namesake.
            raise UnknownDht(f"DHT {descriptor['name']!r} (id {known}) was destroyed; the DHT "
                             f"of that name now is another one (id {descriptor['id']}): open "
                             f"it again to use it")
        if getattr(self, "bucket_count", descriptor["buckets"]) != descriptor["buckets"]:
            self._cache.clear()         # (its buckets are numbered out of the old count)
        self.descriptor = descriptor
        self.name: str = descriptor["name"]
        self.id: int = descriptor["id"]
        self.bucket_count: int = descriptor["buckets"]
        self._hasher = codec.hasher(descriptor["hash"])  # the hash, as domus.client.codec takes it
        self._shift = bucket_shift(self.bucket_count)
        storage = descriptor["storage_services"]
        channels = {entry["name"]: self.cluster.channel(entry["name"], entry["address"])
                    for entry in storage}
        self._storage_channels: list[Channel] = list(channels.values())
        counts = [entry["count"] for entry in storage]
        if sum(counts) != self.bucket_count:
            raise ProtocolError(
                f"DHT {self.name!r}: the supervisor's descriptor gives its storage services "
                f"{sum(counts)} buckets in all, not {self.bucket_count}")
        # The layout as the supervisor knows it now (the counts' placement,
        # then the moves): what D looks up, the last resort of the other
        # methods, and what whole-DHT operations (scans) follow.
        self.layout: BucketMap[Channel] = self._channel_map(
            layout.owners(descriptor, "storage"), channels)
        self._owners: Any = self._dense(self.layout)
        self._direct: Any = self._owners
        self.layout_version: int = descriptor.get("version", 0)
        self.replicated = (descriptor.get("replicas") or 1) > 1
        self.codec = descriptor.get("codec") or "msgpack"
        if self.codec == "pickle" and not self.cluster.secure:
            raise AuthenticationError(
                f"DHT {self.name!r} stores pickles, and this client's connection to the "
                f"deployment is not authenticated (it runs --insecure): unpickling what anyone "
                f"on the network could have stored would let them run code here. Use it only "
                f"on a deployment with a secret")
        self._values = codec.value_codec(self.codec)
        self._layout_tag = wire.layout_tag(self.layout_version)
        self._numbered = wire.numbering(self.bucket_count)
        routers = {entry["name"]: self.cluster.channel(entry["name"], entry["address"])
                   for entry in descriptor["routing_services"]}
        self._routers: Any = self._table(layout.owners(descriptor, "routing"), routers)
        self.graph: RoutingGraph = make_graph(descriptor.get("routing") or "chord",
                                              self.bucket_count,
                                              descriptor.get("routing_degree"))
        self.hop_limit = self.graph.hop_bound() + HOP_SLACK
        self.cache_capacity = max(1, int(self.cache_fraction * self.bucket_count))
        self._named.clear()     # (addresses may have changed)
        self._redirects_since_refresh = 0
        self._refreshed_at = time.monotonic()
        if "D" in self.strategy:
            # The direct table is the layout just fetched: it hits again.
            self._direct_on = True
            self.direct_misses = 0
        self._in_use()

    def _channel_map(self, names: BucketMap[str], channels: dict[str, Channel]
                     ) -> BucketMap[Channel]:
        mapped: BucketMap[Channel] = BucketMap(self.bucket_count)
        for first, end, name in names.ranges():
            mapped.assign(first, end, channels[name])
        return mapped

    def _table(self, names: BucketMap[str], channels: dict[str, Channel]) -> Any:
        return self._dense(self._channel_map(names, channels))

    def _dense(self, mapped: BucketMap[Channel]) -> Any:
        """bucket -> channel as a list when that is small, else the map."""
        return mapped.dense() if self.bucket_count <= DENSE_TABLE_LIMIT else mapped

    def _in_use(self) -> None:
        """Settle the methods in use (D is dropped past its cut-off, unless
        it is the only one) and the fast one: the method a request tries
        before entering its course, the first in use if it can answer
        without asking anyone."""
        if self._direct_on or self.strategy == ("D",):
            self._methods = self.strategy
        else:
            self._methods = tuple(method for method in self.strategy if method != "D")
        self._fast = self._methods[0] if self._methods[0] in ("D", "C") else None

    def methods(self) -> tuple[str, ...]:
        """The strategy's methods still in use."""
        return self._methods

    def __repr__(self) -> str:
        return (f"<domus.{type(self).__name__} {self.name!r} id={self.id} "
                f"buckets={self.bucket_count} services={len(self._storage_channels)} "
                f"lookup={','.join(self.strategy)}>")

    def _bucket(self, encoded_key: bytes) -> int:
        return codec.bucket_of(self._hasher, self._shift, encoded_key)

    def _layout_mark(self) -> int:
        """Which layout a course started with (see REFRESH)."""
        return 0

    # ------------------------------------------------------------ the fast path
    def _first_channel(self, bucket: int) -> Channel | None:
        """The storage channel of ``bucket`` by the first method in use, when
        it can say without asking anyone (its ``lookups`` counted)."""
        fast = self._fast
        self._first_hops = 0
        if fast == "D":
            self._method_stats["D"].lookups += 1
            return self._direct[bucket]
        if fast == "C":
            entry = self._cache.get(bucket)
            if entry is not None:
                _touch(self._cache, bucket)
                self._method_stats["C"].lookups += 1
                return entry[1]
        return None

    def _first_walk(self, bucket: int
                    ) -> Generator[tuple[Any, ...], Any, tuple[Channel, int] | None] | None:
        """When the first method is C and ``bucket`` is not cached: its
        distributed lookup from the nearest cached entry, for the client to
        drive at once (the common miss, kept off the course's longer way);
        its lookup and miss are counted.  None with an empty cache."""
        if self._fast != "C":
            return None
        start = self._nearest_cached(bucket)
        if start is None:
            return None
        stats = self._method_stats["C"]
        stats.lookups += 1
        stats.misses += 1
        return self._walk(start[0], start[1], bucket, stats)

    def _first_walked(self, found: tuple[Channel, int] | None) -> Channel | None:
        """Take the result of a ``_first_walk``: the storage channel, or
        None when the lookup failed (C then falls back: the course starts
        at the next method)."""
        if found is None:
            if len(self._methods) > 1:
                self._method_stats["C"].fallbacks += 1
            return None
        self._first_hops = found[1]
        return found[0]

    def _first_answer(self, channel: Channel, reply: bytes, bucket: int) -> bool:
        """Whether the fast path's reply answers the request (then counted
        as the first method's); False for NOT_OWNER and MOVING, which the
        course takes on; raises the error of any other reply."""
        status = reply[2]
        if status <= wire.ST_NOT_FOUND:
            self._first_hit()
            if reply[3] != self._layout_tag:
                self._layout_seen(reply[3])
            return True
        if status not in _NOT_FINAL:
            raise self._error(reply, channel, bucket)
        return False

    def _layout_seen(self, tag: int) -> None:
        """A reply tagged with another layout version than this client's:
        fetch the layout again if it is newer (at most every
        REFRESH_INTERVAL), with ``_refresh_soon``, which each client does
        its own way (the blocking one at once, the Twisted one in the
        background)."""
        if wire.layout_newer(tag, self._layout_tag) \
                and time.monotonic() - self._tag_refreshed_at >= REFRESH_INTERVAL:
            self._tag_refreshed_at = time.monotonic()
            self._refresh_soon()

    def _refresh_soon(self) -> None:
        raise NotImplementedError

    def _batch_seen(self, replies: Iterable[bytes]) -> None:
        """A batch's replies' layout tags, as ``_layout_seen`` takes a
        single reply's (once the batch is done: its keys keep the numbering
        they were sent with)."""
        for reply in replies:
            if reply[3] != self._layout_tag:
                self._layout_seen(reply[3])
                return

    def _packed(self, value: Any) -> Any:
        """``value`` packed by this DHT's codec; ValueTooLarge past the
        limit.  A large bytes value with msgpack is (its header, itself),
        joined into the message once (codec.keyed_message), not packed
        first: packing copied it into a fresh block of its own, whose pages
        a process faults in anew each time (a block that large is mapped
        from the kernel and given back when freed), about 0.7 ms a MiB here."""
        packed: Any
        if type(value) is bytes and len(value) >= LARGE_VALUE and self._values.name == "msgpack":
            packed = (msgpack_bin_header(len(value)), value)
            size = len(packed[0]) + len(value)
        else:
            packed = self._values.pack(value)
            size = len(packed)
        if size > wire.MAX_VALUE_BYTES:
            raise ValueTooLarge(f"value is {size} bytes encoded, over the "
                                f"{wire.MAX_VALUE_BYTES}-byte limit; split it")
        return packed

    def _encoder(self, op: int, key: Any, value: Any,
                 unsent: bytes | None, sent: bytes | None = None) -> Encoder:
        """``encode`` for a course: ``unsent`` (the fast path's message, if
        it was never sent, or is to be sent again as it was) first, then
        the request again with a new id; ``sent``: what the fast path sent."""
        ids = self.cluster.ids

        def make() -> bytes:
            return codec.keyed_message(op, ids.next(), ids.client_id, self.id, self._hasher,
                                       self._shift, key, value)[0]

        return Encoder(make, unsent, sent)

    def _first_hit(self) -> None:
        self._method_stats[self._fast].resolved(self._first_hops)  # type: ignore[index]

    # ------------------------------------------------------------ a request's course
    def _course(self, encode: Callable[[], bytes], bucket: int,
                first: tuple[Channel, bytes] | None = None,
                mark: int | None = None, skip: int = 0, count: int | None = None) -> Course:
        """The course of one keyed request for ``bucket``: ``encode()`` makes
        the message (a new request id each time).  ``first``: the fast
        path's (channel, reply) when that was not an answer (NOT_OWNER or
        MOVING), which the first method takes as its own; ``mark``: the
        layout it was sent with (see REFRESH); ``skip``: methods the fast
        path has tried already; ``count``: the bucket count ``bucket`` is
        numbered out of (default: the layout's now).  Returns the reply that
        answers the request; raises the error of one that fails, and
        Renumbered once a layout with another bucket count has been
        fetched (by this course or meanwhile), whose tables ``bucket`` does
        not index."""
        if mark is None:
            mark = self._layout_mark()
        if count is None:
            count = self.bucket_count
        redirect: tuple[str, str] | None = None
        methods = self._methods
        for index, method in enumerate(methods):
            if index < skip:
                continue
            if self.bucket_count != count:
                raise Renumbered()
            stats = self._method_stats[method]
            hops = 0
            given = None
            if first is not None and index == 0 and method == self._fast:
                channel, given = first      # (its lookup already counted)
                hops = self._first_hops
            else:
                stats.lookups += 1
                found = yield from self._locate(method, bucket, stats)
                if found is None:
                    if index + 1 < len(methods):
                        stats.fallbacks += 1
                    continue
                channel, hops = found
            reply = yield from self._send(channel, encode, bucket, given)
            if reply[2] != wire.ST_NOT_OWNER:
                stats.resolved(hops)
                return self._final(reply, channel, bucket)
            # A miss: this method's answer is out of date.
            stats.misses += 1
            redirect = self._redirect(reply) or redirect
            self._cache.pop(bucket, None)
            if method == "D":
                self._direct_missed()
            if index + 1 < len(methods):
                stats.fallbacks += 1
        if redirect is not None:
            self._counters["redirects"] += 1
            channel = self.cluster.channel(*redirect)
            reply = yield from self._send(channel, encode, bucket)
            if reply[2] != wire.ST_NOT_OWNER:
                self._final(reply, channel, bucket)
                # Many redirects mean the layout moved on (buckets were
                # rebalanced): fetch it again (at most 4 times a second).
                self._redirects_since_refresh += 1
                if (self._redirects_since_refresh >= REFRESH_AFTER_REDIRECTS
                        and time.monotonic() - self._refreshed_at >= REFRESH_INTERVAL):
                    yield (REFRESH, mark)
                elif reply[3] != self._layout_tag:
                    self._layout_seen(reply[3])
                return reply
        # Last resort: the layout as the supervisor knows it now.
        yield (REFRESH, mark)
        if self.bucket_count != count:
            raise Renumbered()
        channel = self._owners[bucket]
        reply = yield from self._send(channel, encode, bucket)
        if reply[2] == wire.ST_NOT_OWNER:
            raise WrongService(f"DHT {self.name!r}: service {channel.name} ({channel.address}) "
                               f"does not store bucket {bucket}, though the supervisor says it "
                               f"does; a move is under way, retry shortly", wire.ST_NOT_OWNER)
        return self._final(reply, channel, bucket)

    def _final(self, reply: bytes, channel: Channel, bucket: int) -> bytes:
        """A course's last reply: itself if it answers the request, else
        raised as its error (DataLost, StorageError, DhtInactive...)."""
        if reply[2] > wire.ST_NOT_FOUND:
            raise self._error(reply, channel, bucket)
        return reply

    def _locating(self, bucket: int) -> Generator[tuple[Any, ...], Any, Channel | None]:
        """A course that only finds ``bucket``'s storage channel (for a
        batch): each method in use in turn; None if none can."""
        methods = self.methods()
        for index, method in enumerate(methods):
            stats = self._method_stats[method]
            stats.lookups += 1
            found = yield from self._locate(method, bucket, stats)
            if found is not None:
                channel, hops = found
                stats.resolved(hops)
                return channel
            if index + 1 < len(methods):
                stats.fallbacks += 1
        return None

    def _locate(self, method: str, bucket: int, stats: MethodStats
                ) -> Generator[tuple[Any, ...], Any, tuple[Channel, int] | None]:
        """(storage channel, lookup hops) of ``bucket`` by ``method``, or
        None if it cannot tell."""
        if method == "D":
            return self._direct[bucket], 0
        if method == "C":
            entry = self._cache.get(bucket)
            if entry is not None:
                _touch(self._cache, bucket)
                return entry[1], 0
            stats.misses += 1           # not cached: route from the nearest entry
            start = self._nearest_cached(bucket)
            if start is None:
                return None
        else:
            start = self._random_start()
        return (yield from self._walk(start[0], start[1], bucket, stats))

    def _walk(self, channel: Channel, current: int, target: int, stats: MethodStats
              ) -> Generator[tuple[Any, ...], Any, tuple[Channel, int] | None]:
        """A distributed lookup for ``target`` from the AS ``channel``, as
        the router of bucket ``current``: (storage channel, hops) or None
        when it fails (a dead hop, a chain too long, a stale AS)."""
        ids = self.cluster.ids
        for hop in range(1, self.hop_limit + 1):
            message = wire.encode_lookup(ids.next(), ids.client_id, self.id, target, current,
                                         self._numbered)
            try:
                reply = yield (SEND, channel, message, target)
            except DomusError as exc:
                return self._walk_failed(f"hop {hop}: {exc}")
            if reply[2] in (wire.ST_NOT_OWNER, wire.ST_STALE_LAYOUT):
                # It routes nothing of this DHT now, or has another bucket count.
                refused = reply_error(self.name, reply, channel, target)
                return self._walk_failed(f"hop {hop}: {refused}")
            if reply[2] != wire.ST_OK:
                raise self._error(reply, channel, target)
            named = self._named.get(reply[_REF_AT:])     # (the same few services, again and again)
            if named is None:
                kind, bucket, name, address = wire.decode_lookup_reply(reply)
                named = self._named[reply[_REF_AT:]] = self.cluster.channel(name, address)
            kind, bucket = _LOOKUP_REPLY(reply, wire.REPLY_HEADER_SIZE)
            if kind == wire.LOOKUP_FOUND:
                if self._caching:
                    self._remember(target, channel, named)
                return named, hop
            if kind != wire.LOOKUP_NEXT:
                raise ProtocolError(f"lookup reply of unknown kind {kind}")
            channel, current = named, bucket
        return self._walk_failed(f"no answer within {self.hop_limit} hops (the layout is "
                                 f"changing, or the routing services disagree)")

    def _walk_failed(self, why: str) -> None:
        """Count a failed distributed lookup and keep why (``stats()``
        shows the last one); the strategy falls back."""
        self._counters["lookup_failures"] += 1
        self.last_lookup_failure = f"lookup in DHT {self.name!r} failed at {why}"

    def _send(self, channel: Channel, encode: Callable[[], bytes], bucket: int,
              given: bytes | None = None) -> Generator[tuple[Any, ...], Any, bytes]:
        """Send the request to ``channel`` (``given``: its reply, already
        received), asking again while the bucket is MOVING (the same bytes,
        while they may be known: a replicated primary answers MOVING when a
        backup did not take a change, which that backup, or another, may
        have applied); returns the reply."""
        reply = given if given is not None else (yield (SEND, channel, encode(), bucket))
        if reply[2] in (wire.ST_UNKNOWN_DHT, wire.ST_STALE_LAYOUT):
            # A service that left the DHT (it was taken off its lists) knows
            # nothing of it, and one that cannot translate a request's bucket
            # numbering has another layout: a miss, as NOT_OWNER with no
            # redirect.  If the DHT itself is gone, the layout fetched last
            # says so.
            reply = _AS_MISS + reply[3:wire.REPLY_HEADER_SIZE] + _NO_REF \
                + reply[wire.REPLY_HEADER_SIZE:]
        pause, waited = MOVING_FIRST_PAUSE, 0.0
        while reply[2] == wire.ST_MOVING:
            if waited >= MOVING_PATIENCE:
                raise self._error(reply, channel, bucket)
            self._counters["moving_waits"] += 1
            yield (PAUSE, pause)
            waited += pause
            pause = min(pause * 2, MOVING_MAX_PAUSE)
            again = encode.again() if isinstance(encode, Encoder) else encode()
            reply = yield (SEND, channel, again, bucket)
        return reply

    def _error(self, reply: bytes, channel: Any, bucket: int | None) -> DomusError:
        return reply_error(self.name, reply, channel, bucket)

    @staticmethod
    def _redirect(reply: bytes) -> tuple[str, str] | None:
        """The (name, address) a NOT_OWNER reply redirects to, if any."""
        try:
            name, address, _message = wire.decode_redirect(reply)
        except ProtocolError:
            return None
        return (name, address) if name and address else None

    def _direct_missed(self) -> None:
        self.direct_misses += 1
        if self._direct_on and self.direct_misses >= self.direct_cutoff:
            self._direct_on = False
            self._in_use()

    # ------------------------------------------------------------ the cache
    def _remember(self, bucket: int, router: Channel, storage: Channel) -> None:
        cache = self._cache
        cache[bucket] = (router, storage)
        _touch(cache, bucket)
        try:
            while len(cache) > self.cache_capacity:
                cache.popitem(last=False)
        except KeyError:        # (emptied by another thread meanwhile)
            pass

    def _forget_channel(self, dead: Channel) -> None:
        """Forget the cached entries through ``dead`` (its service failed
        to answer), so that no course goes there again from the cache."""
        cache = self._cache
        for bucket, (router, storage) in list(cache.items()):
            if router is dead or storage is dead:
                cache.pop(bucket, None)

    def _dead_service(self, dead: Channel) -> int | None:
        """After ``dead``'s service failed to answer: forget the cached
        entries through it, and say the first bucket the layout has on it
        (None if the layout has none there: whatever sent the request there
        was out of date, and the layout's owners are the ones to try)."""
        self._forget_channel(dead)
        owners = self._owners
        return next((bucket for bucket in range(self.bucket_count) if owners[bucket] is dead),
                    None)

    def _nearest_cached(self, target: int) -> tuple[Channel, int] | None:
        """(routing channel, bucket) of the cached entry nearest ``target``
        in the routing graph (among the first NEAR_PROBES candidates; else
        the most recent entry); None with an empty cache."""
        cache = self._cache
        if not cache:
            return None
        for probe, bucket in enumerate(self.graph.approach(target)):
            entry = cache.get(bucket)
            if entry is not None:
                return entry[0], bucket
            if probe >= NEAR_PROBES:
                break
        try:
            bucket = next(reversed(cache))
            return cache[bucket][0], bucket
        except (StopIteration, KeyError, RuntimeError):   # (another thread changed it)
            return None

    def _random_start(self) -> tuple[Channel, int]:
        """A routing service picked at random, weighted by the buckets it
        routes (the router of a uniformly random bucket), and that bucket."""
        bucket = self._random.randrange(self.bucket_count)
        return self._routers[bucket], bucket

    # ------------------------------------------------------------ batches
    # A batch finds its buckets' owners first (``_batch_owners`` in each
    # client: the direct table, else cached entries and ``_locating``
    # courses side by side), sends, then sends again what came back
    # NOT_OWNER (after fetching the layout) or MOVING (after a pause).
    def _batch_plan(self, keys: list[bytes]) -> tuple[Any, list[int]]:
        """The owners a batch's buckets have without asking anyone (the
        direct table as it is, or cached entries; bucket -> channel), and
        the buckets still to look up (with ``_locating`` courses)."""
        if self._fast == "D":
            stats = self._method_stats["D"]
            stats.lookups += len(keys)
            stats.hits += len(keys)
            stats.hops += len(keys)         # (as len(keys) calls of resolved(0))
            stats.max_hops = max(stats.max_hops, 1)
            return self._direct, []
        owners: dict[int, Any] = {}
        missing = []
        for bucket in {self._bucket(key) for key in keys}:
            channel = self._first_channel(bucket)
            if channel is not None:
                self._first_hit()
                owners[bucket] = channel
            else:
                missing.append(bucket)
        return owners, missing

    def _batch_found(self, owners: dict[int, Any], missing: list[int],
                     found: list[Channel | None]) -> dict[int, Any]:
        """``owners`` with what the lookups of ``missing`` found; the
        supervisor's layout where they found nothing."""
        for bucket, channel in zip(missing, found):
            owners[bucket] = channel if channel is not None else self._owners[bucket]
        return owners

    def _put_round(self, requests: list[tuple[Channel, bytes]], replies: list[bytes],
                   ) -> tuple[int, list[bytes], list[bytes], int, bool]:
        """Take one round of PUT_MANY replies: (keys created, keys and values
        to send again, messages answered NOT_OWNER, whether any was MOVING).
        Nothing of a NOT_OWNER or MOVING message was applied."""
        created, moved, moving = 0, 0, False
        keys: list[bytes] = []
        values: list[bytes] = []
        for (channel, message), reply in zip(requests, replies):
            status = reply[2]
            if status == wire.ST_OK:
                created += wire.U16X2.unpack_from(reply, wire.REPLY_HEADER_SIZE)[1]
            elif status in _NOT_FINAL:
                for _bucket, key, value in wire.decode_put_many(message)[1]:
                    keys.append(key)
                    values.append(value)
                moved += status != wire.ST_MOVING
                moving = moving or status == wire.ST_MOVING
            else:
                raise reply_error(self.name, reply, channel, None)
        return created, keys, values, moved, moving

    def _batch_retry(self, moved: int, moving: bool, rounds: dict[str, Any]
                     ) -> list[tuple[Any, ...]]:
        """What to do before a batch's next round (REFRESH and PAUSE
        instructions), after ``moved`` messages came back NOT_OWNER and some
        MOVING.  Raises once the services keep disagreeing with the
        supervisor, or a bucket keeps moving past MOVING_PATIENCE.  The
        driver runs the steps, then notes the layout the next round goes
        with (``rounds["mark"]``): each round's REFRESH asks for a layout
        newer than the one that round was sent with."""
        steps: list[tuple[Any, ...]] = []
        if moved:
            rounds["refreshes"] += 1
            if rounds["refreshes"] > MAX_BATCH_REFRESHES:
                raise WrongService(f"DHT {self.name!r}: services disagree with the supervisor "
                                   f"about bucket owners; retry shortly", wire.ST_NOT_OWNER)
            if rounds["refreshes"] > 3 and not moving:
                # (Buckets keep moving under the batch, as the balancer
                # moves them a round at a time: a moment before the layout
                # is asked for again, growing as for MOVING.)
                steps.append((PAUSE, rounds["pause"]))
                rounds["waited"] += rounds["pause"]
                rounds["pause"] = min(rounds["pause"] * 2, MOVING_MAX_PAUSE)
            if self._fast == "D":
                for _ in range(moved):      # (one miss per message, not per key)
                    self._method_stats["D"].misses += 1
                    self._direct_missed()
            steps.append((REFRESH, rounds["mark"]))
        if moving:
            if rounds["waited"] >= MOVING_PATIENCE:
                raise WrongService(f"DHT {self.name!r}: a bucket has been moving for more "
                                   f"than {MOVING_PATIENCE:.0f}s; check `domus status`",
                                   wire.ST_MOVING)
            self._counters["moving_waits"] += 1
            steps.append((PAUSE, rounds["pause"]))
            rounds["waited"] += rounds["pause"]
            rounds["pause"] = min(rounds["pause"] * 2, MOVING_MAX_PAUSE)
        return steps

    def _batch_rounds(self) -> dict[str, Any]:
        return {"refreshes": 0, "waited": 0.0, "pause": MOVING_FIRST_PAUSE,
                "mark": self._layout_mark()}

    # ------------------------------------------------------------ scans
    def _renumbered_at(self, bucket: int, count: int, floor: int) -> tuple[int, int]:
        """A scan that had read buckets [0, ``bucket``) of ``count`` when
        the DHT was resized: the bucket of the new count to go on from, and
        the floor (the top 32 bits of a key's hash) below which records were
        read already."""
        floor = max(floor, bucket << (32 - (count.bit_length() - 1)))
        return floor >> (32 - (self.bucket_count.bit_length() - 1)), floor

    def _range_channels(self) -> list[Channel]:
        """Each service that stores at least one bucket of the DHT now
        (moved buckets included), once: those a key range asks."""
        return list(dict.fromkeys(channel for _first, _end, channel in self.layout.ranges()))

    # ------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """This client's lookup counters for the DHT, per method of its
        strategy, and its transport's retries, timeouts and BUSY answers
        backed off (local counters,
        no request is sent)."""
        methods = {method: stats.as_dict() for method, stats in self._method_stats.items()}
        served = sum(stats.hits + stats.walks for stats in self._method_stats.values())
        hops = sum(stats.hops for stats in self._method_stats.values())
        return {
            "dht": self.name,
            "strategy": ",".join(self.strategy),
            "in_use": ",".join(self.methods()),
            "lookups": methods,
            "hops": {"mean": round(hops / served, 3) if served else 0.0,
                     "max": max((stats.max_hops for stats in self._method_stats.values()),
                                default=0)},
            "direct_misses": self.direct_misses,
            "direct_cutoff": self.direct_cutoff,
            "cache": {"entries": len(self._cache), "capacity": self.cache_capacity},
            **self._counters,
            "last_lookup_failure": self.last_lookup_failure,
            "retries": sum(channel.retries for channel in self._storage_channels),
            "timeouts": sum(channel.timeouts for channel in self._storage_channels),
            "busy": sum(channel.busy for channel in self._storage_channels),
        }


def _touch(cache: OrderedDict[int, Any], bucket: int) -> None:
    """Mark ``bucket`` as the most recently used entry of ``cache`` (a
    client shared by threads: another may have dropped it meanwhile)."""
    try:
        cache.move_to_end(bucket)
    except KeyError:
        pass


def reply_error(dht: str, reply: bytes, channel: Any, bucket: int | None) -> DomusError:
    """The domus.errors exception for an error reply from ``channel``
    (anything with ``name`` and ``address``) to a request on DHT ``dht``."""
    status = reply[2]
    if status == wire.ST_NOT_OWNER:
        try:
            text = wire.decode_redirect(reply)[2]
        except ProtocolError:
            text = reply[wire.REPLY_HEADER_SIZE:].decode("utf-8", "replace")
    else:
        text = reply[wire.REPLY_HEADER_SIZE:].decode("utf-8", "replace")
    where = f"service {channel.name} ({channel.address})"
    if status == wire.ST_UNKNOWN_DHT:
        return UnknownDht(f"DHT {dht!r} is not on {where} any more (destroyed?): {text}")
    if status == wire.ST_NOT_OWNER:
        return WrongService(f"{where}: {text}", status)
    if status == wire.ST_STORAGE_FULL:
        return StorageFull(f"{where}: {text}", status)
    if status == wire.ST_STORAGE_ERROR:
        return StorageError(f"{where}, bucket {bucket}: {text}", status)
    if status == wire.ST_DATA_LOST:
        return DataLost(f"{text} (answered by {where})", status)
    if status == wire.ST_INACTIVE:
        return DhtInactive(f"DHT {dht!r} is inactive: its records are kept, and served again "
                           f"once it is activated (cluster.activate_dht({dht!r}) or "
                           f"`domus dht activate {dht}`)", status)
    if status == wire.ST_TOO_LARGE:
        return ValueTooLarge(f"{where} refused the request: {text}")
    if status == wire.ST_MOVING:
        return RemoteError(f"{where}: bucket {bucket} of DHT {dht!r} has been moving for more "
                           f"than {MOVING_PATIENCE:.0f}s; check `domus status`", status)
    name = wire.STATUS_NAMES.get(status, f"status 0x{status:02x}")
    return RemoteError(f"{where} answered {name}: {text}", status)
