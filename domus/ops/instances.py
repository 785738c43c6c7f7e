"""``domus service --instances N``: N services on one node.

A service is single-threaded (one core); a node with many cores runs many.
This starts N ``domus service`` processes, instance i listening on PORT + i
of the address given, with its own data dir (``DIR/instance-i``) and name
(``NAME-i``, or its address), each pinned to one CPU of those it may use
(round robin), and all saying the same host name, so that the supervisor
keeps the copies of a bucket on services of different hosts.  Each instance
records its own launch record: ``domus deployment restart`` restarts them
one by one, as any service.

This process stays in the foreground as their parent: SIGTERM, SIGINT and
SIGHUP are passed on to every instance (each then stops as a service does,
flushing its disk DHTs); an instance that fails (a port in use, a wrong
secret) stops the others, and the exit status is its own; when every
instance has stopped cleanly (``domus deployment shutdown``) it exits 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from typing import Any

from domus.ops.deploy import _die_with_parent
from domus.wire import address as addresses

MAX_INSTANCES = 256


def instance_commands(args: Any, cpus: list[int]) -> list[list[str]]:
    """The ``domus service`` command line of each instance (``args``: the
    parsed ``domus service`` arguments, ``cpus``: those to spread them
    over)."""
    host, port = addresses.parse(args.listen)
    if port + args.instances - 1 > 65535:
        raise SystemExit(f"domus service: {args.instances} instances from port {port} go past "
                         f"65535; listen on a lower port")
    commands = []
    for index in range(args.instances):
        listen = f"{host}:{port + index}"
        command = [sys.executable, "-m", "domus", "service", "--listen", listen,
                   "--data-dir", os.path.join(args.data_dir, f"instance-{index}"),
                   "--heartbeat", str(args.heartbeat),
                   "--host", args.host or socket.gethostname()]
        if args.name:
            command += ["--name", f"{args.name}-{index}"]
        for flag, value in (("--supervisor", args.supervisor), ("--cores", args.cores),
                            ("--ram", args.ram), ("--disk", args.disk),
                            ("--secret-file", args.secret_file)):
            if value is not None:
                command += [flag, str(value)]
        reserve = getattr(args, "disk_reserve", None)     # (parsed: a size or a percent)
        if reserve is not None:
            command += ["--disk-reserve", f"{reserve.percent:g}%" if reserve.percent is not None
                        else str(reserve.size)]
        metrics = getattr(args, "metrics", None)
        if metrics is not None:             # instance I serves its metrics on PORT + I
            metrics_host, metrics_port = addresses.parse(metrics)
            command += ["--metrics", f"{metrics_host}:{metrics_port + index}"]
        if not args.no_pin:
            command += ["--cpus", str(cpus[index % len(cpus)])]
        commands.append(command)
    return commands


def run(args: Any, cpus: list[int]) -> int:
    """Start the instances and wait for them (see the module's docstring)."""
    children: dict[int, tuple[int, subprocess.Popen]] = {}
    stopping = False

    def stop_all(signum: int = signal.SIGTERM) -> None:
        for _index, child in children.values():
            if child.poll() is None:
                try:
                    child.send_signal(signum)
                except ProcessLookupError:
                    pass

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        stop_all(signal.SIGTERM if signum == signal.SIGHUP else signum)

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        for index, command in enumerate(instance_commands(args, cpus)):
            # (own process group: a terminal's Ctrl-C reaches this process,
            # which passes it on once; SIGTERM if this process dies)
            child = subprocess.Popen(command, preexec_fn=_die_with_parent)
            children[child.pid] = (index, child)
    except OSError as exc:
        stop_all()
        print(f"domus service: cannot start instance {len(children)}: {exc}", file=sys.stderr)
        return 1
    listen_host, port = addresses.parse(args.listen)
    print(f"domus service: {args.instances} instances on {listen_host}, ports {port} to "
          f"{port + args.instances - 1} (pids {' '.join(map(str, children))})",
          file=sys.stderr, flush=True)
    status = 0
    left = dict(children)
    while left:
        try:
            pid, code = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid not in left:
            continue
        index, child = left.pop(pid)
        child.returncode = os.waitstatus_to_exitcode(code)
        failed = child.returncode != 0 and not (stopping and child.returncode in (
            -signal.SIGTERM, -signal.SIGINT))
        if failed and status == 0:
            status = child.returncode if child.returncode > 0 else 128 - child.returncode
            print(f"domus service: instance {index} (listening on {child.args[5]}) exited with "
                  f"code {child.returncode}; stopping the other instances",
                  file=sys.stderr, flush=True)
            stopping = True
            stop_all()
    return status
