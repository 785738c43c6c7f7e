"""The Twisted client: the synchronous client's operations, as Deferreds.

For event-driven cluster jobs, which keep many requests outstanding at once::

    from twisted.internet import defer, task
    from domus import txclient
    async def job(reactor):
        cluster = await txclient.connect("127.0.0.1:7700", reactor=reactor)
        dht = await cluster.create_dht("words")
        await defer.gatherResults([dht.put(n, n * n) for n in range(1000)])
        print(await dht.get(12), await dht.length())
        await cluster.close()

    task.react(lambda reactor: defer.Deferred.fromCoroutine(job(reactor)))

It behaves as ``domus.client.blocking``: the same wire messages, the same retry rule
(``domus.client.transport``), the same errors from ``domus.errors``.  An error
arrives as a failed Deferred, argument errors included (a key of the wrong
type fails the Deferred that ``put`` returns).  ``TxDht.stats()`` reads local
counters and returns a dict, not a Deferred.

One UDP socket carries every request to every service; a request that does
not fit a datagram, or whose reply does not, goes over TCP (one connection
per service, opened when first needed).  At most ``window`` datagrams are in
flight to any one service; the rest wait, in order, on the client, so that a
job firing 100,000 puts does not overrun the service's socket buffer.  A
request's retry clock starts when it is first sent, not when it was queued;
when a request reaches its deadline, those still queued for the same service
fail with it.
"""

from __future__ import annotations

import socket
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from twisted.internet import defer, error, protocol, task
from twisted.internet.abstract import isIPAddress
from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol
from twisted.python.failure import Failure

from domus.client.blocking import (
    CREATE_TIMEOUT,
    DEFAULT_TIMEOUT,
    STATE_CHANGE_TIMEOUT,
    move_target,
)
from domus.client.evented import WINDOW, EventedChannel, EventedDht
from domus.client.lookup import MISSING
from domus.client.transport import (
    FIRST_TIMEOUT,
    READ_ONLY_CONTROL,
    RECV_BUFFER,
    RequestIds,
    busy_backoff,
    held_back,
    next_timeout,
    service_busy,
)
from domus.errors import (
    SUPERVISOR_ERRORS,
    AuthenticationError,
    DomusError,
    SupervisorError,
    SupervisorUnreachable,
    UnknownDht,
)
from domus.wire import address as addresses
from domus.wire import auth, secret
from domus.wire import protocol as wire
from domus.wire.attributes import check_strategy, create_request
from domus.wire.control import MessageProtocol, RemoteControlError
from domus.wire.secret import Keys

MAX_PACKET = 65536     # what the UDP socket reads at once (Twisted's default is 8192)
_UNSET = object()


class _Once:
    """The outcome of one asynchronous step (a connection, a layout fetch),
    handed to every caller that asks for it, before or after it is known.

    Awaiting one Deferred from several coroutines does not work (the first
    consumes the result), hence a fresh Deferred per waiter."""

    def __init__(self) -> None:
        self.result: Any = _UNSET
        self._waiters: list[defer.Deferred] = []

    def settle(self, result: Any) -> None:
        self.result = result
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            self._fire(waiter)

    def wait(self) -> defer.Deferred:
        waiter: defer.Deferred = defer.Deferred()
        if self.result is _UNSET:
            self._waiters.append(waiter)
        else:
            self._fire(waiter)
        return waiter

    def _fire(self, waiter: defer.Deferred) -> None:
        if isinstance(self.result, Failure):
            waiter.errback(self.result)
        else:
            waiter.callback(self.result)


def _open_link(reactor: Any, host: str, port: int, timeout: float,
               peer_name: str, keys: Keys | None) -> defer.Deferred:
    """A connected MessageProtocol (length-prefixed TCP, calls as Deferreds)
    whose call timeouts run on ``reactor``, once its handshake has ended
    (fails with AuthenticationError if either side refuses the other)."""
    link = MessageProtocol()
    link.clock = reactor
    link.peer_name = peer_name
    link.keys = keys

    def connected(link: MessageProtocol) -> defer.Deferred:
        set_no_delay = getattr(link.transport, "setTcpNoDelay", None)
        if set_no_delay is not None:
            set_no_delay(True)

        def hung(failure: Failure) -> Failure:
            # (a peer that accepts but never speaks the handshake)
            if failure.check(defer.TimeoutError):
                if link.transport is not None:
                    link.transport.loseConnection()
                return Failure(ConnectionError(f"{peer_name} did not answer the "
                                               f"handshake within {timeout:.1f}s"))
            return failure

        return link.authenticated.addTimeout(timeout, reactor).addErrback(hung)

    endpoint = TCP4ClientEndpoint(reactor, host, port, timeout=timeout)
    return connectProtocol(endpoint, link).addCallback(connected)


def _gather(deferreds: list[defer.Deferred]) -> defer.Deferred:
    """All results in order, or the first failure as it is (not FirstError)."""
    return defer.gatherResults(deferreds, consumeErrors=True).addErrback(
        lambda failure: failure.value.subFailure if failure.check(defer.FirstError)
        else failure)


class _Pending:
    """One UDP request, from when it is queued until its reply, its deadline,
    or the client's close."""

    __slots__ = ("deferred", "message", "request_id", "channel", "dht", "bucket",
                 "started", "timeout", "tries", "timer", "stamps", "busy")

    def __init__(self, channel: TxChannel, message: bytes, dht: str,
                 bucket: int | None) -> None:
        self.channel = channel
        self.message = message
        self.request_id = message[4:8]
        self.dht = dht
        self.bucket = bucket
        self.started = 0.0
        self.timeout = channel.first_timeout
        self.tries = 0
        self.timer: Any = None
        self.stamps: list[bytes] = []   # (secure) the times its tries were sealed with
        self.busy = 0                   # BUSY answers so far
        self.deferred: defer.Deferred = defer.Deferred(canceller=self._cancelled)

    def _cancelled(self, _deferred: defer.Deferred) -> None:
        self.channel.requests.forget(self)


class DatagramRequests(protocol.DatagramProtocol):
    """The client's one UDP socket: requests out, replies matched back by id.

    Invariants of the pending table (request id -> _Pending):
    - an id is in it from its first send until its reply arrives, its
      deadline passes, or it is cancelled; then it leaves for good, so a
      late reply (to an earlier try of an answered request, or to one given
      up) finds nothing and is dropped;
    - a retry resends the very same bytes (same request id, same client id):
      the service's reply cache answers a change it already applied instead of
      applying it twice;
    - every entry in it has exactly one live timer (its retry or deadline).
    """

    def __init__(self, reactor: Any, window: int = WINDOW) -> None:
        self.reactor = reactor   # IReactorTime (callLater, seconds); listenUDP when needed
        self.window = window
        self.pending: dict[bytes, _Pending] = {}
        self.channels: set[TxChannel] = set()
        self.late_replies = 0
        self.stray = 0
        self.unauthenticated = 0        # replies whose MAC did not check (dropped)
        self.send_errors = 0
        self.closed = False
        self._port: Any = None
        self._write: Any = None

    def startProtocol(self) -> None:
        sock = getattr(self.transport, "socket", None)
        if sock is None:
            self._write = self.transport.write
            return
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
        except OSError:
            pass
        # Twisted's write() re-validates the address on every call; ours are
        # IP addresses already (see TxChannel.ip), so send on the socket.
        self._write = sock.sendto

    # -- requests
    def request(self, channel: TxChannel, message: bytes, dht: str = "",
                bucket: int | None = None) -> defer.Deferred:
        """Send ``message`` to ``channel``'s service; the Deferred fires with
        the reply bytes or fails with ServiceUnavailable."""
        if self.closed:
            return defer.fail(DomusError("this Twisted Domus client is closed; connect again"))
        if self.transport is None:
            try:
                self._port = self.reactor.listenUDP(0, self, maxPacketSize=MAX_PACKET)
            except Exception as exc:  # CannotListenError, or a reactor without UDP
                return defer.fail(DomusError(f"cannot open a UDP socket for requests: {exc}"))
        entry = _Pending(channel, message, dht, bucket)
        self.channels.add(channel)
        channel.waiting.append(entry)
        self._pump(channel)
        return entry.deferred

    def _pump(self, channel: TxChannel) -> None:
        """Send what waits for ``channel`` while its window has room."""
        if channel.ip is None:
            self._resolve(channel)
            return
        while channel.waiting and channel.in_flight < self.window:
            entry = channel.waiting.popleft()
            channel.in_flight += 1
            entry.started = self.reactor.seconds()
            self.pending[entry.request_id] = entry
            self._send(entry)

    def _send(self, entry: _Pending) -> None:
        if not entry.channel.throttle.allow():
            # Held back here while the service sheds load: as if BUSY
            # (domus.client.throttle).
            entry.timer = None
            self._busy(entry, held_back(entry.message))
            return
        entry.tries += 1
        entry.timer = self.reactor.callLater(entry.timeout, self._expired, entry)
        message, key = entry.message, entry.channel.key
        if key is not None:
            # Each try sealed afresh (a retry long after the first must not
            # look stale); its reply may answer any of them.
            message = auth.seal_request(key, message)
            entry.stamps.append(message[-12:-8])
        try:
            self._write(message, (entry.channel.ip, entry.channel.port))
        except OSError:
            self.send_errors += 1  # a full send buffer: the retry timer sends it again

    def _expired(self, entry: _Pending) -> None:
        """The retry rule of domus.client.transport.ServiceChannel.request: resend
        after first_timeout, then after twice that, ..., until ``deadline``
        seconds have passed since the first send."""
        read = getattr(self.transport, "doRead", None)
        if read is not None:
            # A reply already waiting in the socket beats the timer: a job
            # that kept the reactor busy must not see retries, or worse a
            # ServiceUnavailable, for replies that did arrive in time.
            read()
            if self.pending.get(entry.request_id) is not entry:
                return
        channel = entry.channel
        channel.timeouts += 1
        elapsed = self.reactor.seconds() - entry.started
        timeout = next_timeout(entry.timeout, elapsed, channel.deadline)
        if timeout is None:
            # The service has not answered for a whole deadline: the requests
            # still waiting for its window fail with this one, rather than
            # wait out a deadline each, one window after another.
            doomed = [entry, *channel.waiting]
            channel.waiting.clear()
            self.forget(entry)
            what = (f"did not answer within {channel.deadline:.1f}s ({channel.retries} retries "
                    f"so far)")
            for request in doomed:
                request.deferred.errback(
                    service_busy(channel.name, channel.address, channel.deadline, request.busy,
                                 request.dht, request.bucket) if request.busy
                    else channel.unavailable(what, request.dht, request.bucket))
            return
        channel.retries += 1
        entry.timeout = timeout
        self._send(entry)

    def _busy(self, entry: _Pending, reply: bytes) -> None:
        """The service answered BUSY: send the same request again after a
        backoff (keeping its window slot, so the channel slows down), or
        fail with ServiceBusy if that would pass the deadline."""
        entry.busy += 1
        channel = entry.channel
        channel.busy += 1
        pause = busy_backoff(entry.busy, reply)
        elapsed = self.reactor.seconds() - entry.started
        if entry.timer is not None and entry.timer.active():
            entry.timer.cancel()
        if elapsed + pause >= channel.deadline:
            self.forget(entry)
            entry.deferred.errback(service_busy(channel.name, channel.address, channel.deadline,
                                                entry.busy, entry.dht, entry.bucket))
            return
        entry.timeout = channel.first_timeout
        entry.timer = self.reactor.callLater(pause, self._send, entry)

    def forget(self, entry: _Pending) -> None:
        """Take ``entry`` out of the table (or the queue) and free its slot."""
        channel = entry.channel
        if self.pending.pop(entry.request_id, None) is entry:
            if entry.timer is not None and entry.timer.active():
                entry.timer.cancel()
            channel.in_flight -= 1
            self._pump(channel)
        elif entry in channel.waiting:
            channel.waiting.remove(entry)

    def datagramReceived(self, data: bytes, peer: Any) -> None:
        if len(data) < wire.REPLY_HEADER_SIZE or data[0] != wire.REPLY_MAGIC:
            self.stray += 1
            return
        entry = self.pending.get(data[4:8])
        if entry is None:
            self.late_replies += 1
            return
        key = entry.channel.key
        if key is not None:
            opened = auth.open_reply_to(key, data, entry.message, entry.stamps)
            if opened is None:
                self.unauthenticated += 1   # not the service's: wait on for its own
                return
            data = opened
        if data[2] == wire.ST_BUSY:
            entry.channel.throttle.answered(True)
            self._busy(entry, data)
            return
        entry.channel.throttle.taken += 1.0
        self.forget(entry)
        if data[2] == wire.ST_REPLY_TOO_LARGE:
            entry.channel.request_tcp(entry.message, entry.dht, entry.bucket).chainDeferred(
                entry.deferred)
        else:
            entry.deferred.callback(data)

    # -- host names
    def _resolve(self, channel: TxChannel) -> None:
        if channel.resolving:
            return
        channel.resolving = True

        def resolved(ip: str) -> None:
            channel.ip = ip
            channel.resolving = False
            self._pump(channel)

        def failed(failure: Failure) -> None:
            channel.resolving = False
            waiting, channel.waiting = channel.waiting, deque()
            for entry in waiting:
                entry.deferred.errback(channel.unavailable(
                    f"cannot be reached: host {channel.host!r} does not resolve "
                    f"({failure.getErrorMessage()})", entry.dht, entry.bucket))

        self.reactor.resolve(channel.host).addCallbacks(resolved, failed)

    def close(self) -> defer.Deferred:
        """Fail what is outstanding and stop listening."""
        self.closed = True
        entries = list(self.pending.values())
        self.pending.clear()
        for channel in self.channels:
            entries.extend(channel.waiting)
            channel.waiting.clear()
            channel.in_flight = 0
        for entry in entries:
            if entry.timer is not None and entry.timer.active():
                entry.timer.cancel()
            entry.deferred.errback(DomusError(
                f"the Twisted Domus client was closed before service {entry.channel.name} "
                f"answered"))
        if self._port is not None:
            port, self._port = self._port, None
            return defer.maybeDeferred(port.stopListening)
        return defer.succeed(None)


class TxChannel(EventedChannel):
    """Requests to one service: over the shared UDP socket, or over this
    channel's own TCP connection when a message does not fit a datagram."""

    def __init__(self, name: str, address: str, *, requests: DatagramRequests,
                 deadline: float, first_timeout: float = FIRST_TIMEOUT,
                 keys: Keys | None = None) -> None:
        super().__init__(name, address, requests=requests, deadline=deadline,
                         first_timeout=first_timeout, keys=keys)
        self.requests: DatagramRequests = requests
        self.ip: str | None = self.host if isIPAddress(self.host) else None
        self.resolving = False
        self._tcp: _Once | None = None
        self._tcp_link: MessageProtocol | None = None

    def request_tcp(self, message: bytes, dht: str = "",
                    bucket: int | None = None) -> defer.Deferred:
        return defer.Deferred.fromCoroutine(self._request_tcp(message, dht, bucket))

    def _request_tcp(self, message: bytes, dht: str, bucket: int | None) -> Any:
        reactor = self.requests.reactor
        return self._while_busy(lambda: self._request_tcp_once(message, dht, bucket), dht,
                                bucket, reactor.seconds,
                                lambda seconds: task.deferLater(reactor, seconds, lambda: None))

    async def _request_tcp_once(self, message: bytes, dht: str, bucket: int | None) -> bytes:
        request_id = int.from_bytes(message[4:8], "big")
        for attempt in (1, 2):
            link: MessageProtocol | None = None
            try:
                link = await self._connect()
                _status, frame = await link.request(message, request_id, self.deadline)
                return frame
            except (TimeoutError, error.TimeoutError) as exc:
                raise self.unavailable(f"failed over TCP ({exc})", dht, bucket) from None
            except AuthenticationError:
                self._drop_tcp(link)
                raise
            except (ConnectionError, error.ConnectError, OSError) as exc:
                # One reconnect (the service may have restarted); a retry of
                # a change is answered from the service's reply cache.
                self._drop_tcp(link)
                if attempt == 2:
                    raise self.unavailable(f"failed over TCP ({exc})", dht, bucket) from None
        raise AssertionError("unreachable")

    def _connect(self) -> defer.Deferred:
        if self._tcp is None:
            once = self._tcp = _Once()

            def made(link: MessageProtocol) -> MessageProtocol:
                self._tcp_link = link
                link.lost.addCallback(lambda _: self._drop_tcp(link))
                return link

            def failed(failure: Failure) -> Failure:
                if self._tcp is once:
                    self._tcp = None
                return failure

            opening = _open_link(self.requests.reactor, self.host, self.port, self.deadline,
                                 f"service {self.name} ({self.address})", self.keys)
            opening.addCallbacks(made, failed).addBoth(once.settle)
            return once.wait()  # (self._tcp may be None again already: a failure at once)
        return self._tcp.wait()

    def _drop_tcp(self, link: MessageProtocol | None) -> None:
        """Forget ``link`` (lost or failing) so the next request reconnects."""
        if link is None or link is self._tcp_link:
            self._tcp = None
            self._tcp_link = None
        if link is not None and link.transport is not None and link.connected:
            link.transport.loseConnection()

    def close(self) -> defer.Deferred:
        link, self._tcp, self._tcp_link = self._tcp_link, None, None
        if link is None or link.transport is None or not link.connected:
            return defer.succeed(None)
        link.transport.loseConnection()
        return link.lost


def connect(address: str | None = None, timeout: float = DEFAULT_TIMEOUT,
            reactor: Any = None, *, window: int = WINDOW,
            secret_file: str | None = None) -> defer.Deferred:
    """Connect to a deployment's supervisor: ``address`` (HOST:PORT), else
    $DOMUS_SUPERVISOR, else 127.0.0.1:7700.  Fires with a TxCluster, or
    fails with SupervisorUnreachable if the supervisor does not answer
    within ``timeout`` seconds, which also bounds every later call.
    ``secret_file``: as domus.connect's (AuthenticationError when it is
    wrong or missing)."""
    if reactor is None:
        from twisted.internet import reactor as default_reactor

        reactor = default_reactor
    try:
        cluster = TxCluster(addresses.supervisor_address(address), timeout, reactor,
                            window=window, secret_file=secret_file)
    except (ValueError, AuthenticationError) as exc:
        return defer.fail(exc)

    def timed_out(failure: Failure) -> Failure:
        failure.trap(defer.TimeoutError)
        return Failure(SupervisorUnreachable(
            f"the Domus supervisor at {cluster.address} did not answer within {timeout:.1f}s; "
            f"is it running (`domus up` or `domus supervisor`) and not overloaded?"))

    def failed(failure: Failure) -> Failure:
        cluster.close()
        return failure

    pinged = cluster.ping().addTimeout(timeout, reactor).addErrback(timed_out)
    return pinged.addCallbacks(lambda _answer: cluster, failed)


class TxCluster:
    """A connection to one Domus deployment; every call returns a Deferred."""

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT, reactor: Any = None,
                 *, window: int = WINDOW, secret_file: str | None = None) -> None:
        if reactor is None:
            from twisted.internet import reactor as default_reactor

            reactor = default_reactor
        self.address = address
        self.host, self.port = addresses.parse(address)
        self.timeout = timeout
        self.reactor = reactor
        self.keys = secret.keys(secret_file)
        self.secure = False             # (the supervisor's handshake said so)
        self.ids = RequestIds()
        self.requests = DatagramRequests(reactor, window)
        self._channels: dict[tuple[str, str], TxChannel] = {}
        self._link: _Once | None = None
        self._link_protocol: MessageProtocol | None = None
        self._opening: defer.Deferred | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"<domus.TxCluster supervisor={self.address}>"

    def channel(self, name: str, address: str) -> TxChannel:
        """The (shared) channel to a service, by name and address."""
        key = (name, address)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = TxChannel(
                name, address, requests=self.requests, deadline=self.timeout,
                keys=self.keys if self.secure else None)
        return channel

    # -- the supervisor link
    def _supervisor(self) -> defer.Deferred:
        """The connected link to the supervisor (connecting if need be)."""
        if self._closed:
            return defer.fail(SupervisorUnreachable("this Twisted Domus client is closed; "
                                                    "connect again"))
        if self._link is None:
            once = self._link = _Once()

            def made(link: MessageProtocol) -> MessageProtocol:
                self._link_protocol = link
                self.secure = link.secure
                link.lost.addCallback(lambda _: self._drop_link(link))
                return link

            def failed(failure: Failure) -> Failure:
                if self._link is once:
                    self._link = None
                if failure.check(defer.CancelledError, AuthenticationError):
                    return failure
                return Failure(SupervisorUnreachable(
                    f"cannot reach the Domus supervisor at {self.address}: "
                    f"{failure.getErrorMessage()}; is it running (`domus up` or `domus "
                    f"supervisor`)? Pass its HOST:PORT or set DOMUS_SUPERVISOR"))

            self._opening = _open_link(self.reactor, self.host, self.port, self.timeout,
                                       f"the supervisor at {self.address}", self.keys)
            self._opening.addCallbacks(made, failed).addBoth(once.settle)
            return once.wait()  # (self._link may be None again already: a failure at once)
        return self._link.wait()

    def _drop_link(self, link: MessageProtocol) -> None:
        if link is self._link_protocol:
            self._link = None
            self._link_protocol = None
        if link.transport is not None and link.connected:
            link.transport.loseConnection()

    def call(self, op: str, timeout: float | None = None, **params: Any) -> defer.Deferred:
        """Run control op ``op`` on the supervisor; fires with its result, or
        fails with the matching domus.errors exception."""
        return defer.Deferred.fromCoroutine(self._call(op, timeout, params))

    async def _call(self, op: str, timeout: float | None, params: dict[str, Any]) -> Any:
        """As domus.client.transport.SupervisorLink.call: a read-only op is sent
        again once if the connection breaks; a change is not (it may have
        been applied)."""
        wait = timeout or self.timeout
        for attempt in (1, 2) if op in READ_ONLY_CONTROL else (2,):
            link = await self._supervisor()
            try:
                return await link.call(op, timeout=wait, **params)
            except RemoteControlError as exc:
                cls = SUPERVISOR_ERRORS.get(exc.kind, SupervisorError)
                raise cls(exc.message or f"{op!r} failed") from None
            except TimeoutError:
                raise SupervisorUnreachable(
                    f"the Domus supervisor at {self.address} did not answer {op!r} within "
                    f"{wait:.1f}s; check that it is running and not overloaded") from None
            except ConnectionError:
                self._drop_link(link)
                if attempt == 2:
                    raise SupervisorUnreachable(
                        f"lost the connection to the Domus supervisor at {self.address} "
                        f"during {op!r} (if it changed something, it may or may not have "
                        f"been applied: check before retrying); is it running?") from None
                # one reconnect: the supervisor may have restarted
        raise AssertionError("unreachable")

    def close(self) -> defer.Deferred:
        """Close every connection and socket; outstanding requests fail.
        Fires when all are closed."""
        self._closed = True
        closing = [self.requests.close()]
        if self._opening is not None and not self._opening.called:
            self._opening.cancel()
        link, self._link, self._link_protocol = self._link_protocol, None, None
        if link is not None and link.transport is not None and link.connected:
            link.transport.loseConnection()
            closing.append(link.lost)
        closing.extend(channel.close() for channel in self._channels.values())
        self._channels.clear()
        return defer.gatherResults(closing).addCallback(lambda _: None)

    # -- the deployment
    def ping(self) -> defer.Deferred:
        return self.call("ping")

    def status(self) -> defer.Deferred:
        return self.call("status")

    def services(self) -> defer.Deferred:
        """Every registered service: name, address, state ("up",
        "unresponsive", "down"), roles, buckets per DHT, resources, load."""
        return self.call("services")

    # -- DHTs
    def create_dht(self, name: str, *, buckets: int | None = None, hash: str | None = None,
                   storage: str | None = None, platform: str | None = None,
                   routing: str | None = None, routing_degree: int | None = None,
                   routing_algorithm: str | None = None, lookup: str | None = None,
                   durability: str | None = None, replicas: int | None = None,
                   routing_services: Iterable[str] | None = None,
                   storage_services: Iterable[str] | None = None,
                   codec: str | None = None,
                   exist_ok: bool = False) -> defer.Deferred:
        """Create a DHT and open it: fires with a TxDht.  Attributes left out
        take their defaults; service sets default to every live service.
        ``exist_ok`` as for Cluster.create_dht: the existing DHT if its
        attributes are these (one being created is waited for)."""
        try:
            attributes = create_request(name, buckets=buckets, hash=hash, storage=storage,
                                        platform=platform, routing=routing,
                                        routing_degree=routing_degree,
                                        routing_algorithm=routing_algorithm, lookup=lookup,
                                        durability=durability, replicas=replicas,
                                        routing_services=routing_services,
                                        storage_services=storage_services, codec=codec)
        except Exception:
            return defer.fail()
        extra = {"exist_ok": True} if exist_ok else {}
        creating = self.call("create_dht", timeout=max(self.timeout, CREATE_TIMEOUT), name=name,
                             attributes=attributes, **extra)
        return creating.addCallback(lambda descriptor: TxDht(self, descriptor))

    def open_dht(self, name: str, *, lookup: str | None = None, cache: float | None = None,
                 direct_cutoff: int | None = None) -> defer.Deferred:
        """Open an existing DHT: fires with a TxDht.  ``lookup``, ``cache``
        and ``direct_cutoff`` choose this client's lookup strategy, as for
        Cluster.open_dht."""
        try:
            if lookup is not None:
                check_strategy(lookup)
        except Exception:
            return defer.fail()

        def opened(descriptor: dict[str, Any]) -> TxDht:
            return TxDht(self, descriptor, lookup=lookup, cache=cache,
                         direct_cutoff=direct_cutoff)

        return self.call("open_dht", name=name, timeout=max(self.timeout, CREATE_TIMEOUT)) \
            .addCallback(opened)

    def list_dhts(self) -> defer.Deferred:
        return self.call("list_dhts")

    def dht_info(self, name: str) -> defer.Deferred:
        return self.call("dht_info", name=name)

    def destroy_dht(self, name: str) -> defer.Deferred:
        return self.call("destroy_dht", name=name).addCallback(lambda _: None)

    def deactivate_dht(self, name: str) -> defer.Deferred:
        """As Cluster.deactivate_dht: fires with the records kept per
        storage service."""
        return self.call("deactivate_dht", name=name, timeout=STATE_CHANGE_TIMEOUT) \
            .addCallback(lambda answer: answer["records"])

    def activate_dht(self, name: str) -> defer.Deferred:
        """As Cluster.activate_dht: fires with the records loaded per
        storage service."""
        return self.call("activate_dht", name=name, timeout=STATE_CHANGE_TIMEOUT) \
            .addCallback(lambda answer: answer["records"])

    def move_bucket(self, name: str, bucket: int, *, routing: str | None = None,
                    storage: str | None = None) -> defer.Deferred:
        """As Cluster.move_bucket: fires with the supervisor's answer."""
        try:
            role, service = move_target(routing, storage)
        except TypeError:
            return defer.fail()
        return self.call("move_bucket", name=name, bucket=bucket, role=role, service=service,
                         timeout=STATE_CHANGE_TIMEOUT)

    def rebalance(self, name: str, dry_run: bool = False) -> defer.Deferred:
        """As Cluster.rebalance: fires with the moves."""
        return self.call("rebalance", name=name, dry_run=dry_run,
                         timeout=STATE_CHANGE_TIMEOUT).addCallback(lambda answer: answer["moves"])

    def accept_loss(self, name: str) -> defer.Deferred:
        """As Cluster.accept_loss: fires with the buckets accepted."""
        return self.call("accept_loss", name=name).addCallback(lambda answer: answer["accepted"])

    def resize_dht(self, name: str, buckets: int) -> defer.Deferred:
        """As Cluster.resize_dht: fires with ``name, from, buckets, steps,
        seconds``."""
        return self.call("resize_dht", name=name, buckets=buckets, timeout=STATE_CHANGE_TIMEOUT)

    def dht_services(self, name: str, *, add: Iterable[str] = (), remove: Iterable[str] = (),
                     roles: Iterable[str] = ("routing", "storage")) -> defer.Deferred:
        """As Cluster.dht_services: fires with the moves made."""
        return self.call("dht_services", name=name, add=list(add), remove=list(remove),
                         roles=list(roles), timeout=STATE_CHANGE_TIMEOUT
                         ).addCallback(lambda answer: answer["moves"])

    def drain_service(self, name: str) -> defer.Deferred:
        """As Cluster.drain_service: fires once it holds no bucket."""
        return self.call("drain_service", name=name, timeout=STATE_CHANGE_TIMEOUT)

    def remove_service(self, name: str, force: bool = False) -> defer.Deferred:
        """As Cluster.remove_service."""
        return self.call("remove_service", name=name, force=force,
                         timeout=STATE_CHANGE_TIMEOUT)

    def balancer_status(self) -> defer.Deferred:
        """As Cluster.balancer_status."""
        return self.call("balancer_status")


class TxDht(EventedDht[TxChannel]):
    """One DHT; every data operation returns a Deferred (its requests are
    domus.client.evented's, on the reactor)."""

    def __init__(self, cluster: TxCluster, descriptor: dict[str, Any],
                 **options: Any) -> None:
        self._fetches = 0                   # layout fetches started so far
        self._refreshing: _Once | None = None
        super().__init__(cluster, descriptor, **options)

    # ------------------------------------------------------------ layout
    def refresh(self) -> defer.Deferred:
        """Fetch the DHT's layout from the supervisor again.  Callers that
        ask while a fetch is under way share it."""
        if self._refreshing is None:
            once = self._refreshing = _Once()
            self._fetches += 1
            self._counters["refreshes"] += 1
            fetching = self.cluster.call("open_dht", name=self.name)
            fetching.addCallbacks(self._load, self._fetch_failed).addBoth(self._fetched, once)
            return once.wait()  # (self._refreshing may be None again already)
        return self._refreshing.wait()

    def _fetch_failed(self, failure: Failure) -> Failure:
        if failure.check(UnknownDht):
            return Failure(UnknownDht(f"DHT {self.name!r} no longer exists (destroyed?); "
                                      f"create or open it again"))
        return failure

    def _fetched(self, result: Any, once: _Once) -> None:
        if self._refreshing is once:
            self._refreshing = None
        once.settle(result)

    def _refresh_soon(self) -> None:
        """(A reply told of a newer layout: fetch it in the background.)"""
        self.refresh().addErrback(lambda _failure: None)

    # -- the reactor's primitives (domus.client.evented)
    def _join_refresh(self) -> defer.Deferred:
        return self._refreshing.wait()

    def _sleep(self, seconds: float) -> defer.Deferred:
        return task.deferLater(self.cluster.reactor, seconds, lambda: None)

    def _now(self) -> float:
        return self.cluster.reactor.seconds()

    def _gather(self, awaitables: list[Any]) -> defer.Deferred:
        return _gather([defer.ensureDeferred(awaitable) for awaitable in awaitables])

    # ------------------------------------------------------------ single keys
    def put(self, key: Any, value: Any) -> defer.Deferred:
        """Store ``value`` under ``key``; fires with True if the key was new."""
        return defer.Deferred.fromCoroutine(self._put(key, value))

    def get(self, key: Any, default: Any = None) -> defer.Deferred:
        """Fires with the value of ``key``, or ``default`` if it is absent."""
        return defer.Deferred.fromCoroutine(self._get(key, default, raise_missing=False))

    def getitem(self, key: Any) -> defer.Deferred:
        """Fires with the value of ``key``; fails with KeyError if absent."""
        return defer.Deferred.fromCoroutine(self._get(key, None, raise_missing=True))

    def delete(self, key: Any) -> defer.Deferred:
        """Remove ``key``; fires with True if it was there."""
        return defer.Deferred.fromCoroutine(self._answer(wire.OP_DELETE, key))

    def contains(self, key: Any) -> defer.Deferred:
        """Fires with True if ``key`` is stored."""
        return defer.Deferred.fromCoroutine(self._answer(wire.OP_CONTAINS, key))

    def pop(self, key: Any, default: Any = MISSING) -> defer.Deferred:
        """Remove ``key``; fires with its value, or ``default`` if it is not
        there (fails with KeyError without one).  Read, then deleted on the
        service only if it is still the value read (else read again): of
        clients popping one key at once exactly one gets its value, and a
        value written in between is never deleted unseen."""
        return defer.Deferred.fromCoroutine(self._pop(key, default))

    def setdefault(self, key: Any, default: Any = None) -> defer.Deferred:
        """Fires with the value of ``key``; if it is not there, with
        ``default``, stored under it in one step on the service: of clients
        setting a default for one key at once, one stores its own and the
        others get it."""
        return defer.Deferred.fromCoroutine(self._setdefault(key, default))

    # ------------------------------------------------------------ batches
    def put_many(self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> defer.Deferred:
        """Store many records, one message per service where they fit in a
        datagram (more where they do not), all sent at once.  Fires with how
        many keys were new.  Either every key and value is valid and all are
        sent, or none is."""
        return defer.Deferred.fromCoroutine(self._put_many(items))

    def get_many(self, keys: Iterable[Any]) -> defer.Deferred:
        """Fires with the values of the keys that are present, as a dict
        (absent keys are left out)."""
        return defer.Deferred.fromCoroutine(self._get_many(keys))

    # ------------------------------------------------------------ whole DHT
    def length(self) -> defer.Deferred:
        """Fires with the number of records in the DHT."""
        return self.records_by_service().addCallback(lambda counts: sum(counts.values()))

    def records_by_service(self) -> defer.Deferred:
        """Fires with how many records each storage service holds of this DHT."""
        return defer.Deferred.fromCoroutine(self._records_by_service())


__all__ = ["connect", "TxCluster", "TxDht", "TxChannel", "DatagramRequests"]
