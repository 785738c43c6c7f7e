"""The requests of the event-driven clients, written once.

The Twisted client (domus.client.tx) and the asyncio client
(domus.client.aio) keep many requests outstanding on one thread; what a
request does (its fast path, its course through domus.client.lookup's
strategies, redirects and MOVING pauses, a dead primary's backup taking
over, a batch's rounds) is the coroutines below, driven by either event
loop.  A subclass supplies the loop's primitives:

- ``channel.request(message, dht, bucket)``: an awaitable of the reply
  (each client's own datagram layer, under domus.client.transport's retry
  rule and per-service window);
- ``_sleep(seconds)``, ``_now()``: the loop's timer and clock;
- ``_gather(awaitables)``: all results in order, or the first failure as
  it is;
- ``refresh()``: an awaitable of a fresh layout, a fetch under way shared
  by every caller, counted in ``_fetches`` (``_refreshing`` is not None
  while one is under way, and ``_join_refresh()`` waits for it).

Each client's public methods wrap these coroutines in its own kind of
result (Deferreds; coroutines).
"""

from __future__ import annotations

import functools
import heapq
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from domus.client import batch, codec
from domus.client.lookup import (
    MAX_REROUTES,
    MISSING,
    PAUSE,
    SEND,
    DirectLookup,
    Renumbered,
    reply_error,
)
from domus.client.throttle import Throttle
from domus.client.transport import (
    FIRST_TIMEOUT,
    MAX_DEADLINE,
    busy_backoff,
    reply_value,
    service_busy,
    service_unavailable,
    stored_digest,
)
from domus.errors import (
    DomusError,
    ServiceUnavailable,
    UnknownDht,
    ValueDecodeError,
)
from domus.wire import address as addresses
from domus.wire import auth
from domus.wire import protocol as wire
from domus.wire.secret import Keys

Channel = TypeVar("Channel")
WINDOW = 32         # datagrams in flight per service; more wait on the client


class EventedChannel:
    """Requests to one service from an event-driven client: over the
    client's shared UDP socket (its ``requests``, a datagram layer of the
    client's own, with domus.client.transport's retry rule and this
    channel's window), or over the channel's own TCP connection when a
    message does not fit a datagram.  A subclass supplies ``request_tcp``
    (one TCP exchange, reconnecting once), and gives ``_while_busy`` its
    loop's clock and sleep."""

    def __init__(self, name: str, address: str, *, requests: Any, deadline: float,
                 first_timeout: float = FIRST_TIMEOUT, keys: Keys | None = None) -> None:
        self.name = name
        self.address = address
        # A secure deployment's (domus.wire.auth): datagrams sealed with the
        # data key, the TCP connection opened with the handshake.
        self.keys = keys
        self.key = keys.data if keys is not None else None
        self.host, self.port = addresses.parse(address)
        # The same limits as domus.client.transport.ServiceChannel (see there why).
        self.deadline = min(deadline, MAX_DEADLINE)
        self.first_timeout = min(first_timeout, self.deadline)
        self.requests = requests
        self.retries = 0
        self.timeouts = 0
        self.busy = 0           # BUSY answers (each followed by a backoff and a retry)
        self.throttle = Throttle()  # (domus.client.throttle)
        self.in_flight = 0
        self.waiting: deque[Any] = deque()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} {self.address}>"

    def unavailable(self, what: str, dht: str = "",
                    bucket: int | None = None) -> ServiceUnavailable:
        return service_unavailable(self.name, self.address, what, dht, bucket)

    def request(self, message: bytes, dht: str = "", bucket: int | None = None) -> Any:
        """Send one request; an awaitable of its reply (retried over UDP, or
        over TCP when it is too big for a datagram)."""
        if len(message) > wire.DEFAULT_MAX_DATAGRAM - auth.REQUEST_TRAILER:
            return self.request_tcp(message, dht, bucket)
        return self.requests.request(self, message, dht, bucket)

    def request_tcp(self, message: bytes, dht: str = "", bucket: int | None = None) -> Any:
        raise NotImplementedError

    async def _while_busy(self, once: Callable[[], Awaitable[bytes]], dht: str,
                          bucket: int | None, clock: Callable[[], float],
                          pause: Callable[[float], Awaitable[Any]]) -> bytes:
        """``once()`` (one TCP exchange), done again after a backoff while
        the service answers BUSY, within the deadline; then ServiceBusy."""
        started = clock()
        tries = 0
        while True:
            frame = await once()
            if frame[2] != wire.ST_BUSY:
                return frame
            tries += 1
            self.busy += 1
            wait = busy_backoff(tries, frame)
            if clock() - started + wait >= self.deadline:
                raise service_busy(self.name, self.address, self.deadline, tries, dht, bucket)
            await pause(wait)


class EventedDht(DirectLookup[Channel]):
    """A DHT's requests as coroutines, for an event loop (see the module)."""

    _fetches: int                   # layout fetches started so far
    _refreshing: Any                # the fetch under way, or None

    # -- the loop's primitives (a subclass's)
    def _sleep(self, seconds: float) -> Awaitable[Any]:
        raise NotImplementedError

    def _now(self) -> float:
        raise NotImplementedError

    def _gather(self, awaitables: list[Any]) -> Awaitable[list[Any]]:
        raise NotImplementedError

    def refresh(self) -> Awaitable[Any]:
        raise NotImplementedError

    def _join_refresh(self) -> Awaitable[Any]:
        raise NotImplementedError

    # ------------------------------------------------------------ layout
    def _layout_mark(self) -> int:
        return self._fetches

    async def _layout_after(self, mark: int) -> None:
        """Wait for a layout fetched after ``mark`` (a past value of
        ``_fetches``): one started since, or else a new one.  A thousand
        requests told NOT_OWNER at once cause one fetch, not a thousand, and
        none of them retries with a layout older than its own NOT_OWNER."""
        if self._fetches > mark:
            if self._refreshing is not None:
                await self._join_refresh()
            return
        if self._refreshing is not None:  # started before the request was sent
            await self._join_refresh()
            await self._layout_after(mark)
            return
        await self.refresh()

    # ------------------------------------------------------------ single keys
    async def _request(self, op: int, key: Any, value: Any = None) -> bytes:
        """One keyed request (``value``: a PUT's packed value, as
        DirectLookup._packed makes it); returns its reply.  As the
        synchronous client: the first method of the strategy
        answers at once when it can, anything else takes the course that
        domus.client.lookup lays out."""
        ids = self.cluster.ids
        count = self.bucket_count
        message, bucket = codec.keyed_message(op, ids.next(), ids.client_id, self.id,
                                              self._hasher, self._shift, key, value)
        first = None
        skip = 0
        unsent = None
        mark = self._fetches
        channel = self._first_channel(bucket)
        if channel is None:
            walk = self._first_walk(bucket)
            if walk is not None:
                channel = self._first_walked(await self._drive(walk))
                skip = channel is None
        if channel is None:
            unsent = message
        else:
            self._counters["messages"] += 1
            try:
                reply = await channel.request(message, self.name, bucket)
            except ServiceUnavailable:
                if not await self._owner_moved(mark, bucket, channel, count):
                    raise
                unsent = message        # (as the synchronous client: sent again as it was)
            else:
                if self._first_answer(channel, reply, bucket):
                    return reply
                first = (channel, reply)
        encode = self._encoder(op, key, value, unsent, message)
        rerouted = 0
        while True:
            try:
                return await self._drive(self._course(encode, bucket, first, mark, skip,
                                                   count))
            except Renumbered:          # the DHT was resized: hash the key anew
                return await self._request(op, key, value)
            except ServiceUnavailable as exc:
                rerouted += 1
                if rerouted > MAX_REROUTES:
                    raise
                # (As the synchronous client: to where the bucket is now, as it was.)
                dead = self.cluster.channel(exc.service, exc.address) if exc.service else None
                if dead is None or not await self._owner_moved(self._fetches, bucket, dead,
                                                               count):
                    raise
                encode = self._encoder(op, key, value, encode.last)
                first, skip, mark = None, 0, self._fetches
                if self.bucket_count == count and encode.last is not None:
                    # (As the synchronous client: straight to the layout's owner.)
                    owner = self._owners[bucket]
                    try:
                        reply = await owner.request(encode.last, self.name, bucket)
                    except ServiceUnavailable:
                        continue
                    if self._first_answer(owner, reply, bucket):
                        return reply
                    first = (owner, reply)

    async def _drive(self, course: Any) -> Any:
        """Run a course (domus.client.lookup) to its end, without blocking."""
        result: Any = None
        try:
            instruction = next(course)
            while True:
                kind = instruction[0]
                try:
                    if kind == SEND:
                        self._counters["messages"] += 1
                        result = await instruction[1].request(instruction[2], self.name,
                                                              instruction[3])
                    elif kind == PAUSE:
                        result = await self._sleep(instruction[1])
                    else:
                        result = await self._layout_after(instruction[1])
                except DomusError as exc:
                    instruction = course.throw(exc)
                    continue
                instruction = course.send(result)
        except StopIteration as stop:
            return stop.value

    async def _owner_moved(self, mark: int, bucket: int, channel: Channel,
                           count: int) -> bool:
        """After ``channel``'s service failed to answer: ask the supervisor
        whether the bucket (numbered out of ``count``) is stored elsewhere
        now (e.g. the service re-registered at a new address, a backup took
        over from it, or the DHT was resized).  False if not, or if the
        supervisor cannot say."""
        patience = min(self.cluster.timeout, MAX_DEADLINE) if self.replicated else 0.0
        started = self._now()
        self._forget_channel(channel)
        while True:
            try:
                await self._layout_after(mark)
            except DomusError:
                return False
            if self.bucket_count != count or self._owners[bucket] is not channel:
                return True
            if self._now() - started >= patience:
                return False
            mark = self._fetches
            await self._sleep(0.1)

    async def _put(self, key: Any, value: Any) -> bool:
        reply = await self._request(wire.OP_PUT, key, self._packed(value))
        return reply[-1:] == b"\x01"

    async def _setdefault(self, key: Any, default: Any) -> Any:
        """The blocking client's ``setdefault``: PUT_IF_ABSENT, then (if the
        key was there) its value; again if it was deleted in between."""
        packed = self._packed(default)
        while True:
            reply = await self._request(wire.OP_PUT_IF_ABSENT, key, packed)
            if reply[-1:] == b"\x01":
                return default
            reply = await self._request(wire.OP_GET, key)
            if reply[2] != wire.ST_NOT_FOUND:
                return self._decoded(key, reply)

    async def _get(self, key: Any, default: Any, *, raise_missing: bool) -> Any:
        reply = await self._request(wire.OP_GET, key)
        if reply[2] == wire.ST_NOT_FOUND:
            if raise_missing:
                raise KeyError(key)
            return default
        return self._decoded(key, reply)

    def _decoded(self, key: Any, reply: bytes) -> Any:
        """The value an OK reply to a GET of ``key`` carries."""
        try:
            return reply_value(self._values, reply, wire.REPLY_HEADER_SIZE)
        except ValueDecodeError as exc:
            raise exc.with_key(key).with_dht(self.name) from None

    async def _answer(self, op: int, key: Any) -> bool:
        reply = await self._request(op, key)
        return reply[2] == wire.ST_OK

    async def _pop(self, key: Any, default: Any) -> Any:
        """The blocking client's ``pop``: the value is read, then deleted
        only if it is still the value read (DELETE_IF), else read again;
        ``default`` (KeyError without one, ``MISSING``) once it is not
        there."""
        while True:
            reply = await self._request(wire.OP_GET, key)
            if reply[2] == wire.ST_NOT_FOUND:
                break
            value = self._decoded(key, reply)
            answer = await self._request(wire.OP_DELETE_IF, key, stored_digest(reply))
            if answer[2] == wire.ST_NOT_FOUND:
                break
            if answer[-1:] == b"\x01":
                return value
        if default is MISSING:
            raise KeyError(key)
        return default

    # ------------------------------------------------------------ batches
    def _exchange(self, requests: list[tuple[Channel, bytes]]) -> Awaitable[list[bytes]]:
        """Every request at once; the replies in request order."""
        return self._gather([channel.request(message, self.name) for channel, message in requests])

    async def _round(self, requests: list[tuple[Channel, bytes]]) -> list[bytes] | None:
        """A batch's round trip; None when a service it went to is gone and
        its buckets are stored elsewhere now (as the synchronous client's
        _exchange: the batch goes again, its changes applying the same
        values again)."""
        mark = self._fetches
        try:
            return await self._exchange(requests)
        except ServiceUnavailable as exc:
            if not exc.service:
                raise
            dead = self.cluster.channel(exc.service, exc.address)
            bucket = self._dead_service(dead)
            if bucket is not None and not await self._owner_moved(mark, bucket, dead,
                                                                  self.bucket_count):
                raise
            return None

    async def _batch_owners(self, keys: list[bytes]) -> Any:
        """As the synchronous client's: the owners of a batch's buckets by
        the lookup strategy, distributed lookups all under way at once.
        They are numbered as the layout is when this returns: if one of
        another bucket count came meanwhile, its table."""
        count = self.bucket_count
        owners, missing = self._batch_plan(keys)
        if not missing:
            return owners
        found = await self._gather([self._drive(self._locating(bucket)) for bucket in missing])
        if self.bucket_count != count:
            return self._owners
        return self._batch_found(owners, missing, found)

    async def _before_next_round(self, moved: int, moving: bool,
                                 rounds: dict[str, Any]) -> None:
        for step in self._batch_retry(moved, moving, rounds):
            if step[0] == PAUSE:
                await self._sleep(step[1])
            else:
                await self._layout_after(step[1])
        rounds["mark"] = self._layout_mark()

    async def _put_many(self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> int:
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        keys, values = batch.encode_pairs(pairs, self._values)
        batch.check_values(values)
        owners = await self._batch_owners(keys)
        shift = self._shift         # (the numbering of ``owners``: the layout may change)
        created = 0
        rounds = self._batch_rounds()
        replies: list[bytes] | None = []
        while keys:
            requests = batch.put_requests(keys, values, self._hasher, shift, owners,
                                          self.id, self.cluster.ids)
            replies = await self._round(requests)
            if replies is None:             # (a backup took over: the round again)
                owners, shift = self._owners, self._shift
                continue
            new, keys, values, moved, moving = self._put_round(requests, replies)
            created += new
            if keys:
                await self._before_next_round(moved, moving, rounds)
                owners, shift = self._owners, self._shift
        self._batch_seen(replies or [])
        return created

    async def _get_many(self, keys: Iterable[Any]) -> dict[Any, Any]:
        wanted = list(keys)
        state = batch.GetMany(wanted, codec.encode_keys(wanted))
        owners = await self._batch_owners(state.encoded)
        shift = self._shift         # (the numbering of ``owners``: the layout may change)
        rounds = self._batch_rounds()
        replies: list[bytes] | None = []
        while state.pending:
            requests, batches = state.requests(self._hasher, shift, owners, self.id,
                                               self.cluster.ids)
            replies = await self._round(requests)
            if replies is None:             # (a backup took over: the round again)
                owners, shift = self._owners, self._shift
                continue
            try:
                moved = state.take(requests, batches, replies, self._batch_error,
                                   self._values.take)
            except ValueDecodeError as exc:
                raise exc.with_dht(self.name) from None
            if moved or state.moving:
                await self._before_next_round(moved, state.moving, rounds)
                owners, shift = self._owners, self._shift
        self._batch_seen(replies or [])
        return state.found

    def _batch_error(self, reply: bytes, channel: Channel) -> Exception:
        return reply_error(self.name, reply, channel, None)

    # ------------------------------------------------------------ whole DHT
    async def _whole_dht(self) -> None:
        """Before an operation on the whole DHT (length, scans, key ranges):
        the layout as the supervisor knows it now, so that a service buckets
        moved to since is not left out; the one this handle has if the
        supervisor cannot say."""
        try:
            await self.refresh()
        except UnknownDht:
            raise
        except DomusError:
            pass

    async def _records_by_service(self) -> dict[str, int]:
        await self._whole_dht()
        ids = self.cluster.ids
        requests = [(channel, wire.encode_length(ids.next(), ids.client_id, self.id))
                    for channel in self._storage_channels]
        counts = {}
        for (channel, _message), reply in zip(requests, await self._exchange(requests)):
            if reply[2] != wire.ST_OK:
                raise reply_error(self.name, reply, channel, None)
            counts[channel.name] = wire.U64.unpack_from(reply, wire.REPLY_HEADER_SIZE)[0]
        return counts

    async def _scan(self) -> AsyncIterator[tuple[bytes, bytes]]:
        """Every record, bucket by bucket, as raw (key, value) bytes, as the
        blocking client's scan: a bucket being moved is waited for; one that
        has moved is scanned at its new owner; after a resize the scan goes
        on from the same point of the hash range."""
        await self._whole_dht()
        ids = self.cluster.ids
        bucket, floor, count = 0, 0, self.bucket_count
        while True:
            if self.bucket_count != count:
                bucket, floor = self._renumbered_at(bucket, count, floor)
                count = self.bucket_count
            if bucket >= count:
                return
            for attempt in (1, 2):
                channel = self._owners[bucket]
                first_page = functools.partial(wire.encode_scan, ids.next(), ids.client_id,
                                               self.id, bucket, 0, 0, self._numbered)
                reply = await self._drive(self._send(channel, first_page, bucket))
                if reply[2] != wire.ST_NOT_OWNER or attempt == 2:
                    break
                await self._layout_after(self._fetches)
                if self.bucket_count != count:
                    break
            if self.bucket_count != count:
                continue
            while True:
                if reply[2] != wire.ST_OK:
                    raise self._error(reply, channel, bucket)
                scan_id, offset, entries = codec.decode_scan_reply(reply)
                if floor:
                    entries = [entry for entry in entries
                               if codec.bucket_of(self._hasher, 32, entry[0]) >= floor]
                for entry in entries:
                    yield entry
                if offset == wire.SCAN_END:
                    break
                reply = await channel.request(wire.encode_scan(ids.next(), ids.client_id,
                                                               self.id, bucket, scan_id, offset),
                                              self.name, bucket)
            bucket += 1

    async def _range(self, query: wire.RangeQuery) -> AsyncIterator[tuple[bytes, bytes]]:
        """A key range's raw (key, value) entries in range order, as the
        blocking client's irange: each service that stores a bucket of the
        DHT walks its own buckets in order and sends a page at a time, the
        first pages of all asked for at once; this merges them, asking a
        service for its next page (starting after the last key of the one
        before) only when its page before is used up."""
        await self._whole_dht()
        ids = self.cluster.ids
        channels = self._range_channels()
        replies = await self._exchange([(channel, wire.encode_range(ids.next(), ids.client_id,
                                                                    query))
                                        for channel in channels])
        order = _Descending if query.reverse else _ascending
        pages: list[tuple[wire.RangeQuery, list[tuple[bytes, bytes]], bool]] = []
        heads: list[tuple[Any, int, int]] = []      # (key order, service, position)
        for index, (channel, reply) in enumerate(zip(channels, replies)):
            entries, more = self._range_page(channel, reply)
            pages.append((query, entries, more))
            if entries:
                heads.append((order(entries[0][0]), index, 0))
        heapq.heapify(heads)
        while heads:
            _key, index, position = heapq.heappop(heads)
            page_query, entries, more = pages[index]
            yield entries[position]
            position += 1
            if position == len(entries):
                if not more:
                    continue
                page_query = codec.next_range_page(page_query, entries[-1][0])
                reply = await channels[index].request(
                    wire.encode_range(ids.next(), ids.client_id, page_query), self.name)
                entries, more = self._range_page(channels[index], reply)
                pages[index] = (page_query, entries, more)
                position = 0
                if not entries:
                    continue
            heapq.heappush(heads, (order(entries[position][0]), index, position))

    def _range_page(self, channel: Channel, reply: bytes
                    ) -> tuple[list[tuple[bytes, bytes]], bool]:
        if reply[2] != wire.ST_OK:
            raise self._error(reply, channel, None)
        return wire.decode_range_reply(reply)


def _ascending(key: bytes) -> bytes:
    return key


class _Descending:
    """A key ordered backwards, for a descending range's heap."""

    __slots__ = ("key",)

    def __init__(self, key: bytes) -> None:
        self.key = key

    def __lt__(self, other: _Descending) -> bool:
        return other.key < self.key
