"""A Domus service process: UDP and TCP listeners on one port, a link to the
supervisor, heartbeats and timers, all on one Twisted reactor thread.

The request handler (domus.service.handler) does the work; this module only
moves bytes and keeps the service registered.  UDP is served by
domus.service.udp (a socket read straight from the reactor, drained in C).
"""

from __future__ import annotations

import itertools
import os
import time
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer, protocol, task
from twisted.logger import Logger
from twisted.python.failure import Failure

from domus._version import __version__
from domus.errors import AuthenticationError
from domus.service.connections import DataFactory
from domus.service.handler import RequestHandler
from domus.service.hosted import FREEZE_LEASE
from domus.service.limits import DEFAULT as DEFAULT_LIMITS
from domus.service.limits import Limits, limit_options
from domus.service.resources import LoadSampler, base_resources, pin_to_cpus
from domus.service.udp import UdpServer
from domus.storage import StorageFault, available_platforms
from domus.storage.headroom import DEFAULT as DEFAULT_RESERVE
from domus.storage.headroom import SAMPLE_INTERVAL, Headroom, Reserve
from domus.wire import address as addresses
from domus.wire import checks, launch, secret
from domus.wire import protocol as wire
from domus.wire.attributes import MAX_BUCKETS
from domus.wire.control import ControlError, MessageProtocol, RemoteControlError

log = Logger(namespace="domus.service")

HEARTBEAT_INTERVAL = 1.0
# A backup has this long to take a change from its primary; past it the
# change fails (the client retries) and the backup is reported.
REPLICATE_TIMEOUT = 2.0
COPY_FAILED_REPORT_INTERVAL = 1.0   # at most one report per backup and DHT a second
FLUSH_INTERVAL = 1.0
RECONNECT_MAX_DELAY = 2.0
# A registration that fails for any reason but a refusal is tried again on
# the same link after REGISTER_FIRST_DELAY, doubling up to REGISTER_MAX_DELAY.
REGISTER_FIRST_DELAY = 0.5
REGISTER_MAX_DELAY = 30.0
REGISTRATION_REFUSED = "RegistrationRefused"    # (the supervisor's REFUSED)
MOVE_OPS = frozenset({"track_bucket", "catch_up_bucket", "freeze_bucket", "export_bucket",
                      "thaw_bucket", "stage_bucket", "discard_bucket"})
EXPORT_PAGE_BYTES = 4 << 20    # records per export page, well under a TCP frame


class DomusService(Service):
    def __init__(self, *, supervisor: str, listen: str, data_dir: str, name: str | None = None,
                 heartbeat: float = HEARTBEAT_INTERVAL,
                 resources: dict[str, Any] | None = None,
                 cpus: list[int] | None = None, secret_file: str | None = None,
                 limits: Limits = DEFAULT_LIMITS, metrics: str | None = None,
                 disk_reserve: Reserve = DEFAULT_RESERVE) -> None:
        self.supervisor_address = addresses.parse(supervisor)
        if metrics is not None:
            addresses.parse(metrics)        # (a bad address fails before anything starts)
        self.metrics_address = metrics      # where /metrics is served; None: nowhere
        self.listen_host, self.listen_port = addresses.parse(listen)
        self.address = f"{self.listen_host}:{self.listen_port}"
        self.service_name = checks.service_name(name or self.address)
        checks.address(self.address)
        self.data_dir = checks.absolute_path(os.path.abspath(data_dir), "data dir")
        os.makedirs(data_dir, exist_ok=True)
        self.heartbeat_interval = heartbeat
        if cpus:
            pin_to_cpus(cpus)       # (before the resources count them)
        self.resources = base_resources(data_dir, **(resources or {}))
        options: list[list[Any]] = [["--heartbeat", heartbeat]]
        options += [[f"--{field}", value] for field, value in sorted((resources or {}).items())]
        if cpus:
            options.append(["--cpus", ",".join(map(str, cpus))])
        if metrics:
            options.append(["--metrics", metrics])
        if disk_reserve != DEFAULT_RESERVE:
            options.append(["--disk-reserve", str(disk_reserve)])
        options += limit_options(limits)
        # The deployment secret, found as every process finds it
        # (domus.wire.secret); None: an insecure deployment.
        self.keys = secret.keys(secret_file)
        if self.keys is not None:
            options.append(["--secret-file", os.path.abspath(self.keys.source)])
        self.launch = launch.record("service", self.address, self.data_dir, options,
                                    name=self.service_name, supervisor=supervisor)
        self.limits = limits
        self.handler = RequestHandler(self.service_name, data_dir=data_dir,
                                      data_key=self.keys.data if self.keys else None,
                                      limits=limits)
        self.peers = PeerLinks(self.service_name, self.keys)
        self.handler.headroom = Headroom(self.data_dir, disk_reserve, self.service_name)
        self.handler.replicator = self.peers.forward
        self.handler.copy_failed = self._copy_failed
        self._reported: dict[tuple[int, str], float] = {}
        self.sampler = LoadSampler(data_dir=self.data_dir)
        self._sampled_since = time.monotonic()
        self.started = time.time()
        self.link: MessageProtocol | None = None
        self.registered = False
        self._register_delay = REGISTER_FIRST_DELAY
        self._ports: list[Any] = []
        self.udp: UdpServer | None = None
        self._timers: list[task.LoopingCall] = []
        self._storage_timer: task.LoopingCall | None = None
        self._phased: list[Any] = []        # the timers' delayed starts
        self._link_factory: Any = None
        self._stopping = False
        self.exit_code = 0

    # -------------------------------------------------------------- lifecycle
    def startService(self) -> None:
        from twisted.internet import reactor

        super().startService()
        self.udp = UdpServer(self.handler, self.listen_host, self.listen_port)
        self.udp.start(reactor)
        def configure(proto: MessageProtocol) -> None:
            proto.data_handler = self.handler.handle_fast
            proto.control_handler = self._client_control
            proto.accepting, proto.keys = True, self.keys
            proto.auth_failures = self._auth_failed

        # (Bounded: connections, their output, input and idle time; each
        # connection counts its bytes each way, which the metrics read.)
        data_factory = DataFactory(self.service_name, self.limits, self.handler.counters,
                                   configure)
        self._ports.append(reactor.listenTCP(self.listen_port, data_factory,
                                             interface=self.listen_host))
        if self.metrics_address:
            from domus.service import metrics

            self._ports.append(metrics.listen(reactor, self.metrics_address, self))
            log.info("service {name}: metrics at http://{address}/metrics",
                     name=self.service_name, address=self.metrics_address)
        log.info("service {name} serving on {address} (UDP and TCP, {path} hot path), "
                 "data dir {dir}", name=self.service_name, address=self.address,
                 path="C" if self.handler.fast is not None else "pure-Python",
                 dir=self.data_dir)
        # The reply cache rotates its generations every ttl/2; polling each
        # second keeps that within a second.
        expire = task.LoopingCall(self._expire)
        # These two run released, Twisted's scheduling of them included (cold
        # code, slow), and take the baton for what changes or reads what C
        # does.
        heartbeat = _ReleasedLoopingCall(self._released, self._heartbeat)
        # Disk DHTs without sync durability are flushed on this interval and
        # when the service stops.
        flush = task.LoopingCall(self._flush)
        # Free space against the reserve, and stores that failed to open.
        # (every SAMPLE_INTERVAL near the reserve, up to a second apart far
        # from it: _tend_storage sets the next interval)
        storage = _ReleasedLoopingCall(self._released, self._tend_storage)
        self._storage_timer = storage
        storage.start(SAMPLE_INTERVAL, now=True)
        # The others start out of step with it and with each other, so that
        # no reactor turn runs two of them: the serving thread waits for
        # the longest one, not for their sum (domus.service.udp).
        for timer, interval, phase in ((heartbeat, self.heartbeat_interval, 0.05),
                                       (expire, 1.0, 0.35), (flush, FLUSH_INTERVAL, 0.65)):
            self._phased.append(reactor.callLater(phase, timer.start, interval, now=False))
        self._timers += [expire, heartbeat, flush, storage]
        self._connect_supervisor()

    def stopService(self) -> defer.Deferred:
        self._stopping = True
        self.peers.close()
        for start in self._phased:
            if start.active():
                start.cancel()
        for timer in self._timers:
            if timer.running:
                timer.stop()
        if self._link_factory is not None:
            self._link_factory.stopTrying()
        if self.link is not None and self.link.transport is not None:
            self.link.transport.loseConnection()
        if self.udp is not None:
            self.udp.stop()
        stops = [defer.maybeDeferred(port.stopListening) for port in self._ports]
        self.handler.close()      # flushes and closes every store; disk files stay
        log.info("service {name} stopping", name=self.service_name)
        super().stopService()
        return defer.DeferredList(stops)

    def _released(self) -> AbstractContextManager[None]:
        """A context in which the reactor thread lets the serving thread
        serve (UdpServer.released): for what changes nothing C reads."""
        return self.udp.released() if self.udp is not None else nullcontext()

    def _held(self) -> AbstractContextManager[None]:
        """The baton again, inside ``_released`` (UdpServer.held)."""
        return self.udp.held() if self.udp is not None else nullcontext()

    def _tend_storage(self) -> None:
        try:
            self.handler.tend_storage(self._released, self._held)
            if self._storage_timer is not None:
                self._storage_timer.interval = self.handler.storage_interval()
        except Exception:       # a bug: say so, and keep the timer going
            log.failure("service {name}: watching its storage failed", name=self.service_name)

    def _flush(self) -> None:
        try:
            self.handler.flush()
        except Exception:
            log.failure("service {name}: flushing the disk DHTs failed", name=self.service_name)

    # -------------------------------------------------------------- supervisor link
    def _connect_supervisor(self) -> None:
        from twisted.internet import reactor

        factory = _SupervisorLinkFactory(self)
        host, port = self.supervisor_address
        self._link_factory = factory
        reactor.connectTCP(host, port, factory, timeout=5)

    def _auth_failed(self, why: str) -> None:
        self.handler.counters["unauthenticated"] += 1

    def link_made(self, link: MessageProtocol) -> None:
        self._write_released(link.transport)
        link.authenticated.addCallbacks(self._authenticated, self._not_authenticated)

    def _write_released(self, transport: Any) -> None:
        """Have the reactor write to the supervisor's link without the
        baton (UdpServer.released): a write only moves bytes to the socket,
        and the heartbeat's, sent in the reactor turn after it, is a cold
        send (the kernel hands the bytes to the supervisor within it) that
        would stop the serving thread."""
        write = transport.doWrite

        def released_write() -> Any:
            with self._released():
                return write()

        transport.doWrite = released_write

    def _not_authenticated(self, failure: Any) -> None:
        from twisted.internet import reactor

        if failure.check(AuthenticationError):
            # A wrong or missing secret: retrying cannot help.
            log.error("service {name}: the supervisor refused it: {error}; stopping",
                      name=self.service_name, error=failure.getErrorMessage())
            self.exit_code = 2
            reactor.stop()

    def _authenticated(self, link: MessageProtocol) -> None:
        self.link = link
        link.peer_name = "supervisor"
        link.control_handler = self._supervisor_control
        held = {str(dht_id): sorted(hosted.repos) for dht_id, hosted in self.handler.dhts.items()}
        registering = link.call("register", name=self.service_name, address=self.address,
                                resources=self.resources, version=__version__, held=held,
                                pid=os.getpid(), launch=self.launch,
                                platforms=list(available_platforms()),
                                hot_path="c" if self.handler.fast is not None else "python",
                                holdings=self.handler.holdings())
        registering.addCallbacks(self._registered, self._register_failed, errbackArgs=(link,))

    def _registered(self, answer: dict[str, Any]) -> None:
        self._register_delay = REGISTER_FIRST_DELAY
        self.handler.sync(answer.get("dhts", []))
        # DHTs it holds that the supervisor destroyed (or took it out of)
        # while it was away, each named by id, deployment and stamp.
        for named in answer.get("drop") or []:
            try:
                self.handler.drop(named)
            except (ValueError, AttributeError, TypeError) as exc:
                log.error("service {name}: {error}", name=self.service_name, error=str(exc))
        self.registered = True
        log.info("service {name} registered with the supervisor; hosting {count} DHTs",
                 name=self.service_name, count=len(self.handler.dhts))

    def _register_failed(self, failure: Any, link: MessageProtocol) -> None:
        from twisted.internet import reactor

        if failure.check(RemoteControlError) and failure.value.kind == REGISTRATION_REFUSED:
            # A refusal for a reason (a name taken by another live service,
            # a figure out of range): retrying cannot help, so stop and say why.
            log.error("service {name}: the supervisor refused registration: {error}; "
                      "stopping", name=self.service_name, error=failure.getErrorMessage())
            self.exit_code = 2
            reactor.stop()
            return
        # Anything else (the supervisor's disk is full, an error of its own,
        # no answer in time) may pass: try again on this link, backing off.
        delay = self._register_delay
        self._register_delay = min(delay * 2, REGISTER_MAX_DELAY)
        log.warn("service {name}: registration failed ({error}); retrying in {delay:.1f}s",
                 name=self.service_name, error=failure.getErrorMessage(), delay=delay)

        def again() -> None:
            if link is self.link and link.connected and not self._stopping:
                self._authenticated(link)

        reactor.callLater(delay, again)

    def link_lost(self) -> None:
        self.link = None
        self.registered = False
        if not self._stopping:
            log.warn("service {name}: lost the supervisor; reconnecting (data keeps being "
                     "served meanwhile)", name=self.service_name)

    def _expire(self) -> None:
        """Each second: the reply cache's generations, and the leases of
        buckets frozen for a move the supervisor never finished."""
        self.handler.reply_cache.expire()
        for hosted in list(self.handler.dhts.values()):
            for bucket in hosted.thaw_expired():
                log.warn("service {name}: DHT {dht!r}: bucket {bucket} was frozen for a move "
                         "that did not finish within {lease:.0f}s; serving it again",
                         name=self.service_name, dht=hosted.name, bucket=bucket,
                         lease=FREEZE_LEASE)

    def _heartbeat(self) -> None:
        # Sampling the load (psutil: /proc) and writing to the supervisor's
        # link change nothing the C path reads: the serving thread serves
        # meanwhile.  What the stats read (repositories, buckets: Berkeley
        # DB's stat lets the GIL go) it reads holding the baton.
        with self._released():
            load = self.sampler.sample(self.handler.requests, time.monotonic(),
                                       self.handler.by_op[wire.OP_LOOKUP])
            if self.handler.headroom is not None:
                load.update(self.handler.headroom.report())
        if self.link is None or not self.registered:
            return
        with self._held():
            fields = self._heartbeat_stats()
        with self._released():
            beat = self.link.call("heartbeat", name=self.service_name, load=load,
                                  stats=fields, timeout=max(5.0, 3 * self.heartbeat_interval))
            beat.addErrback(lambda failure: log.warn("service {name}: heartbeat failed: "
                                                     "{error}", name=self.service_name,
                                                     error=failure.getErrorMessage()))

    def _heartbeat_stats(self) -> dict[str, Any]:
        """What a heartbeat says of the requests, DHTs and buckets (read
        holding the baton)."""
        stats = self.handler.stats()
        now = time.monotonic()
        hot = self.handler.bucket_load(now - self._sampled_since)
        self._sampled_since = now
        return {"requests": stats["requests"], "malformed": stats["malformed"],
                "errors": stats["errors"], "replayed": stats["replayed"],
                "storage_errors": stats["storage_errors"],
                "internal_errors": stats["internal_errors"],
                "hot_path": stats["hot_path"],
                "dhts": stats["dhts"],
                "bucket_records": {hosted.name: hosted.bucket_records()
                                   for hosted in self.handler.dhts.values()},
                "bucket_requests": hot,
                "orphans": self.handler.holdings(unclaimed=True)}

    def _supervisor_control(self, body: dict[str, Any], link: MessageProtocol) -> Any:
        op = body["op"]
        if op == "assign":
            try:
                return {"ok": True, **self.handler.assign(body.get("dht"))}
            except StorageFault as exc:
                raise ControlError("StorageError", f"service {self.service_name}: {exc}") \
                    from None
            except ValueError as exc:
                raise ControlError("InvalidAttribute", f"service {self.service_name}: {exc}") \
                    from None
        if op in ("drop", "discard", "sync"):
            try:
                if op == "drop":
                    return {"dropped": self.handler.drop(body)}
                if op == "discard":
                    return self.handler.discard(body)
                self.handler.sync(body.get("dhts"))
                return {"ok": True}
            except ValueError as exc:
                raise ControlError("DomusError", f"service {self.service_name}: {exc}") \
                    from None
        if op == "ping":
            return {"name": self.service_name}
        if op == "shutdown":
            from twisted.internet import reactor

            reactor.callLater(0.05, reactor.stop)
            return {"ok": True}
        if op == "stats":
            return self.handler.stats()
        if op in MOVE_OPS:
            return self._move_step(op, body)
        if op == "regroup_buckets":
            return self._regroup(body)
        raise ControlError("DomusError", f"unknown control op {op!r} for a service")

    def _regroup(self, body: dict[str, Any]) -> defer.Deferred:
        """Regroup a DHT's repositories into parts of ``count`` buckets
        (domus.service.hosted, "Resizing"), a step per reactor turn so that
        requests are served meanwhile; fires with {"parts", "records",
        "seconds"} once done."""
        from twisted.internet import reactor

        hosted = self._hosted_named(body)
        count = body.get("count")
        if hosted is None or not isinstance(count, int) or isinstance(count, bool) \
                or not 1 <= count <= MAX_BUCKETS or count & (count - 1):
            raise ControlError("DomusError", f"service {self.service_name}: regroup_buckets "
                               f"needs the id of a DHT hosted here and a bucket count")
        try:
            steps = hosted.start_regroup(count)
        except StorageFault as exc:
            raise ControlError("StorageError", f"service {self.service_name}: {exc}") from None
        started = time.monotonic()
        finished: defer.Deferred = defer.Deferred()

        def step() -> None:
            try:
                next(steps)
            except StopIteration as stop:
                if stop.value is None:
                    finished.errback(ControlError("StorageError", f"service "
                                     f"{self.service_name}: regrouping DHT {hosted.name!r} "
                                     f"was stopped (the DHT changed meanwhile)"))
                else:
                    self.handler.refresh_fast_table(hosted.id)
                    finished.callback({**stop.value,
                                       "seconds": round(time.monotonic() - started, 3)})
                return
            except StorageFault as exc:
                finished.errback(ControlError("StorageError",
                                              f"service {self.service_name}: {exc}"))
                return
            except Exception as exc:  # a bug: say so, keep serving
                log.failure("service {name}: regrouping DHT {dht!r} failed",
                            name=self.service_name, dht=hosted.name)
                finished.errback(ControlError("DomusError", f"service {self.service_name}: "
                                              f"regrouping failed: {exc!r}"))
                return
            reactor.callLater(0, step)

        step()
        return finished

    def _hosted_named(self, body: dict[str, Any]) -> Any:
        """The DHT hosted here that ``body``'s ``id`` names (None if it is
        not an id, or not one hosted here)."""
        dht_id = body.get("id")
        if not isinstance(dht_id, int) or isinstance(dht_id, bool):
            return None
        return self.handler.dhts.get(dht_id)

    def _move_step(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        """One step of moving a bucket (domus.service.hosted, "Moving a
        bucket"), as the supervisor drives it."""
        hosted = self._hosted_named(body)
        bucket = body.get("bucket")
        if hosted is None or not isinstance(bucket, int) or isinstance(bucket, bool) \
                or not 0 <= bucket < hosted.bucket_count:
            raise ControlError("DomusError", f"service {self.service_name}: {op} needs the id "
                               f"of a DHT hosted here and a bucket number")
        try:
            if op == "track_bucket":
                return {"records": hosted.track(bucket)}
            if op == "catch_up_bucket":
                return {"records": hosted.catch_up(bucket)}
            if op == "freeze_bucket":
                return {"records": hosted.freeze(bucket)}
            if op == "export_bucket":
                records, following = hosted.export(bucket, int(body.get("offset", 0)),
                                                   EXPORT_PAGE_BYTES)
                return {"records": records, "next": following}
            if op == "thaw_bucket":
                hosted.thaw(bucket)
                return {"ok": True}
            if op == "stage_bucket":
                return {"records": hosted.stage(bucket, body.get("records") or [],
                                                bool(body.get("first")))}
            hosted.discard(bucket)
            return {"ok": True}
        except StorageFault as exc:
            raise ControlError("StorageError", f"service {self.service_name}: {exc}") from None

    def _copy_failed(self, hosted: Any, holder: str, why: str) -> None:
        """Tell the supervisor that the backup on ``holder`` did not take a
        change of DHT ``hosted`` (at most once a second per backup)."""
        key = (hosted.id, holder)
        now = time.monotonic()
        if now - self._reported.get(key, -1e9) < COPY_FAILED_REPORT_INTERVAL:
            return
        self._reported[key] = now
        if self.link is not None and self.registered:
            self.link.call("copy_failed", name=self.service_name, dht=hosted.name,
                           holder=holder, why=why[:500]).addErrback(
                lambda failure: log.warn("service {name}: could not report the failed backup "
                                         "on {holder}: {error}", name=self.service_name,
                                         holder=holder, error=failure.getErrorMessage()))

    def _client_control(self, body: dict[str, Any], link: MessageProtocol) -> Any:
        if body["op"] == "stats":
            return self.handler.stats()
        raise ControlError("DomusError", f"service {self.service_name} takes control op "
                           f"{body['op']!r} only from the supervisor")


class PeerLinks:
    """This service's TCP links to the services that back up its buckets,
    one per peer, made when first needed: a change goes down the one link to
    a backup, so the backup applies its primary's changes in order.  Each
    change waits in one table, answered by the backup's reply or failed by
    a lost link or a sweep of those older than REPLICATE_TIMEOUT (no timer
    and no Deferred per change: this is the replicated write path)."""

    def __init__(self, service_name: str, keys: secret.Keys | None = None) -> None:
        self.service_name = service_name
        self.keys = keys
        self._links: dict[str, MessageProtocol] = {}
        self._connecting: dict[str, list[tuple[bytes, Any, tuple[Any, ...]]]] = {}
        # request id -> (done, args, sent at, link)
        self._waiting: dict[int, tuple[Any, tuple[Any, ...], float, MessageProtocol]] = {}
        self._ids = itertools.count(1)
        self._sweeper: task.LoopingCall | None = None

    def forward(self, peer: str, address: str, request: bytes, done: Any, *args: Any) -> None:
        """Send ``request`` to ``peer`` as a REPLICATE; ``done(result,
        *args)`` is called once, with the change's own reply, or with the
        exception that kept the backup from answering."""
        self._forward(peer, address, request, done, args, False)

    def _forward(self, peer: str, address: str, request: bytes, done: Any,
                 args: tuple[Any, ...], again: bool) -> None:
        link = self._links.get(peer)
        if link is not None and link.connected:
            self._send(link, request, done, args, (peer, address, again))
            return
        waiting = self._connecting.get(peer)
        if waiting is not None:
            waiting.append((request, done, args, again))
            return
        self._connecting[peer] = [(request, done, args, again)]
        self._connect(peer, address)

    def _send(self, link: MessageProtocol, request: bytes, done: Any,
              args: tuple[Any, ...], where: tuple[str, str, bool]) -> None:
        if self._sweeper is None:
            self._sweeper = task.LoopingCall(self._sweep)
            self._sweeper.start(REPLICATE_TIMEOUT / 4, now=False)
        request_id = next(self._ids) & 0xFFFFFFFF
        self._waiting[request_id] = (done, args, time.monotonic(), link, request, where)
        link.sendString(wire.encode_replicate(request_id, link.client_id, request))

    def _answered(self, status: int, request_id: int, frame: bytes) -> None:
        waiting = self._waiting.pop(request_id, None)
        if waiting is None:
            return                          # (timed out already)
        done, args = waiting[0], waiting[1]
        if status == wire.ST_OK:
            done(frame[wire.REPLY_HEADER_SIZE:], *args)
        else:
            done(ConnectionError(f"the backup refused the change: "
                                 f"{wire.STATUS_NAMES.get(status, hex(status))}: "
                                 f"{frame[wire.REPLY_HEADER_SIZE:].decode('utf-8', 'replace')}"),
                 *args)

    def _sweep(self) -> None:
        old = time.monotonic() - REPLICATE_TIMEOUT
        for request_id in [rid for rid, entry in self._waiting.items() if entry[2] < old]:
            done, args, _sent, link, _request, _where = self._waiting.pop(request_id)
            done(TimeoutError(f"{link.peer_name} did not answer within "
                              f"{REPLICATE_TIMEOUT:.0f}s"), *args)

    def _lost(self, peer: str, link: MessageProtocol) -> None:
        if self._links.get(peer) is link:
            del self._links[peer]
        for request_id in [rid for rid, entry in self._waiting.items() if entry[3] is link]:
            done, args, _sent, _link, request, (peer, address, again) = \
                self._waiting.pop(request_id)
            if not again:
                # Once more on a new link: the backup may have closed this
                # one as idle as the change went out (a backup applies a
                # change it has applied already from its reply cache).
                self._forward(peer, address, request, done, args, True)
                continue
            done(ConnectionError(f"the link to {link.peer_name} was lost"), *args)

    def _connect(self, peer: str, address: str) -> None:
        from twisted.internet import reactor
        from twisted.internet.endpoints import TCP4ClientEndpoint, connectProtocol

        try:
            host, port = addresses.parse(address)
        except ValueError as exc:
            # (Failed at once, each change waiting for it: none is left
            # waiting on a connection that was never begun.)
            for _request, done, args, _again in self._connecting.pop(peer, []):
                done(ConnectionError(f"cannot reach service {peer}: {exc}"), *args)
            return
        link = MessageProtocol()
        link.peer_name = f"service {peer} (a backup)"
        link.reply_handler = self._answered
        link.keys = self.keys

        def made(made_link: MessageProtocol) -> None:
            self._links[peer] = made_link
            made_link.lost.addCallback(lambda _: self._lost(peer, made_link))
            for request, done, args, again in self._connecting.pop(peer, []):
                self._send(made_link, request, done, args, (peer, address, again))

        def failed(reason: Failure) -> None:
            for _request, done, args, _again in self._connecting.pop(peer, []):
                done(reason.value, *args)

        connectProtocol(TCP4ClientEndpoint(reactor, host, port, timeout=REPLICATE_TIMEOUT),
                        link).addCallback(lambda made_link: made_link.authenticated
                                          ).addCallbacks(made, failed)

    def close(self) -> None:
        if self._sweeper is not None and self._sweeper.running:
            self._sweeper.stop()
        for link in list(self._links.values()):
            if link.transport is not None:
                link.transport.loseConnection()
        self._links.clear()


class _ReleasedLoopingCall(task.LoopingCall):
    """A LoopingCall whose every call, Twisted's scheduling of the next
    included, runs in ``released()`` (the service's UdpServer.released):
    for a timer that changes nothing the C path reads unless it takes the
    baton back (UdpServer.held)."""

    def __init__(self, released: Any, f: Any) -> None:
        super().__init__(f)
        self._released = released

    def __call__(self) -> None:
        with self._released():
            super().__call__()


class _SupervisorLinkFactory(protocol.ReconnectingClientFactory):
    noisy = False
    maxDelay = RECONNECT_MAX_DELAY
    initialDelay = 0.2
    factor = 1.6

    def __init__(self, service: DomusService) -> None:
        self.service = service

    def buildProtocol(self, addr: Any) -> MessageProtocol:
        self.resetDelay()
        link = MessageProtocol()
        link.factory = self
        link.keys = self.service.keys
        link.connectionMade = lambda: (MessageProtocol.connectionMade(link),  # type: ignore[method-assign]
                                       self.service.link_made(link))
        link.lost.addCallback(lambda _: self.service.link_lost())
        return link

    def clientConnectionFailed(self, connector: Any, reason: Any) -> None:
        if not self.service._stopping:
            log.warn("service {name}: supervisor at {host}:{port} unreachable ({reason}); "
                     "retrying", name=self.service.service_name, host=connector.host,
                     port=connector.port, reason=reason.getErrorMessage())
        super().clientConnectionFailed(connector, reason)
