"""The systems under test, started on hosts (benchmarks.scalability.hosts):
a Domus deployment, a Redis Cluster and a MariaDB server.  Each keeps the
PIDs of what it started, per host, and stops them by PID."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from benchmarks.scalability.hosts import Host

SUPERVISOR_PORT = 7700
SERVICE_PORT = 7701
REDIS_PORT = 7000
MARIADB_PORT = 3306


def wait_for(predicate: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = predicate()
            if last:
                return last
        except Exception as exc:  # noqa: BLE001  (not yet)
            last = exc
        time.sleep(0.1)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


@dataclass
class System:
    """Processes started on hosts, by host name."""

    data_dir: str
    processes: dict[str, list[subprocess.Popen]] = field(default_factory=dict)
    logs: list[Any] = field(default_factory=list)

    def spawn(self, host: Host, argv: list[str], log: str,
              env: dict[str, str] | None = None) -> subprocess.Popen:
        output = open(os.path.join(self.data_dir, f"{log}.log"), "ab")  # noqa: SIM115
        self.logs.append(output)
        process = subprocess.Popen(host.command(argv), stdout=output, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=env)
        self.processes.setdefault(host.name, []).append(process)
        return process

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the processes on each host (their
        children included: ``--instances`` starts some)."""
        used = {}
        for host, processes in self.processes.items():
            total = 0.0
            for process in processes:
                try:
                    parent = psutil.Process(process.pid)
                    for member in [parent, *parent.children(recursive=True)]:
                        times = member.cpu_times()
                        total += times.user + times.system
                except psutil.NoSuchProcess:
                    pass
            used[host] = total
        return used

    def stop(self, timeout: float = 20.0) -> None:
        everything = [p for processes in self.processes.values() for p in processes]
        for process in everything:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in everything:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self.logs:
            log.close()
        self.logs.clear()

    def check_alive(self) -> None:
        for host, processes in self.processes.items():
            for process in processes:
                if process.poll() is not None:
                    raise RuntimeError(f"{' '.join(map(str, process.args[4:7]))} on {host} "
                                       f"exited with code {process.returncode}; logs in "
                                       f"{self.data_dir}")


class Domus(System):
    """A supervisor on ``head`` and services on ``service_hosts``
    (``instances`` per host), each service saying its host's name."""

    def start(self, head: Host, service_hosts: list[Host], instances: int = 1,
              storage: str = "ram") -> Domus:
        self.secret = os.path.join(self.data_dir, "secret")
        self.supervisor = f"{head.address}:{SUPERVISOR_PORT}"
        python = [sys.executable, "-m", "domus"]
        env = dict(os.environ, DOMUS_SECRET_FILE=self.secret, PYTHONUNBUFFERED="1",
                   DOMUS_LOG_LEVEL="warn")
        subprocess.run([*python, "secret", "new", self.secret], check=True,
                       capture_output=True)
        self.spawn(head, [*python, "supervisor", "--listen", self.supervisor, "--data-dir",
                          os.path.join(self.data_dir, "supervisor"), "--balance", "manual",
                          "--secret-file", self.secret], "supervisor", env)
        for host in service_hosts:
            argv = [*python, "service", "--supervisor", self.supervisor,
                    "--listen", f"{host.address}:{SERVICE_PORT}", "--host", host.name,
                    "--data-dir", os.path.join(self.data_dir, host.name)]
            if instances > 1:
                argv += ["--instances", str(instances), "--no-pin"]
            self.spawn(host, argv, f"service-{host.name}", env)
        self.expected = len(service_hosts) * instances
        self.env = env
        self.target = {"supervisor": self.supervisor, "secret": self.secret}
        # The driver (in the machine's own namespace) asks the supervisor
        # through a host: a one-shot `domus service list` run on the head.
        wait_for(lambda: (self.check_alive(), self.up_count(head) >= self.expected)[1],
                 60, f"{self.expected} Domus services up")
        return self

    def up_count(self, head: Host) -> int:
        listing = subprocess.run(head.command(
            [sys.executable, "-m", "domus", "service", "list", "--json", "--supervisor",
             self.supervisor, "--secret-file", self.secret]), capture_output=True, text=True,
            env=self.env, timeout=30)
        if listing.returncode:
            return 0
        import json

        return sum(entry["state"] == "up" for entry in json.loads(listing.stdout))

    def create(self, head: Host, name: str, *extra: str) -> None:
        subprocess.run(head.command(
            [sys.executable, "-m", "domus", "dht", "create", name, "--supervisor",
             self.supervisor, "--secret-file", self.secret, *extra]),
            check=True, capture_output=True, text=True, env=self.env, timeout=60)


class RedisCluster(System):
    """One ``redis-server`` per host in cluster mode (no persistence), joined
    with ``redis-cli --cluster create`` (3 nodes or more; with fewer, which
    it refuses, by the same CLUSTER ADDSLOTSRANGE and MEET it sends)."""

    def start(self, hosts: list[Host]) -> RedisCluster:
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server not found (apt-get install redis-server)")
        for host in hosts:
            directory = os.path.join(self.data_dir, host.name)
            os.makedirs(directory, exist_ok=True)
            self.spawn(host, [server, "--port", str(REDIS_PORT), "--bind", host.address,
                              "--cluster-enabled", "yes", "--cluster-config-file",
                              os.path.join(directory, "nodes.conf"), "--dir", directory,
                              "--save", "", "--appendonly", "no", "--protected-mode", "no",
                              "--daemonize", "no"], f"redis-{host.name}")
        nodes = [f"{host.address}:{REDIS_PORT}" for host in hosts]
        self.hosts = hosts
        for host in hosts:
            wait_for(lambda host=host: self._cli(host, host, "ping").strip() == "PONG", 20,
                     f"redis-server on {host.name}")
        if len(hosts) >= 3:
            subprocess.run(hosts[0].command(["redis-cli", "--cluster", "create", *nodes,
                                             "--cluster-replicas", "0", "--cluster-yes"]),
                           check=True, capture_output=True, text=True, timeout=60)
        else:
            share = 16384 // len(hosts)
            for index, host in enumerate(hosts):
                last = 16383 if index == len(hosts) - 1 else (index + 1) * share - 1
                self._cli(host, host, "cluster", "addslotsrange", str(index * share), str(last))
            for host in hosts[1:]:
                self._cli(host, host, "cluster", "meet", hosts[0].address, str(REDIS_PORT))
        wait_for(lambda: all("cluster_state:ok" in self._cli(host, host, "cluster", "info")
                             for host in hosts), 30, "the Redis Cluster to be ok")
        self.target = {"nodes": nodes}
        return self

    def flush(self) -> None:
        """Every node empty again (FLUSHALL on each)."""
        for host in self.hosts:
            self._cli(host, host, "flushall")

    @staticmethod
    def _cli(where: Host, server: Host, *args: str) -> str:
        return subprocess.run(where.command(["redis-cli", "-h", server.address, "-p",
                                             str(REDIS_PORT), *args]),
                              capture_output=True, text=True, timeout=20).stdout


class MariaDB(System):
    """One MariaDB server (InnoDB) on a host, no grant tables (the suite's
    own namespace network only), a table ``bench.kv (k BIGINT PRIMARY KEY,
    v BIGINT)``.  ``innodb_flush_log_at_trx_commit=2``: a commit reaches
    the OS at once and the disk each second, as Domus's async disk DHTs."""

    def start(self, host: Host) -> MariaDB:
        server = shutil.which("mariadbd") or "/usr/sbin/mariadbd"
        install = shutil.which("mariadb-install-db")
        if not os.path.exists(server) or install is None:
            raise RuntimeError("MariaDB not found (apt-get install mariadb-server)")
        data = os.path.join(self.data_dir, "mariadb")
        subprocess.run([install, "--no-defaults", f"--datadir={data}", "--user=root",
                        "--auth-root-authentication-method=normal", "--skip-test-db"],
                       check=True, capture_output=True, text=True, timeout=120)
        socket_path = os.path.join(self.data_dir, "mariadb.sock")
        self.spawn(host, [server, "--no-defaults", f"--datadir={data}", "--user=root",
                          f"--socket={socket_path}", f"--port={MARIADB_PORT}",
                          f"--bind-address={host.address}", "--skip-grant-tables",
                          f"--pid-file={os.path.join(self.data_dir, 'mariadb.pid')}",
                          "--innodb-flush-log-at-trx-commit=2", "--skip-log-bin",
                          "--innodb-buffer-pool-size=128M"], "mariadb")
        self.target = {"host": host.address, "port": MARIADB_PORT}
        wait_for(lambda: (self.check_alive(), os.path.exists(socket_path))[1], 60,
                 "mariadbd to listen")
        import pymysql

        def ready() -> bool:
            connection = pymysql.connect(unix_socket=socket_path, user="root")
            with connection.cursor() as cursor:
                cursor.execute("CREATE DATABASE IF NOT EXISTS bench")
                cursor.execute("CREATE TABLE IF NOT EXISTS bench.kv (k BIGINT PRIMARY KEY, "
                               "v BIGINT) ENGINE=InnoDB")
            connection.commit()
            connection.close()
            return True

        wait_for(ready, 60, "MariaDB to take connections")
        return self
