"""Headroom: the free space a service keeps on the filesystem of its data
dir, so that a full disk never stops it from deleting, checkpointing or
recovering.

A service's *reserve* (``domus service --disk-reserve SIZE|PCT``) is the
free space its disk DHTs must leave on that filesystem.  ``Headroom`` says,
from the filesystem's own count (``statvfs``: the space an unprivileged
process may still use), which of three states the service is in:

- ``ok``: free space is above the reserve by more than ``MARGIN``: writes
  are served at full speed (the C hot path included);
- ``near``: within ``MARGIN`` of the reserve: every put on a disk DHT
  looks at the free space first (the C path leaves changes of disk DHTs to
  Python), so that no put lands in the reserve between two samples;
- ``full``: below the reserve: puts on disk DHTs are refused
  (``StorageFull``), while reads, deletes and Berkeley DB's checkpoints,
  log removal and compaction go on inside the reserve.  The service leaves
  this state by itself as soon as free space is back above the reserve
  by ``hysteresis(reserve)`` (records deleted and their pages given back,
  the filesystem grown, another job's files removed).

The reserve is for what Berkeley DB must write to free space: a delete
is logged before its page is freed, a checkpoint writes the pages the
log holds, and only then are old log files removed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

MIB = 1 << 20
# The default reserve: 1 % of the filesystem, at least DEFAULT_MIN and at
# most DEFAULT_MAX, and never more than a quarter of a small filesystem.
DEFAULT_PERCENT = 1.0
DEFAULT_MIN = 64 * MIB
DEFAULT_MAX = 1 << 30
# Within this of the reserve, every put looks at the free space itself:
# more than the C path writes between two samples (SAMPLE_INTERVAL).
MARGIN = 64 * MIB
SAMPLE_INTERVAL = 0.1
# Far from the reserve the free space is looked at less often, never so
# seldom that writes at MARGIN per SAMPLE_INTERVAL could reach the margin
# between two looks (next_interval), and at least this often.
LONGEST_INTERVAL = 1.0

OK, NEAR, FULL = "ok", "near", "full"


def hysteresis(reserve: int) -> int:
    """How far above the reserve free space must be for a service at its
    reserve to take puts again: an eighth of the reserve, at least 2 MiB
    and at most MARGIN (so that a checkpoint that lets a log file go does
    not let a put in only for the next to be refused)."""
    return min(max(reserve // 8, 2 * MIB), MARGIN)

_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)", re.IGNORECASE)
_PERCENT = re.compile(r"(\d+(?:\.\d+)?)\s*%")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


@dataclass(frozen=True)
class Reserve:
    """A reserve as given: ``size`` bytes, or ``percent`` of the
    filesystem (None for both: the default rule)."""
    size: int | None = None
    percent: float | None = None

    def bytes_of(self, total: int) -> int:
        """The reserve on a filesystem of ``total`` bytes."""
        if self.size is not None:
            return self.size
        if self.percent is not None:
            return int(total * self.percent / 100)
        return min(max(int(total * DEFAULT_PERCENT / 100), DEFAULT_MIN), DEFAULT_MAX,
                   total // 4)

    def __str__(self) -> str:
        if self.size is not None:
            return str(self.size)
        if self.percent is not None:
            return f"{self.percent:g}%"
        return "default"


DEFAULT = Reserve()


def parse_reserve(text: str) -> Reserve:
    """``--disk-reserve``'s value: a size (``512m``, ``2G``, ``1.5GiB``,
    ``1048576`` bytes; ``0``: no reserve) or a percentage of the filesystem
    (``5%``, at most 90 %).  ValueError naming the problem otherwise."""
    given = text.strip()
    percent = _PERCENT.fullmatch(given)
    if percent is not None:
        value = float(percent[1])
        if value > 90:
            raise ValueError(f"disk reserve {text!r}: a percentage of the filesystem must be "
                             f"at most 90%")
        return Reserve(percent=value)
    size = _SIZE.fullmatch(given)
    if size is None or (size[3] and not size[2]):
        raise ValueError(f"disk reserve {text!r} is neither a size (512m, 2G, 1048576) nor a "
                         f"percentage of the filesystem (5%)")
    return Reserve(size=int(float(size[1]) * _UNITS[size[2].lower()]))


def describe_bytes(count: float) -> str:
    """``count`` bytes, readably (``3.2 MiB``)."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if abs(count) >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def filesystem_space(path: str) -> tuple[int, int]:
    """(free, total) bytes of the filesystem under ``path``: free as an
    unprivileged process may use it."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize


class Headroom:
    """The free space under a service's data dir against its reserve.
    ``space`` is how the filesystem is asked (injected so that tests can
    drive the states without filling a disk; the service uses statvfs)."""

    def __init__(self, path: str, reserve: Reserve = DEFAULT, service_name: str = "",
                 space: Callable[[str], tuple[int, int]] = filesystem_space) -> None:
        self.path = path
        self.reserve = reserve
        self.service_name = service_name
        self._space = space
        self.free = 0
        self.total = 0
        self.reserve_bytes = 0
        self.state = OK
        self.refused = 0            # puts refused at the reserve, ever
        self.sample()

    def measure(self) -> tuple[int, int] | None:
        """(free, total) bytes under the data dir as the filesystem says
        now, or None if it cannot be asked (the data dir gone, or its
        filesystem unmounted).  Changes nothing here."""
        try:
            return self._space(self.path)
        except OSError:
            return None

    def next_interval(self) -> float:
        """How long until free space should be looked at again: within
        MARGIN of the reserve (or past it) every SAMPLE_INTERVAL; farther,
        the time writes at MARGIN a SAMPLE_INTERVAL (the rate the margin is
        sized for) would take to reach the margin, at most LONGEST_INTERVAL.
        (A service's timer then wakes once a second, not ten times, on a
        disk with room: each look is some 0.5-1 ms of Python, statvfs
        included, taken from the cores that serve.)"""
        if self.state != OK:
            return SAMPLE_INTERVAL
        ahead = self.free - self.reserve_bytes - MARGIN
        seconds = ahead / (MARGIN / SAMPLE_INTERVAL)
        return min(max(seconds, SAMPLE_INTERVAL), LONGEST_INTERVAL)

    def state_for(self, space: tuple[int, int] | None) -> str:
        """The state a sample that measured ``space`` would leave (the
        state as it is if None).  Changes nothing."""
        if space is None:
            return self.state
        free, total = space
        reserve = self.reserve.bytes_of(total)
        if free < reserve or (self.state == FULL and free < reserve + hysteresis(reserve)):
            return FULL
        if free < reserve + MARGIN:
            return NEAR
        return OK

    def sample(self) -> bool:
        """Ask the filesystem now and take its answer (``take``); True if
        the state changed."""
        return self.take(self.measure())

    def take(self, space: tuple[int, int] | None) -> bool:
        """Take ``space``, a ``measure()`` made just before; True if the
        state changed.  None (the data dir could not be asked) keeps the
        last answer."""
        if space is None:
            return False
        before = self.state
        self.state = self.state_for(space)
        self.free, self.total = space
        self.reserve_bytes = self.reserve.bytes_of(self.total)
        return self.state != before

    @property
    def full(self) -> bool:
        return self.state == FULL

    def refusal(self, what: str = "a put") -> str | None:
        """None if a write may go ahead now (the filesystem asked again
        unless it is far from the reserve); else why it may not, naming
        the service, the path and the free space."""
        if self.state == OK:
            return None
        self.sample()
        if self.state != FULL:
            return None
        self.refused += 1
        return self.message(what)

    def message(self, what: str = "a put") -> str:
        return (f"service {self.service_name} refused {what}: its disk is at its reserve "
                f"({describe_bytes(self.free)} free under {self.path}, reserve "
                f"{describe_bytes(self.reserve_bytes)}); delete records or free space on that "
                f"filesystem, and writes resume by themselves")

    def report(self) -> dict[str, float | bool]:
        """What a heartbeat says of it."""
        return {"free_disk": float(self.free), "disk_total": float(self.total),
                "disk_reserve": float(self.reserve_bytes), "disk_full": self.full}
