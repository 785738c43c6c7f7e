"""The supervisor service: registers services, creates and destroys DHTs,
decides bucket assignments, and tells services what they host.

It is not on the data path.  Clients ask it for a DHT's descriptor once,
then talk to services directly; a supervisor that is down or restarting
does not stop puts and gets.

Invariant: a DHT is in the persisted state only once every service it
involves has acknowledged hosting it.  A service that (re)registers is told
the full set of DHTs it takes part in, and drops any other.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from domus.supervisor import balancer
from domus.supervisor.metrics import SupervisorMetrics
from domus.supervisor.metrics import listen as serve_metrics
from domus.supervisor.state import SupervisorState
from domus.supervisor.timing import DOWN_AFTER, PUSH_TIMEOUT
from twisted.application.service import Service
from twisted.internet import defer, protocol, task
from twisted.logger import Logger
from twisted.python.failure import Failure

from domus._version import __version__
from domus.errors import InvalidAttribute, SupervisorError
from domus.placement import assignment, layout, replicas
from domus.wire import address as addresses
from domus.wire import checks, identities, secret
from domus.wire import launch as launch_records
from domus.wire import protocol as wire
from domus.wire.attributes import (
    MAX_BUCKETS,
    MIN_BUCKETS,
    PLATFORM_MEDIA,
    PLATFORM_NEEDS,
    check_request,
    default_bucket_count,
)
from domus.wire.control import ControlError, MessageProtocol

log = Logger(namespace="domus.supervisor")

# Deactivating a RAM DHT writes every record it holds; activating reads them.
STATE_CHANGE_TIMEOUT = 600.0
SHUTDOWN_WAIT = 30.0   # seconds a service has to stop when the deployment shuts down
# A live storage move catches up with writes made during the copy for at
# most CATCH_UP_ROUNDS rounds, and freezes the bucket (requests on it wait,
# answered MOVING) for the last one once a round brings no more than
# FREEZE_AFTER_CHANGES changed keys, or after the last round.
CATCH_UP_ROUNDS = 20
FREEZE_AFTER_CHANGES = 500
BALANCE_INTERVAL = 2.0  # seconds between two rounds of the balancer (--balance auto)
# A service whose link drops is failed over (its primaries promoted) unless
# it is back within this; a hung one, once it is unresponsive (--down-after).
FAILOVER_GRACE = 0.5
AUTOMATIC = "balancer: "    # what the balancer does by itself (``_balancing`` starts so)
REPAIRS_PER_ROUND = 32  # backups copied per round of repair
BALANCE_MODES = ("auto", "manual")
# A register that names a live service's name or address waits this long for
# that service to answer the supervisor's ping; one that does not is dead.
PROBE_TIMEOUT = 3.0
# What one service takes of one DHT: buckets of a role per service of that
# role at most.  Opening them is one turn of the service's reactor, and must
# end within the supervisor's push timeout (10 s by default): measured by
# `python -m benchmarks.bucket_cost` (docs/operations.md, "What the control
# plane checks"), about 0.45 KiB and 10 us a bucket on a RAM platform, some
# 7 KiB and 5-7 ms on Berkeley DB on disk.  A create or resize past it is
# refused, saying how many buckets the DHT's services can take.
BUCKETS_PER_SERVICE = {"python-dict": 65536, "domus-rbt": 65536,
                       "domus-bsddb-btree": 1024, "domus-bsddb-hash": 1024}
# What a control request to the supervisor may be (domus.wire.protocol.
# decode_control): the largest are a register's holdings and a heartbeat's
# per-bucket figures, well under these; in memory, at most some 64 bytes a
# container and 14 a byte of scalars.
MAX_REQUEST_BODY = 4 << 20
MAX_REQUEST_CONTAINERS = 1 << 18
# The kind of a control error that refuses a registration for good (the
# service stops, saying why); any other error in register is retried.
REFUSED = "RegistrationRefused"


class SupervisorService(Service):
    def __init__(self, *, listen: str, data_dir: str, down_after: float = DOWN_AFTER,
                 push_timeout: float = PUSH_TIMEOUT, balance: str = "auto",
                 balancer_settings: balancer.Settings | None = None,
                 secret_file: str | None = None, insecure: bool = False,
                 metrics: str | None = None) -> None:
        if not (down_after > 0 and push_timeout > 0):
            raise ValueError(f"down_after ({down_after}) and push_timeout ({push_timeout}) "
                             "must be positive numbers of seconds")
        if balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES}, not {balance!r}")
        self.listen_host, self.listen_port = addresses.parse(listen)
        self.address = f"{self.listen_host}:{self.listen_port}"
        if metrics is not None:
            addresses.parse(metrics)        # (a bad address fails before anything starts)
        self.metrics_address = metrics      # where /metrics is served; None: nowhere
        self.metrics = SupervisorMetrics(self)
        data_dir = os.path.abspath(data_dir)
        self.state = SupervisorState(data_dir)
        # The deployment secret (domus.wire.secret): given, or made at the
        # first start in the data dir; none with --insecure.
        self.keys: secret.Keys | None = None
        if not insecure:
            path = os.path.abspath(secret_file or os.path.join(data_dir, secret.SECRET_FILE))
            if secret_file is None and not os.path.exists(path):
                secret.create(path)
                log.info("made the deployment secret {path} (mode 0600): give it to every "
                         "service and client of this deployment (--secret-file or "
                         "${env})", path=path, env=secret.ENVIRONMENT)
            self.keys = secret.Keys.from_secret(secret.load(path), path)
        self.auth_failures = 0
        options: list[list[Any]] = []
        if (down_after, push_timeout) != (DOWN_AFTER, PUSH_TIMEOUT):
            options += [["--down-after", down_after], ["--push-timeout", push_timeout]]
        if balance != "auto":
            options.append(["--balance", balance])
        knobs = balancer_settings or balancer.Settings()
        for flag, value, default in (
                ("--balance-settle", knobs.settle, balancer.Settings.settle),
                ("--balance-max-moves", knobs.max_moves, balancer.Settings.max_moves),
                ("--balance-cooldown", knobs.cooldown, balancer.Settings.cooldown),
                ("--balance-cpu-busy", knobs.cpu_busy, balancer.Settings.cpu_busy),
                ("--balance-smoothing", knobs.smoothing, balancer.Settings.smoothing)):
            if value != default:
                options.append([flag, value])
        if metrics is not None:
            options.append(["--metrics", metrics])
        if insecure:
            options.append(["--insecure", None])
        elif secret_file is not None:
            options.append(["--secret-file", os.path.abspath(secret_file)])
        self.state.launch = launch_records.record("supervisor", listen, data_dir, options)
        self._shutting_down = False
        self.down_after = down_after
        self.push_timeout = push_timeout
        # The balancer (domus.supervisor.balancer): its mode, knobs and
        # memory; the services being drained; what it is doing now.
        self.balance = balance
        self.balancer_settings = balancer_settings or balancer.Settings()
        self.memory = balancer.Memory()
        self.draining: set[str] = set()
        self._balancing: str | None = None
        self._balance_timer: task.LoopingCall | None = None
        self.links: dict[str, MessageProtocol] = {}
        self.live: dict[str, dict[str, Any]] = {}   # name -> last_seen, load, stats
        self._creating: set[str] = set()
        self._registering: dict[str, str] = {}     # name -> address, while probing
        # service -> DHTs it must be taken out of (it came back without what
        # it held) once they are not being changed
        self._taking_out: dict[str, set[str]] = {}
        self._failing_over: set[str] = set()    # DHTs a failover waits for
        # service -> when its link dropped (failover waits FAILOVER_GRACE)
        self._down_since: dict[str, float] = {}
        self._started_at = time.monotonic()
        # DHT name -> what is being done to it ("being activated", ...): one
        # change at a time (activation, deactivation, a bucket move).
        self._changing: dict[str, str] = {}
        self._port: Any = None
        self._metrics_port: Any = None
        self._watch: task.LoopingCall | None = None
        self.started = time.time()

    # -------------------------------------------------------------- lifecycle
    def startService(self) -> None:
        from twisted.internet import reactor

        super().startService()
        factory = protocol.Factory.forProtocol(MessageProtocol)
        original = factory.buildProtocol

        def build(addr: Any) -> MessageProtocol:
            link = original(addr)
            link.control_handler = counted
            link.accepting, link.keys = True, self.keys
            link.max_control_body = MAX_REQUEST_BODY
            link.max_control_containers = MAX_REQUEST_CONTAINERS
            link.auth_failures = self._auth_failed
            return link

        counted = self.metrics.counted(self.control)
        factory.buildProtocol = build
        self._port = reactor.listenTCP(self.listen_port, factory, interface=self.listen_host)
        self.state.stamp_all()    # (DHTs of an older state file)
        if self.metrics_address:
            self._metrics_port = serve_metrics(reactor, self.metrics_address, self.metrics)
            log.info("supervisor: metrics at http://{address}/metrics",
                     address=self.metrics_address)
        self.state.save()     # with this process's launch record
        self._watch = task.LoopingCall(self._watch_services)
        self._watch.start(1.0, now=False)
        self._balance_timer = task.LoopingCall(self._balance_round)
        self._balance_timer.start(BALANCE_INTERVAL, now=False)
        log.info("supervisor listening on {address}; state in {path} ({services} services, "
                 "{dhts} DHTs known)", address=self.address, path=self.state.path,
                 services=len(self.state.services), dhts=len(self.state.dhts))

    def stopService(self) -> defer.Deferred:
        for timer in (self._watch, self._balance_timer):
            if timer is not None and timer.running:
                timer.stop()
        for link in list(self.links.values()):
            if link.transport is not None:
                link.transport.loseConnection()
        super().stopService()
        ports = [port for port in (self._port, self._metrics_port) if port is not None]
        return defer.DeferredList([defer.maybeDeferred(port.stopListening) for port in ports])

    def _auth_failed(self, why: str) -> None:
        self.auth_failures += 1

    # -------------------------------------------------------------- dispatch
    def control(self, body: dict[str, Any], link: MessageProtocol) -> Any:
        handler = getattr(self, "op_" + body["op"], None)
        if handler is None:
            raise ControlError("SupervisorError", f"the supervisor has no operation "
                               f"{body['op']!r}")
        params = {key: value for key, value in body.items() if key != "op"}
        try:
            return handler(link, **params)
        except TypeError as exc:
            raise ControlError("SupervisorError", f"bad arguments to {body['op']!r}: {exc}") \
                from None

    # -------------------------------------------------------------- services
    def service_state(self, name: str) -> str:
        link = self.links.get(name)
        if link is None or not link.connected:
            return "down"
        seen = self.live.get(name, {}).get("last_seen", 0.0)
        return "up" if time.monotonic() - seen < self.down_after else "unresponsive"

    def live_services(self) -> list[str]:
        return sorted(name for name in self.state.services if self.service_state(name) == "up")

    def op_register(self, link: MessageProtocol, *, name: str, address: str,
                    resources: dict[str, Any], held: dict[str, Any] | None = None,
                    version: str = "", pid: int = 0,
                    launch: dict[str, Any] | None = None,
                    platforms: list[str] | None = None,
                    hot_path: str = "", holdings: list[Any] | None = None) -> Any:
        """A service joins (or rejoins) the deployment.

        Invariant: a registration never takes over a live service's name or
        address.  A connection registers once; a name or address held by
        another connection that is still open is given up only once that
        connection's service fails to answer the supervisor's own ping
        (PROBE_TIMEOUT): the restart of a service whose old link has not
        dropped yet, or whose host vanished.  Everything the service says is
        checked (domus.wire.checks) before anything is kept; a refusal has
        kind RegistrationRefused, which tells the service that retrying
        cannot help."""
        if self._shutting_down:
            raise ControlError(REFUSED, "the deployment is shutting down; start "
                               "this service again after `domus deployment restart`")
        registered_as = getattr(link, "registered_as", None)
        if registered_as is not None:
            raise ControlError(REFUSED, f"this connection registered service "
                               f"{registered_as!r} already; a connection registers "
                               f"one service, once")
        try:
            fields = self._checked_registration(link, name, address, resources, held, version,
                                                pid, launch, platforms, hot_path, holdings)
        except ValueError as exc:
            raise ControlError(REFUSED, f"cannot register service {name!r}: {exc}") from None
        if name in self._registering or address in self._registering.values():
            raise ControlError(REFUSED, f"service {name!r} (or address {address}) is being "
                               f"registered by another connection right now")
        rivals = self._rivals(link, name, address)
        if not rivals:
            return self._admit(link, fields)
        self._registering[name] = address
        link.registered_as = name       # (no second register while this one waits)

        def probed(results: list[tuple[bool, Any]]) -> Any:
            self._registering.pop(name, None)
            link.registered_as = None
            # (each probe fires True for a dead service: see _probe)
            alive = [(rival, holder) for (rival, holder), (_fired, dead) in zip(rivals, results)
                     if not dead]
            if alive:
                _rival, holder = alive[0]
                what = (f"service name {name!r} is taken by a live service at "
                        f"{self.state.services[holder]['address']}" if holder == name else
                        f"address {address} is that of live service {holder!r}")
                raise ControlError(REFUSED, f"{what}; give this one another --name (or "
                                   f"--listen), or stop that one first")
            if not link.connected:
                raise ControlError(REFUSED, "the registering connection closed")
            for rival, holder in rivals:
                log.info("service {holder} did not answer the supervisor's ping; its link "
                         "is closed for the registration of {name}", holder=holder, name=name)
                _drop_link(rival)
            return self._admit(link, fields)

        probes = [self._probe(rival) for rival, _holder in rivals]
        return defer.DeferredList(probes).addCallback(probed)

    def _sort_holdings(self, name: str, holdings: list[dict[str, Any]]
                       ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """What service ``name`` holds, sorted into what it must drop (DHTs
        of this deployment that were destroyed, or that it no longer takes
        part in: named by id, deployment and stamp) and what this supervisor
        does not know (kept by the service: orphans).  The next DHT id
        skips the orphans' ids, so that no new DHT is given one."""
        drops, unknown = [], []
        mine = {descriptor["id"]: descriptor for descriptor in self._descriptors_for(name)}
        by_stamp = {descriptor.get("stamp"): descriptor for descriptor in self.state.dhts.values()}
        for holding in holdings:
            known = by_stamp.get(holding["stamp"]) if holding["stamp"] else None
            if holding["deployment"] == self.state.deployment and known is not None \
                    and known["id"] == holding["id"]:
                if holding["id"] not in mine:
                    drops.append(identities.of(known))
            elif holding["deployment"] == self.state.deployment \
                    and holding["stamp"] in self.state.destroyed:
                drops.append(identities.of(holding))
            elif holding["stamp"] is None and holding["id"] in mine:
                continue        # (data of an older Domus: the next assign stamps it)
            else:
                unknown.append(holding)
        if unknown:
            self.state.next_dht_id = max(self.state.next_dht_id,
                                         max(holding["id"] for holding in unknown) + 1)
        return drops, unknown

    def _orphans(self, name: str, holdings: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The holdings a service reports (its heartbeat's ``orphans``:
        those the supervisor has not told it to host) that this supervisor
        does not know."""
        known = {(descriptor.get("deployment"), descriptor.get("stamp"))
                 for descriptor in self.state.dhts.values()}
        return [holding for holding in holdings
                if (holding["deployment"], holding["stamp"]) not in known
                or holding["stamp"] is None]

    def _rivals(self, link: MessageProtocol, name: str,
                address: str) -> list[tuple[MessageProtocol, str]]:
        """The open links of other services that hold ``name`` or
        ``address``: (link, service name)."""
        rivals = []
        for holder, record in self.state.services.items():
            if holder != name and record["address"] != address:
                continue
            other = self.links.get(holder)
            if other is not None and other is not link and other.connected:
                rivals.append((other, holder))
        return rivals

    def _probe(self, rival: MessageProtocol) -> defer.Deferred:
        """Fires True if the service on ``rival`` is dead (no answer to a
        ping within PROBE_TIMEOUT, or its link drops), False if it answers
        anything."""
        from domus.wire.control import RemoteControlError

        def answered(_: Any) -> bool:
            return False

        def failed(failure: Any) -> bool:
            return not failure.check(RemoteControlError)

        return rival.call("ping", timeout=PROBE_TIMEOUT).addCallbacks(answered, failed)

    def _checked_registration(self, link: MessageProtocol, name: Any, address: Any,
                              resources: Any, held: Any, version: Any, pid: Any, launch: Any,
                              platforms: Any, hot_path: Any, holdings: Any) -> dict[str, Any]:
        checks.service_name(name)
        checks.address(address)
        fields: dict[str, Any] = {"name": name, "address": address,
                                  "resources": checks.resources(resources)}
        if not (isinstance(version, str) and len(version) <= 64):
            raise ValueError(f"version {version!r} is not a short string")
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 1 << 32:
            raise ValueError(f"pid {pid!r} is not a process id")
        if hot_path not in ("", "c", "python"):
            raise ValueError(f"hot path {hot_path!r} is not 'c' or 'python'")
        if platforms is not None and not (
                isinstance(platforms, list) and len(platforms) <= 64
                and all(isinstance(platform, str) and len(platform) <= 64
                        for platform in platforms)):
            raise ValueError("platforms must be a list of platform names")
        if held is not None and not (isinstance(held, dict) and len(held) <= 1 << 20
                                     and all(isinstance(key, str) for key in held)):
            raise ValueError("held must be a map of DHT ids")
        if launch is not None:
            # Kept only from an authenticated connection (all of them, on a
            # secure deployment; on an insecure one, none is, and records are
            # kept all the same), and only as validated fields.
            if self.keys is not None and not link.secure:
                raise ValueError("a launch record is taken only from an authenticated "
                                 "connection")
            launch = launch_records.validate(launch)
            if launch["role"] != "service" or launch["name"] != name \
                    or launch["address"] != address:
                raise ValueError("its launch record is not that of this service (role, "
                                 "name and address must match)")
        fields.update(version=version, pid=pid, launch=launch, platforms=platforms,
                      hot_path=hot_path, held={str(key) for key in (held or {})},
                      holdings=identities.checked_holdings(holdings))
        return fields

    def _admit(self, link: MessageProtocol, fields: dict[str, Any]) -> dict[str, Any]:
        name, address, resources = fields["name"], fields["address"], fields["resources"]
        known = self.state.services.get(name)
        old = self.links.get(name)
        if old is not None and old is not link and old.connected:
            _drop_link(old)           # (proven dead, or never live: see op_register)
        record = {"name": name, "address": address, "resources": resources,
                  "registered": (known or {}).get("registered", time.time()),
                  "last_registered": time.time(), "version": fields["version"],
                  "pid": fields["pid"],
                  "launch": fields["launch"] or (known or {}).get("launch"),
                  # the storage platforms it can run (None: it did not say,
                  # as services before 0.1.0 did not: every platform)
                  "platforms": fields["platforms"], "hot_path": fields["hot_path"]}
        drops, unknown = self._sort_holdings(name, fields["holdings"])
        self.state.services[name] = record
        moved = known is not None and known["address"] != address
        if moved:
            self._readdress(name, address)
        if known is not None:
            self._returning(name, fields["held"])
        try:
            self.state.save()
        except OSError as exc:
            # (A full disk, say.  What changed above is kept in memory, and
            # saved by the next change; the service retries, as it does any
            # error that is not a refusal, and its retry finds it known.)
            raise ControlError("SupervisorError", f"the supervisor could not save its state: "
                               f"{exc}; the service will retry") from None
        self.links[name] = link
        link.registered_as = name
        self._down_since.pop(name, None)
        link.peer_name = f"service {name}"
        self.live[name] = {"last_seen": time.monotonic(), "load": {}, "stats": {},
                           "orphans": unknown}
        link.lost.addCallback(lambda _: self._link_lost(name, link))
        log.info("service {name} registered from {address} (pid {pid}); {cores} cores, "
                 "{ram} MiB RAM", name=name, address=address, pid=fields["pid"],
                 cores=resources.get("cores"), ram=int(resources.get("ram", 0)) >> 20)
        if unknown:
            log.warn("service {name} holds {count} DHT(s) this supervisor does not know: "
                     "{dhts}; it keeps them (`domus status` lists them; `domus service "
                     "discard {name} ID` discards one)", name=name, count=len(unknown),
                     dhts=[f"{orphan['name']} (id {orphan['id']})" for orphan in unknown])
        self.metrics.registrations += 1
        return {"dhts": self._descriptors_for(name), "supervisor_version": __version__,
                "deployment": self.state.deployment, "drop": drops}

    def _readdress(self, name: str, address: str) -> None:
        for descriptor in self.state.dhts.values():
            moved = False
            for role in ("routing_services", "storage_services"):
                for entry in descriptor[role]:
                    if entry["name"] == name:
                        entry["address"] = address
                        moved = True
            if moved:
                descriptor["version"] = layout.next_version(descriptor)

    def _link_lost(self, name: str, link: MessageProtocol) -> None:
        if self.links.get(name) is link:
            del self.links[name]
            log.warn("service {name} disconnected", name=name)
            since = self._down_since[name] = time.monotonic()
            if not self._shutting_down:
                from twisted.internet import reactor

                reactor.callLater(FAILOVER_GRACE, self._fail_over_if_gone, name, since)

    def _fail_over_if_gone(self, name: str, since: float) -> None:
        """The grace after a link dropped at ``since`` is over: fail the
        service over unless it is back (or dropped again since)."""
        if (self.service_state(name) == "down" and name in self.state.services
                and self._down_since.get(name) == since):
            self._fail_over(name, "its link to the supervisor dropped")

    def _down_past_grace(self, name: str) -> bool:
        """Down longer than a failover waits: FAILOVER_GRACE since its link
        dropped, or, for a service not back since this supervisor started,
        the time a silent service is given (its link is being made again)."""
        since = self._down_since.get(name)
        if since is None:
            return time.monotonic() - self._started_at >= self.down_after
        return time.monotonic() - since >= FAILOVER_GRACE

    def op_heartbeat(self, link: MessageProtocol, *, name: str, load: dict[str, Any],
                     stats: dict[str, Any] | None = None) -> dict[str, Any]:
        if self.links.get(name) is not link:
            raise ControlError("UnknownService", f"service {name!r} is not registered on "
                               f"this link; register first")
        try:
            checks.load(load)
            stats = _checked_stats(stats or {})
            orphans = self._orphans(name, identities.checked_holdings(stats.pop("orphans", None)))
        except ValueError as exc:
            raise ControlError("SupervisorError", f"heartbeat of service {name!r} refused: "
                               f"{exc}") from None
        self.live[name] = {"last_seen": time.monotonic(), "load": load, "stats": stats,
                           "orphans": orphans}
        next_id = max((orphan["id"] for orphan in orphans), default=0) + 1
        if next_id > self.state.next_dht_id:
            self.state.next_dht_id = next_id
            self.state.save()
        self.metrics.heartbeats += 1
        return {"ok": True}

    def _watch_services(self) -> None:
        for name in list(self.links):
            if self.service_state(name) == "unresponsive":
                silent = time.monotonic() - self.live.get(name, {}).get("last_seen", 0)
                log.warn("service {name} has sent no heartbeat for {seconds:.1f}s",
                         name=name, seconds=silent)
                self._fail_over(name, f"it sent no heartbeat for {silent:.0f}s")
        self._fail_over_down()
        for name, dhts in list(self._taking_out.items()):
            for dht in sorted(dhts):
                if dht not in self._changing:
                    dhts.discard(dht)
                    self._take_out(name, dht)
            if not dhts:
                del self._taking_out[name]
        self._resume_dhts()

    def _resume_dhts(self) -> None:
        """Activate again each RAM DHT a deployment shutdown saved, as soon
        as every service it involves is back up."""
        if self._shutting_down:
            return
        for name, descriptor in list(self.state.dhts.items()):
            if (not descriptor.get("resume") or name in self._changing
                    or any(self.service_state(service) != "up"
                           for service in self._involved(descriptor))):
                continue
            log.info("activating DHT {name!r} again: the deployment was restarted", name=name)
            self._change_state(name, "active").addErrback(
                lambda failure, dht=name: log.error(
                    "could not activate DHT {name!r} after the restart: {error}; it stays "
                    "inactive (`domus dht activate {name}` tries again)", name=dht,
                    error=failure.getErrorMessage()))

    def op_services(self, link: MessageProtocol) -> list[dict[str, Any]]:
        return [self._service_view(name) for name in sorted(self.state.services)]

    def _service_view(self, name: str) -> dict[str, Any]:
        record = self.state.services[name]
        roles: set[str] = set()
        buckets: dict[str, dict[str, int]] = {}
        for dht_name, descriptor in self.state.dhts.items():
            counts = {}
            for role in layout.ROLES:
                if any(entry["name"] == name for entry in descriptor[f"{role}_services"]):
                    # What it holds now: its initial count, give or take moves.
                    counts[role] = layout.owners(descriptor, role).buckets(name)
                    roles.add(role)
            if counts:
                buckets[dht_name] = counts
        live = self.live.get(name, {})
        return {"name": name, "address": record["address"], "state": self.service_state(name),
                "roles": sorted(roles), "buckets": buckets, "resources": record["resources"],
                "load": live.get("load", {}), "stats": live.get("stats", {}),
                "pid": record.get("pid"), "version": record.get("version"),
                "platforms": self._platforms_of(name), "hot_path": record.get("hot_path", ""),
                # DHTs it holds that this supervisor does not know (kept;
                # `domus service discard` removes one)
                "unknown_dhts": live.get("orphans", [])}

    def _platforms_of(self, name: str) -> list[str]:
        platforms = self.state.services[name].get("platforms")
        return list(PLATFORM_MEDIA) if platforms is None else platforms

    def op_remove_service(self, link: MessageProtocol, *, name: str,
                          force: bool = False) -> Any:
        if name not in self.state.services:
            raise ControlError("UnknownService", f"no service named {name!r} is registered")
        held = self._held_by(name)
        stats = (self.live.get(name, {}).get("stats") or {}).get("dhts", {})
        records = sum((stats.get(dht) or {}).get("records", 0) for dht in held)
        if held and not force:
            raise ControlError("SupervisorError", f"service {name!r} still holds buckets of "
                               f"DHT(s) {held} ({records} records); drain it first "
                               f"(`domus service drain {name}`), then remove it, or remove "
                               f"it with --force, which loses those records")
        if held:
            return self._force_out(name, held, records)
        # It holds nothing: take it out of the DHTs that still list it (with
        # count 0 once rebased; a count left means a layout that needs it).
        listing = self._descriptors_for(name)
        for descriptor in listing:
            counted = [entry for role in ("routing_services", "storage_services")
                       for entry in descriptor[role] if entry["name"] == name and entry["count"]]
            if counted:
                raise ControlError("SupervisorError", f"service {name!r} holds no bucket, but "
                                   f"DHT {descriptor['name']!r} still counts it in its layout; "
                                   f"run `domus dht rebalance {descriptor['name']}` first")
        changed = []
        for descriptor in listing:
            stripped = dict(descriptor, version=layout.next_version(descriptor))
            for role in ("routing_services", "storage_services"):
                stripped[role] = [entry for entry in descriptor[role] if entry["name"] != name]
            self.state.dhts[descriptor["name"]] = stripped
            changed.append(stripped)
        del self.state.services[name]
        self.draining.discard(name)
        self.state.save()
        old_link = self.links.pop(name, None)
        pushes = [self._push(self._involved(descriptor), descriptor, self.push_timeout)
                  for descriptor in changed]
        if old_link is not None:
            pushes.append(old_link.call("shutdown", timeout=self.push_timeout)
                          .addErrback(lambda _failure: None))
        return defer.DeferredList(pushes, consumeErrors=True).addCallback(
            lambda _: {"removed": name})

    # -------------------------------------------------------------- DHTs
    def _descriptors_for(self, name: str) -> list[dict[str, Any]]:
        taking_out = self._taking_out.get(name, set())
        return [self._without(descriptor, name, restarted=True)
                if descriptor["name"] in taking_out else descriptor
                for descriptor in self.state.dhts.values()
                if any(entry["name"] == name
                       for role in ("routing_services", "storage_services")
                       for entry in descriptor[role])]

    def _find(self, name: str) -> dict[str, Any]:
        descriptor = self.state.dhts.get(name)
        if descriptor is None:
            known = ", ".join(sorted(self.state.dhts)) or "none"
            raise ControlError("UnknownDht", f"no DHT named {name!r} (DHTs: {known}); "
                               f"create it with create_dht or `domus dht create`")
        return descriptor

    def op_open_dht(self, link: MessageProtocol, *, name: str) -> dict[str, Any]:
        return self._find(name)

    def op_dht_info(self, link: MessageProtocol, *, name: str) -> dict[str, Any]:
        descriptor = dict(self._find(name))
        records = {}
        for entry in descriptor["storage_services"]:
            stats = self.live.get(entry["name"], {}).get("stats", {})
            held = stats.get("dhts", {}).get(name)
            records[entry["name"]] = held["records"] if held else None
        descriptor["records_reported"] = records
        descriptor["hot_buckets"] = self._hot_buckets(name)
        descriptor["replication"] = self._replica_view(descriptor)
        return descriptor

    def _hot_buckets(self, name: str, top: int = 10) -> list[dict[str, Any]]:
        """The buckets of DHT ``name`` that served the most requests per
        second in the services' last heartbeats (sampled), busiest first."""
        hot = []
        for service, live in self.live.items():
            stats = live.get("stats") or {}
            records = (stats.get("bucket_records") or {}).get(name) or {}
            for bucket, rate in ((stats.get("bucket_requests") or {}).get(name) or {}).items():
                hot.append({"bucket": int(bucket), "service": service,
                            "requests_per_s": rate, "records": records.get(bucket)})
        hot.sort(key=lambda entry: -entry["requests_per_s"])
        return hot[:top]

    def op_list_dhts(self, link: MessageProtocol) -> list[dict[str, Any]]:
        return [self._summary(descriptor) for descriptor in self.state.dhts.values()]

    @staticmethod
    def _summary(descriptor: dict[str, Any]) -> dict[str, Any]:
        return {key: descriptor[key] for key in ("name", "id", "buckets", "hash", "storage",
                                                 "platform", "routing", "lookup", "state",
                                                 "created")} | {
            "resume": descriptor.get("resume", False),
            "routing_degree": descriptor.get("routing_degree"),
            "routing_algorithm": descriptor.get("routing_algorithm") or "fewest-hops",
            "routing_services": [entry["name"] for entry in descriptor["routing_services"]],
            "storage_services": [entry["name"] for entry in descriptor["storage_services"]],
            "replicas": descriptor.get("replicas") or 1,
            "codec": descriptor.get("codec") or "msgpack",
            "degraded": bool(replicas.missing(descriptor)),
            "lost_buckets": len(descriptor.get("storage_lost") or {})}

    @defer.inlineCallbacks
    def op_create_dht(self, link: MessageProtocol, *, name: str,
                      attributes: dict[str, Any] | None = None) -> Any:
        try:
            wanted = check_request(name, attributes or {})
        except InvalidAttribute as exc:
            raise ControlError("InvalidAttribute", str(exc)) from None
        if wanted["codec"] == "pickle" and self.keys is None:
            raise ControlError("InvalidAttribute", (
                f"DHT {name!r}: codec 'pickle' needs a deployment with a secret, and this one "
                f"runs --insecure: anyone who can send it a datagram could store a pickle "
                f"that runs code in every client that reads it. Use codec 'msgpack' or "
                f"'raw', or restart the deployment with a secret"))
        if name in self.state.dhts or name in self._creating:
            raise ControlError("DhtExists", f"a DHT named {name!r} already exists; open it with "
                               f"open_dht, or destroy it first")
        self._creating.add(name)
        try:
            descriptor = self._plan(name, wanted)
            involved = self._involved(descriptor)
            acks = [self.links[service].call("assign", dht=descriptor, timeout=self.push_timeout)
                    for service in involved]
            results = yield defer.DeferredList(acks, consumeErrors=True)
            failed = [service for service, (ok, _value) in zip(involved, results) if not ok]
            if failed:
                for service in involved:
                    link_to = self.links.get(service)
                    if link_to is not None:
                        link_to.call("drop", **identities.of(descriptor)).addErrback(
                            lambda _f: None)
                self.state.forget(descriptor)
                self.state.save()
                raise ControlError("SupervisorError", f"could not create DHT {name!r}: "
                                   f"service(s) {failed} did not acknowledge; check "
                                   f"`domus status` and try again")
            self.state.dhts[name] = descriptor
            self.state.save()
            log.info("created DHT {name!r} (id {id}): {buckets} buckets, routing on {routing}, "
                     "storage on {storage}", name=name, id=descriptor["id"],
                     buckets=descriptor["buckets"],
                     routing=[e["name"] for e in descriptor["routing_services"]],
                     storage=[e["name"] for e in descriptor["storage_services"]])
            return descriptor
        finally:
            self._creating.discard(name)

    def _able_to_store(self, platform: str, services: list[str], *, named: bool) -> list[str]:
        """The services of ``services`` that can store ``platform``.  A
        Berkeley DB platform is an optional extra: services without it are
        left out, and a DHT none can store (or one whose named storage
        services cannot) is refused before anything is assigned."""
        able = [service for service in services if platform in self._platforms_of(service)]
        unable = [service for service in services if service not in able]
        if able and not (named and unable):
            return able
        need = PLATFORM_NEEDS.get(platform, "a newer Domus")
        which = f"service(s) {unable} cannot" if named and unable else "no live service can"
        raise ControlError("PlatformUnavailable",
                           f"{which} store platform {platform!r}: it needs {need} where the "
                           f"services run, then a restart of those services")

    def _with_room(self, wanted: dict[str, Any], services: list[str],
                   named: bool) -> list[str]:
        """A disk DHT's storage services, but those whose disk is at its
        reserve (balancer.takes_storage); named ones must all have room."""
        view = self._balancer_view()
        full = [name for name in services if not balancer.takes_storage(wanted, view[name])]
        if full and (named or len(full) == len(services)):
            raise ControlError("StorageError", f"service(s) {full} have their disk at its "
                               f"reserve (`domus status`); free space there, or store the "
                               f"DHT elsewhere")
        return [name for name in services if name not in full]

    def _plan(self, name: str, wanted: dict[str, Any]) -> dict[str, Any]:
        live = self.live_services()
        if not live:
            raise ControlError("NoServices", "no live services are registered; start some "
                               "with `domus service` (or `domus up`) first")
        sets = {}
        for role in ("routing_services", "storage_services"):
            chosen = wanted.get(role) or live
            for service in chosen:
                if service not in self.state.services:
                    raise ControlError("UnknownService", f"{role} names {service!r}, which is "
                                       f"not registered (services: {sorted(self.state.services)})")
                if self.service_state(service) != "up":
                    raise ControlError("SupervisorError", f"{role} names {service!r}, which is "
                                       f"{self.service_state(service)}; start it or leave it out")
            if role == "storage_services":
                chosen = self._able_to_store(wanted["platform"], chosen,
                                             named=bool(wanted.get(role)))
                chosen = self._with_room(wanted, chosen, named=bool(wanted.get(role)))
            sets[role] = list(chosen)
        buckets = wanted.get("buckets") or default_bucket_count(
            len(set(sets["routing_services"]) | set(sets["storage_services"])))
        descriptor: dict[str, Any] = {
            "id": self.state.allocate_dht_id(), "name": name, "buckets": buckets,
            "hash": wanted["hash"], "storage": wanted["storage"], "platform": wanted["platform"],
            "routing": wanted["routing"], "routing_degree": wanted["routing_degree"],
            "routing_algorithm": wanted["routing_algorithm"], "lookup": wanted["lookup"],
            "durability": wanted["durability"], "codec": wanted["codec"], "state": "active",
            "created": time.time(), "version": 1, "initial_buckets": buckets,
            # whose it is (domus.wire.identities): a service deletes its
            # data only when told to by a message naming both
            "deployment": self.state.deployment, "stamp": identities.new(),
            # roles given no service list follow the deployment: services
            # that register later get their share (the balancer)
            "follow": [role for role in layout.ROLES if not wanted.get(f"{role}_services")],
        }
        for role, role_name in (("routing_services", "routing"), ("storage_services", "storage")):
            services = sets[role]
            weights = [assignment.weight(self.state.services[s]["resources"], role_name,
                                         wanted["storage"]) for s in services]
            counts = assignment.proportional_counts(buckets, weights)
            descriptor[role] = [{"name": s, "address": self.state.services[s]["address"],
                                 "count": count} for s, count in zip(services, counts)]
        self._check_scale(name, buckets, descriptor)
        copies = wanted.get("replicas") or 1
        descriptor["replicas"] = copies
        if copies > 1:
            storage = sets["storage_services"]
            hosts = {name: self.state.services[name]["resources"].get("hostname", name)
                     for name in storage}
            try:
                backups = replicas.place_backups(layout.initial(descriptor, "storage"),
                                                 storage, hosts, copies)
            except ValueError as exc:
                raise ControlError("InvalidAttribute", f"DHT {name!r}: {exc}") from None
            descriptor["storage_backups"] = [replicas.encode(copy) for copy in backups]
        return descriptor

    @staticmethod
    def _check_scale(name: str, buckets: int, descriptor: dict[str, Any]) -> None:
        """Refuse a bucket count the DHT's services cannot take (see
        BUCKETS_PER_SERVICE), naming the largest they can."""
        cap = BUCKETS_PER_SERVICE.get(descriptor["platform"], 1024)
        for role in ("routing_services", "storage_services"):
            services = max(1, len(descriptor[role]))
            if buckets > cap * services:
                most = 1 << (cap * services).bit_length() - 1
                raise ControlError("InvalidAttribute", f"DHT {name!r}: {buckets} buckets is "
                                   f"more than its {services} {role.split('_')[0]} service(s) "
                                   f"can take: each takes at most {cap} buckets of a "
                                   f"{descriptor['platform']} DHT, so at most {most} buckets "
                                   f"(a power of two) here; add services or ask for fewer")

    @staticmethod
    def _involved(descriptor: dict[str, Any]) -> list[str]:
        names: dict[str, None] = {}
        for role in ("routing_services", "storage_services"):
            for entry in descriptor[role]:
                names[entry["name"]] = None
        return list(names)

    def op_destroy_dht(self, link: MessageProtocol, *, name: str) -> defer.Deferred:
        descriptor = self._find(name)
        self._refuse_while_changing(name, "destroy")
        del self.state.dhts[name]
        self.state.forget(descriptor)
        self.state.save()
        drops = []
        for service in self._involved(descriptor):
            link_to = self.links.get(service)
            if link_to is not None:
                drops.append(link_to.call("drop", **identities.of(descriptor),
                                          timeout=self.push_timeout)
                             .addErrback(lambda failure, s=service: log.warn(
                                 "service {service} did not drop DHT {name!r}: {error}; it "
                                 "will when it next registers", service=s, name=name,
                                 error=failure.getErrorMessage())))
        log.info("destroyed DHT {name!r} (id {id})", name=name, id=descriptor["id"])
        # Answer once the services have dropped it (or failed to say so): a
        # request sent after destroy_dht returns must not find it still served.
        return defer.DeferredList(drops).addCallback(lambda _: {"destroyed": name})

    # -------------------------------------------------------------- activation
    def op_deactivate_dht(self, link: MessageProtocol, *, name: str) -> defer.Deferred:
        return self._change_state(name, "inactive")

    def op_activate_dht(self, link: MessageProtocol, *, name: str) -> defer.Deferred:
        return self._change_state(name, "active")

    @defer.inlineCallbacks
    def _change_state(self, name: str, state: str, resume: bool = False) -> Any:
        """Take a DHT offline (its RAM records saved by each service, its
        memory freed) or bring it back, on every service it involves.

        All or nothing: every involved service must be up and must
        acknowledge; if one fails, those that changed are told to change
        back, and the DHT keeps its state.  The state is saved only once
        every service has changed, so a supervisor restart re-applies the
        state it knew, and a service that re-registers meanwhile is told it."""
        descriptor = self._find(name)
        verb = "deactivate" if state == "inactive" else "activate"
        if descriptor.get("state", "active") == state:
            return {"name": name, "state": state, "changed": False, "records": {}}
        self._refuse_while_changing(name, verb)
        involved = self._involved(descriptor)
        down = [service for service in involved if self.service_state(service) != "up"]
        if down:
            raise ControlError("SupervisorError", f"cannot {verb} DHT {name!r}: service(s) "
                               f"{down} are not up; start them (`domus status` shows them) "
                               f"and try again")
        changed = dict(descriptor, state=state)
        # ``resume``: deactivated by a deployment shutdown, to be activated
        # again once its services are back (see _resume_dhts).
        changed.pop("resume", None)
        if resume:
            changed["resume"] = True
        self._changing[name] = f"being {verb}d"
        try:
            answers = yield defer.DeferredList(
                [self.links[service].call("assign", dht=changed, timeout=STATE_CHANGE_TIMEOUT)
                 for service in involved], consumeErrors=True)
            failed = {service: failure.getErrorMessage()
                      for service, (ok, failure) in zip(involved, answers) if not ok}
            if failed:
                for service, (ok, _answer) in zip(involved, answers):
                    if ok and service in self.links:
                        self.links[service].call("assign", dht=descriptor,
                                                 timeout=STATE_CHANGE_TIMEOUT).addErrback(
                            lambda failure, s=service: log.warn(
                                "service {service} did not undo the change of DHT {name!r}: "
                                "{error}; it will when it next registers", service=s,
                                name=name, error=failure.getErrorMessage()))
                problems = "; ".join(f"{service}: {message}"
                                     for service, message in sorted(failed.items()))
                raise ControlError("SupervisorError", f"could not {verb} DHT {name!r}, which "
                                   f"stays {descriptor.get('state', 'active')}: {problems}")
            records = {service: answer.get("records", 0)
                       for service, (_ok, answer) in zip(involved, answers)}
            # ``saved``: what each service wrote to its RAM snapshot, so that
            # activation can tell a missing or short snapshot from an empty
            # one.  Kept while inactive, sent with the activation, then gone.
            changed.pop("saved", None)
            if state == "inactive" and descriptor["storage"] == "ram":
                changed["saved"] = records
            self.state.dhts[name] = changed
            self.state.save()
        finally:
            self._changing.pop(name, None)
        log.info("{verb}d DHT {name!r}: {records} records {how}", verb=verb, name=name,
                 records=sum(records.values()),
                 how="saved or closed on disk" if state == "inactive" else "back in service")
        return {"name": name, "state": state, "changed": True, "records": records}

    def _refuse_while_changing(self, name: str, verb: str) -> None:
        doing = self._changing.get(name)
        if doing is not None:
            raise ControlError("SupervisorError", f"cannot {verb} DHT {name!r} now: it is "
                               f"{doing}; try again once that has finished")

    # -------------------------------------------------------------- moving a bucket
    # Moving one bucket's routing or storage to another service, by hand
    # (``domus dht move``).  The counts of the descriptor never change; the
    # move is listed in its ``<role>_moves``, and a service new to the role
    # is listed with count 0 (domus.placement.layout.move).  A move never takes a
    # service out of a DHT.
    #
    # A routing move changes the layout only, all or nothing as activation
    # is: every service the DHT involves (the new one included) takes the
    # new descriptor, or those that did are given the old one back.
    #
    # A storage move copies the bucket's records (domus.service.hosted,
    # "Moving a bucket"): the source freezes the bucket, its records are
    # paged into a staged copy on the target, then the new layout is
    # published.  Invariant: until the target has acknowledged the new
    # layout, the source's frozen copy is the bucket, and any failure thaws
    # it (nothing changed, nothing lost).  From that acknowledgement on, the
    # target's copy is the bucket: the new layout is saved at once and never
    # rolled back, because the source deletes its copy as soon as it hears
    # of it, and a source that failed to answer may have heard.  A service
    # that misses the new layout then (it died, or failed) gets it when it
    # next registers; until then the source answers MOVING for the bucket.

    def op_move_bucket(self, link: MessageProtocol, *, name: str, bucket: int, role: str,
                       service: str) -> Any:
        descriptor = self._find(name)
        if role not in layout.ROLES:
            raise ControlError("SupervisorError", f"a bucket's role is 'routing' or "
                               f"'storage', not {role!r}")
        buckets = descriptor["buckets"]
        if isinstance(bucket, bool) or not isinstance(bucket, int) or not 0 <= bucket < buckets:
            raise ControlError("SupervisorError", f"DHT {name!r} has buckets 0 to "
                               f"{buckets - 1}; {bucket!r} is not one of them")
        if service not in self.state.services:
            raise ControlError("UnknownService", f"no service named {service!r} is "
                               f"registered (services: {sorted(self.state.services)})")
        if descriptor.get("state", "active") == "inactive":
            raise ControlError("SupervisorError", f"DHT {name!r} is inactive; activate it "
                               f"(`domus dht activate {name}`) before moving its buckets")
        self._refuse_while_changing(name, "move a bucket of")
        if role == "storage":
            self._able_to_store(descriptor["platform"], [service], named=True)
            if any(copy.get(bucket) == service for copy in replicas.backups(descriptor)):
                raise ControlError("SupervisorError", f"service {service} holds a backup of "
                                   f"bucket {bucket} of DHT {name!r}: the primary there would "
                                   f"leave the bucket a copy short; move it to a service that "
                                   f"holds no copy of it")
        source = layout.owners(descriptor, role).owner(bucket)
        answer = {"name": name, "bucket": bucket, "role": role, "from": source, "to": service,
                  "changed": False, "records": None, "seconds": 0.0, "lagging": {}}
        if source == service:
            return answer        # already there: nothing to do
        moved = layout.move(descriptor, role, bucket, service,
                            self.state.services[service]["address"])
        needed = [source, service] if role == "storage" else self._involved(moved)
        down = [peer for peer in needed if self.service_state(peer) != "up"]
        if down:
            raise ControlError("SupervisorError", f"cannot move {role} of bucket {bucket} of "
                               f"DHT {name!r} from {source} to {service}: service(s) {down} "
                               f"are not up; start them (`domus status` shows them) and try "
                               f"again")
        self._changing[name] = f"having {role} of bucket {bucket} moved to {service}"
        started = time.monotonic()
        moving = (self._move_storage(descriptor, moved, bucket, source, service)
                  if role == "storage" else self._move_routing(descriptor, moved, bucket))

        def done(result: dict[str, Any]) -> dict[str, Any]:
            seconds = time.monotonic() - started
            if link is not None:                # (_carry_out counts its own)
                self.metrics.moved("hand", role, seconds)
            log.info("DHT {name!r}: {role} of bucket {bucket} moved from {source} to "
                     "{target} in {seconds:.2f}s{records}", name=name, role=role,
                     bucket=bucket, source=source, target=service, seconds=seconds,
                     records=f" ({result['records']} records)" if role == "storage" else "")
            return answer | result | {"changed": True, "seconds": seconds}

        def finished(result: Any) -> Any:
            self._changing.pop(name, None)
            if link is not None and isinstance(result, Failure):
                self.metrics.move_failed("hand", role)
            return result

        return moving.addCallback(done).addBoth(finished)

    # ------------------------------------------------------------ balancing
    def _balancer_view(self) -> dict[str, dict[str, Any]]:
        """What the balancer knows of each service."""
        return {name: {"resources": record["resources"], "state": self.service_state(name),
                       "address": record["address"],
                       "load": self.live.get(name, {}).get("load", {}),
                       "platforms": record.get("platforms")}
                for name, record in self.state.services.items()}

    def _records_per_bucket(self, dht: str) -> dict[str, float]:
        """service -> records per bucket it stores of ``dht`` (its last
        heartbeat's counts): the balancer's estimate of a move's size."""
        estimate = {}
        for name, live in self.live.items():
            held = (live.get("stats") or {}).get("dhts", {}).get(dht)
            if held and held.get("storage_buckets"):
                estimate[name] = held["records"] / held["storage_buckets"]
        return estimate

    def _heat(self, dht: str) -> dict[str, dict[int, float]]:
        """service -> bucket -> requests per second on its busiest buckets
        of ``dht`` (sampled; their last heartbeats)."""
        heat = {}
        for name, live in self.live.items():
            sampled = ((live.get("stats") or {}).get("bucket_requests") or {}).get(dht) or {}
            heat[name] = {int(bucket): rate for bucket, rate in sampled.items()}
        return heat

    def _whole_plan(self, name: str) -> list[balancer.Move]:
        """Every move that takes DHT ``name`` to its targets now, with no
        wait, budget or rest (``rebalance``, a drain)."""
        unbounded = dataclasses.replace(self.balancer_settings, max_moves=1 << 30,
                                        records_per_round=1 << 62, cooldown=0.0)
        scratch = balancer.Memory(factors=dict(self.memory.factors),
                                  others=dict(self.memory.others), pins=dict(self.memory.pins))
        return balancer.plan(self.state.dhts[name], self._balancer_view(), scratch, unbounded,
                             immediate=True, draining=self.draining,
                             records=self._records_per_bucket(name))

    def _balance_round(self) -> None:
        """One round of ``--balance auto``: at most one DHT's moves at a time."""
        if self._balancing or self._shutting_down:
            return
        self._regroup_round()
        if self._repair_round() is not None:
            return
        services = self._balancer_view()
        now = time.monotonic()
        balancer.adjust_for_load(services, self.memory, self.balancer_settings, now)
        if self.balance != "auto":
            return
        for name, descriptor in sorted(self.state.dhts.items()):
            if (name in self._changing or descriptor.get("state", "active") != "active"):
                continue
            moves = balancer.plan(descriptor, services, self.memory, self.balancer_settings, now,
                                  draining=self.draining, records=self._records_per_bucket(name),
                                  heat=self._heat(name))
            if moves:
                self._balancing = f"{AUTOMATIC}moving {len(moves)} bucket(s) of DHT {name!r}"
                self._carry_out(moves, "balancer").addErrback(
                    lambda failure: log.failure("balancer round failed", failure)
                ).addBoth(lambda _: setattr(self, "_balancing", None))
                return

    @defer.inlineCallbacks
    def _carry_out(self, moves: list[balancer.Move], by: str) -> Any:
        """Make ``moves`` one after the other (each all or nothing, as
        ``move_bucket``); stop at the first that fails.  Then describe each
        DHT by counts again where its layout allows.  Returns what was done."""
        done = []
        for move in moves:
            if move.dht not in self.state.dhts:
                break
            try:
                result = yield self.op_move_bucket(None, name=move.dht, bucket=move.bucket,
                                                   role=move.role, service=move.target)
            except Exception as exc:  # reported, and the round ends
                self.metrics.move_failed(by, move.role)
                self.memory.note(time.monotonic(), f"{by}: moving {move.role} of bucket "
                                 f"{move.bucket} of DHT {move.dht!r} from {move.source} to "
                                 f"{move.target} failed: {_describe(exc)}", **move.as_dict())
                log.warn("{by}: moving {role} of bucket {bucket} of DHT {dht!r} failed: "
                         "{error}", by=by, role=move.role, bucket=move.bucket, dht=move.dht,
                         error=_describe(exc))
                break
            self.memory.moved_at[(move.dht, move.role, move.bucket)] = time.monotonic()
            self.metrics.moved(by, move.role, result.get("seconds", 0.0))
            record = move.as_dict() | {"records": result.get("records"), "by": by,
                                       "seconds": round(result.get("seconds", 0.0), 3)}
            self.memory.note(time.monotonic(), f"{by}: moved {move.role} of bucket "
                             f"{move.bucket} of DHT {move.dht!r} from {move.source} to "
                             f"{move.target}: {move.why}", **record)
            log.info("{by}: DHT {dht!r}: {role} of bucket {bucket} moved from {source} to "
                     "{target}: {why}", by=by, dht=move.dht, role=move.role, bucket=move.bucket,
                     source=move.source, target=move.target, why=move.why)
            done.append(record)
        for name in sorted({move.dht for move in moves}):
            yield self._rebase(name)
        return done

    @defer.inlineCallbacks
    def _rebase(self, name: str) -> Any:
        """Describe DHT ``name``'s layout by counts alone again, if it can be
        (domus.supervisor.balancer.rebase), and tell its services."""
        descriptor = self.state.dhts.get(name)
        if descriptor is None or name in self._changing:
            return
        rebased = balancer.rebase(descriptor)
        if rebased == descriptor:
            return
        rebased["version"] = layout.next_version(descriptor)
        self._changing[name] = "being described by counts again"
        try:
            self.state.dhts[name] = rebased
            self.state.save()
            # Same owners, other words: a service that misses it gets it at
            # its next registration and serves the same buckets meanwhile.
            yield self._push(self._involved(rebased), rebased, self.push_timeout)
        finally:
            self._changing.pop(name, None)

    @defer.inlineCallbacks
    def _wait_for_balancer(self) -> Any:
        from twisted.internet import reactor

        while self._balancing:
            yield task.deferLater(reactor, 0.05, lambda: None)

    def op_rebalance(self, link: MessageProtocol, *, name: str,
                     dry_run: bool = False) -> Any:
        self._find(name)
        if dry_run:
            return {"name": name, "dry_run": True,
                    "moves": [move.as_dict() for move in self._whole_plan(name)]}
        self._refuse_while_changing(name, "rebalance")
        return self._rebalance_now(name)

    @defer.inlineCallbacks
    def _rebalance_now(self, name: str) -> Any:
        yield self._wait_for_balancer()
        self._balancing = f"rebalancing DHT {name!r} by hand"
        try:
            planned = self._whole_plan(name)
            done = yield self._carry_out(planned, "rebalance")
        finally:
            self._balancing = None
        if len(done) < len(planned):
            raise ControlError("SupervisorError", f"rebalancing DHT {name!r} stopped after "
                               f"{len(done)} of {len(planned)} moves: "
                               f"{self.memory.decisions[-1]['decision']}")
        return {"name": name, "dry_run": False, "moves": done}

    def op_dht_services(self, link: MessageProtocol, *, name: str, add: list[str] = (),
                        remove: list[str] = (), roles: list[str] = layout.ROLES) -> Any:
        """Change the services a DHT's roles are listed on: ``add`` get their
        share, ``remove`` give theirs away and are taken off the lists; the
        roles changed stop following the deployment.  Done at once."""
        descriptor = self._find(name)
        roles = list(roles)
        add, remove = list(add), list(remove)
        if not roles or any(role not in layout.ROLES for role in roles):
            raise ControlError("SupervisorError", f"roles must be among {layout.ROLES}, "
                               f"not {roles!r}")
        for service in add + remove:
            if service not in self.state.services:
                raise ControlError("UnknownService", f"no service named {service!r} is "
                                   f"registered (services: {sorted(self.state.services)})")
        if set(add) & set(remove):
            raise ControlError("SupervisorError", f"{sorted(set(add) & set(remove))} cannot "
                               f"be both added and removed")
        for service in add:
            if self.service_state(service) != "up":
                raise ControlError("SupervisorError", f"service {service!r} is "
                                   f"{self.service_state(service)}; start it first")
        if "storage" in roles and add:
            self._able_to_store(descriptor["platform"], add, named=True)
        self._refuse_while_changing(name, "change the services of")
        changed = dict(descriptor, version=layout.next_version(descriptor))
        for role in roles:
            entries = list(changed[f"{role}_services"])
            listed = {entry["name"] for entry in entries}
            entries += [{"name": service, "address": self.state.services[service]["address"],
                         "count": 0} for service in add if service not in listed]
            changed[f"{role}_services"] = entries
            leaving = (set(changed.get(f"{role}_leaving", ())) | set(remove)) - set(add)
            changed.pop(f"{role}_leaving", None)
            if leaving:
                changed[f"{role}_leaving"] = sorted(leaving)
            stayers = [entry["name"] for entry in entries if entry["name"] not in leaving]
            if not stayers:
                raise ControlError("SupervisorError", f"DHT {name!r} would have no {role} "
                                   f"service left")
        changed["follow"] = [role for role in changed.get("follow", ()) if role not in roles]
        return self._change_services(name, descriptor, changed)

    @defer.inlineCallbacks
    def _change_services(self, name: str, before: dict[str, Any],
                         changed: dict[str, Any]) -> Any:
        self._changing[name] = "having its services changed"
        try:
            failed = yield self._push(self._involved(changed), changed, self.push_timeout)
            if failed:
                took = [service for service in self._involved(changed) if service not in failed]
                self._push_back(before, took, self._involved(before))
                raise ControlError("SupervisorError", f"could not change the services of "
                                   f"DHT {name!r}; nothing changed: {failed}")
            self.state.dhts[name] = changed
            self.state.save()
        finally:
            self._changing.pop(name, None)
        yield self._wait_for_balancer()
        self._balancing = f"changing the services of DHT {name!r}"
        try:
            done = yield self._carry_out(self._whole_plan(name), "dht services")
        finally:
            self._balancing = None
        yield self._strip_leavers(name)
        return {"name": name, "moves": done, "dht": self.state.dhts.get(name)}

    @defer.inlineCallbacks
    def _strip_leavers(self, name: str) -> Any:
        """Take off a DHT's lists the services leaving it that hold nothing
        of it and no longer count in its layout."""
        descriptor = self.state.dhts.get(name)
        if descriptor is None:
            return
        changed = dict(descriptor)
        for role in layout.ROLES:
            leaving = set(descriptor.get(f"{role}_leaving", ()))
            gone = {entry["name"] for entry in descriptor[f"{role}_services"]
                    if entry["name"] in leaving and not entry["count"]
                    and not layout.owners(descriptor, role).buckets(entry["name"])}
            if gone:
                changed[f"{role}_services"] = [entry for entry in descriptor[f"{role}_services"]
                                               if entry["name"] not in gone]
                changed.pop(f"{role}_leaving")
                if leaving - gone:
                    changed[f"{role}_leaving"] = sorted(leaving - gone)
        if changed != descriptor:
            changed["version"] = layout.next_version(descriptor)
            self.state.dhts[name] = changed
            self.state.save()
            dropped = set(self._involved(descriptor)) - set(self._involved(changed))
            yield self._push(self._involved(changed), changed, self.push_timeout)
            yield defer.DeferredList([self._call(service, "drop", self.push_timeout,
                                                 **identities.of(changed)) for service in dropped],
                                     consumeErrors=True)

    @defer.inlineCallbacks
    def _force_out(self, name: str, held: dict[str, dict[str, int]], records: int) -> Any:
        """``remove --force``: every bucket ``name`` is the primary of goes
        to a live backup of it where there is one, else, empty, to the
        service the balancer's targets give it to, and is *lost* (requests
        on it get DATA_LOST until the loss is accepted); its backups are
        missing (and repaired); then it is removed."""
        busy = [dht for dht in held if dht in self._changing]
        if busy:
            raise ControlError("SupervisorError", f"DHT(s) {busy} are being changed; try "
                               f"again once that is done")
        yield self._wait_for_balancer()
        self._balancing = f"removing service {name} by force"
        try:
            view = self._balancer_view()
            reported = (self.live.get(name, {}).get("stats") or {}).get("bucket_records") or {}
            records = 0
            for dht in sorted(held):
                descriptor = self.state.dhts[dht]
                promoted = self._without(descriptor, name, restarted=False)
                left = list(layout.buckets_in(layout.ranges_of(
                    layout.owners(promoted, "storage"), name)))
                try:
                    changed = balancer.force_out(promoted, name, view, self.memory,
                                                 self.draining)
                except ValueError as exc:
                    raise ControlError("SupervisorError", f"cannot remove service {name!r}: "
                                       f"{exc}") from None
                if left:
                    changed["storage_lost"] = {**(promoted.get("storage_lost") or {}),
                                               **{str(bucket): name for bucket in left}}
                    counts = reported.get(dht) or {}
                    records += sum(int(counts.get(bucket, counts.get(str(bucket), 0)) or 0)
                                   for bucket in left)
                changed["version"] = layout.next_version(descriptor)
                self.state.dhts[dht] = changed
                self.state.save()
                lagging = yield self._push(self._involved(changed), changed, self.push_timeout)
                for service, error in sorted(lagging.items()):
                    log.warn("DHT {dht!r}: service {service} did not take the layout without "
                             "{name}: {error}; it will when it next registers", dht=dht,
                             service=service, name=name, error=error)
                yield self._rebase(dht)
            log.warn("service {name} removed by force: {records} records of {dhts} lost",
                     name=name, records=records, dhts=sorted(held))
            self.memory.note(time.monotonic(), f"service {name} removed by force; its buckets "
                             f"of {sorted(held)} went to their backups, or empty to the "
                             f"others: {records} records lost", service=name)
        finally:
            self._balancing = None
        answer = yield self.op_remove_service(None, name=name)
        return answer | {"lost_records": records, "dhts": sorted(held)}

    def _held_by(self, service: str) -> dict[str, dict[str, int]]:
        """DHT -> role ("routing", "storage", "backup") -> buckets that
        ``service`` holds now."""
        held: dict[str, dict[str, int]] = {}
        for name, descriptor in self.state.dhts.items():
            for role in layout.ROLES:
                count = layout.owners(descriptor, role).buckets(service)
                if count:
                    held.setdefault(name, {})[role] = count
            backups = sum(copy.buckets(service) for copy in replicas.backups(descriptor))
            if backups:
                held.setdefault(name, {})["backup"] = backups
        return held

    def op_drain_service(self, link: MessageProtocol, *, name: str) -> Any:
        if name not in self.state.services:
            raise ControlError("UnknownService", f"no service named {name!r} is registered")
        return self._drain(name)

    @defer.inlineCallbacks
    def _drain(self, name: str) -> Any:
        self.draining.add(name)
        self.memory.note(time.monotonic(), f"draining service {name}", service=name)
        yield self._wait_for_balancer()
        self._balancing = f"draining service {name}"
        moved: list[dict[str, Any]] = []
        try:
            for dht in sorted(self._held_by(name)):
                if dht in self.state.dhts:
                    planned = self._whole_plan(dht)
                    moved += (yield self._carry_out(planned, f"drain of {name}"))
            for dht in sorted(self._held_by(name)):
                if (self.state.dhts.get(dht) or {}).get("replicas", 1) > 1:
                    moved += (yield self._drain_copies(dht, name))
        finally:
            self._balancing = None
        left = self._held_by(name)
        if left:
            state = self.service_state(name)
            why = (f"it is {state}, so its records cannot be copied; start it again"
                   if state != "up" else self.memory.decisions[-1]["decision"])
            raise ControlError("SupervisorError", f"service {name} still holds buckets of "
                               f"{left} after the drain: {why}")
        records = sum(move["records"] or 0 for move in moved if move["role"] == "storage")
        return {"drained": name, "moves": len(moved), "records": records}

    @defer.inlineCallbacks
    def _drain_copies(self, dht: str, name: str) -> Any:
        """A drain's copies of a replicated DHT: each bucket ``name`` is
        still the primary of (the balancer moves none onto a service that
        backs it up) goes to a live backup of it, ``name`` taking that
        backup's place; then each backup ``name`` holds is copied to another
        service, which takes its place."""
        moved: list[dict[str, Any]] = []
        self._failover_first(dht)
        descriptor = self.state.dhts[dht]
        primary = layout.owners(descriptor, "storage")
        copies = replicas.backups(descriptor)
        swapped = False
        for bucket in list(layout.buckets_in(layout.ranges_of(primary, name))):
            for copy in copies:
                holder = copy.get(bucket)
                if holder and self.service_state(holder) == "up":
                    primary.assign(bucket, bucket + 1, holder)
                    copy.assign(bucket, bucket + 1, name)
                    swapped = True
                    moved.append({"dht": dht, "bucket": bucket, "role": "storage",
                                  "source": name, "target": holder, "records": 0,
                                  "why": f"{name} is draining; {holder} has a copy"})
                    break
        # (Each step with the DHT marked as changing, as a repair is: a
        # failover, a failed backup's report or a move meanwhile would
        # change the layout under it.)
        if swapped:
            changed = replicas.with_backups(balancer.describe(
                descriptor, "storage", primary,
                [dict(entry) for entry in descriptor["storage_services"]]), copies)
            self._refuse_while_changing(dht, "promote the backups of")
            self._changing[dht] = f"having the backups of {name}'s buckets promoted"
            try:
                yield self._take_layout(dht, descriptor, changed, "promote the backups of")
            finally:
                self._changing.pop(dht, None)
        for rank, copy in enumerate(replicas.backups(self.state.dhts[dht]), start=1):
            for bucket in list(layout.buckets_in(layout.ranges_of(copy, name))):
                self._failover_first(dht)
                descriptor = self.state.dhts[dht]
                if replicas.backups(descriptor)[rank - 1].get(bucket) != name:
                    continue            # (a failover changed its copies meanwhile)
                source = layout.owners(descriptor, "storage").get(bucket)
                candidates = [service for service in self.live_services()
                              if descriptor["platform"] in self._platforms_of(service)
                              and service not in self.draining]
                taken = set(replicas.holders(descriptor, bucket))
                if source is None or not set(candidates) - taken:
                    continue
                hosts = {service: self.state.services[service]["resources"].get(
                    "hostname", service) for service in candidates}
                target = replicas.choose(candidates, hosts, taken,
                                         replicas.copies_held(descriptor))
                changed_copies = replicas.backups(descriptor)
                changed_copies[rank - 1].assign(bucket, bucket + 1, target)
                changed = replicas.with_backups(descriptor, changed_copies, {
                    service: self.state.services[service]["address"] for service in candidates})
                self._refuse_while_changing(dht, f"copy bucket {bucket} of")
                self._changing[dht] = f"having a copy of bucket {bucket} made on {target}"
                started = time.monotonic()
                try:
                    result = yield self._copy_replica(descriptor, changed, bucket, source,
                                                      target)
                except Exception:
                    self.metrics.move_failed("drain", "backup")
                    raise
                finally:
                    self._changing.pop(dht, None)
                self.metrics.moved("drain", "backup", time.monotonic() - started)
                moved.append({"dht": dht, "bucket": bucket, "role": "backup", "source": name,
                              "target": target, "records": result["records"],
                              "why": f"{name} is draining"})
        return moved

    # -------------------------------------------------------------- resizing
    # A DHT's bucket count doubles or halves, one step at a time, while its
    # clients read and write (domus.service.hosted, "Resizing", says how a
    # service serves buckets of either count meanwhile):
    #   doubling: every involved service takes the descriptor of 2C buckets
    #     (all or nothing: one that fails has the others take the old one
    #     back); it serves each new bucket from the repository of the old
    #     one it is half of.  The new layout is saved and clients learn of
    #     it from their replies' layout tags.  Then each storage service
    #     splits its repositories, live; one that cannot now (it is down)
    #     does when it is back (``_regroup_round``).
    #   halving: the two buckets that become one are first stored on one
    #     service (live moves of the odd ones, where the pairs straddle two
    #     services); each storage service merges them, live, into one
    #     repository that serves both; then every involved service takes
    #     the descriptor of C/2 buckets (all or nothing), which is saved.
    #     If a service fails before that, the DHT keeps C buckets and the
    #     merged repositories are split again by ``_regroup_round``.
    # Clients that still number buckets out of the old count are served all
    # along: services translate their requests.
    def op_resize_dht(self, link: MessageProtocol, *, name: str, buckets: int) -> Any:
        descriptor = self._find(name)
        if (isinstance(buckets, bool) or not isinstance(buckets, int)
                or not MIN_BUCKETS <= buckets <= MAX_BUCKETS or buckets & (buckets - 1)):
            raise ControlError("InvalidAttribute", f"a DHT's bucket count must be a power of "
                               f"two from {MIN_BUCKETS} to {MAX_BUCKETS}, not {buckets!r}")
        self._check_scale(name, buckets, descriptor)
        if descriptor.get("state", "active") != "active":
            raise ControlError("SupervisorError", f"DHT {name!r} is inactive; activate it "
                               f"(`domus dht activate {name}`) before resizing it")
        if (descriptor.get("replicas") or 1) > 1:
            raise ControlError("SupervisorError", f"DHT {name!r} keeps {descriptor['replicas']} "
                               f"copies of each bucket; resizing a replicated DHT is not "
                               f"supported yet (create one of the bucket count you want and "
                               f"copy the records over)")
        if not (self._balancing or "").startswith(AUTOMATIC):
            self._refuse_while_changing(name, "resize")   # (the balancer's own is waited for)
        down = [service for service in self._involved(descriptor)
                if self.service_state(service) != "up"]
        if down:
            raise ControlError("SupervisorError", f"cannot resize DHT {name!r}: service(s) "
                               f"{down} are not up; start them (or remove them) first")
        return self._resize(name, buckets)

    @defer.inlineCallbacks
    def _resize(self, name: str, buckets: int) -> Any:
        yield self._wait_for_balancer()
        self._refuse_while_changing(name, "resize")
        started = time.monotonic()
        before = self.state.dhts[name]["buckets"]
        self._changing[name] = f"being resized to {buckets} buckets"
        steps: list[dict[str, Any]] = []
        try:
            self._balancing = f"resizing DHT {name!r} to {buckets} buckets"
            while self.state.dhts[name]["buckets"] != buckets:
                current = self.state.dhts[name]["buckets"]
                if buckets > current:
                    steps.append((yield self._double(name)))
                else:
                    steps.append((yield self._halve(name)))
                self._forget_buckets(name)
        finally:
            self._balancing = None
            self._changing.pop(name, None)
        seconds = time.monotonic() - started
        log.info("DHT {name!r} resized from {before} to {after} buckets in {seconds:.2f}s",
                 name=name, before=before, after=buckets, seconds=seconds)
        self.memory.note(time.monotonic(), f"DHT {name!r} resized from {before} to "
                         f"{buckets} buckets", dht=name)
        return {"name": name, "from": before, "buckets": buckets, "steps": steps,
                "seconds": round(seconds, 3)}

    def _forget_buckets(self, name: str) -> None:
        """The balancer's memory of a DHT's buckets, whose numbers changed."""
        for memory in (self.memory.moved_at, self.memory.pins):
            for key in [key for key in memory if key[0] == name]:
                del memory[key]

    @defer.inlineCallbacks
    def _take_layout(self, name: str, before: dict[str, Any], after: dict[str, Any],
                     why: str) -> Any:
        """Every involved service takes ``after``, or every one is given
        ``before`` back and ControlError says why; then ``after`` is saved.
        (Those that failed too: one whose acknowledgement was lost, or
        came too late, has taken ``after``, and a service left with another
        bucket count than the supervisor's refuses its clients' scans.)"""
        involved = self._involved(after)
        failed = yield self._push(involved, after, self.push_timeout)
        if failed:
            self._push_back(before, involved, self._involved(before))
            problems = "; ".join(f"{service}: {error}" for service, error in sorted(failed.items()))
            raise ControlError("SupervisorError", f"could not {why} DHT {name!r}; it keeps "
                               f"{before['buckets']} buckets: {problems}")
        self.state.dhts[name] = after
        self.state.save()

    @defer.inlineCallbacks
    def _regroup(self, name: str, services: list[str], count: int) -> Any:
        """Each of ``services`` regroups its repositories of DHT ``name`` into
        parts of ``count`` buckets; fires with service -> error for those
        that failed, and the records regrouped."""
        dht_id = self.state.dhts[name]["id"]
        answers = yield defer.DeferredList(
            [self._call(service, "regroup_buckets", STATE_CHANGE_TIMEOUT, id=dht_id, count=count)
             for service in services], consumeErrors=True)
        failed = {service: _error_text(answer)
                  for service, (ok, answer) in zip(services, answers) if not ok}
        records = sum(answer.get("records", 0) for ok, answer in answers if ok)
        return failed, records

    @defer.inlineCallbacks
    def _double(self, name: str) -> Any:
        before = self.state.dhts[name]
        after = balancer.resized(before, before["buckets"] * 2)
        yield self._take_layout(name, before, after, "double")
        storage = sorted(layout.owners(after, "storage").owners())
        failed, records = yield self._regroup(name, storage, after["buckets"])
        for service, error in sorted(failed.items()):
            log.warn("DHT {name!r}: service {service} did not split its buckets yet ({error}); "
                     "it serves them as they are and splits them later", name=name,
                     service=service, error=error)
        return {"buckets": after["buckets"], "split": records, "lagging": failed}

    @defer.inlineCallbacks
    def _halve(self, name: str) -> Any:
        descriptor = self.state.dhts[name]
        count = descriptor["buckets"]
        if count < 2:
            raise ControlError("SupervisorError", f"DHT {name!r} has one bucket already")
        # The two buckets that become one go to one service first.
        moved = 0
        for bucket, source, target in _straddling_pairs(layout.owners(descriptor, "storage")):
            current = self.state.dhts[name]
            changed = layout.move(current, "storage", bucket, target,
                                  self.state.services[target]["address"])
            started = time.monotonic()
            try:
                result = yield self._move_storage(current, changed, bucket, source, target)
            except Exception:
                self.metrics.move_failed("resize", "storage")
                raise
            self.metrics.moved("resize", "storage", time.monotonic() - started)
            moved += result.get("records") or 0
        storage = sorted(layout.owners(self.state.dhts[name], "storage").owners())
        failed, merged = yield self._regroup(name, storage, count // 2)
        if failed:
            problems = "; ".join(f"{service}: {error}" for service, error in sorted(failed.items()))
            raise ControlError("SupervisorError", f"could not halve DHT {name!r}, which keeps "
                               f"{count} buckets: merging failed on {problems}")
        before = self.state.dhts[name]
        yield self._take_layout(name, before, balancer.resized(before, count // 2), "halve")
        return {"buckets": count // 2, "moved": moved, "merged": merged}

    def _regroup_round(self) -> None:
        """Services that still serve buckets from parts of another count
        (a split after doubling that they missed; merges of a halving that
        failed) are asked to regroup, one DHT and service at a time."""
        for name, descriptor in sorted(self.state.dhts.items()):
            if name in self._changing or descriptor.get("state", "active") != "active":
                continue
            for service in sorted(self._involved(descriptor)):
                held = ((self.live.get(service) or {}).get("stats") or {}).get("dhts", {})
                mine = held.get(name) or {}
                if (mine.get("unregrouped_buckets") and mine.get("buckets") ==
                        descriptor["buckets"] and self.service_state(service) == "up"):
                    self._changing[name] = f"having its buckets regrouped on {service}"
                    regrouping = self._regroup(name, [service], descriptor["buckets"])

                    def done(result: Any, dht: str = name, by: str = service) -> None:
                        failed, records = result
                        self.memory.note(time.monotonic(), f"service {by} regrouped the "
                                         f"buckets of DHT {dht!r} ({records} records)"
                                         if not failed else f"service {by} could not regroup "
                                         f"DHT {dht!r}: {failed[by]}", dht=dht, service=by)
                        # (Its next heartbeat tells the outcome.)
                        held_by = (self.live.get(by) or {}).get("stats", {}).get("dhts", {})
                        held_by.get(dht, {}).pop("unregrouped_buckets", None)

                    regrouping.addCallback(done).addErrback(
                        lambda failure: log.failure("regrouping failed", failure)).addBoth(
                        lambda _, dht=name: self._changing.pop(dht, None))
                    return

    # -------------------------------------------------------------- replication
    # A replicated DHT (``replicas`` R > 1) keeps each bucket on R services
    # (domus.placement.replicas): its primary, which clients use and which
    # writes to the others first (domus.service.handler), and its backups.
    #   Failover: a service whose link drops (and is not back within
    #     FAILOVER_GRACE), or that goes silent past --down-after, is taken
    #     out of every DHT's copies: for each bucket it was the primary of,
    #     its first backup on a live service becomes the primary (a layout
    #     change only: that service has every acknowledged write of the
    #     bucket); its backups are left missing.  Clients learn the new
    #     layout from their failed requests and replies.
    #   Repair: missing backups are copied live from their primary to a
    #     service that holds no copy of the bucket (on another host where
    #     there is one), a round of them at a time (``_repair_round``).
    #   Returning: a service that registers again having lost what it held
    #     (its process restarted) is no copy of anything any more; a bucket
    #     whose only copies were there, in RAM, is *lost*: requests on it
    #     get DATA_LOST until ``accept_loss``.  A disk service's files are
    #     its copies: a bucket only it holds stays its.
    #   A backup that fails to take a change is reported by its primary
    #     (``copy_failed``) and taken off that primary's buckets.
    def _failover_first(self, name: str) -> None:
        """Between two steps of a long change of DHT ``name`` (a drain's
        copies): a failover that met the change goes before the next step,
        so that a dead service's buckets do not wait for the whole change."""
        if name not in self._failing_over:
            return
        for service in list(self.state.services):
            state = self.service_state(service)
            if state == "unresponsive":
                self._fail_over(service, "it sent no heartbeat")
            elif state == "down" and service not in self.links and self._down_past_grace(service):
                self._fail_over(service, "it is down")

    def _fail_over_down(self) -> None:
        """(A failover that met a DHT being changed is done now.)"""
        for name in list(self.state.services):
            if (self.service_state(name) == "down" and name not in self.links
                    and self._down_past_grace(name)):
                self._fail_over(name, "it is down")

    def _fail_over(self, service: str, why: str) -> None:
        changed_dhts = []
        for name, descriptor in list(self.state.dhts.items()):
            # (An inactive DHT serves nothing: its records wait in each
            # service's files, which a restart keeps, for the layout they
            # were saved under.)
            if ((descriptor.get("replicas") or 1) < 2
                    or descriptor.get("state", "active") != "active"):
                continue
            if name in self._changing:
                # (A repair or a move under way: it stops at its next step,
                # and the next watch of the services fails over.)
                self._failing_over.add(name)
                continue
            changed = self._without(descriptor, service, restarted=False)
            if changed is not descriptor:
                self.state.dhts[name] = changed
                changed_dhts.append(changed)
        for descriptor in changed_dhts:
            self._failing_over.discard(descriptor["name"])
        if not changed_dhts:
            return
        self.state.save()
        self.metrics.failovers += 1
        log.warn("failover: service {service} is out ({why}); DHTs {dhts} promote its "
                 "buckets' backups", service=service, why=why,
                 dhts=[descriptor["name"] for descriptor in changed_dhts])
        self.memory.note(time.monotonic(), f"failover: service {service} is out ({why}); "
                         f"its buckets of {[d['name'] for d in changed_dhts]} are served by "
                         f"their backups", service=service)
        # (The failed service too, if its link is still there: a hung one
        # takes the layout once it wakes, instead of serving its old
        # buckets' reads, stale, to clients that still ask it.)
        for descriptor in changed_dhts:
            self._push([peer for peer in self._involved(descriptor)
                        if self.service_state(peer) == "up"
                        or peer == service and self.service_state(peer) != "down"],
                       descriptor, self.push_timeout).addCallback(self._log_lagging,
                                                                  descriptor["name"])

    def _log_lagging(self, lagging: dict[str, str], name: str) -> None:
        for service, error in sorted(lagging.items()):
            log.warn("DHT {name!r}: service {service} did not take the layout after a "
                     "failover: {error}; it will when it next registers", name=name,
                     service=service, error=error)

    def _without(self, descriptor: dict[str, Any], service: str, *,
                 restarted: bool) -> dict[str, Any]:
        """``descriptor`` with ``service`` holding no copy: its primaries
        promoted to live backups where there is one; else they stay its
        (``restarted`` and in RAM: lost).  The same object if nothing
        changes."""
        copies = replicas.backups(descriptor)
        primary = layout.owners(descriptor, "storage")
        lost = dict(descriptor.get("storage_lost") or {})
        changed = False
        ram = descriptor["storage"] == "ram"
        for first, end, owner in list(primary.ranges()):
            if owner != service:
                continue
            for bucket in range(first, end):
                for copy in copies:
                    holder = copy.get(bucket)
                    if holder and holder != service and self.service_state(holder) == "up":
                        primary.assign(bucket, bucket + 1, holder)
                        copy.assign(bucket, bucket + 1, None)
                        changed = True
                        break
                else:
                    if restarted and ram and str(bucket) not in lost:
                        lost[str(bucket)] = service
                        changed = True
        for copy in copies:
            for first, end, owner in list(copy.ranges()):
                if owner == service:
                    copy.assign(first, end, None)
                    changed = True
        if not changed:
            return descriptor
        result = balancer.describe(descriptor, "storage", primary,
                                   [dict(entry) for entry in descriptor["storage_services"]])
        if copies:
            result = replicas.with_backups(result, copies)
        else:
            result["version"] = layout.next_version(descriptor)
        result.pop("storage_lost", None)
        if lost:
            result["storage_lost"] = lost
        return result

    def _returning(self, name: str, held: set[str]) -> None:
        """A known service registers again: for each DHT it is a copy of but
        holds nothing of (its process restarted), it is a copy of nothing
        any more (see above).  Runs before it is told its DHTs."""
        for dht, descriptor in list(self.state.dhts.items()):
            if str(descriptor["id"]) in held or descriptor.get("state") == "inactive":
                continue
            holding = name in layout.owners(descriptor, "storage").owners() or any(
                name in copy.owners() for copy in replicas.backups(descriptor))
            if not holding:
                continue
            if (descriptor.get("replicas") or 1) < 2 and descriptor["storage"] != "ram":
                continue            # its files are the DHT's only copy: still its
            if dht in self._changing:
                # (Done once the change is over; meanwhile it is told a layout
                # in which it holds nothing of the DHT: see _descriptors_for.)
                self._taking_out.setdefault(name, set()).add(dht)
                continue
            self._take_out(name, dht)

    def _take_out(self, name: str, dht: str) -> None:
        """Service ``name`` came back without what it held of DHT ``dht``."""
        descriptor = self.state.dhts.get(dht)
        if descriptor is not None:
            changed = self._without(descriptor, name, restarted=True)
            if changed is not descriptor:
                self.state.dhts[dht] = changed
                lost = sorted(set(changed.get("storage_lost") or {})
                              - set(descriptor.get("storage_lost") or {}), key=int)
                if lost:
                    log.error("DHT {dht!r}: service {name} restarted without the records of "
                              "buckets {buckets}, which had no other copy: they are lost; "
                              "`domus dht accept-loss {dht}` serves them again, empty",
                              dht=dht, name=name, buckets=lost)
                    self.memory.note(time.monotonic(), f"DHT {dht!r}: buckets {lost} lost "
                                     f"with service {name}", dht=dht, service=name)
                self.state.save()
                peers = [peer for peer in self._involved(changed)
                         if self.service_state(peer) == "up"]
                self._push(peers, changed, self.push_timeout).addCallback(
                    self._log_lagging, dht)

    def op_copy_failed(self, link: MessageProtocol, *, name: str, dht: str, holder: str,
                       why: str = "") -> dict[str, Any]:
        """A primary could not write to a backup: that backup is taken off
        every bucket whose primary is ``name`` (it is missing, and repaired
        later), unless the layout has already moved on."""
        descriptor = self.state.dhts.get(dht)
        if descriptor is None or self.links.get(name) is not link or dht in self._changing:
            return {"changed": False}
        primary = layout.owners(descriptor, "storage")
        copies = replicas.backups(descriptor)
        changed = False
        for first, end, owner in list(primary.ranges()):
            if owner != name:
                continue
            for copy in copies:
                for low, high, backup in list(copy.ranges(first, end)):
                    if backup == holder:
                        copy.assign(low, high, None)
                        changed = True
        if not changed:
            return {"changed": False}
        updated = replicas.with_backups(descriptor, copies)
        self.state.dhts[dht] = updated
        self.state.save()
        log.warn("DHT {dht!r}: the backups on {holder} of {name}'s buckets are dropped: "
                 "{why}", dht=dht, holder=holder, name=name, why=why)
        self.memory.note(time.monotonic(), f"DHT {dht!r}: the backups on {holder} of "
                         f"{name}'s buckets failed ({why}); they will be copied again",
                         dht=dht, service=holder)
        self._push([peer for peer in self._involved(updated)
                    if self.service_state(peer) == "up"], updated, self.push_timeout
                   ).addCallback(self._log_lagging, dht)
        return {"changed": True}

    def op_accept_loss(self, link: MessageProtocol, *, name: str) -> Any:
        descriptor = self._find(name)
        lost = sorted((descriptor.get("storage_lost") or {}), key=int)
        if not lost:
            return {"name": name, "accepted": []}
        self._refuse_while_changing(name, "accept the loss of")
        changed = dict(descriptor, version=layout.next_version(descriptor))
        changed.pop("storage_lost")
        self.state.dhts[name] = changed
        self.state.save()
        log.warn("DHT {name!r}: the loss of buckets {buckets} accepted; they serve again, "
                 "empty", name=name, buckets=lost)
        self.memory.note(time.monotonic(), f"DHT {name!r}: the loss of buckets {lost} "
                         f"accepted", dht=name)
        return self._push([peer for peer in self._involved(changed)
                           if self.service_state(peer) == "up"], changed, self.push_timeout
                          ).addCallback(lambda lagging: {"name": name,
                                                         "accepted": [int(b) for b in lost],
                                                         "lagging": lagging})

    def _repair_round(self) -> Any:
        """Copy missing backups (at most REPAIRS_PER_ROUND), the DHT with
        the most first; None when there is nothing to do."""
        for name, descriptor in sorted(self.state.dhts.items()):
            if ((descriptor.get("replicas") or 1) < 2 or name in self._changing
                    or descriptor.get("state", "active") != "active"):
                continue
            gaps = replicas.missing(descriptor)
            # (Only gaps a copy can be made for now: the balancer waits while
            # a repair runs, and must not wait on gaps nobody can fill.)
            if any(self._repair_target(descriptor, bucket) is not None
                   for _rank, first, end in gaps for bucket in range(first, end)):
                self._balancing = f"{AUTOMATIC}copying missing backups of DHT {name!r}"
                return self._repair(name, gaps).addErrback(
                    lambda failure: log.failure("repairing failed", failure)
                ).addBoth(lambda _: setattr(self, "_balancing", None))
            if self.balance == "auto" and self._backup_to_move(descriptor) is not None:
                self._balancing = f"{AUTOMATIC}moving backups of DHT {name!r}"
                return self._move_backups(name).addErrback(
                    lambda failure: log.failure("moving a backup failed", failure)
                ).addBoth(lambda _: setattr(self, "_balancing", None))
        return None

    @defer.inlineCallbacks
    def _move_backups(self, name: str) -> Any:
        """A round of backup moves (``--balance-max-moves`` at most)."""
        for _move in range(self.balancer_settings.max_moves):
            descriptor = self.state.dhts.get(name)
            if descriptor is None or name in self._changing or self._failing_over:
                return
            move = self._backup_to_move(descriptor)
            if move is None:
                return
            yield self._move_backup(name, *move)

    def _backup_to_move(self, descriptor: dict[str, Any]) -> tuple[int, int, str, str] | None:
        """Backups follow capacity too: when the service holding the most
        copies of a DHT's buckets (primaries and backups) is more than one
        over its share of them all, and another more than one under, one of
        its backups of a bucket the other holds no copy of moves there
        (rank, bucket, from, to); None when shares are within one bucket."""
        view = self._balancer_view()
        eligible = balancer.eligible(descriptor, "storage", view, self.draining)
        if len(eligible) < 2:
            return None
        capacity = [balancer.capacity(view[name], "storage", descriptor["storage"])
                    for name in eligible]
        total = descriptor["buckets"] * (descriptor.get("replicas") or 1)
        shares = dict(zip(eligible, assignment.proportional_counts(total, capacity)))
        held = replicas.copies_held(descriptor)
        over = max(eligible, key=lambda name: held.get(name, 0) - shares[name])
        under = min(eligible, key=lambda name: held.get(name, 0) - shares[name])
        if held.get(over, 0) - shares[over] <= 1 or shares[under] - held.get(under, 0) <= 1:
            return None
        if not balancer.takes_storage(descriptor, view[under]):
            return None         # (its disk is at its reserve)
        for rank, copy in enumerate(replicas.backups(descriptor), start=1):
            for first, end, holder in copy.ranges():
                if holder != over:
                    continue
                for bucket in range(first, end):
                    if (under not in replicas.holders(descriptor, bucket)
                            and self.memory.moved_at.get((descriptor["name"], "backup", bucket),
                                                         -1e18)
                            < time.monotonic() - self.balancer_settings.cooldown):
                        return rank, bucket, over, under
        return None

    @defer.inlineCallbacks
    def _move_backup(self, name: str, rank: int, bucket: int, source: str, target: str) -> Any:
        """A backup of ``bucket`` from ``source`` to ``target``: copied live
        from the bucket's primary, then ``source`` lets it go."""
        descriptor = self.state.dhts[name]
        primary = layout.owners(descriptor, "storage").get(bucket)
        if primary is None or self.service_state(primary) != "up":
            return None
        copies = replicas.backups(descriptor)
        copies[rank - 1].assign(bucket, bucket + 1, target)
        changed = replicas.with_backups(descriptor, copies,
                                        {target: self.state.services[target]["address"]})
        self._changing[name] = f"having a backup of bucket {bucket} moved to {target}"
        started = time.monotonic()
        try:
            result = yield self._copy_replica(descriptor, changed, bucket, primary, target)
        except Exception:
            self.metrics.move_failed("balancer", "backup")
            raise
        finally:
            self._changing.pop(name, None)
        self.metrics.moved("balancer", "backup", time.monotonic() - started)
        self.memory.moved_at[(name, "backup", bucket)] = time.monotonic()
        self.memory.note(time.monotonic(), f"balancer: moved the backup of bucket {bucket} of "
                         f"DHT {name!r} from {source} to {target} (copies follow capacity)",
                         dht=name, bucket=bucket, role="backup", source=source, target=target,
                         records=result["records"])
        return result

    @defer.inlineCallbacks
    def _repair(self, name: str, gaps: list[tuple[int, int, int]]) -> Any:
        done = 0
        self._failing_over.discard(name)
        for rank, first, end in gaps:
            for bucket in range(first, end):
                if done >= REPAIRS_PER_ROUND or name not in self.state.dhts:
                    return done
                if name in self._failing_over:          # a failover goes first
                    from twisted.internet import reactor

                    reactor.callLater(0, self._fail_over_down)
                    return done
                descriptor = self.state.dhts[name]
                planned = self._repair_target(descriptor, bucket)
                if planned is None:
                    continue
                source, target, candidates = planned
                copies = replicas.backups(descriptor)
                copies[rank - 1].assign(bucket, bucket + 1, target)
                changed = replicas.with_backups(descriptor, copies, {
                    service: self.state.services[service]["address"] for service in candidates})
                self._changing[name] = f"having a copy of bucket {bucket} made on {target}"
                try:
                    result = yield self._copy_replica(descriptor, changed, bucket, source,
                                                      target)
                except Exception as exc:  # reported; the next round tries again
                    self.metrics.repairs["failed"] += 1
                    self.memory.note(time.monotonic(), f"repair: copying bucket {bucket} of "
                                     f"DHT {name!r} to {target} failed: {_describe(exc)}",
                                     dht=name, bucket=bucket)
                    return done
                finally:
                    self._changing.pop(name, None)
                done += 1
                self.metrics.repairs["done"] += 1
                log.info("repair: DHT {name!r}: bucket {bucket} copied from {source} to "
                         "{target} ({records} records)", name=name, bucket=bucket,
                         source=source, target=target, records=result["records"])
                self.memory.note(time.monotonic(), f"repair: bucket {bucket} of DHT {name!r} "
                                 f"copied to {target} ({result['records']} records)",
                                 dht=name, bucket=bucket, role="backup", source=source,
                                 target=target, records=result["records"])
        return done

    def _repair_target(self, descriptor: dict[str, Any], bucket: int
                       ) -> tuple[str, str, list[str]] | None:
        """(source, target, candidates) of a new copy of ``bucket``: its
        primary, if up, copies it to the service ``replicas.choose`` picks
        of the live ones that can store it; None if none can now (its
        primary is down, it is lost, or every candidate holds a copy)."""
        source = layout.owners(descriptor, "storage").get(bucket)
        if (source is None or self.service_state(source) != "up"
                or str(bucket) in (descriptor.get("storage_lost") or {})):
            return None
        taken = set(replicas.holders(descriptor, bucket))
        candidates = [service for service in self.live_services()
                      if descriptor["platform"] in self._platforms_of(service)
                      and service not in self.draining]
        if not set(candidates) - taken:
            return None             # (no service left to hold another copy)
        hosts = {service: self.state.services[service]["resources"].get(
            "hostname", service) for service in candidates}
        return source, replicas.choose(candidates, hosts, taken,
                                       replicas.copies_held(descriptor)), candidates

    def _replica_view(self, descriptor: dict[str, Any]) -> dict[str, Any]:
        """Where each bucket's copies are, as ranges of buckets with the
        same holders (primary first; None: a copy missing), and which
        buckets are lost."""
        copies = [layout.owners(descriptor, "storage"), *replicas.backups(descriptor)]
        cuts = sorted({0, descriptor["buckets"]} | {point for copy in copies
                                                    for first, end, _ in copy.ranges()
                                                    for point in (first, end)})
        ranges = []
        for first, end in zip(cuts, cuts[1:]):
            holders = [copy.get(first) for copy in copies]
            if ranges and ranges[-1]["holders"] == holders and ranges[-1]["end"] == first:
                ranges[-1]["end"] = end
            else:
                ranges.append({"first": first, "end": end, "holders": holders})
        missing = sum(end - first for _rank, first, end in replicas.missing(descriptor))
        return {"replicas": descriptor.get("replicas") or 1, "copies": ranges,
                "missing_copies": missing,
                "lost_buckets": sorted(int(b) for b in descriptor.get("storage_lost") or {})}

    def op_balancer_status(self, link: MessageProtocol) -> dict[str, Any]:
        return {"mode": self.balance, "settings": dataclasses.asdict(self.balancer_settings),
                "doing": self._balancing, "draining": sorted(self.draining),
                "damped": dict(self.memory.factors),
                "balancing": sorted(f"{dht}/{role}" for dht, role in self.memory.active),
                "decisions": list(self.memory.decisions)[-30:]}

    @defer.inlineCallbacks
    def _move_routing(self, descriptor: dict[str, Any], moved: dict[str, Any],
                      bucket: int) -> Any:
        """Every involved service takes ``moved``, or none keeps it."""
        name = descriptor["name"]
        before = self._involved(descriptor)
        involved = self._involved(moved)     # ``before``, and the new service if it was not
        failed = yield self._push(involved, moved, self.push_timeout)
        if failed:
            took = [service for service in involved if service not in failed]
            self._push_back(descriptor, took, before)
            problems = "; ".join(f"{service}: {error}" for service, error in sorted(failed.items()))
            raise ControlError("SupervisorError", f"could not move routing of bucket {bucket} "
                               f"of DHT {name!r}; nothing changed: {problems}")
        self.state.dhts[name] = moved
        self.state.save()
        return {"records": None, "lagging": {}}

    @defer.inlineCallbacks
    def _move_storage(self, descriptor: dict[str, Any], moved: dict[str, Any], bucket: int,
                      source: str, target: str) -> Any:
        """Steps 1 to 4 of domus.service.hosted, "Moving a bucket"."""
        frozen = yield self._copy_bucket(descriptor, moved, bucket, source, target, "move")
        # The target serves the bucket now: the move is done (see above).
        name = descriptor["name"]
        self.state.dhts[name] = moved
        self.state.save()
        lagging = yield self._push([service for service in self._involved(moved)
                                    if service != target], moved, self.push_timeout)
        for service, error in sorted(lagging.items()):
            log.warn("DHT {name!r}: service {service} did not take the layout with bucket "
                     "{bucket} moved to {target}: {error}; it will when it next registers",
                     name=name, service=service, bucket=bucket, target=target, error=error)
        return {"records": frozen, "lagging": lagging}

    @defer.inlineCallbacks
    def _copy_replica(self, descriptor: dict[str, Any], changed: dict[str, Any], bucket: int,
                      source: str, target: str) -> Any:
        """A new backup of ``bucket`` on ``target``, copied live from its
        primary ``source`` as a move copies it: ``changed`` names it.  Once
        the target holds the copy, the primary (frozen for the last catch-up
        meanwhile) takes the layout and sends it every change from then on,
        and thaws."""
        frozen = yield self._copy_bucket(descriptor, changed, bucket, source, target, "copy")
        name = descriptor["name"]
        self.state.dhts[name] = changed
        self.state.save()
        lagging = yield self._push([service for service in self._involved(changed)
                                    if service != target], changed, self.push_timeout)
        try:
            yield self._call(source, "thaw_bucket", self.push_timeout, id=descriptor["id"],
                             bucket=bucket)
        except Exception as exc:  # it thaws by itself when its lease ends
            lagging[source] = f"thawing: {_describe(exc)}"
        for service, error in sorted(lagging.items()):
            log.warn("DHT {name!r}: service {service} did not take the layout with a copy of "
                     "bucket {bucket} on {target}: {error}", name=name, service=service,
                     bucket=bucket, target=target, error=error)
        return {"records": frozen, "lagging": lagging}

    @defer.inlineCallbacks
    def _copy_bucket(self, descriptor: dict[str, Any], moved: dict[str, Any], bucket: int,
                     source: str, target: str, what: str) -> Any:
        """Copy ``bucket`` from ``source`` to ``target`` live, and have the
        target take ``moved`` (which makes its copy the bucket, or a backup
        of it); fires with the records copied.  On any failure before the
        target took it, everything is undone and ControlError says why."""
        name, dht_id = descriptor["name"], descriptor["id"]
        before = self._involved(descriptor)
        newcomer = target not in before       # hosts nothing of the DHT yet
        froze = staged = told = False
        step = ""
        try:
            if newcomer:
                step = f"giving service {target} the DHT"
                yield self._call(target, "assign", self.push_timeout, dht=descriptor)
            step = f"tracking the bucket's changes on service {source}"
            froze = True            # (thawing also ends the tracking)
            yield self._call(source, "track_bucket", self.push_timeout, id=dht_id,
                             bucket=bucket)
            offset: int | None = 0
            first = True
            staged_count = 0
            while offset is not None:
                step = f"exporting records from service {source}"
                page = yield self._call(source, "export_bucket", STATE_CHANGE_TIMEOUT,
                                        id=dht_id, bucket=bucket, offset=offset)
                step = f"staging records on service {target}"
                staged = True
                # (The first page, even an empty one, makes the staged copy.)
                staged_count = (yield self._call(target, "stage_bucket", STATE_CHANGE_TIMEOUT,
                                                 id=dht_id, bucket=bucket,
                                                 records=page["records"],
                                                 first=first))["records"]
                first = False
                offset = page["next"]
            # Catch up with what writers changed meanwhile, while they write;
            # freeze for the last round only, once a round brings few changes.
            for _round in range(CATCH_UP_ROUNDS):
                step = f"catching up with changes on service {source}"
                changes = (yield self._call(source, "catch_up_bucket", STATE_CHANGE_TIMEOUT,
                                            id=dht_id, bucket=bucket))["records"]
                if changes:
                    step = f"staging changes on service {target}"
                    yield self._call(target, "stage_bucket", STATE_CHANGE_TIMEOUT, id=dht_id,
                                     bucket=bucket, records=changes, first=False)
                if len(changes) // 2 <= FREEZE_AFTER_CHANGES:
                    break
            step = f"freezing the bucket on service {source}"
            asked_freeze = time.monotonic()
            frozen = (yield self._call(source, "freeze_bucket", self.push_timeout, id=dht_id,
                                       bucket=bucket))["records"]
            step = f"staging the last changes on service {target}"
            changes = (yield self._call(source, "catch_up_bucket", self.push_timeout,
                                        id=dht_id, bucket=bucket))["records"]
            staged_count = (yield self._call(target, "stage_bucket", self.push_timeout,
                                             id=dht_id, bucket=bucket, records=changes,
                                             first=False))["records"]
            if time.monotonic() - asked_freeze > wire.FREEZE_LEASE / 4:
                step = "finishing while the source's freeze lasts"
                raise ControlError("SupervisorError", f"the last catch-up took "
                                   f"{time.monotonic() - asked_freeze:.1f}s, too long for "
                                   f"the source's {wire.FREEZE_LEASE:.0f}s freeze")
            if staged_count != frozen:
                step = "checking the copy"
                raise ControlError("SupervisorError", f"service {target} staged "
                                   f"{staged_count} records of the {frozen} frozen on "
                                   f"{source}")
            step = f"giving service {target} the new layout"
            told = True
            yield self._call(target, "assign", self.push_timeout, dht=moved)
        except Exception as exc:
            cause = _describe(exc)
            problems = yield self._undo_move(descriptor, bucket, source, target,
                                             froze=froze, staged=staged, told=told,
                                             newcomer=newcomer)
            outcome = ("nothing changed: the bucket is served by "
                       f"{source} as before" if not problems else
                       f"undoing it failed too ({'; '.join(problems)})")
            raise ControlError("SupervisorError", f"could not {what} storage of bucket "
                               f"{bucket} of DHT {name!r} from {source} to {target}: "
                               f"{step} failed: {cause}; {outcome}") from None
        return frozen

    @defer.inlineCallbacks
    def _undo_move(self, descriptor: dict[str, Any], bucket: int, source: str, target: str,
                   *, froze: bool, staged: bool, told: bool, newcomer: bool) -> Any:
        """Step 4: thaw at the source, and leave the target as it was
        (without the DHT if it had none of it, else without the staged copy
        and with the old layout).  Waits for every answer; returns what
        failed."""
        dht_id = descriptor["id"]
        undoing = []
        if froze:
            undoing.append((source, "thaw_bucket", {"id": dht_id, "bucket": bucket}))
        if newcomer:
            undoing.append((target, "drop", identities.of(descriptor)))
        else:
            if told:
                undoing.append((target, "assign", {"dht": descriptor}))
            if staged or told:
                undoing.append((target, "discard_bucket", {"id": dht_id, "bucket": bucket}))
        answers = yield defer.DeferredList(
            [self._call(service, op, self.push_timeout, **params)
             for service, op, params in undoing], consumeErrors=True)
        problems = [f"{op} on service {service}: {_error_text(failure)}"
                    for (service, op, _params), (ok, failure) in zip(undoing, answers) if not ok]
        for problem in problems:
            log.error("DHT {name!r}: undoing the move of bucket {bucket}: {problem}",
                      name=descriptor["name"], bucket=bucket, problem=problem)
        return problems

    def _call(self, service: str, op: str, timeout: float, **params: Any) -> defer.Deferred:
        """Control op ``op`` on ``service``, over its link."""
        link_to = self.links.get(service)
        if link_to is None or not link_to.connected:
            return defer.fail(ConnectionError(f"service {service} is not connected"))
        return link_to.call(op, timeout=timeout, **params)

    def _push(self, services: list[str], descriptor: dict[str, Any],
              timeout: float) -> defer.Deferred:
        """Give each of ``services`` the descriptor; fires with service ->
        error message for those that did not acknowledge it."""
        pushes = [self._call(service, "assign", timeout, dht=descriptor) for service in services]
        return defer.DeferredList(pushes, consumeErrors=True).addCallback(
            lambda answers: {service: _error_text(failure)
                             for service, (ok, failure) in zip(services, answers) if not ok})

    def _push_back(self, descriptor: dict[str, Any], services: list[str],
                   before: list[str]) -> None:
        """Give ``services`` the old descriptor again (or drop the DHT on
        those it did not involve); failures are logged, and mended when the
        service next registers."""
        for service in services:
            if service in before:
                undo = self._call(service, "assign", self.push_timeout, dht=descriptor)
            else:
                undo = self._call(service, "drop", self.push_timeout, **identities.of(descriptor))
            undo.addErrback(lambda failure, s=service: log.warn(
                "service {service} did not undo the change of DHT {name!r}: {error}; it "
                "will when it next registers", service=s, name=descriptor["name"],
                error=failure.getErrorMessage()))

    # -------------------------------------------------------------- shutdown
    @defer.inlineCallbacks
    def op_shutdown_deployment(self, link: MessageProtocol, *, save_ram: bool = True) -> Any:
        """Stop every service cleanly (disk DHTs flushed and closed), then
        this supervisor; its state and the services' launch records stay, for
        ``domus deployment restart``.

        With ``save_ram`` (the default) every active RAM DHT is first
        deactivated (its records saved under the services' data dirs) and
        marked to be activated again once its services are back, so a
        restart brings every DHT back as it was.  If one cannot be saved,
        nothing is stopped and the error says which.  Without it, RAM DHTs
        come back empty."""
        if self._shutting_down:
            raise ControlError("SupervisorError", "the deployment is already shutting down")
        saved: dict[str, int] = {}
        if save_ram:
            for name, descriptor in list(self.state.dhts.items()):
                if descriptor["storage"] != "ram" or descriptor.get("state") == "inactive":
                    continue
                try:
                    answer = yield self._change_state(name, "inactive", resume=True)
                except ControlError as exc:
                    raise ControlError("SupervisorError", f"nothing was stopped: RAM DHT "
                                       f"{name!r} could not be saved ({exc.message}); fix "
                                       f"that, or shut down with --discard-ram") from None
                saved[name] = sum(answer["records"].values())
        self._shutting_down = True
        stopping = {name: link_to for name, link_to in self.links.items() if link_to.connected}
        for link_to in stopping.values():
            link_to.call("shutdown", timeout=self.push_timeout).addErrback(lambda _failure: None)
        gone = yield defer.DeferredList([self._gone(link_to) for link_to in stopping.values()])
        stopped = sorted(name for name, (_ok, went) in zip(stopping, gone) if went)
        still = sorted(set(stopping) - set(stopped))
        log.info("deployment shutdown: services {stopped} stopped{still}; the supervisor stops "
                 "now", stopped=stopped, still=f", {still} did not" if still else "")
        from twisted.internet import reactor

        reactor.callLater(0.2, reactor.stop)
        return {"stopped": stopped, "not_stopped": still,
                "down": sorted(set(self.state.services) - set(stopping)),
                "saved_ram_dhts": saved, "data_dir": self.state.data_dir}

    @staticmethod
    def _gone(link_to: MessageProtocol) -> defer.Deferred:
        """Fires True once the service closes its link (it has stopped),
        False if it has not within SHUTDOWN_WAIT."""
        from twisted.internet import reactor

        waited: defer.Deferred = defer.Deferred()
        timer = reactor.callLater(SHUTDOWN_WAIT, lambda: waited.called or waited.callback(False))

        def closed(_: Any) -> None:
            if timer.active():
                timer.cancel()
            if not waited.called:
                waited.callback(True)

        link_to.lost.addCallback(closed)
        return waited

    # -------------------------------------------------------------- status
    def op_status(self, link: MessageProtocol) -> dict[str, Any]:
        return {"supervisor": {"address": self.address, "version": __version__,
                               "pid": os.getpid(), "uptime": time.time() - self.started,
                               "data_dir": self.state.data_dir,
                               "secure": self.keys is not None,
                               "refused_connections": self.auth_failures,
                               "deployment": self.state.deployment},
                "services": self.op_services(link),
                "dhts": self.op_list_dhts(link)}

    def op_discard_dht(self, link: MessageProtocol, *, service: str, id: int) -> Any:
        """Tell service ``service`` to delete the DHT with id ``id`` that it
        holds and this supervisor does not know (an orphan it reported),
        named by that DHT's deployment and stamp; fires with what it
        discarded."""
        if service not in self.state.services or self.service_state(service) != "up":
            raise ControlError("UnknownService", f"service {service!r} is not registered and "
                               f"up; only a live service can discard what it holds")
        orphans = self.live.get(service, {}).get("orphans", [])
        found = [orphan for orphan in orphans if orphan["id"] == id]
        if not found:
            listed = ", ".join(f"{orphan['id']} ({orphan['name']})" for orphan in orphans)
            raise ControlError("UnknownDht", f"service {service!r} reports no DHT with id "
                               f"{id!r} that this supervisor does not know (it reports: "
                               f"{listed or 'none'}); a DHT of the deployment is destroyed "
                               f"with `domus dht destroy NAME`")
        orphan = found[0]

        def discarded(answer: dict[str, Any]) -> dict[str, Any]:
            live = self.live.get(service, {})
            live["orphans"] = [held for held in live.get("orphans", []) if held["id"] != id]
            log.info("service {service} discarded DHT {name!r} (id {id}), which this "
                     "supervisor did not know", service=service, name=orphan["name"], id=id)
            return {"service": service, **orphan, **answer}

        def refused(failure: Any) -> Any:
            from domus.wire.control import RemoteControlError

            if failure.check(RemoteControlError):
                raise ControlError("SupervisorError", failure.value.message)
            raise ControlError("SupervisorError", f"service {service!r} did not discard DHT id "
                               f"{id}: {failure.getErrorMessage()}")

        return self.links[service].call("discard", timeout=self.push_timeout,
                                        **identities.of(orphan)).addCallbacks(discarded, refused)

    def op_ping(self, link: MessageProtocol) -> dict[str, Any]:
        return {"supervisor": self.address, "version": __version__,
                "secure": self.keys is not None, "pid": os.getpid()}


def _checked_stats(stats: Any, depth: int = 0) -> Any:
    """A heartbeat's stats, every number in them finite, not negative and
    at most MAX_LOAD (the balancer does arithmetic on them), nested at most
    6 deep; ValueError otherwise."""
    if depth > 6:
        raise ValueError("its stats are nested too deep")
    if isinstance(stats, dict):
        return {key: _checked_stats(value, depth + 1) for key, value in stats.items()}
    if isinstance(stats, list):
        return [_checked_stats(value, depth + 1) for value in stats]
    if isinstance(stats, int | float) and not isinstance(stats, bool):
        checks.figure(stats, "a figure of its stats", high=checks.MAX_LOAD, positive=False)
    return stats


def _drop_link(link: MessageProtocol) -> None:
    """Close a service's link at once (its peer may be gone without a word)."""
    transport = getattr(link, "transport", None)
    if transport is not None:
        abort = getattr(transport, "abortConnection", None)
        (abort or transport.loseConnection)()


def _straddling_pairs(owners: Any) -> list[tuple[int, str, str]]:
    """(odd bucket, its owner, its even sibling's owner) of every pair of
    buckets (2b, 2b + 1) that two services hold: only where a range of the
    layout starts at an odd bucket."""
    pairs = []
    for first, _end, owner in owners.ranges():
        if first % 2:
            sibling = owners.get(first - 1)
            if sibling is not None and sibling != owner:
                pairs.append((first, owner, sibling))
    return pairs


def _describe(error: BaseException) -> str:
    return getattr(error, "message", None) or str(error) or type(error).__name__


def _error_text(failure: Any) -> str:
    return _describe(failure.value)


__all__ = ["SupervisorService", "SupervisorError"]
