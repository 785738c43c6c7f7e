"""Resources of a node (BS subsystem): what it has, and how busy it is.

Base resources are measured once at start (psutil) and can be overridden,
for nodes shared with other work.  Load is sampled on a timer and smoothed
as an exponential moving average.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import psutil


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: all of the node's,
    unless a batch system, ``taskset`` or ``--cpus`` narrowed it)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(psutil.cpu_count(logical=True) or 1))


def pin_to_cpus(cpus: list[int]) -> None:
    """Run this process on ``cpus`` only (``domus service --cpus``)."""
    os.sched_setaffinity(0, cpus)


def base_resources(data_dir: str, cores: float | None = None, ram: int | None = None,
                   disk: int | None = None) -> dict[str, Any]:
    """cores (the CPUs this process may use), ram (bytes) and disk (free
    bytes under ``data_dir``)."""
    return {
        "hostname": socket.gethostname(),
        "cores": cores if cores is not None else len(usable_cpus()),
        "ram": ram if ram is not None else psutil.virtual_memory().total,
        "disk": disk if disk is not None else psutil.disk_usage(data_dir).free,
    }


class LoadSampler:
    """What a service reports in each heartbeat of its process and node:
    smoothed CPU (``cpu``: this process, % of one core; ``node_cpu``: the
    node's CPUs this process may run on, % of them: the whole node unless
    its affinity is narrower, so that services pinned to different CPUs of
    one node each see their own), request and lookup rates, and network
    bytes per second (sent and received, every interface); and as they are
    now, its RSS, the node's free RAM and the free disk under its data dir."""

    def __init__(self, alpha: float = 0.3, data_dir: str | None = None) -> None:
        self.alpha = alpha
        self.data_dir = data_dir
        self.process = psutil.Process(os.getpid())
        self.process.cpu_percent(None)
        self.cpus = usable_cpus()
        psutil.cpu_percent(None, percpu=True)
        self._last_requests: int | None = None
        self._last_lookups = 0
        self._last_time: float | None = None
        self._last_net = _net_bytes()
        self.load: dict[str, float] = {"cpu": 0.0, "node_cpu": 0.0, "rss": 0.0,
                                       "requests_per_s": 0.0, "lookups_per_s": 0.0,
                                       "net_bytes_per_s": 0.0}

    def sample(self, requests: int, now: float, lookups: int = 0) -> dict[str, float]:
        """``requests``: every request answered so far; ``lookups``: the
        LOOKUPs among them (the routing load)."""
        rate = lookup_rate = net_rate = 0.0
        net = _net_bytes()
        if self._last_time is not None and now > self._last_time:
            rate = (requests - (self._last_requests or 0)) / (now - self._last_time)
            lookup_rate = (lookups - self._last_lookups) / (now - self._last_time)
            net_rate = max(net - self._last_net, 0) / (now - self._last_time)
        self._last_requests, self._last_lookups, self._last_time = requests, lookups, now
        self._last_net = net
        fresh = {
            "cpu": self.process.cpu_percent(None),
            "node_cpu": self._node_cpu(),
            "rss": float(self.process.memory_info().rss),
            "requests_per_s": rate,
            "lookups_per_s": lookup_rate,
            "net_bytes_per_s": net_rate,
        }
        for name, value in fresh.items():
            self.load[name] = self.alpha * value + (1 - self.alpha) * self.load[name]
        self.load["rss"] = fresh["rss"]
        self.load["free_ram"] = float(psutil.virtual_memory().available)
        if self.data_dir is not None:
            try:
                self.load["free_disk"] = float(psutil.disk_usage(self.data_dir).free)
            except OSError:          # the data dir went away: say nothing of it
                self.load.pop("free_disk", None)
        return dict(self.load)


    def _node_cpu(self) -> float:
        per_cpu = psutil.cpu_percent(None, percpu=True)
        mine = [per_cpu[cpu] for cpu in self.cpus if cpu < len(per_cpu)]
        return sum(mine) / len(mine) if mine else 0.0


def _net_bytes() -> int:
    counters = psutil.net_io_counters()
    return (counters.bytes_sent + counters.bytes_recv) if counters is not None else 0
