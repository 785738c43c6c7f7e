"""A local deployment: a supervisor and N services as separate processes on
one host.  Used by ``domus up``, the demo, the benchmarks and the tests.

Children get SIGTERM when this process dies (PR_SET_PDEATHSIG), so even a
``kill -9`` of the parent leaves no orphan behind.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from typing import IO, Any

from domus.errors import DomusError, SupervisorUnreachable

_CALLS = itertools.count()     # free_port_block's calls in this process

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    os.setpgrp()  # Ctrl-C in the terminal reaches `domus up`, which stops us in order


def port_is_free(host: str, port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        probe = socket.socket(socket.AF_INET, kind)
        try:
            if kind == socket.SOCK_STREAM:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
        except OSError:
            return False
        finally:
            probe.close()
    return True


# Where local deployments (tests, benchmarks, ``domus up --port 0``...)
# take their ports; jobs take theirs above (domus.ops.job), and both stay
# below the kernel's ephemeral ports.
LOCAL_FIRST_PORT = 10000
LOCAL_LAST_PORT = 20000
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports(path: str | None = None) -> range:
    """The ports the kernel hands to sockets that bind none themselves: a
    client's UDP socket, an outgoing TCP connection.  A port free now in
    that range can be taken by any such socket before a service binds it,
    so ports for services are not chosen there.  Linux's default range
    when the setting cannot be read."""
    try:
        with open(path or EPHEMERAL_RANGE_FILE, encoding="ascii") as setting:
            low, high = (int(field) for field in setting.read().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def port_block_finder(count: int, host: str, start: int, stop: int,
                      first: int) -> int | None:
    """The first block of ``count`` ports free on ``host`` (TCP and UDP),
    searched from ``first`` through [start, stop), stepping over blocks
    taken, and over the kernel's ephemeral ports (ephemeral_ports) unless
    the whole span lies among them; None when there is none."""
    span = stop - start - count
    if span <= 0:
        return None
    ephemeral = ephemeral_ports()
    avoid = not (ephemeral.start <= start and stop <= ephemeral.stop)
    base = start + (first - start) % span
    for _ in range(2000):
        clear = not avoid or base + count <= ephemeral.start or base >= ephemeral.stop
        if clear and all(port_is_free(host, base + offset) for offset in range(count)):
            return base
        base = start + (base - start + count + 13) % span
    return None


def free_port_block(count: int, host: str = "127.0.0.1", start: int = LOCAL_FIRST_PORT,
                    stop: int = LOCAL_LAST_PORT) -> int:
    """A base port P with P .. P+count-1 free for TCP and UDP.  Processes
    start looking at different places (their pid), and so do a process's
    successive calls: a port that a first call returned, and that nothing
    has bound yet (or any more), is not simply handed out again.  (Below
    the ports jobs take, domus.ops.job.FIRST_PORT: a job starting beside a
    local deployment never finds the port it chose taken by it; and below
    the kernel's ephemeral ports, which a client's socket may take at any
    time.)"""
    first = start + (os.getpid() * 37 + next(_CALLS) * 7919) % max(stop - start - count, 1)
    base = port_block_finder(count, host, start, stop, first)
    if base is None:
        raise DomusError(f"no block of {count} free ports on {host} in {start}-{stop - 1}")
    return base


class LocalDeployment:
    def __init__(self, services: int = 3, *, port: int = 7700, data_dir: str,
                 host: str = "127.0.0.1", heartbeat: float = 1.0,
                 log_to: IO[str] | None = None, service_args: list[str] | None = None,
                 supervisor_args: list[str] | None = None, insecure: bool = False,
                 metrics_port: int | None = None) -> None:
        if services < 0:
            raise ValueError("the number of services must be >= 0")
        if metrics_port is not None:
            # The supervisor's metrics on metrics_port, service i's on the
            # port after: none of them may be a port the deployment serves on.
            clash = (set(range(metrics_port, metrics_port + services + 1))
                     & set(range(port, port + services + 1)))
            if clash:
                raise ValueError(f"metrics ports {metrics_port}-{metrics_port + services} "
                                 f"overlap the deployment's ports {port}-{port + services} "
                                 f"(supervisor, then services); pick another metrics port")
            if metrics_port + services > 65535:
                raise ValueError(f"metrics ports {metrics_port}-{metrics_port + services} "
                                 f"go past 65535")
        self.host = host
        self.port = port
        self.data_dir = os.path.abspath(data_dir)
        self.service_count = services
        self.heartbeat = heartbeat
        self.log_to = log_to
        self.service_args = service_args or []
        self.supervisor_args = supervisor_args or []
        self.supervisor_address = f"{host}:{port}"
        self.metrics_port = metrics_port
        # The deployment secret (domus.wire.secret): the supervisor makes it
        # in its data dir at its first start; every process started here is
        # given it.  None: --insecure.
        self.insecure = insecure or "--insecure" in self.supervisor_args
        self.secret_file: str | None = None if self.insecure else os.path.join(
            self.data_dir, "supervisor", "secret")
        if self.insecure and "--insecure" not in self.supervisor_args:
            self.supervisor_args.append("--insecure")
        self.supervisor: subprocess.Popen | None = None
        self.services: dict[str, subprocess.Popen] = {}
        self._logs: list[IO[Any]] = []
        os.makedirs(os.path.join(self.data_dir, "logs"), exist_ok=True)

    # -- names and addresses
    def service_name(self, index: int) -> str:
        return f"s{index + 1}"

    def service_address(self, index: int) -> str:
        return f"{self.host}:{self.port + 1 + index}"

    def metrics_address(self, name: str) -> str | None:
        """Where process ``name`` ("supervisor", or a service's name) serves
        its metrics; None without metrics."""
        if self.metrics_port is None:
            return None
        if name == "supervisor":
            return f"{self.host}:{self.metrics_port}"
        index = [self.service_name(i) for i in range(self.service_count)].index(name)
        return f"{self.host}:{self.metrics_port + 1 + index}"

    def _metrics_args(self, name: str) -> list[str]:
        address = self.metrics_address(name)
        return ["--metrics", address] if address else []

    def log_path(self, name: str) -> str:
        return os.path.join(self.data_dir, "logs", f"{name}.log")

    # -- processes
    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        if self.log_to is not None:
            output: Any = self.log_to
        else:
            output = open(self.log_path(name), "a", encoding="utf-8")  # noqa: SIM115
            self._logs.append(output)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("DOMUS_SECRET_FILE", None)      # (another deployment's, perhaps)
        if self.secret_file is not None and name != "supervisor":
            env["DOMUS_SECRET_FILE"] = self.secret_file
        return subprocess.Popen([sys.executable, "-m", "domus", *argv], stdout=output,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent, env=env)

    def _refuse_taken_ports(self) -> None:
        """A port of this deployment that another process holds is an
        error now, naming it, rather than a process that dies in its log
        (or, worse, another deployment answering in its place)."""
        wanted = [("supervisor", self.port, "--port")] + [
            (self.service_name(index), self.port + 1 + index, "--port")
            for index in range(self.service_count)]
        if self.metrics_port is not None:
            wanted += [(f"{name}'s metrics", self.metrics_port + offset, "--metrics-port")
                       for offset, name in enumerate(
                           ["supervisor", *map(self.service_name, range(self.service_count))])]
        for name, port, flag in wanted:
            if not 0 < port < 65536:
                raise DomusError(f"port {port} (for {name}) is out of range: ports are 1 to "
                                 f"65535, and the services take the {self.service_count} "
                                 f"after the supervisor's")
            if not port_is_free(self.host, port):
                guess = (f"another deployment (domus status --supervisor {self.host}:{port})? "
                         if flag == "--port" else "")
                raise DomusError(f"port {port} on {self.host} (for {name}) is in use: "
                                 f"{guess}Choose another with {flag}")

    def start_supervisor(self) -> None:
        self.supervisor = self._spawn("supervisor", [
            "supervisor", "--listen", self.supervisor_address,
            "--data-dir", os.path.join(self.data_dir, "supervisor"),
            *self._metrics_args("supervisor"), *self.supervisor_args])
        self.wait_for_supervisor()

    def start_service(self, index: int) -> None:
        name = self.service_name(index)
        self.services[name] = self._spawn(name, [
            "service", "--name", name, "--supervisor", self.supervisor_address,
            "--listen", self.service_address(index),
            "--data-dir", os.path.join(self.data_dir, name),
            "--heartbeat", str(self.heartbeat), *self._metrics_args(name),
            *self.service_args])

    def start(self, timeout: float = 30.0) -> LocalDeployment:
        self._refuse_taken_ports()
        self.start_supervisor()
        for index in range(self.service_count):
            self.start_service(index)
        self.wait_until_up([self.service_name(i) for i in range(self.service_count)], timeout)
        return self

    def environment(self) -> dict[str, str]:
        """What a job needs in its environment to use this deployment
        (DOMUS_SUPERVISOR, and DOMUS_SECRET_FILE unless it is insecure)."""
        env = {"DOMUS_SUPERVISOR": self.supervisor_address}
        if self.secret_file is not None:
            env["DOMUS_SECRET_FILE"] = self.secret_file
        return env

    def connect(self, timeout: float = 10.0) -> Any:
        """A client (domus.Cluster) of this deployment."""
        from domus.client.blocking import connect

        return connect(self.supervisor_address, timeout=timeout, secret_file=self.secret_file)

    def _client(self, timeout: float) -> Any:
        from domus.client.blocking import Cluster

        return Cluster(self.supervisor_address, timeout=timeout, secret_file=self.secret_file)

    def wait_for_supervisor(self, timeout: float = 20.0) -> None:

        deadline = time.monotonic() + timeout
        while True:
            self._check_alive("supervisor", self.supervisor)
            try:
                if self.secret_file is not None and not os.path.exists(self.secret_file):
                    raise SupervisorUnreachable("no secret yet")   # (not made yet)
                with self._client(1.0) as cluster:
                    answer = cluster.ping()
                if self.supervisor is not None and answer.get("pid") not in (
                        None, self.supervisor.pid):
                    raise DomusError(f"another supervisor (pid {answer.get('pid')}) answers at "
                                     f"{self.supervisor_address}, not the one started here")
                return
            except SupervisorUnreachable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def wait_until_up(self, names: list[str], timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        with self._client(2.0) as cluster:
            while True:
                for name in names:
                    self._check_alive(name, self.services.get(name))
                states = {entry["name"]: entry["state"] for entry in cluster.services()}
                if all(states.get(name) == "up" for name in names):
                    return
                if time.monotonic() > deadline:
                    raise DomusError(f"services not up after {timeout}s: "
                                     f"{ {n: states.get(n, 'unregistered') for n in names} }")
                time.sleep(0.05)

    def _check_alive(self, name: str, process: subprocess.Popen | None) -> None:
        if process is not None and process.poll() is not None:
            raise DomusError(f"{name} exited with code {process.returncode} during start-up"
                             f"{self.last_words(name)}; see {self.log_path(name)}")

    def last_words(self, name: str) -> str:
        """': ' and the last line a process logged that says why it stopped
        (an error or a traceback's last line), or ''."""
        try:
            with open(self.log_path(name), encoding="utf-8", errors="replace") as log:
                lines = [line.strip() for line in log.readlines()[-40:] if line.strip()]
        except OSError:
            return ""
        for line in reversed(lines):
            if any(word in line for word in ("Error", "error", "refused", "cannot", "denied")):
                return ": " + line[:300]
        return ": " + lines[-1][:300] if lines else ""

    def kill_service(self, name: str, sig: int = signal.SIGKILL) -> None:
        process = self.services[name]
        process.send_signal(sig)
        process.wait(10)

    def stop_supervisor(self, sig: int = signal.SIGTERM) -> None:
        if self.supervisor is not None:
            self.supervisor.send_signal(sig)
            self.supervisor.wait(10)

    def stop(self, timeout: float = 10.0) -> None:
        processes = [p for p in [*self.services.values(), self.supervisor] if p is not None]
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for process in processes:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def __enter__(self) -> LocalDeployment:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()
