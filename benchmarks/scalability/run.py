"""The driver: hosts, systems, clients, the points of each experiment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.scalability.hosts import Host, Hosts
from benchmarks.scalability.systems import Domus, MariaDB, RedisCluster, System

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LEAD = 0.4          # seconds between sending a point's commands and its start


@dataclass
class Plan:
    """What to measure.  Hosts: a head (the supervisor, as the paper's
    front-end), ``max(services)`` service hosts and ``max(clients)`` client
    hosts."""

    services: list[int]           # M: service hosts of N Xcli M 1srv
    clients: list[int]            # N: client hosts
    per_host: list[int]           # X: clients per host
    seconds: float
    keys: int                     # records loaded for get
    ycsb_records: int
    strategies: list[tuple[str, float | None]]
    instances: int = 2            # services per host in the --instances points
    many_dhts: int = 8
    heartbeat_services: int = 200
    heartbeat_seconds: float = 5.0


QUICK = Plan(services=[1, 2], clients=[1, 2], per_host=[1], seconds=0.3, keys=2000,
             ycsb_records=1000, strategies=[("C,R", 0.5), ("R", None)],
             heartbeat_services=50, heartbeat_seconds=1.0)
FULL = Plan(services=[1, 2, 3], clients=[1, 2, 3, 4], per_host=[1, 2], seconds=4.0,
            keys=20000, ycsb_records=10000,
            strategies=[("C,R", 0.5), ("C,R", 0.25), ("R", None)], heartbeat_seconds=10.0)


class Workers:
    """``per_host`` long-lived client processes on each client host."""

    def __init__(self, hosts: list[Host], per_host: int, log_dir: str) -> None:
        self.slots: dict[tuple[int, int], subprocess.Popen] = {}
        self.hosts = hosts
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [ROOT, os.environ.get("PYTHONPATH")])), PYTHONUNBUFFERED="1")
        for index, host in enumerate(hosts):
            for slot in range(per_host):
                log = open(os.path.join(log_dir, f"worker-{host.name}-{slot}.log"),  # noqa: SIM115
                           "ab")
                self.slots[(index, slot)] = subprocess.Popen(
                    host.command([sys.executable, "-m", "benchmarks.scalability.worker"]),
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                    cwd=ROOT, env=env)
                log.close()

    def ask(self, slots: list[tuple[int, int]], commands: list[dict[str, Any]],
            timeout: float = 300.0) -> list[dict[str, Any]]:
        for slot, command in zip(slots, commands):
            self.slots[slot].stdin.write(json.dumps(command) + "\n")
            self.slots[slot].stdin.flush()
        answers, errors = [], []
        for slot in slots:      # (every answer read, errors or not: the next ask is in step)
            line = self.slots[slot].stdout.readline()
            if not line:
                errors.append(f"client {slot} on {self.hosts[slot[0]].name} exited "
                              f"(code {self.slots[slot].poll()}); see its log")
                continue
            answer = json.loads(line)
            if "error" in answer:
                errors.append(f"client {slot} on {self.hosts[slot[0]].name}: "
                              f"{answer['error']}")
            answers.append(answer)
        if errors:
            raise RuntimeError("; ".join(errors[:2]))
        return answers

    def forget(self) -> None:
        """Every client closes its connections (a system was stopped)."""
        slots = list(self.slots)
        self.ask(slots, [{"do": "forget"}] * len(slots))

    def cpu_pids(self) -> dict[int, list[int]]:
        by_host: dict[int, list[int]] = {}
        for (host, _slot), process in self.slots.items():
            by_host.setdefault(host, []).append(process.pid)
        return by_host

    def close(self) -> None:
        for process in self.slots.values():
            try:
                process.stdin.write(json.dumps({"do": "quit"}) + "\n")
                process.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
        for process in self.slots.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@dataclass
class Suite:
    plan: Plan
    delay_us: float
    progress: Any = print
    points: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.work = tempfile.mkdtemp(prefix="domus-scalability-")
        self.live: list[System] = []
        self.head_count = 1
        self.service_count = max(self.plan.services)
        self.client_count = max(self.plan.clients)

    def track(self, kind: type) -> type:
        """``kind``, whose instances are stopped when the run ends however
        it ends (a start that fails half-way included)."""

        def made(*args: Any) -> Any:
            system = kind(*args)
            self.live.append(system)
            return system

        return made  # type: ignore[return-value]

    # ------------------------------------------------------------ layout
    @property
    def head(self) -> Host:
        return self.hosts.hosts[0]

    def service_hosts(self, count: int) -> list[Host]:
        return self.hosts.hosts[1:1 + count]

    def client_hosts(self) -> list[Host]:
        return self.hosts.hosts[1 + self.service_count:]

    def system_dir(self, name: str) -> str:
        path = os.path.join(self.work, name)
        os.makedirs(path, exist_ok=True)
        return path

    # ------------------------------------------------------------ one point
    def measure(self, label: dict[str, Any], systems: list[System], clients: int,
                per_host: int, command: dict[str, Any],
                client_offset: int = 0) -> dict[str, Any]:
        """Run ``command`` on ``per_host`` clients of each of ``clients``
        client hosts (from ``client_offset``) at once; record the point."""
        slots = [(host, slot) for host in range(client_offset, client_offset + clients)
                 for slot in range(per_host)]
        start_at = time.time() + LEAD
        commands = [dict(command, do="run", start_at=start_at, seconds=self.plan.seconds,
                         seed=hash((label.get("experiment"), index)) & 0xFFFFFFF,
                         client=index, clients=len(slots))
                    for index, _slot in enumerate(slots)]
        for slot, one in zip(slots, commands):
            self.workers.slots[slot].stdin.write(json.dumps(one) + "\n")
            self.workers.slots[slot].stdin.flush()
        time.sleep(max(0.0, start_at - time.time()))
        cpu_before = {name: used for system in systems
                      for name, used in system.cpu_seconds().items()}
        traffic_before = self.hosts.traffic()
        time.sleep(self.plan.seconds)
        cpu_after = {name: used for system in systems
                     for name, used in system.cpu_seconds().items()}
        traffic_after = self.hosts.traffic()
        answers = self.workers.ask(slots, [])
        seconds = self.plan.seconds
        service_cpu = {host: (cpu_after[host] - cpu_before.get(host, 0.0)) / seconds
                       for host in cpu_after if host != self.head.name}
        supervisor_cpu = ((cpu_after[self.head.name] - cpu_before.get(self.head.name, 0.0))
                          / seconds if self.head.name in cpu_after else None)
        client_cpu: dict[str, float] = {}
        for (host, _slot), answer in zip(slots, answers):
            name = self.workers.hosts[host].name
            client_cpu[name] = client_cpu.get(name, 0.0) + answer["cpu"] / answer["elapsed"]
        network = {host: sum(traffic_after[host]) - sum(traffic_before[host])
                   for host in traffic_after}
        ops = sum(answer["ops"] for answer in answers)
        latency: dict[str, dict[str, float]] = {}
        for answer in answers:
            for kind, figures in answer["latency"].items():
                latency.setdefault(kind, []).append(figures)
        merged = {kind: {"count": sum(f["count"] for f in figures),
                         # (per-client percentiles, weighted by count)
                         **{p: sum(f[p] * f["count"] for f in figures)
                            / max(1, sum(f["count"] for f in figures))
                            for p in ("p50_us", "p99_us", "p999_us", "mean_us")}}
                  for kind, figures in latency.items()}
        point = {**label, "clients_per_host": per_host, "client_hosts": clients,
                 "throughput": sum(a["ops"] / a["elapsed"] for a in answers), "ops": ops,
                 "service_cpu": service_cpu, "client_cpu": client_cpu,
                 "supervisor_cpu": supervisor_cpu,
                 "network_bytes_per_s": {h: b / seconds for h, b in network.items() if b},
                 "latency": merged,
                 "hops": (sum(a.get("hops", 0.0) for a in answers) / len(answers)),
                 "retries": sum(a.get("retries", 0) for a in answers),
                 "busy": sum(a.get("busy", 0) for a in answers),
                 "load_average": round(os.getloadavg()[0], 2)}
        self.points.append(point)
        nodes = label.get("nodes")
        busy = f"{point['busy']:,} BUSY answers backed off, " if point["busy"] else ""
        self.progress(f"  {label['experiment']:<26} {label.get('system', ''):<8} "
                      f"N={clients} X={per_host} M={label.get('services', '-')} "
                      f"#nodes={nodes}: {point['throughput']:>9,.0f} ops/s  "
                      f"({busy}load {point['load_average']})")
        return point

    def load(self, system: str, target: dict[str, Any], keys: int, ycsb: bool = False) -> None:
        """Records for get/YCSB, loaded by the first clients in parallel."""
        slots = [(host, 0) for host in range(self.client_count)]
        share = -(-keys // len(slots))
        self.workers.ask(slots, [{"do": "load", "system": system, "target": target,
                                  "first": index * share, "end": min(keys, (index + 1) * share),
                                  "seed": index, "ycsb": ycsb}
                                 for index in range(len(slots))])

    # ------------------------------------------------------------ experiments
    def domus_disjoint(self) -> None:
        """N Xcli M 1srv: services and clients on disjoint hosts."""
        for services in self.plan.services:
            domus = self.track(Domus)(self.system_dir(f"domus-m{services}")).start(
                self.head, self.service_hosts(services))
            try:
                domus.create(self.head, "put1", "--lookup", "D")
                for per_host in self.plan.per_host:
                    for clients in self.plan.clients:
                        self.measure({"experiment": "N Xcli M 1srv", "system": "domus",
                                      "op": "put1", "services": services,
                                      "nodes": clients + services, "lookup": "D",
                                      "storage": "ram"},
                                     [domus], clients, per_host,
                                     {"system": "domus", "op": "put1",
                                      "target": dict(domus.target, dhts=["put1"])})
                if services == self.plan.services[0]:
                    self._domus_variants(domus, services)
            finally:
                domus.stop()
                self.workers.forget()

    def _domus_variants(self, domus: Domus, services: int) -> None:
        """At M services: get, the lookup strategies, disk, many DHTs."""
        clients = max(self.plan.clients)
        per_host = self.plan.per_host[0]
        domus.create(self.head, "get", "--lookup", "D")
        self.load("domus", dict(domus.target, dhts=["get"]), self.plan.keys)
        base = {"system": "domus", "services": services, "nodes": clients + services,
                "storage": "ram"}
        self.measure({**base, "experiment": "get", "op": "get", "lookup": "D"},
                     [domus], clients, per_host,
                     {"system": "domus", "op": "get", "keys": self.plan.keys,
                      "target": dict(domus.target, dhts=["get"])})
        for strategy, cache in [("D", None), *self.plan.strategies]:
            self.measure({**base, "experiment": "lookup strategies", "op": "get",
                          "lookup": strategy if cache is None else f"{strategy} {cache:g}"},
                         [domus], clients, per_host,
                         {"system": "domus", "op": "get", "keys": self.plan.keys,
                          "lookup": strategy, "cache": cache,
                          "target": dict(domus.target, dhts=["get"])})
        domus.create(self.head, "on-disk", "--storage", "disk", "--platform",
                     "domus-bsddb-btree")
        self.measure({**base, "experiment": "disk", "op": "put1", "lookup": "D",
                      "storage": "disk/domus-bsddb-btree"}, [domus], clients, per_host,
                     {"system": "domus", "op": "put1",
                      "target": dict(domus.target, dhts=["on-disk"])})
        names = [f"many-{index}" for index in range(self.plan.many_dhts)]
        for name in names:
            domus.create(self.head, name, "--buckets", "32")
        self.measure({**base, "experiment": f"{len(names)} DHTs", "op": "put1",
                      "lookup": "D"}, [domus], clients, per_host,
                     {"system": "domus", "op": "put1", "target": dict(domus.target, dhts=names)})

    def domus_instances(self) -> None:
        """What ``--instances`` buys: the same hosts, more services each."""
        services = self.plan.services[0]
        clients = max(self.plan.clients)
        per_host = max(self.plan.per_host)
        for instances in (1, self.plan.instances):
            domus = self.track(Domus)(self.system_dir(f"domus-instances{instances}")).start(
                self.head, self.service_hosts(services), instances=instances)
            try:
                domus.create(self.head, "put1")
                self.measure({"experiment": "--instances", "system": "domus", "op": "put1",
                              "services": services, "instances": instances,
                              "nodes": clients + services, "lookup": "D", "storage": "ram"},
                             [domus], clients, per_host,
                             {"system": "domus", "op": "put1",
                              "target": dict(domus.target, dhts=["put1"])})
            finally:
                domus.stop()
                self.workers.forget()

    def domus_shared(self) -> None:
        """N Xcli 1srv: each host runs a service and X clients."""
        hosts = self.client_hosts()
        for clients in self.plan.clients:
            domus = self.track(Domus)(self.system_dir(f"domus-shared{clients}")).start(
                self.head, hosts[:clients])
            try:
                domus.create(self.head, "put1")
                for per_host in self.plan.per_host:
                    self.measure({"experiment": "N Xcli 1srv", "system": "domus", "op": "put1",
                                  "services": clients, "nodes": clients, "lookup": "D",
                                  "storage": "ram"}, [domus], clients, per_host,
                                 {"system": "domus", "op": "put1",
                                  "target": dict(domus.target, dhts=["put1"])})
            finally:
                domus.stop()
                self.workers.forget()

    def redis(self) -> None:
        """The Redis Cluster baseline on the same service hosts."""
        for services in self.plan.services:
            cluster = self.track(RedisCluster)(self.system_dir(f"redis-m{services}")).start(
                self.service_hosts(services))
            try:
                for per_host in self.plan.per_host:
                    for clients in self.plan.clients:
                        self.measure({"experiment": "N Xcli M 1srv", "system": "redis",
                                      "op": "put1", "services": services,
                                      "nodes": clients + services},
                                     [cluster], clients, per_host,
                                     {"system": "redis", "op": "put1",
                                      "target": cluster.target})
                if services == self.plan.services[0]:
                    self.load("redis", cluster.target, self.plan.keys)
                    clients = max(self.plan.clients)
                    self.measure({"experiment": "get", "system": "redis", "op": "get",
                                  "services": services, "nodes": clients + services},
                                 [cluster], clients, self.plan.per_host[0],
                                 {"system": "redis", "op": "get", "keys": self.plan.keys,
                                  "target": cluster.target})
            finally:
                cluster.stop()
                self.workers.forget()

    def mariadb(self) -> None:
        """The MariaDB (InnoDB) baseline: one server, as the paper's MySQL."""
        server = self.track(MariaDB)(self.system_dir("mariadb")).start(self.service_hosts(1)[0])
        try:
            for per_host in self.plan.per_host:
                for clients in self.plan.clients:
                    self.measure({"experiment": "N Xcli M 1srv", "system": "mariadb",
                                  "op": "put1", "services": 1, "nodes": clients + 1},
                                 [server], clients, per_host,
                                 {"system": "mariadb", "op": "put1", "target": server.target})
            self.load("mariadb", server.target, self.plan.keys)
            clients = max(self.plan.clients)
            self.measure({"experiment": "get", "system": "mariadb", "op": "get",
                          "services": 1, "nodes": clients + 1}, [server], clients,
                         self.plan.per_host[0],
                         {"system": "mariadb", "op": "get", "keys": self.plan.keys,
                          "target": server.target})
        finally:
            server.stop()
            self.workers.forget()

    def ycsb(self) -> None:
        """YCSB A-F on Domus (domus-rbt: E scans key ranges) and Redis Cluster."""
        services = max(self.plan.services)
        clients = max(self.plan.clients)
        per_host = self.plan.per_host[0]
        records = self.plan.ycsb_records
        domus = self.track(Domus)(self.system_dir("ycsb-domus")).start(self.head,
                                                           self.service_hosts(services))
        try:
            for workload in "ABCDEF":
                name = f"ycsb-{workload.lower()}"
                domus.create(self.head, name, "--platform", "domus-rbt")
                target = dict(domus.target, dhts=[name])
                self.load("domus", target, records, ycsb=True)
                self.measure({"experiment": f"YCSB {workload}", "system": "domus", "op": "ycsb",
                              "services": services, "nodes": clients + services},
                             [domus], clients, per_host,
                             {"system": "domus", "op": "ycsb", "workload": workload,
                              "records": records, "target": target})
        finally:
            domus.stop()
            self.workers.forget()
        cluster = self.track(RedisCluster)(self.system_dir("ycsb-redis")).start(
            self.service_hosts(services))
        try:
            for workload in "ABCDEF":
                cluster.flush()     # (each workload on its freshly loaded records)
                self.load("redis", cluster.target, records, ycsb=True)
                self.measure({"experiment": f"YCSB {workload}", "system": "redis", "op": "ycsb",
                              "services": services, "nodes": clients + services},
                             [cluster], clients, per_host,
                             {"system": "redis", "op": "ycsb", "workload": workload,
                              "records": records, "target": cluster.target})
        finally:
            cluster.stop()
            self.workers.forget()

    # ------------------------------------------------------------ the run
    def run(self, only: set[str] | None = None) -> dict[str, Any]:
        count = 1 + self.service_count + self.client_count
        self.hosts = Hosts(count, delay_us=self.delay_us)
        self.started = time.monotonic()
        try:
            self.hosts.open()
            self.progress(f"{count} hosts (network namespaces {self.hosts.tag}-*): 1 head, "
                          f"{self.service_count} service hosts, {self.client_count} client "
                          f"hosts; delay: {self.hosts.netem}")
            self.workers = Workers(self.client_hosts(), max(self.plan.per_host),
                                   self.system_dir("clients"))
            try:
                experiments = [("domus", self.domus_disjoint), ("shared", self.domus_shared),
                               ("instances", self.domus_instances), ("redis", self.redis),
                               ("mariadb", self.mariadb), ("ycsb", self.ycsb)]
                for name, experiment in experiments:
                    if only is None or name in only:
                        self.progress(f"{name}:")
                        try:
                            experiment()
                        except RuntimeError as exc:
                            note = f"{name}: not measured: {exc}"
                            self.notes.append(note)
                            self.progress(f"  {note}")
            finally:
                for system in self.live:
                    system.stop()
                self.workers.close()
        finally:
            self.hosts.close()
            shutil.rmtree(self.work, ignore_errors=True)
        return {"hosts": count, "netem": self.hosts.netem, "delay_us": self.delay_us,
                "work_dir": self.work,
                "namespace_tag": self.hosts.tag, "seconds_per_point": self.plan.seconds,
                "plan": self.plan.__dict__, "points": self.points, "notes": self.notes,
                "wall_seconds": round(time.monotonic() - self.started, 1)}
