"""The synchronous client: what a cluster job imports.

    import domus
    with domus.connect() as cluster:
        dht = cluster.create_dht("words")
        dht["apple"] = 3

A ``Dht`` is a ``MutableMapping``.  Keys are int, str, bytes or tuples of
those; values are anything the DHT's codec encodes (msgpack by default,
where tuples come back as lists; ``codec="pickle"`` or ``"raw"``).  Each operation is one
request to the service that stores the key's bucket, found by the DHT's
lookup strategy; the supervisor is asked only when a DHT is opened or its
layout changed.
"""

from __future__ import annotations

import functools
import heapq
import threading
import time
from collections.abc import (
    Callable,
    Generator,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    MutableMapping,
    Sequence,
    ValuesView,
)
from operator import itemgetter
from typing import Any

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
from domus.client.transport import (
    REPLICATED_SPIN,
    RequestIds,
    ServiceChannel,
    SupervisorLink,
    exchange,
    fork_aware,
    reply_value,
    stored_digest,
)
from domus.errors import (
    DomusError,
    ServiceUnavailable,
    UnknownDht,
    ValueDecodeError,
)
from domus.wire import address as addresses
from domus.wire import protocol as wire
from domus.wire import secret
from domus.wire.attributes import check_strategy, create_request
from domus.wire.keys import decode_key

DEFAULT_TIMEOUT = 5.0
FAILOVER_POLL = 0.1      # seconds between asking the supervisor who took over a bucket
# Deactivation saves every record of a RAM DHT, activation loads them: the
# supervisor gives the services 600 s; the client waits a little longer.
STATE_CHANGE_TIMEOUT = 620.0
# A creation waits for every service's acknowledgement (the supervisor's
# --push-timeout, 10 s by default); an open or an exist_ok creation may
# wait for one in flight first.
CREATE_TIMEOUT = 30.0
_PUT = wire.OP_PUT
_GET = wire.OP_GET
_DELETE = wire.OP_DELETE
_CONTAINS = wire.OP_CONTAINS
_PUT_IF_ABSENT = wire.OP_PUT_IF_ABSENT
_DELETE_IF = wire.OP_DELETE_IF
_OK = wire.ST_OK
_NOT_FOUND = wire.ST_NOT_FOUND
_NOT_OWNER = wire.ST_NOT_OWNER
_MAX_VALUE_BYTES = wire.MAX_VALUE_BYTES
_HEADER = wire.REPLY_HEADER_SIZE
_keyed = codec.keyed_message
_pack_value = codec.pack_value
_unpack_value = codec.unpack_value
_value_of = codec.value_of
_entry_key = itemgetter(0)


def connect(address: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
            secret_file: str | None = None) -> Cluster:
    """Connect to a deployment's supervisor: ``address`` (HOST:PORT), else
    $DOMUS_SUPERVISOR, else 127.0.0.1:7700.  ``timeout`` bounds every call:
    nothing waits longer before raising a clear error.  ``secret_file``: the
    deployment secret (default: $DOMUS_SECRET_FILE, then
    ./domus-data/supervisor/secret; see domus.wire.secret); a wrong or
    missing one raises AuthenticationError saying so."""
    cluster = Cluster(addresses.supervisor_address(address), timeout,
                      secret_file=secret_file)
    try:
        cluster.ping()
    except BaseException:
        cluster.close()
        raise
    return cluster


def move_target(routing: str | None, storage: str | None) -> tuple[str, str]:
    """The (role, service) of ``move_bucket(..., routing=, storage=)``."""
    if routing is not None and storage is None:
        return "routing", routing
    if storage is not None and routing is None:
        return "storage", storage
    raise TypeError("move_bucket() takes exactly one of routing=SERVICE and storage=SERVICE")


class Cluster:
    """A connection to one Domus deployment."""

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT, *,
                 secret_file: str | None = None) -> None:
        if (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                or not 0 < timeout < float("inf")):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        self.address = address
        self.timeout = timeout
        self.ids = RequestIds()
        self.keys = secret.keys(secret_file)
        self.supervisor = SupervisorLink(address, timeout, self.ids, self.keys)
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

    @property
    def secure(self) -> bool:
        """Whether the deployment authenticates this client (has a secret)."""
        return self.supervisor.secure

    def channel(self, name: str, address: str) -> ServiceChannel:
        """The (shared) channel to a service, by name and address."""
        key = (name, address)
        channel = self._channels.get(key)
        if channel is None:
            # (a deployment run --insecure takes no MACs, whatever secret
            # this process found at the default path)
            keys = self.keys if self.supervisor.secure else None
            made = ServiceChannel(name, address, deadline=self.timeout, keys=keys)
            # Two threads may make it at once: both use the first one kept.
            channel = self._channels.setdefault(key, made)
            if channel is not made:
                made.close()
        return channel

    # -- DHTs
    def create_dht(self, name: str, *, buckets: int | None = None, hash: str | None = None,
                   storage: str | None = None, platform: str | None = None,
                   routing: str | None = None, routing_degree: int | None = None,
                   routing_algorithm: str | None = None, lookup: str | None = None,
                   durability: str | None = None, replicas: int | None = None,
                   routing_services: Iterable[str] | None = None,
                   storage_services: Iterable[str] | None = None,
                   codec: str | None = None, exist_ok: bool = False) -> Dht:
        """Create a DHT and open it.  Attributes left out take their
        defaults (README, "DHT attributes"); service sets default to every live
        service.  ``exist_ok``: a DHT of that name with these attributes
        (its bucket count and service sets only where given) is opened
        instead, one being created is waited for, and one with other
        attributes raises DhtExists naming them; so every task of a job may
        call it."""
        attributes = create_request(name, buckets=buckets, hash=hash, storage=storage,
                                    platform=platform, routing=routing,
                                    routing_degree=routing_degree,
                                    routing_algorithm=routing_algorithm, lookup=lookup,
                                    durability=durability, replicas=replicas,
                                    routing_services=routing_services,
                                    storage_services=storage_services, codec=codec)
        extra = {"exist_ok": True} if exist_ok else {}
        descriptor = self.supervisor.call("create_dht", name=name, attributes=attributes,
                                          timeout=max(self.timeout, CREATE_TIMEOUT), **extra)
        return Dht(self, descriptor)

    def open_dht(self, name: str, *, lookup: str | None = None, cache: float | None = None,
                 direct_cutoff: int | None = None) -> Dht:
        """Open an existing DHT.  ``lookup`` is this client's lookup strategy
        ("D", "D,C,R", "C,R" or "R"; default: the DHT's own), ``cache`` the
        size of its lookup cache as a fraction of the bucket count (default
        0.5), ``direct_cutoff`` the direct misses after which it stops using
        direct lookups (default 8; domus.client.lookup says more).  A DHT
        being created is waited for."""
        if lookup is not None:
            check_strategy(lookup)
        descriptor = self.supervisor.call("open_dht", name=name,
                                          timeout=max(self.timeout, CREATE_TIMEOUT))
        return Dht(self, descriptor, lookup=lookup, cache=cache, direct_cutoff=direct_cutoff)

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

    def rebalance(self, name: str, dry_run: bool = False) -> list[dict[str, Any]]:
        """Move DHT ``name``'s buckets to their targets now (the balancer's
        plan, without its waits and budgets), one move after the other, each
        all or nothing; with ``dry_run``, only say which.  Returns the moves:
        ``bucket, role, source, target, records, why``."""
        return self.supervisor.call("rebalance", name=name, dry_run=dry_run,
                                    timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))["moves"]

    def resize_dht(self, name: str, buckets: int) -> dict[str, Any]:
        """Change DHT ``name``'s bucket count to ``buckets`` (a power of two),
        doubling or halving a step at a time, while its clients read and
        write (they learn the new count from their replies).  Returns
        ``name, from, buckets, steps, seconds``.  A step that fails leaves
        the DHT at the count it had before that step, every record kept,
        and SupervisorError says why."""
        return self.supervisor.call("resize_dht", name=name, buckets=buckets,
                                    timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))

    def dht_services(self, name: str, *, add: Sequence[str] = (), remove: Sequence[str] = (),
                     roles: Sequence[str] = ("routing", "storage")) -> list[dict[str, Any]]:
        """Change the services DHT ``name`` is listed on, for ``roles``:
        those in ``add`` get their share of its buckets, those in ``remove``
        give theirs away and are taken off; the changed roles stop following
        the deployment.  Returns the moves made (as ``rebalance``)."""
        return self.supervisor.call("dht_services", name=name, add=list(add),
                                    remove=list(remove), roles=list(roles),
                                    timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))["moves"]

    def drain_service(self, name: str) -> dict[str, Any]:
        """Move every bucket off service ``name``; returns once it holds
        none: ``drained, moves, records``.  It gets none back until it is
        removed (``remove_service``) and registers anew."""
        return self.supervisor.call("drain_service", name=name,
                                    timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))

    def remove_service(self, name: str, force: bool = False) -> dict[str, Any]:
        """Take a service that holds no bucket out of the deployment (and
        tell it to stop); one that still holds buckets is refused: drain it
        first.  With ``force`` its buckets go, empty, to the other services
        and its records are lost (``lost_records`` says how many it last
        reported): for a service that is gone for good."""
        return self.supervisor.call("remove_service", name=name, force=force,
                                    timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))

    def accept_loss(self, name: str) -> list[int]:
        """Accept that DHT ``name``'s lost buckets (every copy gone with a
        service) lost their records: they serve again, empty, instead of
        raising DataLost.  Returns the buckets accepted."""
        return self.supervisor.call("accept_loss", name=name)["accepted"]

    def balancer_status(self) -> dict[str, Any]:
        """The balancer's mode, knobs, what it is doing, and its last
        decisions with their reasons."""
        return self.supervisor.call("balancer_status")

    def services(self) -> list[dict[str, Any]]:
        """Every registered service: name, address, state ("up",
        "unresponsive", "down"), roles, buckets per DHT, resources, load."""
        return self.supervisor.call("services")

    def status(self) -> dict[str, Any]:
        return self.supervisor.call("status")

    def discard_dht(self, service: str, dht_id: int) -> dict[str, Any]:
        """Delete, on service ``service``, the DHT with id ``dht_id`` that it
        holds and the supervisor does not know (``services()[i]
        ["unknown_dhts"]``: of another deployment, or one a supervisor
        restarted on another data dir forgot).  A DHT of the deployment is
        refused: destroy it with ``destroy_dht``.  Returns what was
        discarded: ``service, id, name, deployment, stamp, records``."""
        return self.supervisor.call("discard_dht", service=service, id=dht_id,
                                    timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))


class Dht(DirectLookup[ServiceChannel], MutableMapping):
    """One DHT, used like a dict, from any number of threads.

    Requests of different threads go out side by side, each on its
    thread's own sockets (domus.client.transport); what threads share is
    the layout, which a refresh replaces while others read it.  Fetches are
    serialised (``_fetching``): a thousand requests told NOT_OWNER at once
    cause one fetch, not a thousand.  A request that met a layout half
    replaced (an index past a table of another bucket count) waits for the
    fetch to end and starts again.  The lookup counters are not locked:
    under many threads they may miss a few counts."""

    def __init__(self, cluster: Any, descriptor: dict[str, Any], **options: Any) -> None:
        self._fetching = threading.Lock()
        self._begun = 0                 # layout fetches begun (under _fetching)
        self._loads = 0                 # layouts being or been loaded
        super().__init__(cluster, descriptor, **options)
        fork_aware(self)

    def _after_fork(self) -> None:
        self._fetching = threading.Lock()   # (a parent's thread may have held it)

    def _value_of(self, key: Any, data: bytes, offset: int) -> Any:
        """The value of ``key`` stored as ``data[offset:]``, by this DHT's
        codec; a ValueDecodeError names the DHT and the key."""
        try:
            return reply_value(self._values, data, offset)
        except ValueDecodeError as exc:
            raise exc.with_key(key).with_dht(self.name) from None

    def _load(self, descriptor: dict[str, Any]) -> None:
        self._loads += 1
        super()._load(descriptor)

    def _layout_mark(self) -> int:
        return self._begun

    def refresh(self) -> None:
        """Fetch the DHT's layout from the supervisor again."""
        self._layout_after(self._begun)

    def _layout_after(self, mark: int) -> None:
        """A layout whose fetch began after ``mark`` (a past ``_begun``):
        one another thread fetched meanwhile, or else a new one."""
        with self._fetching:
            if self._begun > mark:
                return
            self._begun += 1
            try:
                self._fetch()
            except BaseException:
                self._begun -= 1
                raise

    def _fetch(self) -> None:
        self._counters["refreshes"] += 1
        try:
            descriptor = self.cluster.supervisor.call("open_dht", name=self.name)
        except UnknownDht:
            raise UnknownDht(f"DHT {self.name!r} no longer exists (destroyed?); "
                             f"create or open it again") from None
        self._load(descriptor)

    def _reloaded(self, loads: int) -> bool:
        """Whether a layout was loaded since ``loads`` (a past ``_loads``);
        if so, once that load has ended."""
        if self._loads == loads:
            return False
        with self._fetching:
            return True

    def _refresh_soon(self) -> None:
        """(A reply told of a newer layout: fetch it now; if the supervisor
        cannot be reached, redirects still lead the way.)"""
        try:
            self.refresh()
        except UnknownDht:
            raise
        except DomusError:
            pass

    # ------------------------------------------------------------ single keys
    def _request(self, op: int, key: Any, value: Any = None) -> bytes:
        loads = self._loads
        try:
            return self._keyed_request(op, key, value)
        except IndexError:
            if not self._reloaded(loads):
                raise
            return self._request(op, key, value)   # (another thread's refresh: anew)

    def _keyed_request(self, op: int, key: Any, value: Any = None) -> bytes:
        """One keyed request (``value``: a PUT's packed value); returns its
        reply.  The first method of the lookup strategy answers at once when
        it can (a direct table, a cached entry); anything else (a miss, a
        distributed lookup, a bucket being moved) takes the course that
        domus.client.lookup lays out."""
        ids = self.cluster.ids
        count = self.bucket_count
        message, bucket = _keyed(op, ids.next(), ids.client_id, self.id, self._hasher,
                                 self._shift, key, value)
        first = None
        skip = 0
        unsent = None
        channel = self._first_channel(bucket)
        if channel is None:
            walk = self._first_walk(bucket)
            if walk is not None:
                channel = self._first_walked(self._drive(walk))
                skip = channel is None
        if channel is None:
            unsent = message
        else:
            self._counters["messages"] += 1
            try:
                reply = channel.request(message, self.name, bucket,
                                        REPLICATED_SPIN if self.replicated
                                        and op in wire.CHANGING_OPS else None)
            except ServiceUnavailable:
                if not self._owner_moved(bucket, channel, count):
                    raise
                # Sent again as it was: a copy that took it from the dead
                # primary answers it from its reply cache, applying it once.
                unsent = message
            else:
                if self._first_answer(channel, reply, bucket):
                    return reply
                first = (channel, reply)
        encode = self._encoder(op, key, value, unsent, message)
        rerouted = 0
        while True:
            try:
                return self._drive(self._course(encode, bucket, first, skip=skip,
                                             count=count))
            except Renumbered:          # the DHT was resized: hash the key anew
                return self._keyed_request(op, key, value)
            except ServiceUnavailable as exc:
                rerouted += 1
                if rerouted > MAX_REROUTES:
                    raise
                # (The service it went to is gone and the bucket stored
                # elsewhere now: drained and removed, or a replicated
                # bucket's primary died and its backup was promoted.  Sent
                # again as it was.)
                dead = self.cluster.channel(exc.service, exc.address) if exc.service else None
                if dead is None or not self._owner_moved(bucket, dead, count):
                    raise
                encode = self._encoder(op, key, value, encode.last)
                first, skip = None, 0
                if self.bucket_count == count and encode.last is not None:
                    # Straight to where the layout says the bucket is now
                    # (the course's routing services may still name the
                    # service that is gone); the course takes a refusal on.
                    owner = self._owners[bucket]
                    try:
                        reply = owner.request(encode.last, self.name, bucket)
                    except ServiceUnavailable:
                        continue
                    if self._first_answer(owner, reply, bucket):
                        return reply
                    first = (owner, reply)

    def _drive(self, course: Generator[tuple[Any, ...], Any, Any]) -> Any:
        """Run a course (domus.client.lookup) to its end with blocking I/O."""
        result: Any = None
        try:
            instruction = next(course)
            while True:
                kind = instruction[0]
                try:
                    if kind == SEND:
                        self._counters["messages"] += 1
                        result = instruction[1].request(instruction[2], self.name,
                                                        instruction[3])
                    elif kind == PAUSE:
                        time.sleep(instruction[1])
                        result = None
                    else:
                        self._layout_after(instruction[1])
                        result = None
                except DomusError as exc:
                    instruction = course.throw(exc)
                    continue
                instruction = course.send(result)
        except StopIteration as stop:
            return stop.value

    def _drive_all(self, courses: dict[int, Generator[tuple[Any, ...], Any, Any]]
                   ) -> dict[int, Any]:
        """Run many courses that only send, side by side: each round sends
        every course's next message at once.  Returns each one's result."""
        results: dict[int, Any] = {}
        waiting: dict[int, tuple[Any, ...]] = {}

        def advance(bucket: int, step: Callable[[], tuple[Any, ...]]) -> None:
            try:
                waiting[bucket] = step()
            except StopIteration as stop:
                results[bucket] = stop.value

        for bucket, course in courses.items():
            advance(bucket, course.__next__)
        while waiting:
            round_ = list(waiting.items())
            waiting.clear()
            try:
                replies = exchange([(sent[1], sent[2]) for _bucket, sent in round_], self.name)
            except DomusError:
                replies = None   # a service is down: one by one, so only its courses see it
            for index, (bucket, sent) in enumerate(round_):
                course = courses[bucket]
                if replies is not None:
                    advance(bucket, functools.partial(course.send, replies[index]))
                    continue
                try:
                    reply = sent[1].request(sent[2], self.name, sent[3])
                except DomusError as exc:
                    advance(bucket, functools.partial(course.throw, exc))
                else:
                    advance(bucket, functools.partial(course.send, reply))
        return results

    def _owner_moved(self, bucket: int, channel: ServiceChannel, count: int) -> bool:
        """After a service failed to answer: ask the supervisor whether the
        owner of ``bucket`` (numbered out of ``count``) is now elsewhere
        (the service re-registered at a new address; a replicated DHT's
        backup took over from it, which the supervisor decides within
        seconds: asked again until the client's deadline; the DHT was
        resized).  False if not, or if the supervisor cannot say."""
        patience = channel.deadline if self.replicated else 0.0
        started = time.monotonic()
        self._forget_channel(channel)
        while True:
            try:
                self.refresh()
            except DomusError:
                return False
            if self.bucket_count != count or self._owners[bucket] is not channel:
                return True
            if time.monotonic() - started >= patience:
                return False
            time.sleep(FAILOVER_POLL)

    def put(self, key: Any, value: Any) -> bool:
        """Store ``value`` under ``key``; True if the key was new."""
        return self._request(_PUT, key, self._packed(value))[-1:] == b"\x01"

    __setitem__ = put  # type: ignore[assignment]

    def setdefault(self, key: Any, default: Any = None) -> Any:
        """The value of ``key``; if it is not there, ``default``, stored
        under it.  One step on the service (PUT_IF_ABSENT): of clients
        setting a default for the same key at once, one stores its own and
        every other gets that one, never overwrites it."""
        packed = self._packed(default)
        while True:
            if self._request(_PUT_IF_ABSENT, key, packed)[-1:] == b"\x01":
                return default
            reply = self._request(_GET, key)
            if reply[2] != _NOT_FOUND:
                return self._value_of(key, reply, _HEADER)
            # (deleted since: set it again)

    def __getitem__(self, key: Any) -> Any:
        reply = self._request(_GET, key)
        if reply[2] == _NOT_FOUND:
            raise KeyError(key)
        return self._value_of(key, reply, _HEADER)

    def get(self, key: Any, default: Any = None) -> Any:
        reply = self._request(_GET, key)
        if reply[2] == _NOT_FOUND:
            return default
        return self._value_of(key, reply, _HEADER)

    def delete(self, key: Any) -> bool:
        """Remove ``key``; True if it was there."""
        return self._request(_DELETE, key)[2] == _OK

    def __delitem__(self, key: Any) -> None:
        if not self.delete(key):
            raise KeyError(key)

    def pop(self, key: Any, default: Any = MISSING) -> Any:
        """Remove ``key`` and return its value; ``default`` if it is not
        there (KeyError without one).  The value is read, then deleted on
        the service only if it is still the value read (DELETE_IF): a value
        another client writes in between is read in its turn, never deleted
        unseen, and of clients popping one key at once exactly one gets its
        value (the others ``default``, or KeyError)."""
        while True:
            reply = self._request(_GET, key)
            if reply[2] == _NOT_FOUND:
                break
            value = self._value_of(key, reply, _HEADER)
            answer = self._request(_DELETE_IF, key, stored_digest(reply))
            if answer[2] == _NOT_FOUND:
                break
            if answer[-1:] == b"\x01":
                return value
            # (another value since: read it)
        if default is MISSING:
            raise KeyError(key)
        return default

    def __contains__(self, key: object) -> bool:
        return self._request(_CONTAINS, key)[2] == _OK

    # ------------------------------------------------------------ batches
    def _batch_owners(self, keys: list[bytes]) -> Any:
        """bucket -> storage channel for a batch of encoded keys, by the
        lookup strategy: the direct table as it is, else cached entries and
        distributed lookups (side by side) for the buckets not cached."""
        owners, missing = self._batch_plan(keys)
        if not missing:
            return owners
        found = self._drive_all({bucket: self._locating(bucket) for bucket in missing})
        return self._batch_found(owners, missing, [found[bucket] for bucket in missing])

    def _settled_owners(self, keys: list[bytes]) -> tuple[Any, int]:
        """``_batch_owners`` and the ``_loads`` they were found with, found
        again if another thread's refresh replaced the layout meanwhile."""
        while True:
            loads = self._loads
            try:
                return self._batch_owners(keys), loads
            except IndexError:
                if not self._reloaded(loads):
                    raise

    def _before_next_round(self, moved: int, moving: bool, rounds: dict[str, Any]) -> None:
        for step in self._batch_retry(moved, moving, rounds):
            if step[0] == PAUSE:
                time.sleep(step[1])
            else:
                self._layout_after(step[1])
        rounds["mark"] = self._layout_mark()

    def put_many(self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> int:
        """Store many records, one message per service where they fit in a
        datagram (more where they do not), pipelined.  Returns how many keys
        were new.  Either every key and value is valid and all are sent, or
        none is."""
        pairs = list(items.items() if isinstance(items, Mapping) else items)
        keys, values = batch.encode_pairs(pairs, self._values)
        batch.check_values(values)
        owners, loads = self._settled_owners(keys)
        created = 0
        rounds = self._batch_rounds()
        replies: list[bytes] | None = []
        while keys:
            try:
                requests = batch.put_requests(keys, values, self._hasher, self._shift, owners,
                                              self.id, self.cluster.ids)
            except IndexError:
                if not self._reloaded(loads):
                    raise
                loads, owners = self._loads, self._owners   # (another thread's refresh)
                continue
            replies = self._exchange(requests)
            if replies is None:             # a primary died: its backup took over
                owners = self._owners
                continue
            new, keys, values, moved, moving = self._put_round(requests, replies)
            created += new
            if keys:
                self._before_next_round(moved, moving, rounds)
                owners = self._owners
        self._batch_seen(replies or [])
        return created

    def get_many(self, keys: Iterable[Any]) -> dict[Any, Any]:
        """Values of the keys that are present (absent keys are left out)."""
        wanted = list(keys)
        state = batch.GetMany(wanted, codec.encode_keys(wanted))
        owners, loads = self._settled_owners(state.encoded)
        rounds = self._batch_rounds()
        replies: list[bytes] | None = []
        while state.pending:
            try:
                requests, batches = state.requests(self._hasher, self._shift, owners, self.id,
                                                   self.cluster.ids)
            except IndexError:
                if not self._reloaded(loads):
                    raise
                loads, owners = self._loads, self._owners   # (another thread's refresh)
                continue
            replies = self._exchange(requests)
            if replies is None:             # a primary died: its backup took over
                owners = self._owners
                continue
            try:
                moved = state.take(requests, batches, replies, self._batch_error,
                                   self._values.take)
            except ValueDecodeError as exc:
                raise exc.with_dht(self.name) from None
            if moved or state.moving:
                self._before_next_round(moved, state.moving, rounds)
                owners = self._owners
        self._batch_seen(replies or [])
        return state.found

    def _exchange(self, requests: list[tuple[ServiceChannel, bytes]]) -> list[bytes] | None:
        """A batch's round trip; None when a service it went to is gone and
        its buckets are stored elsewhere now (a replicated bucket's backup
        took over, or the service was drained and removed): the batch goes
        again, its changes applying the same values again."""
        try:
            return exchange(requests, self.name)
        except ServiceUnavailable as exc:
            if not exc.service:
                raise
            dead = self.cluster.channel(exc.service, exc.address)
            bucket = self._dead_service(dead)
            if bucket is not None and not self._owner_moved(bucket, dead, self.bucket_count):
                raise
            return None

    def _batch_error(self, reply: bytes, channel: ServiceChannel) -> DomusError:
        return reply_error(self.name, reply, channel, None)

    # ------------------------------------------------------------ whole DHT
    def __len__(self) -> int:
        return sum(self.records_by_service().values())

    def _whole_dht(self) -> None:
        """Before an operation on the whole DHT (len, scans, key ranges): the
        layout as the supervisor knows it now, so that a service buckets
        moved to since this handle was opened is not left out.  With the
        supervisor unreachable, the layout this handle has."""
        try:
            self.refresh()
        except UnknownDht:
            raise
        except DomusError:
            pass

    def records_by_service(self) -> dict[str, int]:
        """How many records each storage service holds of this DHT."""
        self._whole_dht()
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
        """Every record, bucket by bucket, as raw (key, value) bytes.  A
        bucket being moved is waited for; one that has moved is scanned at
        its new owner (a move during a bucket's scan fails the scan)."""
        self._whole_dht()
        ids = self.cluster.ids
        # ``bucket`` is numbered out of ``count``; the layout may change
        # between two records this yields (the caller's own requests fetch
        # it when their replies tell of a newer one).
        bucket, floor, count = 0, 0, self.bucket_count
        while True:
            if self.bucket_count != count:
                # Resized meanwhile: go on from the same point of the hash
                # range, skipping what was read already.
                bucket, floor = self._renumbered_at(bucket, count, floor)
                count = self.bucket_count
            if bucket >= count:
                return
            for attempt in (1, 2):
                channel = self._owners[bucket]
                first_page = functools.partial(wire.encode_scan, ids.next(), ids.client_id,
                                               self.id, bucket, 0, 0, self._numbered)
                reply = self._drive(self._send(channel, first_page, bucket))
                if reply[2] != _NOT_OWNER or attempt == 2:
                    break
                self.refresh()
                if self.bucket_count != count:
                    break
            if self.bucket_count != count:
                continue
            while True:
                if reply[2] != _OK:
                    raise self._error(reply, channel, bucket)
                scan_id, offset, entries = codec.decode_scan_reply(reply)
                if floor:
                    entries = [entry for entry in entries
                               if codec.bucket_of(self._hasher, 32, entry[0]) >= floor]
                yield from entries
                if offset == wire.SCAN_END:
                    break
                reply = channel.request(wire.encode_scan(ids.next(), ids.client_id, self.id,
                                                         bucket, scan_id, offset),
                                        self.name, bucket)
            bucket += 1

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

    def popitem(self) -> tuple[Any, Any]:
        """Remove some record and return it as (key, value); KeyError if
        the DHT is empty.  The first key a scan finds is popped (``pop``:
        its value goes to this client only); a key another client popped
        meanwhile is passed over for the next.  (The MutableMapping
        mixin's scanned the whole DHT for its first key, and of two clients
        popping at once, both could return the same record.)"""
        for key in self:
            try:
                return key, self.pop(key)
            except KeyError:
                continue                # (popped by another client meanwhile)
        raise KeyError(f"popitem(): DHT {self.name!r} is empty")

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
        query = codec.range_query(self.id, lo, hi, inclusive, reverse, items)
        return self._irange(query, bool(items))

    def _irange(self, query: wire.RangeQuery, items: bool) -> Iterator[Any]:
        self._whole_dht()
        ids = self.cluster.ids
        channels = self._range_channels()
        first = exchange([(channel, wire.encode_range(ids.next(), ids.client_id, query))
                          for channel in channels], self.name)
        pages = [self._range_pages(channel, query, reply)
                 for channel, reply in zip(channels, first)]
        merged = heapq.merge(*pages, key=_entry_key, reverse=query.reverse)
        if items:
            for key, value in merged:
                key = decode_key(key)
                yield key, self._value_of(key, value, 0)
        else:
            for key, _value in merged:
                yield decode_key(key)

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
            query = codec.next_range_page(query, entries[-1][0])
            reply = channel.request(wire.encode_range(ids.next(), ids.client_id, query),
                                    self.name)


class _ScanItems(ItemsView):
    """items() in one scan, not one get per key."""

    _mapping: Dht

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        for key, value in self._mapping._scan():
            key = decode_key(key)
            yield key, self._mapping._value_of(key, value, 0)


class _ScanValues(ValuesView):
    _mapping: Dht

    def __iter__(self) -> Iterator[Any]:
        name = self._mapping.name
        unpack = self._mapping._values.unpack_at
        for key, value in self._mapping._scan():
            try:
                decoded = unpack(value, 0)
            except ValueDecodeError as exc:
                raise exc.with_key(decode_key(key)).with_dht(name) from None
            yield decoded


__all__ = ["connect", "Cluster", "Dht"]
