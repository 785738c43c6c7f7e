"""How a deployment's processes are started again after
``domus deployment shutdown`` (or a crash).

Every supervisor and service records, when it starts, a *launch record*
(domus.wire.launch: validated fields, never a command line), which the
supervisor keeps in its state file.  ``domus deployment restart`` reads
them, checks each again, and rebuilds each command itself: on this host
``[sys.executable, "-m", "domus", ...]`` (the Python running the restart),
on another host ``domus ...`` from that host's PATH, through a launcher
such as ``ssh {host}`` into which every substitution is quoted.  Each
process starts detached from the terminal (its own session, output
appended to ``<data dir>/<role>.log``), and each command is printed before
it runs.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from domus.errors import DomusError, SupervisorUnreachable
from domus.wire import checks
from domus.wire import launch as records

REMOTE_EXECUTABLE = ["domus"]      # on another host: the `domus` on its PATH


def is_local(launch: dict[str, Any]) -> bool:
    return launch.get("host") == socket.gethostname()


def command(launch: dict[str, Any], *, local: bool | None = None) -> list[str]:
    """The argv that starts the process of a validated record: this
    Python's ``-m domus`` here, the remote host's ``domus`` elsewhere."""
    local = is_local(launch) if local is None else local
    executable = [sys.executable, "-m", "domus"] if local else REMOTE_EXECUTABLE
    return [*executable, *records.arguments(launch)]


def command_line(launch: dict[str, Any]) -> str:
    """A shell command that starts the process of a validated record on its
    host, detached, its output appended to its log: what a launcher runs on
    the process's host, and what a user can paste there.  Every word is
    quoted; environment keys are DOMUS_* names (checked again here)."""
    env = " ".join(f"{shlex.quote(key)}={shlex.quote(value)}"
                   for key, value in sorted(checks.environment(launch["env"]).items()))
    data_dir = launch["data_dir"]
    return (f"mkdir -p {shlex.quote(data_dir)} && cd {shlex.quote(data_dir)} && "
            f"{'env ' + env + ' ' if env else ''}"
            f"nohup setsid {shlex.join(command(launch, local=False))} "
            f">>{shlex.quote(records.log_file(launch))} 2>&1 </dev/null &")


def launcher_argv(launcher: str, host: str) -> list[str]:
    """The launcher template with ``{host}`` filled in: the host must be a
    valid host name or IP address, and is quoted, so it stays one word that
    cannot be taken as an option (``-oProxyCommand=...`` is not a host)."""
    checks.host(host)
    if "{host}" not in launcher:
        raise ValueError(f"the launcher {launcher!r} has no {{host}} to fill in")
    try:
        return shlex.split(launcher.replace("{host}", shlex.quote(host)))
    except ValueError as exc:
        raise ValueError(f"the launcher {launcher!r} is not a valid command: {exc}") from None


def start(launch: dict[str, Any], launcher: str | None = None,
          report: Callable[[str], None] = print) -> subprocess.Popen | None:
    """Start the process of launch record ``launch`` (validated again
    here; ValueError if it does not pass).  Here if it ran on this host
    (returns its Popen), else through ``launcher`` (a command template with
    ``{host}``, e.g. ``ssh {host}``; returns None once the launcher has
    handed the command over).  ValueError if it ran elsewhere and no
    launcher is given.  ``report`` is told each command before it runs."""
    launch = records.validate(launch)
    if is_local(launch):
        argv = command(launch, local=True)
        report(f"running: {shlex.join(argv)}  (in {launch['data_dir']}, output to "
               f"{records.log_file(launch)})")
        os.makedirs(launch["data_dir"], exist_ok=True)
        with open(records.log_file(launch), "ab") as log:
            return subprocess.Popen(
                argv, cwd=launch["data_dir"],
                env={**os.environ, **launch["env"], "PYTHONUNBUFFERED": "1"},
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
    if not launcher:
        raise ValueError(f"it ran on host {launch['host']!r}, not here; pass --launcher "
                         f"(e.g. --launcher 'ssh {{host}}') or run there: "
                         f"{command_line(launch)}")
    argv = [*launcher_argv(launcher, launch["host"]), command_line(launch)]
    report(f"running: {shlex.join(argv)}")
    subprocess.run(argv, check=True, stdin=subprocess.DEVNULL, timeout=60)
    return None


def shutdown(cluster: Any, *, save_ram: bool = True) -> dict[str, Any]:
    """Ask the supervisor to stop the deployment (see the supervisor's
    ``shutdown_deployment``) and wait until it has exited; returns its
    summary."""
    from domus.client.blocking import STATE_CHANGE_TIMEOUT

    summary = cluster.supervisor.call("shutdown_deployment", save_ram=save_ram,
                                      timeout=STATE_CHANGE_TIMEOUT)
    cluster.close()
    _wait_for_exit(cluster.address)
    return summary


def _wait_for_exit(address: str, timeout: float = 30.0) -> None:
    """Until the supervisor at ``address`` no longer answers (it has closed
    its port), so that a new one can take the port."""
    from domus.client.blocking import Cluster

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with Cluster(address, timeout=1.0) as cluster:
                cluster.ping()
        except SupervisorUnreachable:
            return
        time.sleep(0.05)
    raise DomusError(f"the supervisor at {address} still answers {timeout:.0f}s after it "
                     f"was told to shut down")


def restart(state_dir: str, *, launcher: str | None = None, timeout: float = 60.0,
            report: Callable[[str], None] = print) -> int:
    """Start the deployment whose supervisor keeps its state in
    ``state_dir``: the supervisor, then every registered service that is not
    already up, each as its launch record says; wait until they are up and
    every DHT a shutdown saved is active again.  Returns the number of
    processes that could not be started (0: all is well)."""
    from domus.client.blocking import Cluster
    from domus.supervisor.state import STATE_FILE, SupervisorState

    if not os.path.exists(os.path.join(state_dir, STATE_FILE)):
        raise DomusError(f"{state_dir} holds no supervisor state ({STATE_FILE}); pass the "
                         f"supervisor's --data-dir")
    state = SupervisorState(state_dir)
    if not state.launch:
        raise DomusError(f"{state.path} has no launch record (written by an older Domus); "
                         f"start the supervisor and services yourself this time")
    try:
        supervisor = records.validate(state.launch)
        if supervisor["role"] != "supervisor":
            raise ValueError("it is not a supervisor's")
        address = supervisor["address"]
        start(supervisor, launcher, report)
    except ValueError as exc:
        raise DomusError(f"{state.path}: the supervisor's launch record is refused: {exc}; "
                         f"start the supervisor yourself this time") from None
    _wait_for_supervisor(address, timeout)
    report(f"supervisor started at {address} (state in {state_dir})")
    failures = 0
    with Cluster(address, timeout=5.0) as cluster:
        # Services that outlived the supervisor reconnect by themselves
        # within their retry delay; start only the others.
        time.sleep(RECONNECT_GRACE)
        states = {entry["name"]: entry["state"] for entry in cluster.services()}
        started = []
        for name, entry in sorted(state.services.items()):
            if states.get(name) == "up":
                report(f"service {name} is running already")
                continue
            recorded = entry.get("launch")
            if not recorded:
                report(f"service {name}: no launch record; start it yourself")
                failures += 1
                continue
            try:
                recorded = records.validate(recorded)
                if recorded["role"] != "service" or recorded["name"] != name:
                    raise ValueError(f"it is not service {name!r}'s")
            except ValueError as exc:
                report(f"service {name}: its launch record is refused ({exc}); start it "
                       f"yourself")
                failures += 1
                continue
            try:
                start(recorded, launcher, report)
            except (ValueError, OSError, subprocess.SubprocessError) as exc:
                report(f"service {name} not started: {exc}")
                failures += 1
                continue
            started.append(name)
        up = _wait_for_services(cluster, started, timeout)
        for name in started:
            if name in up:
                report(f"service {name} started at {state.services[name]['address']}")
            else:
                report(f"service {name} did not come up in {timeout:.0f}s; see "
                       f"{records.log_file(records.validate(state.services[name]['launch']))}")
                failures += 1
        _wait_for_resumed(cluster, timeout)
        for dht in cluster.list_dhts():
            report(_dht_line(cluster, dht))
    return failures


RECONNECT_GRACE = 2.5     # a service retries the supervisor at least every 2 s


def _wait_for_supervisor(address: str, timeout: float) -> None:
    from domus.client.blocking import Cluster

    deadline = time.monotonic() + timeout
    while True:
        try:
            with Cluster(address, timeout=1.0) as cluster:
                cluster.ping()
            return
        except SupervisorUnreachable:
            if time.monotonic() > deadline:
                raise SupervisorUnreachable(f"the supervisor did not answer at {address} "
                                            f"within {timeout:.0f}s of its start") from None
            time.sleep(0.1)


def _wait_for_services(cluster: Any, names: list[str], timeout: float) -> set[str]:
    deadline = time.monotonic() + timeout
    while True:
        states = {entry["name"]: entry["state"] for entry in cluster.services()}
        up = {name for name in names if states.get(name) == "up"}
        if len(up) == len(names) or time.monotonic() > deadline:
            return up
        time.sleep(0.1)


def _wait_for_resumed(cluster: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (any(dht["resume"] for dht in cluster.list_dhts())
           and time.monotonic() < deadline):
        time.sleep(0.1)


def _dht_line(cluster: Any, dht: dict[str, Any]) -> str:
    kind = f"{dht['storage']}/{dht['platform']}"
    if dht["state"] != "active":
        waiting = " (waiting for its services to be activated again)" if dht["resume"] else ""
        return f"DHT {dht['name']!r} ({kind}): inactive{waiting}"
    try:
        records = len(cluster.open_dht(dht["name"]))
    except DomusError as exc:
        return f"DHT {dht['name']!r} ({kind}): active, but not all of it answers: {exc}"
    return f"DHT {dht['name']!r} ({kind}): active, {records} records"
