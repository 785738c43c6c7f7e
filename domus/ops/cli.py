"""The ``domus`` command."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import shlex
import signal
import sys
import time
from typing import Any

from domus.errors import AuthenticationError, DomusError
from domus.service import limits
from domus.supervisor.balancer import Settings
from domus.supervisor.timing import DOWN_AFTER, PUSH_TIMEOUT
from domus.wire import address as addresses
from domus.wire.attributes import MAX_BUCKETS, MIN_BUCKETS
from domus.wire.keys import DEFAULT_HASH, HASH_FUNCTIONS

SERVICE_ADMIN = ("list", "remove", "drain", "discard")


def _positive_seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return seconds


def _dht_id(text: str) -> int:
    from domus.wire import checks

    try:
        return checks.dht_id(int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a DHT id (an integer from 1 to "
                                         f"{checks.MAX_DHT_ID})") from None


def _number(kind: type, low: float, high: float, what: str) -> Any:
    """An argparse type: a ``kind`` (int or float) from ``low`` to
    ``high``, refused with a message naming the value and the range."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text} is out of range: {what} go from "
                                             f"{low:g} to {high:g}")
        return value

    return parse


_SERVICES = _number(int, 0, 1024, "services")
_PORT = _number(int, 1, 65535, "ports")
_BUCKET = _number(int, 0, 2 ** 31 - 1, "bucket numbers")
_BUCKETS = _number(int, MIN_BUCKETS, MAX_BUCKETS, "bucket counts")
_REPLICAS = _number(int, 1, 3, "replicas")
_DEGREE = _number(int, 2, 1024, "de Bruijn degrees")
_MOVES = _number(int, 1, 1_000_000, "moves per round")
_PERCENT = _number(float, 0.0, 1e6, "percentages")
_CORES = _number(float, 0.01, 1e6, "cores")
_BYTES = _number(int, 1, 2 ** 62, "sizes in bytes")
_CACHE_BYTES = _number(int, 0, 2 ** 62, "cache sizes in bytes")
_CONNECTIONS = _number(int, 1, 1_000_000, "connection counts")
_SCANS = _number(int, 1, 100_000_000, "scan counts")
_KEYS = _number(int, 1, 2 ** 40, "key counts")
_CACHE = _number(int, 2, 2 ** 32, "reply cache sizes")
_FACTOR = _number(int, 0, 65_507, "reply factors")
_SHED_AFTER = _number(float, 0.0, 3600.0, "seconds")
_SPIN = _number(float, 0.0, 0.01, "seconds")


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1]")
    return value


def _disk_reserve(text: str) -> Any:
    from domus.storage.headroom import parse_reserve

    try:
        return parse_reserve(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _cpu_list(text: str) -> list[int]:
    """'2', '0,1' or '4-7' (as taskset -c): the CPU numbers, each one that
    this machine has."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list such as 2, 0,1 or "
                                         f"4-7") from None
    present = os.cpu_count() or 1
    if not cpus or min(cpus) < 0 or max(cpus) >= present:
        raise argparse.ArgumentTypeError(f"CPUs {text} are not all among this machine's "
                                         f"0 to {present - 1}")
    return sorted(cpus)


def _instance_count(text: str) -> int:
    from domus.ops.instances import MAX_INSTANCES

    try:
        count = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of instances") from None
    if not 1 <= count <= MAX_INSTANCES:
        raise argparse.ArgumentTypeError(f"{count} instances: give 1 to {MAX_INSTANCES}")
    return count


def _listen_address(text: str) -> str:
    """A HOST:PORT to listen on (``--metrics``)."""
    try:
        addresses.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _run_reactor(service: Any) -> int:
    from twisted.internet import reactor
    from twisted.logger import (
        FilteringLogObserver,
        LogLevel,
        LogLevelFilterPredicate,
        globalLogBeginner,
        textFileLogObserver,
    )

    level = LogLevel.levelWithName(os.environ.get("DOMUS_LOG_LEVEL", "info").lower())
    levels = LogLevelFilterPredicate(defaultLogLevel=level)
    for chatty in ("twisted", "log_legacy"):  # factory start/stop, port open/close
        levels.setLogLevelForNamespace(chatty, max(level, LogLevel.warn))
    observer = FilteringLogObserver(textFileLogObserver(sys.stderr), [levels])
    globalLogBeginner.beginLoggingTo([observer], redirectStandardIO=False)
    failures: list[BaseException] = []

    def start() -> None:
        try:
            service.startService()
        except Exception as exc:  # e.g. port in use: say so and exit non-zero
            failures.append(exc)
            print(f"domus: cannot start: {exc}", file=sys.stderr)
            reactor.stop()

    reactor.callWhenRunning(start)
    reactor.addSystemEventTrigger("before", "shutdown",
                                  lambda: None if failures else service.stopService())
    reactor.run()
    return 1 if failures else getattr(service, "exit_code", 0)


def cmd_supervisor(args: argparse.Namespace) -> int:
    from domus.supervisor.server import SupervisorService

    try:
        supervisor = SupervisorService(
            listen=args.listen, data_dir=args.data_dir, down_after=args.down_after,
            push_timeout=args.push_timeout, balance=args.balance,
            balancer_settings=Settings(settle=args.balance_settle,
                                       max_moves=args.balance_max_moves,
                                       cooldown=args.balance_cooldown,
                                       cpu_busy=args.balance_cpu_busy,
                                       smoothing=args.balance_smoothing),
            secret_file=args.secret_file, insecure=args.insecure,
            metrics=args.metrics)
    except ValueError as exc:
        raise SystemExit(f"domus: cannot start the supervisor: {exc}") from None
    return _run_reactor(supervisor)


def cmd_service(args: argparse.Namespace) -> int:
    if args.instances > 1:
        from domus.ops import instances
        from domus.service.resources import usable_cpus

        return instances.run(args, args.cpus or usable_cpus())
    from domus.service.allocator import keep_large_blocks
    from domus.service.server import DomusService

    keep_large_blocks()     # (this process serves large values: see the module)

    overrides = {key: value for key, value in
                 (("cores", args.cores), ("ram", args.ram), ("disk", args.disk),
                  ("host", args.host)) if value is not None}
    try:
        bounds = limits.from_options(args)
        service = DomusService(supervisor=addresses.supervisor_address(args.supervisor),
                               listen=args.listen, data_dir=args.data_dir, name=args.name,
                               heartbeat=args.heartbeat, resources=overrides,
                               cpus=args.cpus, secret_file=args.secret_file,
                               limits=bounds, metrics=args.metrics,
                               **({"disk_reserve": args.disk_reserve}
                                  if args.disk_reserve is not None else {}))
    except ValueError as exc:
        raise SystemExit(f"domus: cannot start the service: {exc}") from None
    return _run_reactor(service)


def cmd_up(args: argparse.Namespace) -> int:
    from domus.ops.deploy import LocalDeployment

    try:
        deployment = LocalDeployment(args.services, port=args.port, data_dir=args.data_dir,
                                     host=args.host, insecure=args.insecure,
                                     metrics_port=args.metrics_port)
    except ValueError as exc:
        print(f"domus up: {exc}", file=sys.stderr)
        return 2
    stopping = False
    code = 0

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        deployment.start()
        print(f"Domus is up: supervisor at {deployment.supervisor_address}, "
              f"{args.services} services "
              f"({', '.join(deployment.service_address(i) for i in range(args.services))}); "
              f"logs in {os.path.join(deployment.data_dir, 'logs')}", flush=True)
        if args.metrics_port is not None:
            names = ["supervisor", *(deployment.service_name(i) for i in range(args.services))]
            print("metrics: " + ", ".join(f"{name} http://{deployment.metrics_address(name)}"
                                          f"/metrics" for name in names), flush=True)
        exports = " ".join(f"{name}={shlex.quote(value)}"
                           for name, value in deployment.environment().items())
        print(f"export {exports}; press Ctrl-C to stop", flush=True)
        while True:
            for name, process in [("supervisor", deployment.supervisor),
                                  *deployment.services.items()]:
                if process is not None and process.poll() is not None:
                    print(f"domus up: {name} exited with code {process.returncode}"
                          f"{deployment.last_words(name)}; see {deployment.log_path(name)}",
                          file=sys.stderr, flush=True)
                    if name == "supervisor":
                        code = 1
                        raise KeyboardInterrupt
                    deployment.services.pop(name)
                    break
            time.sleep(0.5)
    except KeyboardInterrupt:
        if code == 0:
            _say_what_ram_dhts_lose(deployment)
    except DomusError as exc:
        print(f"domus up: {exc}", file=sys.stderr)
        deployment.stop()
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deployment.stop()
    print("Domus stopped." if code == 0 else "Domus stopped: its supervisor had exited.",
          flush=True)
    return code


def _say_what_ram_dhts_lose(deployment: Any) -> None:
    """At Ctrl-C of ``domus up``: the RAM DHTs that hold records, which
    stopping loses (``domus deployment shutdown`` saves them instead)."""
    try:
        with deployment.connect(timeout=2.0) as cluster:
            held = [(entry["name"], len(cluster.open_dht(entry["name"])))
                    for entry in cluster.list_dhts()
                    if entry["storage"] == "ram" and entry["state"] == "active"]
    except (DomusError, OSError):
        return
    held = [(name, records) for name, records in held if records]
    if held:
        listed = ", ".join(f"{name} ({records:,} record{'s' if records != 1 else ''})"
                           for name, records in held)
        print(f"domus up: stopping loses what RAM DHTs hold: {listed}; to keep them, stop "
              f"with `domus deployment shutdown` instead (it saves RAM DHTs to the data "
              f"dir), then `domus up` again", file=sys.stderr, flush=True)


def _cluster(args: argparse.Namespace) -> Any:
    from domus.client.blocking import connect

    try:
        addresses.parse(addresses.supervisor_address(args.supervisor))
    except ValueError as exc:  # a malformed --supervisor or $DOMUS_SUPERVISOR
        raise SystemExit(f"domus: {exc}") from None
    try:
        return connect(args.supervisor, timeout=args.timeout, secret_file=args.secret_file)
    except AuthenticationError as exc:
        raise SystemExit(f"domus: {exc}") from None


def _megabytes(value: float) -> str:
    return f"{value / 2**20:.0f}"


# Platform names in `domus status`'s PLATFORMS column.
_SHORT_PLATFORM = {"python-dict": "dict", "domus-rbt": "rbt", "domus-bsddb-btree": "bdb-btree",
                   "domus-bsddb-hash": "bdb-hash"}


def format_status(status: dict[str, Any]) -> str:
    supervisor = status["supervisor"]
    guard = ("secure" if supervisor.get("secure") else "INSECURE (no secret: anyone who "
             "reaches its ports may use it)")
    refused = supervisor.get("refused_connections", 0)
    lines = [f"supervisor {supervisor['address']}  version {supervisor['version']}  "
             f"up {supervisor['uptime']:.0f}s  data {supervisor['data_dir']}  {guard}"
             + (f"  refused {refused} connections" if refused else ""), ""]
    rows = [("SERVICE", "ADDRESS", "STATE", "ROLES", "BUCKETS (routing/storage per DHT)",
             "REQ/S", "LOOKUP/S", "CPU%", "NODE CPU%", "RSS MiB", "FREE RAM", "FREE DISK",
             "NET KB/S", "HOT PATH", "PLATFORMS")]
    for service in status["services"]:
        load = service.get("load") or {}
        buckets = " ".join(f"{dht}:{counts.get('routing', 0)}/{counts.get('storage', 0)}"
                           for dht, counts in sorted(service["buckets"].items())) or "-"
        up = service["state"] == "up"
        rows.append((service["name"], service["address"], service["state"],
                     ",".join(service["roles"]) or "-", buckets,
                     f"{load.get('requests_per_s', 0):.0f}" if up else "-",
                     f"{load.get('lookups_per_s', 0):.0f}" if up else "-",
                     f"{load.get('cpu', 0):.0f}" if up else "-",
                     f"{load.get('node_cpu', 0):.0f}" if up else "-",
                     _megabytes(load.get("rss", 0)) if up else "-",
                     _size(load.get("free_ram")) if up else "-",
                     (_size(load.get("free_disk"))
                      + (" DISK FULL" if load.get("disk_full") else "")) if up else "-",
                     f"{load.get('net_bytes_per_s', 0) / 1000:.0f}" if up else "-",
                     {"c": "C", "python": "python (slow)"}.get(service.get("hot_path"), "-"),
                     ",".join(_SHORT_PLATFORM.get(name, name)
                              for name in service.get("platforms", [])) or "-"))
    lines += _table(rows)
    alarms = storage_alarms(status["services"])
    if alarms:
        lines += ["", "alarms:", *(f"  {alarm}" for alarm in alarms)]
    lines.append("")
    dht_rows = [("DHT", "ID", "STATE", "BUCKETS", "REPLICAS", "HASH", "STORAGE", "ROUTING",
                 "LOOKUP", "ROUTING SERVICES", "STORAGE SERVICES")]
    for dht in status["dhts"]:
        state = dht.get("state", "active")
        if dht.get("lost_buckets"):
            state += f", {dht['lost_buckets']} buckets LOST"
        elif dht.get("degraded"):
            state += ", DEGRADED (copies missing)"
        dht_rows.append((dht["name"], str(dht["id"]), state,
                         str(dht["buckets"]), str(dht.get("replicas", 1)), dht["hash"],
                         f"{dht['storage']}/{dht['platform']}", dht["routing"], dht["lookup"],
                         ",".join(dht["routing_services"]), ",".join(dht["storage_services"])))
    lines += _table(dht_rows) if status["dhts"] else ["no DHTs"]
    stored = _stored_rows(status["services"])
    if stored:
        lines += ["", *_table(stored)]
    orphans = [(service["name"], orphan) for service in status["services"]
               for orphan in service.get("unknown_dhts") or []]
    if orphans:
        lines += ["", "DHTs unknown to the supervisor (kept by their services; "
                  "`domus service discard SERVICE ID` deletes one):"]
        rows = [("SERVICE", "ID", "NAME", "STORAGE", "RECORDS", "DEPLOYMENT", "STAMP")]
        rows += [(name, str(orphan["id"]), str(orphan.get("name") or "?"),
                  f"{orphan.get('storage') or '?'}/{orphan.get('platform') or '?'}",
                  "-" if orphan.get("records") is None else f"{orphan['records']:,}",
                  str(orphan.get("deployment") or "?"), str(orphan.get("stamp") or "?"))
                 for name, orphan in orphans]
        lines += _table(rows)
    return "\n".join(lines)


def _stored_rows(services: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """What each service stores of each DHT, as its last heartbeat said: the
    records and the bytes its platform counts holding for them (record-tree
    arenas, Berkeley DB pages; "-" where the platform cannot tell)."""
    rows = [("SERVICE", "DHT", "RECORDS", "HELD", "BYTES/RECORD")]
    for service in services:
        dhts = (service.get("stats") or {}).get("dhts") or {}
        for name, held in sorted(dhts.items()):
            if not held.get("storage_buckets"):
                continue
            records = held.get("records", 0)
            size = held.get("storage_bytes")
            rows.append((service["name"], name, f"{records:,}",
                         "-" if size is None else _bytes(size),
                         "-" if size is None or not records else f"{size / records:,.0f}"))
    return rows if len(rows) > 1 else []


def _bytes(value: float) -> str:
    return _size(value) if value >= 1 << 20 else f"{value / 1024:.1f} KiB"


def storage_alarms(services: list[dict[str, Any]]) -> list[str]:
    """A line for each service whose disk is at its reserve, and for each
    DHT whose storage will not open on a service (whole, or some buckets),
    with why."""
    alarms = []
    for service in services:
        name = service["name"]
        load = service.get("load") or {}
        if service["state"] == "up" and load.get("disk_full"):
            alarms.append(f"{name}: DISK FULL: {_size(load.get('free_disk'))} free, reserve "
                          f"{_size(load.get('disk_reserve'))}: puts on its disk DHTs are "
                          f"refused (reads and deletes go on); delete records or free space "
                          f"under its data dir")
        for dht, held in sorted(((service.get("stats") or {}).get("dhts") or {}).items()):
            if held.get("problem"):
                alarms.append(f"{name}: DHT {dht!r} NOT SERVED (retrying): {held['problem']}")
            failed = held.get("failed_buckets") or {}
            if failed:
                buckets = sorted(int(bucket) for bucket in failed)
                shown = ", ".join(map(str, buckets[:8])) + (", ..." if len(buckets) > 8 else "")
                alarms.append(f"{name}: DHT {dht!r}: {len(buckets)} buckets NOT SERVED "
                              f"(retrying) [{shown}]: {next(iter(failed.values()))}")
    return alarms


def _size(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value / 1024:.0f} KiB"


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
            for row in rows]


def cmd_secret(args: argparse.Namespace) -> int:
    """`domus secret new FILE`: a new deployment secret (mode 0600), for a
    supervisor's --secret-file and its processes' $DOMUS_SECRET_FILE."""
    from domus.wire import secret

    try:
        secret.create(args.file)
    except FileExistsError:
        raise SystemExit(f"domus: {args.file} exists already; a secret is never "
                         f"overwritten (remove it first to replace it)") from None
    except OSError as exc:
        raise SystemExit(f"domus: cannot write {args.file}: {exc.strerror}") from None
    print(f"made the deployment secret {args.file} (mode 0600); give it to the supervisor "
          f"(--secret-file) and to every process of the deployment ($DOMUS_SECRET_FILE)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        status = cluster.status()
    print(json.dumps(status, indent=2, sort_keys=True) if args.json else format_status(status))
    return 0


def cmd_service_admin(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        if args.action == "list":
            services = cluster.services()
            if args.json:
                print(json.dumps(services, indent=2, sort_keys=True))
            else:
                rows = [("SERVICE", "ADDRESS", "STATE", "ROLES")]
                rows += [(s["name"], s["address"], s["state"], ",".join(s["roles"]) or "-")
                         for s in services]
                print("\n".join(_table(rows)))
        elif args.action == "remove":
            answer = cluster.remove_service(args.name, force=args.force)
            lost = answer.get("lost_records")
            print(f"removed service {args.name}" + (
                "" if lost is None else f" by force: its buckets of {answer['dhts']} went to "
                f"their backups, or empty to the other services; {lost:,} records lost"))
        elif args.action == "discard":
            answer = cluster.discard_dht(args.name, args.dht_id)
            records = answer.get("records")
            print(f"service {args.name} discarded DHT {answer.get('name')!r} (id "
                  f"{answer['id']}, deployment {answer.get('deployment')}, stamp "
                  f"{answer.get('stamp')})" + ("" if records is None else
                                                f": {records:,} records"))
        elif args.action == "drain":
            drained = cluster.drain_service(args.name)
            print(f"drained service {args.name}: {drained['moves']} bucket moves, "
                  f"{drained['records']:,} records copied; it holds no bucket now "
                  f"(`domus service remove {args.name}` takes it out)")
    return 0


def format_moves(moves: list[dict[str, Any]]) -> str:
    """The balancer's moves as a table (``domus dht rebalance``)."""
    if not moves:
        return "nothing to move: every bucket is where its targets want it"
    rows = [("BUCKET", "ROLE", "FROM", "TO", "RECORDS", "WHY")]
    rows += [(str(move["bucket"]), move["role"], move["source"], move["target"],
              "-" if move["records"] is None else f"{move['records']:,}", move["why"])
             for move in moves]
    return "\n".join(_table(rows))


def cmd_balancer(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        status = cluster.balancer_status()
    if args.json:
        print(json.dumps(status, indent=2, sort_keys=True))
        return 0
    print(f"mode {status['mode']}; now: {status['doing'] or 'idle'}; draining: "
          f"{', '.join(status['draining']) or 'none'}; balancing: "
          f"{', '.join(status['balancing']) or 'none'}")
    for service, factor in sorted(status["damped"].items()):
        print(f"{service}: weight x{factor:.2f} while it is busy")
    decisions = status["decisions"]
    print(f"last {len(decisions)} decisions:" if decisions else "no decisions yet")
    for decision in decisions:
        at = time.strftime("%H:%M:%S", time.localtime(decision["at"]))
        print(f"  {at}  {decision['decision']}")
    return 0


def cmd_dht(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        if args.action == "create":
            dht = cluster.create_dht(
                args.name, buckets=args.buckets, hash=args.hash, storage=args.storage,
                platform=args.platform, routing=args.routing,
                routing_degree=args.routing_degree, routing_algorithm=args.routing_algorithm,
                lookup=args.lookup,
                durability=args.durability, replicas=args.replicas, codec=args.codec,
                routing_services=_names(args.routing_services),
                storage_services=_names(args.storage_services), exist_ok=args.exist_ok)
            done = "existed already" if dht.descriptor.get("existed") else "created"
            print(f"DHT {dht.name!r} {done} (id {dht.id}, {dht.bucket_count} buckets)"
                  if done != "created" else
                  f"created DHT {dht.name!r} (id {dht.id}, {dht.bucket_count} buckets)")
        elif args.action == "list":
            dhts = cluster.list_dhts()
            if args.json:
                print(json.dumps(dhts, indent=2, sort_keys=True))
            elif not dhts:
                print("no DHTs")
            else:
                rows = [("DHT", "ID", "STATE", "BUCKETS", "STORAGE", "ROUTING", "LOOKUP")]
                rows += [(d["name"], str(d["id"]), d.get("state", "active"), str(d["buckets"]),
                          f"{d['storage']}/{d['platform']}", d["routing"], d["lookup"])
                         for d in dhts]
                print("\n".join(_table(rows)))
        elif args.action == "info":
            print(json.dumps(cluster.dht_info(args.name), indent=2, sort_keys=True))
        elif args.action == "destroy":
            cluster.destroy_dht(args.name)
            print(f"destroyed DHT {args.name!r}")
        elif args.action == "deactivate":
            kept = cluster.deactivate_dht(args.name)
            print(f"deactivated DHT {args.name!r}: {sum(kept.values())} records kept "
                  f"({_per_service(kept)}); `domus dht activate {args.name}` brings it back")
        elif args.action == "activate":
            loaded = cluster.activate_dht(args.name)
            print(f"activated DHT {args.name!r}"
                  + (f": {sum(loaded.values())} saved records loaded ({_per_service(loaded)})"
                     if any(loaded.values()) else ""))
        elif args.action == "rebalance":
            moves = cluster.rebalance(args.name, dry_run=args.dry_run)
            print(format_moves(moves))
            if moves:
                print(f"{'would move' if args.dry_run else 'moved'} {len(moves)} bucket(s) of "
                      f"DHT {args.name!r}")
        elif args.action == "accept-loss":
            accepted = cluster.accept_loss(args.name)
            print(f"DHT {args.name!r}: the loss of {len(accepted)} bucket(s) accepted"
                  + (f" ({', '.join(map(str, accepted))}); they serve again, empty"
                     if accepted else ": none was lost"))
        elif args.action == "resize":
            answer = cluster.resize_dht(args.name, args.buckets)
            print(f"resized DHT {args.name!r} from {answer['from']} to {answer['buckets']} "
                  f"buckets in {answer['seconds']:.2f}s "
                  f"({len(answer['steps'])} step{'s' if len(answer['steps']) != 1 else ''})")
            for step in answer["steps"]:
                for service, error in sorted(step.get("lagging", {}).items()):
                    print(f"domus: warning: service {service} has not split its buckets yet "
                          f"({error}); it will", file=sys.stderr)
        elif args.action == "services":
            roles = [args.role] if args.role else ["routing", "storage"]
            moves = cluster.dht_services(args.name, add=_names(args.add) or [],
                                         remove=_names(args.remove) or [], roles=roles)
            print(format_moves(moves))
            info = cluster.dht_info(args.name)
            for role in roles:
                print(f"{role} services: "
                      f"{', '.join(entry['name'] for entry in info[f'{role}_services'])}")
        elif args.action == "move":
            answer = cluster.move_bucket(args.name, args.bucket, routing=args.routing,
                                         storage=args.storage)
            print(format_move(answer))
            for service, error in sorted(answer.get("lagging", {}).items()):
                print(f"domus: warning: service {service} did not take the new layout "
                      f"({error}); it will when it next registers", file=sys.stderr)
    return 0


def format_move(answer: dict[str, Any]) -> str:
    """One line saying what ``move_bucket`` did."""
    where = f"DHT {answer['name']}: bucket {answer['bucket']} {answer['role']}"
    if not answer["changed"]:
        return f"{where} is on {answer['to']} already; nothing moved"
    moved = f"{where} moved {answer['from']} -> {answer['to']}"
    if answer["records"] is None:
        return moved
    return f"{moved} ({answer['records']:,} records, {answer['seconds']:.2f} s)"


def cmd_deployment(args: argparse.Namespace) -> int:
    from domus.errors import SupervisorUnreachable
    from domus.ops import launch

    state_dir = getattr(args, "data_dir", None)
    try:
        cluster = _cluster(args)
    except SupervisorUnreachable:
        if args.action == "shutdown" or not state_dir:
            raise
        print(f"no supervisor answers at {addresses.supervisor_address(args.supervisor)}; "
              f"starting the deployment from {state_dir}")
    else:
        summary = launch.shutdown(cluster, save_ram=not args.discard_ram)
        _print_shutdown(summary)
        if args.action == "shutdown":
            return 0
        state_dir = state_dir or summary["data_dir"]
    failures = launch.restart(os.path.abspath(state_dir), launcher=args.launcher,
                              timeout=args.wait)
    return 1 if failures else 0


def _print_shutdown(summary: dict[str, Any]) -> None:
    stopped = summary["stopped"]
    print(f"stopped {len(stopped)} services ({', '.join(stopped) or 'none'}) and the "
          f"supervisor")
    if summary["not_stopped"]:
        print(f"did not confirm they stopped: {', '.join(summary['not_stopped'])}",
              file=sys.stderr)
    if summary["down"]:
        print(f"were down already: {', '.join(summary['down'])}")
    for name, records in sorted(summary["saved_ram_dhts"].items()):
        print(f"RAM DHT {name!r}: {records} records saved; active again after the restart")
    print(f"restart with: domus deployment restart --data-dir {summary['data_dir']}")


def _per_service(counts: dict[str, int]) -> str:
    return ", ".join(f"{service}: {count}" for service, count in sorted(counts.items()))


def _names(text: str | None) -> list[str] | None:
    return [part.strip() for part in text.split(",") if part.strip()] if text else None


def _key(args: argparse.Namespace) -> Any:
    if args.int_key:
        try:
            return int(args.key)
        except ValueError:
            raise SystemExit(f"domus: --int-key given but {args.key!r} is not an integer") \
                from None
    return args.key


def cmd_data(args: argparse.Namespace) -> int:
    with _cluster(args) as cluster:
        dht = cluster.open_dht(args.dht)
        key = _key(args)
        if args.command == "put":
            try:
                value = json.loads(args.value) if args.json_value else args.value
            except json.JSONDecodeError as exc:
                raise SystemExit(f"domus: --json-value given but {args.value!r} is not "
                                 f"valid JSON: {exc}") from None
            created = dht.put(key, value)
            print("created" if created else "replaced")
        elif args.command == "get":
            missing = object()
            value = dht.get(key, missing)
            if value is missing:
                print(f"domus: key {key!r} is not in DHT {args.dht!r}{_int_hint(args, dht)}",
                      file=sys.stderr)
                return 1
            print(json.dumps(value, default=_bytes_for_json)
                  if not isinstance(value, str) else value)
        elif args.command == "del":
            if not dht.delete(key):
                print(f"domus: key {key!r} is not in DHT {args.dht!r}{_int_hint(args, dht)}",
                      file=sys.stderr)
                return 1
            print("deleted")
    return 0


def _int_hint(args: argparse.Namespace, dht: Any) -> str:
    """A key given as digits without --int-key is the string; say so when
    the integer is there."""
    if args.int_key:
        return ""
    try:
        number = int(args.key)
    except ValueError:
        return ""
    if number in dht:
        return f" (the integer {number} is: keys are strings unless --int-key is given)"
    return " (keys are strings unless --int-key is given)"


def _bytes_for_json(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "backslashreplace")
    raise TypeError(type(value).__name__)


def _version_line() -> str:
    """``domus --version``: the version, where it is installed and what it
    runs on (the C paths or the pure-Python ones)."""
    from domus._version import __version__

    try:
        from domus import _codec, _hotpath, _rbtree, _recordtree  # noqa: F401
        paths = "C extensions built"
    except ImportError:
        paths = "C extensions not built: pure-Python paths (slower)"
    location = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return f"domus {__version__} ({location}; {paths})"


class _VersionAction(argparse.Action):
    """``--version``, printed as one line (argparse's own wraps it)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        print(_version_line())
        parser.exit()


class _Help(argparse.HelpFormatter):
    """Help that shows each option's default (unless its text already says
    it, or it has none worth saying)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or "default" in text
                or action.default in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class _Parser(argparse.ArgumentParser):
    """argparse's parser, with defaults in its help and a "did you mean"
    when a command or choice is mistyped."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Help)
        super().__init__(*args, **kwargs)

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            choices = [str(choice) for choice in action.choices]
            raise argparse.ArgumentError(action, f"invalid choice: {value!r}"
                                         f"{_did_you_mean(str(value), choices)} "
                                         f"(choose from {', '.join(choices)})")


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.5)
    return f"; did you mean {close[0]!r}?" if close else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="domus", description="Distributed hash tables for cluster jobs.")
    parser.add_argument("--version", action=_VersionAction, nargs=0,
                        help="print the version, where Domus runs from and whether its C "
                        "extensions are built, then exit")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def talks(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sub.add_argument("--supervisor", default=None, metavar="HOST:PORT",
                         help="the supervisor (default: $DOMUS_SUPERVISOR, then 127.0.0.1:7700)")
        sub.add_argument("--timeout", type=_positive_seconds, default=5.0, metavar="SECONDS",
                         help="seconds to wait for any answer (default 5)")
        sub.add_argument("--secret-file", metavar="FILE", default=None,
                         help="the deployment secret (default: $DOMUS_SECRET_FILE, then "
                         "./domus-data/supervisor/secret)")
        return sub

    up = commands.add_parser("up", help="run a supervisor and N services here, in the foreground")
    up.add_argument("--services", type=_SERVICES, default=3, metavar="N",
                    help="services to start")
    up.add_argument("--port", type=_PORT, default=7700,
                    help="supervisor port; services take the next N ports")
    up.add_argument("--host", default="127.0.0.1",
                    help="address every process listens on")
    up.add_argument("--data-dir", default="domus-data", metavar="DIR",
                    help="the supervisor's and services' data dirs, logs and the secret")
    up.add_argument("--metrics-port", type=_PORT, default=None, metavar="P",
                    help="serve Prometheus metrics over HTTP: the supervisor's at "
                    "http://HOST:P/metrics, the services' on the next N ports (P+1 .. P+N); "
                    "default: no metrics")
    up.add_argument("--insecure", action="store_true", help="no deployment secret: anyone "
                    "who can reach its ports may use it (a trusted network only)")
    up.set_defaults(func=cmd_up)

    sup = commands.add_parser("supervisor", help="run the supervisor")
    sup.add_argument("--listen", default="127.0.0.1:7700", metavar="HOST:PORT")
    sup.add_argument("--data-dir", required=True)
    sup.add_argument("--down-after", type=_positive_seconds, default=DOWN_AFTER,
                     metavar="SECONDS", help="a service silent this long is unresponsive "
                     "(default %(default)s)")
    sup.add_argument("--push-timeout", type=_positive_seconds, default=PUSH_TIMEOUT,
                     metavar="SECONDS", help="how long a service has to acknowledge a change "
                     "of its DHTs (default %(default)s)")
    sup.add_argument("--balance", choices=("auto", "manual"), default="auto",
                     help="auto: buckets follow resources and load by themselves; manual: "
                     "only `domus dht rebalance` and drains move them (default auto)")
    knobs = Settings()
    sup.add_argument("--balance-settle", type=_positive_seconds, default=knobs.settle,
                     metavar="SECONDS", help="how long an imbalance must last before the "
                     "balancer moves anything (default %(default)s)")
    sup.add_argument("--balance-max-moves", type=_MOVES, default=knobs.max_moves, metavar="N",
                     help="buckets the balancer moves per round, one DHT at a time "
                     "(default %(default)s)")
    sup.add_argument("--balance-cooldown", type=_positive_seconds, default=knobs.cooldown,
                     metavar="SECONDS", help="how long a moved bucket is left where it is "
                     "(default %(default)s)")
    sup.add_argument("--balance-cpu-busy", type=_PERCENT, default=knobs.cpu_busy,
                     metavar="PERCENT", help="a service whose own CPU stays above this (%% of "
                     "a core) while another has room gives buckets away (default %(default)s; "
                     "over 100: never)")
    sup.add_argument("--secret-file", metavar="FILE", help="the deployment secret (default: "
                     "<data dir>/secret, made at the first start, mode 0600)")
    sup.add_argument("--insecure", action="store_true", help="no secret: anyone who can reach "
                     "the deployment's ports may use it (a trusted network only)")
    sup.add_argument("--balance-smoothing", type=_fraction, default=knobs.smoothing,
                     metavar="FRACTION", help="weight of each new sample of the CPU other work "
                     "uses on a node, in the balancer's average that routing shares follow "
                     "(default %(default)s: slow, so bursts move nothing)")
    sup.add_argument("--metrics", type=_listen_address, default=None, metavar="HOST:PORT",
                     help="serve Prometheus metrics at http://HOST:PORT/metrics "
                     "(default: not served)")
    sup.set_defaults(func=cmd_supervisor)

    svc = commands.add_parser(
        "service", help="run a service (or: service list|remove|drain)",
        description="Run a service (with --listen and --data-dir), or administer the "
        "deployment's services:\n" + "".join(
            f"  domus service {action:<7} {text}\n"
            for action, text in SERVICE_ADMIN_HELP.items())
        + "(`domus service ACTION --help` for each)",
        formatter_class=type("_RawHelp", (argparse.RawDescriptionHelpFormatter, _Help), {}))
    svc.add_argument("--supervisor", default=None, metavar="HOST:PORT")
    svc.add_argument("--listen", required=True, metavar="HOST:PORT")
    svc.add_argument("--data-dir", required=True)
    svc.add_argument("--name", default=None, help="default: the listen address")
    svc.add_argument("--heartbeat", type=_positive_seconds, default=1.0, metavar="SECONDS",
                     help="seconds between heartbeats")
    svc.add_argument("--cores", type=_CORES, default=None,
                     help="declare cores (the balancer's routing weight; default: measured)")
    svc.add_argument("--ram", type=_BYTES, default=None, metavar="BYTES",
                     help="declare RAM (the storage weight of RAM DHTs; default: measured)")
    svc.add_argument("--disk", type=_BYTES, default=None, metavar="BYTES",
                     help="declare disk (the storage weight of disk DHTs; default: measured)")
    svc.add_argument("--secret-file", metavar="FILE", help="the deployment secret (default: "
                     "$DOMUS_SECRET_FILE, then ./domus-data/supervisor/secret)")
    svc.add_argument("--cpus", type=_cpu_list, default=None, metavar="LIST",
                     help="run on these CPUs only, e.g. 2 or 0,1 or 4-7 (default: those it "
                     "was started with); its cores and node load count these only")
    svc.add_argument("--host", default=None, metavar="NAME",
                     help="the host this service runs on, as the supervisor sees it: copies "
                     "of a bucket go to services of different hosts (default: this machine's "
                     "hostname)")
    svc.add_argument("--instances", type=_instance_count, default=1, metavar="N",
                     help="run N services on this node (one core each): ports PORT to "
                     "PORT+N-1 of --listen, data dirs DIR/instance-I, names NAME-I, each "
                     "pinned to one of the CPUs (--cpus, else all, round robin); stopped "
                     "together (default 1)")
    svc.add_argument("--no-pin", action="store_true",
                     help="with --instances: leave the instances unpinned")
    svc.add_argument("--metrics", type=_listen_address, default=None, metavar="HOST:PORT",
                     help="serve Prometheus metrics at http://HOST:PORT/metrics "
                     "(default: not served)")
    svc.add_argument("--disk-reserve", type=_disk_reserve, default=None, metavar="SIZE|PCT",
                     help="free space to keep on the data dir's filesystem: below it, puts on "
                     "disk DHTs are refused (StorageFull) while reads and deletes go on; a "
                     "size (512m, 2G) or a percentage (5%%); default 1%% of the filesystem, at "
                     "least 64 MiB, at most 1 GiB and a quarter of the filesystem")
    bounds = svc.add_argument_group("bounds", "what peers can make the service hold "
                                    "(docs/operations.md, Bounds)")
    bounds.add_argument("--max-connections", type=_CONNECTIONS, default=limits.MAX_CONNECTIONS,
                        metavar="N", help="TCP connections open at once (default %(default)s, "
                        "fewer if the file descriptor limit is lower)")
    bounds.add_argument("--max-connections-per-host", type=_CONNECTIONS,
                        default=limits.MAX_CONNECTIONS_PER_HOST, metavar="N",
                        help="TCP connections open at once from one address "
                        "(default %(default)s)")
    bounds.add_argument("--idle-timeout", type=_positive_seconds, default=limits.IDLE_TIMEOUT,
                        metavar="SECONDS", help="close a TCP connection that completes no "
                        "frame for this long (default %(default)s)")
    bounds.add_argument("--write-timeout", type=_positive_seconds, default=limits.WRITE_TIMEOUT,
                        metavar="SECONDS", help="abort a TCP connection that leaves its "
                        "replies unread for this long (default %(default)s)")
    bounds.add_argument("--input-budget", type=_BYTES, default=limits.INPUT_BUDGET,
                        metavar="BYTES", help="bytes of partial TCP frames held, all "
                        "connections together (default %(default)s)")
    bounds.add_argument("--max-scans", type=_SCANS, default=limits.MAX_SCANS, metavar="N",
                        help="SCANs open at once (default %(default)s)")
    bounds.add_argument("--max-scan-keys", type=_KEYS, default=limits.MAX_SCAN_KEYS,
                        metavar="N", help="keys held by open SCANs' snapshots, all together "
                        "(default %(default)s)")
    bounds.add_argument("--udp-reply-factor", type=_FACTOR, default=limits.UDP_REPLY_FACTOR,
                        metavar="F", help="on an insecure deployment, a UDP reply is at most "
                        "F times its request (larger ones go over TCP; 0: no bound; "
                        "default %(default)s)")
    bounds.add_argument("--shed-after", type=_SHED_AFTER, default=limits.SHED_AFTER,
                        metavar="SECONDS", help="answer BUSY to a datagram that waited "
                        "longer than this (0: never shed; default %(default)s)")
    bounds.add_argument("--reply-cache-entries", type=_CACHE, default=limits.REPLY_CACHE_ENTRIES,
                        metavar="N", help="replies of changes kept so that a retry is applied "
                        "once; N/2 changes per 15 s at most, past that BUSY (about 30 bytes "
                        "each with the C path, 155 without; default %(default)s)")
    bounds.add_argument("--bdb-ram-cache", type=_CACHE_BYTES, default=limits.BDB_RAM_CACHE,
                        metavar="BYTES", help="the Berkeley DB cache of each RAM DHT stored "
                        "in Berkeley DB: the most this service holds of it (0: half the "
                        "machine's memory, at most 4 GiB; default %(default)s)")
    bounds.add_argument("--spin", type=_SPIN, default=limits.SPIN, metavar="SECONDS",
                        help="once its socket is empty, the serving thread reads it again "
                        "for this long, yielding the CPU, before it sleeps (0: sleep at "
                        "once; default %(default)s)")
    svc.set_defaults(func=cmd_service)

    secret_parser = commands.add_parser("secret", help="make a deployment secret (for job "
                                        "scripts: see docs/operations.md)")
    secret_actions = secret_parser.add_subparsers(dest="action", required=True)
    secret_new = secret_actions.add_parser("new", help="write a new secret to FILE (mode 0600; "
                                           "never overwrites)")
    secret_new.add_argument("file", metavar="FILE")
    secret_parser.set_defaults(func=cmd_secret)

    status = talks(commands.add_parser("status", help="services, roles, buckets and load"))
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    dht = commands.add_parser("dht", help="create, list, inspect, resize, deactivate, activate and "
                              "destroy DHTs, and move their buckets")
    actions = dht.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = talks(actions.add_parser("create", help="create a DHT"))
    create.add_argument("name")
    create.add_argument("--buckets", type=_BUCKETS, help="bucket count, a power of two "
                        "(default: 64 per storage service, rounded up to a power of two)")
    create.add_argument("--hash", choices=sorted(HASH_FUNCTIONS),
                        help=f"key hash (default {DEFAULT_HASH})")
    create.add_argument("--storage", help="medium: ram (default) or disk")
    create.add_argument("--platform", help="storage platform, e.g. python-dict, domus-rbt, "
                        "domus-bsddb-btree (default: the medium's)")
    create.add_argument("--routing", help="routing graph: chord or bruijn")
    create.add_argument("--routing-degree", type=_DEGREE, help="bruijn: the graph's degree "
                        "(a power of two, default 2)")
    create.add_argument("--routing-algorithm", help="fewest-hops (default) or least-work")
    create.add_argument("--lookup", help="default lookup strategy of clients: D, D,C,R, "
                        "C,R or R")
    create.add_argument("--durability", help="disk DHTs: async (default) or sync")
    create.add_argument("--replicas", type=_REPLICAS, help="copies of each bucket, on distinct "
                        "services (distinct hosts where there are enough): 1 (default) to 3")
    create.add_argument("--codec", help="how clients encode values: msgpack (default), "
                        "pickle (any Python object; needs the deployment's secret) or raw "
                        "(bytes)")
    create.add_argument("--routing-services", help="comma-separated service names")
    create.add_argument("--storage-services", help="comma-separated service names")
    create.add_argument("--exist-ok", action="store_true", help="a DHT of that name with "
                        "these attributes is fine (one being created is waited for); one "
                        "with other attributes is an error naming them")
    listing = talks(actions.add_parser("list", help="every DHT, its state and layout"))
    listing.add_argument("--json", action="store_true")
    talks(actions.add_parser("info", help="one DHT's attributes, buckets per service and "
                             "copies")).add_argument("name")
    talks(actions.add_parser("destroy", help="delete a DHT and every record in it")) \
        .add_argument("name")
    talks(actions.add_parser("deactivate", help="take a DHT offline, keeping its records (RAM "
                             "DHTs are saved to the services' data dirs)")).add_argument("name")
    talks(actions.add_parser("activate", help="bring a deactivated DHT back")) \
        .add_argument("name")
    move = talks(actions.add_parser("move", help="move one bucket's routing or storage (with "
                                    "its records) to another service"))
    move.add_argument("name")
    move.add_argument("bucket", type=_BUCKET)
    target = move.add_mutually_exclusive_group(required=True)
    target.add_argument("--routing", metavar="SERVICE", help="the service to route the bucket")
    target.add_argument("--storage", metavar="SERVICE",
                        help="the service to store the bucket (its records are copied there)")
    services = talks(actions.add_parser("services", help="add services to a DHT, or take "
                                        "them off it; its buckets move at once"))
    services.add_argument("name")
    services.add_argument("--add", metavar="S1,S2", help="services that get a share")
    services.add_argument("--remove", metavar="S1,S2", help="services that give theirs away")
    services.add_argument("--role", choices=("routing", "storage"),
                          help="change this role only (default: both)")
    rebalance = talks(actions.add_parser("rebalance", help="move a DHT's buckets to the "
                                         "balancer's targets now (or --dry-run: say which)"))
    rebalance.add_argument("name")
    rebalance.add_argument("--dry-run", action="store_true", help="print the plan, move nothing")
    accept = talks(actions.add_parser("accept-loss", help="serve a DHT's lost buckets again, "
                                      "empty (they raise DataLost until then)"))
    accept.add_argument("name")
    resize = talks(actions.add_parser("resize", help="double or halve a DHT's bucket count "
                                      "(any power of two, a step at a time) while it serves"))
    resize.add_argument("name")
    resize.add_argument("--buckets", type=_BUCKETS, required=True, metavar="N",
                        help="the new bucket count, a power of two")
    dht.set_defaults(func=cmd_dht)

    balance = commands.add_parser("balancer", help="what the balancer does and why")
    balance_actions = balance.add_subparsers(dest="action", required=True, metavar="ACTION")
    balance_status = talks(balance_actions.add_parser("status", help="mode, moves in flight, "
                                                      "last decisions with their reasons"))
    balance_status.add_argument("--json", action="store_true")
    balance.set_defaults(func=cmd_balancer)

    deployment = commands.add_parser("deployment", help="shut a whole deployment down, or "
                                     "restart it with every disk (and saved RAM) DHT")
    stages = deployment.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action, helptext in (
            ("shutdown", "stop every service (disk DHTs flushed, RAM DHTs saved) and the "
                         "supervisor"),
            ("restart", "shut down if running, then start the supervisor and every service "
                        "again from the supervisor's state")):
        stage = talks(stages.add_parser(action, help=helptext))
        stage.add_argument("--discard-ram", action="store_true",
                           help="do not save RAM DHTs: they come back empty")
        if action == "restart":
            stage.add_argument("--data-dir", metavar="DIR",
                               help="the supervisor's data dir (needed when it is not running)")
            stage.add_argument("--launcher", metavar="TEMPLATE",
                               help="how to run a command on a service's host, e.g. "
                                    "'ssh {host}' (services on this host start directly)")
            stage.add_argument("--wait", type=_positive_seconds, default=60.0,
                               help="seconds to wait for the processes to come up (default 60)")
    deployment.set_defaults(func=cmd_deployment)

    for name, helptext in (("put", "store a value"), ("get", "print a value"),
                           ("del", "delete a key")):
        sub = talks(commands.add_parser(name, help=helptext))
        sub.add_argument("dht")
        sub.add_argument("key")
        if name == "put":
            sub.add_argument("value")
            sub.add_argument("--json-value", action="store_true",
                             help="parse VALUE as JSON (default: a string)")
        sub.add_argument("--int-key", action="store_true", help="the key is an integer")
        sub.set_defaults(func=cmd_data)
    return parser


SERVICE_ADMIN_HELP = {
    "list": "every registered service: its address, state and roles",
    "remove": "take a service out of the deployment (it must hold no buckets, or --force)",
    "drain": "move every bucket off a service, so that it can leave",
    "discard": "delete a DHT a service holds that the supervisor does not know (see "
               "`domus status`)",
}


def _service_admin_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="domus service")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    for action in SERVICE_ADMIN:
        sub = actions.add_parser(action, help=SERVICE_ADMIN_HELP[action])
        sub.add_argument("--supervisor", default=None, metavar="HOST:PORT",
                         help="the supervisor (default: $DOMUS_SUPERVISOR, then "
                         "127.0.0.1:7700)")
        sub.add_argument("--timeout", type=_positive_seconds, default=5.0, metavar="SECONDS",
                         help="seconds to wait for any answer")
        sub.add_argument("--secret-file", metavar="FILE", default=None,
                         help="the deployment secret (default: $DOMUS_SECRET_FILE, then "
                         "./domus-data/supervisor/secret)")
        if action == "list":
            sub.add_argument("--json", action="store_true", help="print JSON")
        if action in ("remove", "drain", "discard"):
            sub.add_argument("name")
        if action == "discard":
            sub.add_argument("dht_id", type=_dht_id, metavar="DHT_ID",
                             help="the id `domus status` shows under DHTs unknown to the "
                             "supervisor")
        if action == "remove":
            sub.add_argument("--force", action="store_true", help="remove it even if it holds "
                             "buckets: they go, empty, to the others, and its records are lost")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if len(argv) >= 2 and argv[0] == "service" and argv[1] in SERVICE_ADMIN:
            return cmd_service_admin(_service_admin_parser().parse_args(argv[1:]))
        if len(argv) >= 2 and argv[0] == "service" and not argv[1].startswith("-"):
            print(f"domus service: unknown action {argv[1]!r}"
                  f"{_did_you_mean(argv[1], list(SERVICE_ADMIN))} (the actions are "
                  f"{', '.join(SERVICE_ADMIN)}; without one, `domus service --listen ...` "
                  f"runs a service)", file=sys.stderr)
            return 2
        args = build_parser().parse_args(argv)
        return args.func(args)
    except DomusError as exc:
        print(f"domus: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
