"""The synchronous client: what a cluster job imports.

    import domus
    with domus.connect() as cluster:
        dht = cluster.create_dht("words")
        dht["apple"] = 3

A ``Dht`` is a ``MutableMapping``.  Keys are int, str or bytes; values are
anything msgpack encodes (tuples come back as lists).  Each operation is one
request to the service that stores the key's bucket, found by the DHT's
lookup strategy; the supervisor is asked only when a DHT is opened or its
layout changed.
"""

from __future__ import annotations

import heapq
from collections.abc import (
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    MutableMapping,
    ValuesView,
)
from operator import itemgetter
from typing import Any

from domus import address as addresses
from domus import batch, codec
from domus import protocol as wire
from domus.attributes import create_request
from domus.errors import (
    DhtInactive,
    DomusError,
    InvalidAttribute,
    RemoteError,
    ServiceUnavailable,
    StorageError,
    UnknownDht,
    ValueTooLarge,
    WrongService,
)
from domus.keys import decode_key
from domus.lookup import DirectLookup
from domus.transport import RequestIds, ServiceChannel, SupervisorLink, exchange

DEFAULT_TIMEOUT = 5.0
# Deactivation saves every record of a RAM DHT, activation loads them: the
# supervisor gives the services 600 s; the client waits a little longer.
STATE_CHANGE_TIMEOUT = 620.0
_MISSING = object()
_PUT = wire.OP_PUT
_GET = wire.OP_GET
_DELETE = wire.OP_DELETE
_CONTAINS = wire.OP_CONTAINS
_OK = wire.ST_OK
_NOT_FOUND = wire.ST_NOT_FOUND
_NOT_OWNER = wire.ST_NOT_OWNER
_MAX_VALUE_BYTES = wire.MAX_VALUE_BYTES
_HEADER = wire.REPLY_HEADER_SIZE
_keyed = codec.keyed
_pack_value = codec.pack_value
_unpack_value = codec.unpack_value
_entry_key = itemgetter(0)


def connect(address: str | None = None, *, timeout: float = DEFAULT_TIMEOUT) -> Cluster:
    """Connect to a deployment's supervisor: ``address`` (HOST:PORT), else
    $DOMUS_SUPERVISOR, else 127.0.0.1:7700.  ``timeout`` bounds every call:
    nothing waits longer before raising a clear error."""
    cluster = Cluster(addresses.supervisor_address(address), timeout)
    cluster.ping()
    return cluster


def move_target(routing: str | None, storage: str | None) -> tuple[str, str]:
    """The (role, service) of ``move_bucket(..., routing=, storage=)``."""
    if routing is not None and storage is None:
        return "routing", routing
    if storage is not None and routing is None:
        return "storage", storage
    raise TypeError("move_bucket() takes exactly one of routing=SERVICE and storage=SERVICE")


def reply_error(dht: str, reply: bytes, channel: Any, bucket: int | None) -> DomusError:
    """The domus.errors exception for an error reply from ``channel``
    (anything with ``name`` and ``address``) to a request on DHT ``dht``."""
    status = reply[2]
    text = reply[wire.REPLY_HEADER_SIZE:].decode("utf-8", "replace")
    where = f"service {channel.name} ({channel.address})"
    if status == wire.ST_UNKNOWN_DHT:
        return UnknownDht(f"DHT {dht!r} is not on {where} any more (destroyed?): {text}")
    if status == wire.ST_NOT_OWNER:
        return WrongService(f"{where}: {text}", status)
    if status == wire.ST_STORAGE_ERROR:
        return StorageError(f"{where}, bucket {bucket}: {text}", status)
    if status == wire.ST_INACTIVE:
        return DhtInactive(f"DHT {dht!r} is inactive: its records are kept, and served again "
                           f"once it is activated (cluster.activate_dht({dht!r}) or "
                           f"`domus dht activate {dht}`)", status)
    if status == wire.ST_TOO_LARGE:
        return ValueTooLarge(f"{where} refused the request: {text}")
    name = wire.STATUS_NAMES.get(status, f"status 0x{status:02x}")
    return RemoteError(f"{where} answered {name}: {text}", status)


class Cluster:
    """A connection to one Domus deployment."""

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.address = address
        self.timeout = timeout
        self.ids = RequestIds()
        self.supervisor = SupervisorLink(address, timeout, self.ids)
        self._channels: dict[tuple[str, str], ServiceChannel] = {}

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.supervisor.close()
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    def ping(self) -> dict[str, Any]:
        return self.supervisor.call("ping")

    def channel(self, name: str, address: str) -> ServiceChannel:
        """The (shared) channel to a service, by name and address."""
        key = (name, address)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = ServiceChannel(name, address, deadline=self.timeout)
        return channel

    # -- DHTs
    def create_dht(self, name: str, *, buckets: int | None = None, hash: str | None = None,
                   storage: str | None = None, platform: str | None = None,
                   routing: str | None = None, lookup: str | None = None,
                   durability: str | None = None,
                   routing_services: Iterable[str] | None = None,
                   storage_services: Iterable[str] | None = None) -> Dht:
        """Create a DHT and open it.  Attributes left out take their
        defaults (README, "DHT attributes"); service sets default to every live
        service."""
        attributes = create_request(name, buckets=buckets, hash=hash, storage=storage,
                                    platform=platform, routing=routing, lookup=lookup,
                                    durability=durability, routing_services=routing_services,
                                    storage_services=storage_services)
        descriptor = self.supervisor.call("create_dht", name=name, attributes=attributes,
                                          timeout=max(self.timeout, 15.0))
        return Dht(self, descriptor)

    def open_dht(self, name: str, *, lookup: str | None = None,
                 cache: float | None = None) -> Dht:
        """Open an existing DHT.  ``lookup`` and ``cache`` choose this
        client's lookup strategy (only "D" in this version)."""
        descriptor = self.supervisor.call("open_dht", name=name)
        if lookup is not None and lookup.replace(" ", "").upper() != "D":
            raise InvalidAttribute(f"lookup strategy {lookup!r} is not available in this "
                                   f"version; use 'D'")
        return Dht(self, descriptor)

    def list_dhts(self) -> list[dict[str, Any]]:
        return self.supervisor.call("list_dhts")

    def dht_info(self, name: str) -> dict[str, Any]:
        return self.supervisor.call("dht_info", name=name)

    def destroy_dht(self, name: str) -> None:
        self.supervisor.call("destroy_dht", name=name)

    def deactivate_dht(self, name: str) -> dict[str, int]:
        """Take a DHT offline on every service, keeping its records: a RAM
        DHT's are saved under the services' data dirs, then its memory is
        freed; a disk DHT's files are flushed and closed.  Requests to it
        raise DhtInactive until ``activate_dht``.  Returns the records kept
        per storage service.  All or nothing: if a service cannot (a full
        disk, a service down) the DHT stays active and SupervisorError says
        why."""
        return self.supervisor.call("deactivate_dht", name=name,
                                    timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))["records"]

    def activate_dht(self, name: str) -> dict[str, int]:
        """Bring a deactivated DHT back with every record; returns the
        records loaded per storage service (0 for disk DHTs, whose files are
        simply opened).  Activating an active DHT does nothing."""
        return self.supervisor.call("activate_dht", name=name,
                                    timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))["records"]

    def move_bucket(self, name: str, bucket: int, *, routing: str | None = None,
                    storage: str | None = None) -> dict[str, Any]:
        """Move one bucket's routing, or its storage, to the named service
        (give exactly one of ``routing`` and ``storage``).

        A storage move copies the bucket's records to the service and deletes
        them at the old one; requests on the bucket meanwhile are answered
        MOVING.  All or nothing: on any failure the bucket stays where it was
        with every record, and SupervisorError says why.  Returns the
        supervisor's answer: ``name, bucket, role, from, to, changed``
        (False if the service held the bucket already), ``records`` (moved;
        None for routing), ``seconds``, and ``lagging`` (services that missed
        the new layout and get it when they next register)."""
        role, service = move_target(routing, storage)
        return self.supervisor.call("move_bucket", name=name, bucket=bucket, role=role,
                                    service=service,
                                    timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))

    def services(self) -> list[dict[str, Any]]:
        """Every registered service: name, address, state ("up",
        "unresponsive", "down"), roles, buckets per DHT, resources, load."""
        return self.supervisor.call("services")

    def status(self) -> dict[str, Any]:
        return self.supervisor.call("status")


class Dht(DirectLookup[ServiceChannel], MutableMapping):
    """One DHT, used like a dict."""

    def refresh(self) -> None:
        """Fetch the DHT's layout from the supervisor again."""
        self._stats["refreshes"] += 1
        try:
            descriptor = self.cluster.supervisor.call("open_dht", name=self.name)
        except UnknownDht:
            raise UnknownDht(f"DHT {self.name!r} no longer exists (destroyed?); "
                             f"create or open it again") from None
        self._load(descriptor)

    # ------------------------------------------------------------ single keys
    def _request(self, op: int, key: Any, value: bytes | None = None) -> bytes:
        """One keyed request (``value``: a PUT's packed value); returns its
        reply.  Retries once after refreshing the layout if the service says
        the bucket moved, or if it does not answer and the supervisor says
        the bucket's owner changed."""
        ids = self.cluster.ids
        message, bucket = _keyed(op, ids.next(), ids.client_id, self.id, self._hasher,
                                 self._shift, key, value)
        self._stats["lookups"] += 1
        channel = self._owners[bucket]
        try:
            reply = channel.request(message, self.name, bucket)
        except ServiceUnavailable:
            if not self._owner_moved(bucket, channel):
                raise
        else:
            if reply[2] <= _NOT_FOUND:
                self._stats["hits"] += 1
                return reply
            if reply[2] != _NOT_OWNER:
                raise self._error(reply, channel, bucket)
            self._stats["misses"] += 1
            self.refresh()
        # Once more, with the new layout.
        message, bucket = _keyed(op, ids.next(), ids.client_id, self.id, self._hasher,
                                 self._shift, key, value)
        channel = self._owners[bucket]
        reply = channel.request(message, self.name, bucket)
        if reply[2] <= _NOT_FOUND:
            self._stats["hits"] += 1
            return reply
        raise self._error(reply, channel, bucket)

    def _owner_moved(self, bucket: int, channel: ServiceChannel) -> bool:
        """After a service failed to answer: ask the supervisor whether the
        bucket's owner is now elsewhere (e.g. the service re-registered at a
        new address).  False if not, or if the supervisor cannot say."""
        try:
            self.refresh()
        except DomusError:
            return False
        return self._owners[bucket] is not channel

    def _error(self, reply: bytes, channel: ServiceChannel, bucket: int | None) -> DomusError:
        return reply_error(self.name, reply, channel, bucket)

    def put(self, key: Any, value: Any) -> bool:
        """Store ``value`` under ``key``; True if the key was new."""
        packed = _pack_value(value)
        if len(packed) > _MAX_VALUE_BYTES:
            raise ValueTooLarge(f"value is {len(packed)} bytes encoded, over the "
                                f"{_MAX_VALUE_BYTES}-byte limit; split it")
        return self._request(_PUT, key, packed)[-1:] == b"\x01"

    __setitem__ = put  # type: ignore[assignment]

    def __getitem__(self, key: Any) -> Any:
        reply = self._request(_GET, key)
        if reply[2] == _NOT_FOUND:
            raise KeyError(key)
        return _unpack_value(reply, _HEADER)

    def get(self, key: Any, default: Any = None) -> Any:
        reply = self._request(_GET, key)
        if reply[2] == _NOT_FOUND:
            return default
        return _unpack_value(reply, _HEADER)

    def delete(self, key: Any) -> bool:
        """Remove ``key``; True if it was there."""
        return self._request(_DELETE, key)[2] == _OK

    def __delitem__(self, key: Any) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def __contains__(self, key: object) -> bool:
        return self._request(_CONTAINS, key)[2] == _OK

    # ------------------------------------------------------------ batches
    def put_many(self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> int:
        """Store many records, one message per service where they fit in a
        datagram (more where they do not), pipelined.  Returns how many keys
        were new.  Either every key and value is valid and all are sent, or
        none is."""
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        keys, values = batch.encode_pairs(pairs)
        batch.check_values(values)
        self._stats["lookups"] += len(keys)
        created = 0
        for attempt in (1, 2):
            requests = self._put_many_requests(keys, values)
            replies = exchange(requests, self.name)
            applied, new, moved = batch.put_replies(requests, replies, self._batch_error,
                                                    last_try=attempt == 2)
            self._stats["hits"] += applied
            created += new
            if not moved:
                break
            # Some service no longer holds some buckets: refresh and send again
            # (re-putting the records that did land is harmless).
            self._stats["misses"] += 1
            self.refresh()
        return created

    def get_many(self, keys: Iterable[Any]) -> dict[Any, Any]:
        """Values of the keys that are present (absent keys are left out)."""
        wanted = list(keys)
        state = batch.GetMany(wanted, codec.encode_keys(wanted))
        self._stats["lookups"] += len(wanted)
        misses = 0
        while state.pending:
            requests, batches = self._get_many_requests(state)
            replies = exchange(requests, self.name)
            if state.take(requests, batches, replies, self._batch_error):
                misses += 1
                if misses > 1:
                    raise WrongService(f"DHT {self.name!r}: services disagree with the "
                                       f"supervisor about bucket owners; retry shortly")
                self._stats["misses"] += 1
                self.refresh()
        self._stats["hits"] += state.answered
        return state.found

    def _batch_error(self, reply: bytes, channel: ServiceChannel) -> DomusError:
        return reply_error(self.name, reply, channel, None)

    # ------------------------------------------------------------ whole DHT
    def __len__(self) -> int:
        return sum(self.records_by_service().values())

    def records_by_service(self) -> dict[str, int]:
        """How many records each storage service holds of this DHT."""
        ids = self.cluster.ids
        requests = [(channel, wire.encode_length(ids.next(), ids.client_id, self.id))
                    for channel in self._storage_channels]
        counts = {}
        for (channel, _message), reply in zip(requests, exchange(requests, self.name)):
            if reply[2] != _OK:
                raise self._error(reply, channel, None)
            counts[channel.name] = wire.U64.unpack_from(reply, wire.REPLY_HEADER_SIZE)[0]
        return counts

    def _scan(self) -> Iterator[tuple[bytes, bytes]]:
        """Every record, bucket by bucket, as raw (key, value) bytes."""
        ids = self.cluster.ids
        for bucket in range(self.bucket_count):
            channel = self._owners[bucket]
            scan_id, offset = 0, 0
            while True:
                reply = channel.request(wire.encode_scan(ids.next(), ids.client_id, self.id,
                                                         bucket, scan_id, offset),
                                        self.name, bucket)
                if reply[2] != _OK:
                    raise self._error(reply, channel, bucket)
                scan_id, offset, entries = codec.decode_scan_reply(reply)
                yield from entries
                if offset == wire.SCAN_END:
                    break

    def __iter__(self) -> Iterator[Any]:
        for key, _value in self._scan():
            yield decode_key(key)

    def keys(self) -> KeysView:
        return KeysView(self)

    def items(self) -> ItemsView:
        return _ScanItems(self)

    def values(self) -> ValuesView:
        return _ScanValues(self)

    def clear(self) -> None:
        keys = list(self)
        for key in keys:
            self.delete(key)

    # ------------------------------------------------------------ key ranges
    def irange(self, lo: Any = None, hi: Any = None, *,
               inclusive: tuple[bool, bool] = (True, True), reverse: bool = False,
               items: bool = False) -> Iterator[Any]:
        """An iterator over the keys from ``lo`` to ``hi`` (None: unbounded)
        in key order, or over (key, value) pairs if ``items``; descending if
        ``reverse``.  ``inclusive`` says whether each bound belongs to the
        range.  Needs a DHT on an ordered platform (``domus-rbt``); on any
        other the first ``next()`` raises RemoteError saying so.

        Key order is the order of encoded keys: every int before every str
        before every bytes; ints by value, str by code point, bytes bytewise.
        Bounds are keys of any of the three kinds and need not be stored:
        ``irange(b"")`` is every bytes key, ``irange("", b"", inclusive=(True,
        False))`` every str key.

        Each storage service walks its own buckets in order and sends a page
        at a time; this merges the services' pages.  A page is asked for
        only when the previous one from that service is used up, and the
        first pages of all services are asked for at once.

        Not a snapshot: while other clients write, every key present for the
        whole iteration is yielded exactly once, and keys come strictly in
        order (each service continues after the last key it sent); a key
        written or deleted meanwhile may or may not be seen.  Argument errors
        (a bound that is not a key) are raised here, at once."""
        low = None if lo is None else codec.encode_key(lo)
        high = None if hi is None else codec.encode_key(hi)
        if not (isinstance(inclusive, tuple) and len(inclusive) == 2):
            raise TypeError("irange(): inclusive must be a tuple of two bools, "
                            "e.g. (True, False)")
        query = wire.RangeQuery(self.id, low, high, bool(inclusive[0]), bool(inclusive[1]),
                                bool(reverse), not items)
        return self._irange(query, bool(items))

    def _irange(self, query: wire.RangeQuery, items: bool) -> Iterator[Any]:
        ids = self.cluster.ids
        channels = self._range_channels()
        first = exchange([(channel, wire.encode_range(ids.next(), ids.client_id, query))
                          for channel in channels], self.name)
        pages = [self._range_pages(channel, query, reply)
                 for channel, reply in zip(channels, first)]
        merged = heapq.merge(*pages, key=_entry_key, reverse=query.reverse)
        if items:
            for key, value in merged:
                yield decode_key(key), _unpack_value(value, 0)
        else:
            for key, _value in merged:
                yield decode_key(key)

    def _range_channels(self) -> list[ServiceChannel]:
        """Each service that stores at least one bucket of the DHT now
        (moved buckets included), once."""
        return list(dict.fromkeys(channel for _first, _end, channel in self.layout.ranges()))

    def _range_pages(self, channel: ServiceChannel, query: wire.RangeQuery,
                     reply: bytes) -> Iterator[tuple[bytes, bytes]]:
        """One service's part of a range, as raw (key, value) entries in
        range order, from its first reply on; each further page starts after
        the last key of the one before."""
        ids = self.cluster.ids
        while True:
            if reply[2] != _OK:
                raise self._error(reply, channel, None)
            entries, more = wire.decode_range_reply(reply)
            yield from entries
            if not more:
                return
            last = entries[-1][0]
            if query.reverse:
                query = query._replace(high=last, high_inclusive=False)
            else:
                query = query._replace(low=last, low_inclusive=False)
            reply = channel.request(wire.encode_range(ids.next(), ids.client_id, query),
                                    self.name)


class _ScanItems(ItemsView):
    """items() in one scan, not one get per key."""

    _mapping: Dht

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        for key, value in self._mapping._scan():
            yield decode_key(key), _unpack_value(value, 0)


class _ScanValues(ValuesView):
    _mapping: Dht

    def __iter__(self) -> Iterator[Any]:
        for _key, value in self._mapping._scan():
            yield _unpack_value(value, 0)


__all__ = ["connect", "Cluster", "Dht"]
