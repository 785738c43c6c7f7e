"""What the batch job scripts (clients/slurm/, clients/pbs/) need that a
shell does badly: an address other nodes reach, free ports, a bounded wait
for the job's own deployment, and a shutdown that stops only the job's own.

    python -m domus.ops.job address [--interface IF | --network CIDR]
    python -m domus.ops.job ports COUNT [--seed JOBID] [--for supervisor|services]
                                  [--host ADDRESS]
    python -m domus.ops.job wait --job-id ID --services N [--timeout S] [--watch PID]
    python -m domus.ops.job shutdown --job-id ID [--timeout S]

A job's deployment is *its own* when its supervisor's data dir is under a
directory named ``domus-job-<ID>`` (the scripts put it there) and the
supervisor accepts the job's secret ($DOMUS_SECRET_FILE, made per job): a
supervisor of another job refuses the handshake, so a task never stores
into, nor a trap stops, another job's deployment.  Exit codes: 0 done, 2
bad usage, 3 not the job's own deployment or none, 4 timed out, 5 a
watched process (the supervisor, the service step) ended.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import time
from typing import Any

import psutil

from domus.errors import AuthenticationError, DomusError, SupervisorUnreachable
from domus.ops.deploy import LOCAL_LAST_PORT, port_block_finder

# Jobs take their ports from here; local deployments (domus.ops.deploy.
# free_port_block: tests, benchmarks) below, so the two never pick the same
# free port at once on one node; and both stay below the kernel's
# ephemeral ports (32768 and up by default), which any client's socket may
# take between the search and the bind (ephemeral_ports).
FIRST_PORT = LOCAL_LAST_PORT
LAST_PORT = 32768


def job_directory(job_id: str) -> str:
    return f"domus-job-{job_id}"


def address(interface: str | None = None, network: str | None = None) -> str:
    """This node's IPv4 address: on ``interface``, or in ``network`` (CIDR),
    else the one the default route leaves by (what other nodes most likely
    reach), else the first non-loopback one."""
    addresses = {name: [entry.address for entry in entries if entry.family == socket.AF_INET]
                 for name, entries in psutil.net_if_addrs().items()}
    if interface:
        if not addresses.get(interface):
            raise SystemExit(f"domus job: interface {interface!r} has no IPv4 address "
                             f"(interfaces: {', '.join(sorted(addresses))})")
        return addresses[interface][0]
    if network:
        try:
            wanted = ipaddress.ip_network(network, strict=False)
        except ValueError as exc:
            raise SystemExit(f"domus job: --network {network!r}: {exc}") from None
        for found in addresses.values():
            for candidate in found:
                if ipaddress.ip_address(candidate) in wanted:
                    return candidate
        raise SystemExit(f"domus job: no address of this node is in {network} "
                         f"({', '.join(a for found in addresses.values() for a in found)})")
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))     # (TEST-NET: nothing is sent by a connect)
        return probe.getsockname()[0]
    except OSError:
        pass
    finally:
        probe.close()
    for _name, found in sorted(addresses.items()):
        for candidate in found:
            if not ipaddress.ip_address(candidate).is_loopback:
                return candidate
    return "127.0.0.1"


ROLES = ("supervisor", "services")
ROLE_STRIDE = 97      # ports between the places two searches start from


def search_start(seed: int, role: str, count: int) -> int:
    """Where the search for ``role``'s ports of job ``seed`` starts: each
    (job, role) its own place, so that a job's service step never starts
    where the next job's supervisor does (as seeds JOBID and JOBID + 1 did:
    two jobs started side by side could both find the port free, and the
    one that bound it second could not start)."""
    span = max(LAST_PORT - FIRST_PORT - count, 1)
    return FIRST_PORT + ((seed * len(ROLES) + ROLES.index(role)) * ROLE_STRIDE) % span


def free_ports(count: int, seed: int, host: str = "0.0.0.0", role: str = "supervisor") -> int:
    """A base port P with P .. P+count-1 free (TCP and UDP) on ``host``,
    searched from a place that the seed (the job id) and the role
    (search_start) pick, so that jobs on one node, and a job's supervisor
    and services, start apart; a taken block is stepped over."""
    base = port_block_finder(count, host, FIRST_PORT, LAST_PORT,
                             search_start(seed, role, count))
    if base is None:
        raise SystemExit(f"domus job: no {count} free ports on {host} in "
                         f"{FIRST_PORT}-{LAST_PORT - 1}")
    return base


def _own(cluster: Any, job_id: str) -> dict[str, Any]:
    status = cluster.status()
    data_dir = status["supervisor"]["data_dir"]
    mine = job_directory(job_id)
    if not any(part == mine or part.startswith(mine + ".") for part in data_dir.split(os.sep)):
        raise SystemExit(f"domus job: the supervisor at {cluster.address} is not job "
                         f"{job_id}'s (its data dir is {data_dir}); not touching it")
    return status


def _connect(timeout: float) -> Any:
    from domus.client.blocking import connect

    return connect(timeout=timeout)


def wait(job_id: str, services: int, timeout: float, watch: list[int] = ()) -> int:
    """Until the job's supervisor has ``services`` services up; 3 if the
    supervisor there is another job's, 4 after ``timeout`` seconds, 5 at
    once if a process of ``watch`` (the supervisor, the service step) has
    ended."""
    deadline = time.monotonic() + timeout
    last = "no answer from the supervisor yet"
    while time.monotonic() < deadline:
        ended = [pid for pid in watch if not _running(pid)]
        if ended:
            print(f"domus job: process {ended[0]} of job {job_id} (its supervisor or its "
                  f"service step) has ended; see its log", file=sys.stderr)
            return 5
        try:
            with _connect(5.0) as cluster:
                status = _own(cluster, job_id)
                up = [s["name"] for s in status["services"] if s["state"] == "up"]
                if len(up) >= services:
                    print(f"domus job: {len(up)} services up: {', '.join(sorted(up))}")
                    return 0
                last = f"{len(up)} of {services} services up"
        except AuthenticationError as exc:
            print(f"domus job: the supervisor refused job {job_id}'s secret: it is another "
                  f"deployment's ({exc})", file=sys.stderr)
            return 3
        except (SupervisorUnreachable, DomusError) as exc:
            last = str(exc)
        time.sleep(0.5)
    print(f"domus job: timed out after {timeout:.0f}s waiting for {services} services of job "
          f"{job_id} ({last}); see the job's service logs", file=sys.stderr)
    return 4


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def shutdown(job_id: str, timeout: float) -> int:
    """``domus deployment shutdown`` of the job's own deployment: disk DHTs
    flushed, every service and the supervisor stopped."""
    from domus.ops import launch

    try:
        cluster = _connect(timeout)
    except SupervisorUnreachable:
        print(f"domus job: no supervisor of job {job_id} answers: nothing to shut down",
              file=sys.stderr)
        return 3
    except AuthenticationError as exc:
        print(f"domus job: not job {job_id}'s supervisor ({exc}); not shutting it down",
              file=sys.stderr)
        return 3
    with cluster:
        _own(cluster, job_id)
        summary = launch.shutdown(cluster)
    print(f"domus job: stopped {len(summary['stopped'])} services and the supervisor of "
          f"job {job_id}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m domus.ops.job",
                                     description=__doc__.split("\n\n")[0])
    actions = parser.add_subparsers(dest="action", required=True)
    where = actions.add_parser("address", help="the IPv4 address other nodes reach")
    pick = where.add_mutually_exclusive_group()
    pick.add_argument("--interface", default=os.environ.get("DOMUS_INTERFACE") or None)
    pick.add_argument("--network", default=os.environ.get("DOMUS_NETWORK") or None)
    ports = actions.add_parser("ports", help="the first of COUNT free ports")
    ports.add_argument("count", type=int)
    ports.add_argument("--seed", type=int, default=os.getpid())
    ports.add_argument("--for", dest="role", choices=ROLES, default="supervisor",
                       help="whose ports: the job's supervisor or a node's services")
    ports.add_argument("--host", default="0.0.0.0")
    for name in ("wait", "shutdown"):
        sub = actions.add_parser(name)
        sub.add_argument("--job-id", required=True)
        sub.add_argument("--timeout", type=float, default=120.0 if name == "wait" else 60.0)
        if name == "wait":
            sub.add_argument("--services", type=int, required=True)
            sub.add_argument("--watch", type=int, action="append", default=[], metavar="PID",
                             help="fail at once if this process ends (repeatable)")
    args = parser.parse_args(argv)
    if args.action == "address":
        print(address(args.interface, args.network))
        return 0
    if args.action == "ports":
        print(free_ports(args.count, args.seed, args.host, args.role))
        return 0
    if args.action == "wait":
        return wait(args.job_id, args.services, args.timeout, args.watch)
    return shutdown(args.job_id, args.timeout)


if __name__ == "__main__":
    raise SystemExit(main())
