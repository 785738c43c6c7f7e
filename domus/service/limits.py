"""Every bound a service keeps on what its peers can make it hold, in one
place: the defaults, and what ``domus service`` options change them.

docs/operations.md (*Bounds*) lists each with what happens when it is
reached.  A service takes a ``Limits`` (``DomusService(limits=...)``); the
request handler, the TCP port and the UDP socket each read their part.
"""

from __future__ import annotations

import dataclasses
import resource

# TCP, per service (the data port: clients, and the primaries of replicated
# buckets backed up here).
MAX_CONNECTIONS = 1024            # open at once, in total (and below the fd limit)
MAX_CONNECTIONS_PER_HOST = 256    # open at once from one peer address
IDLE_TIMEOUT = 120.0              # s without a whole frame (nothing, or a partial one)
WRITE_TIMEOUT = 30.0              # s a connection may leave its replies unread
OUTPUT_HIGH_WATER = 4 << 20       # unsent reply bytes before a connection's reading stops
INPUT_BUDGET = 256 << 20          # bytes of partial frames held, all connections together
# SCAN cursors.
MAX_SCANS = 4096                  # open scans, in total
MAX_SCANS_PER_CLIENT = 16         # open scans per client id
MAX_SCAN_KEYS = 8_000_000         # keys held by the scans' snapshots, all together
# UDP replies on an insecure deployment: at most this many times the
# request's size (0: up to a whole datagram).
UDP_REPLY_FACTOR = 16
# The reply cache (domus.service.replycache): entries in its two generations
# together; the current one takes half, so changes past REPLY_CACHE_ENTRIES / 2
# in 15 s (MAX_DEADLINE) are answered BUSY.  8,000,000 is 266,667 changes a
# second sustained, near what one service applies at its peak on the 2-core
# development VM (benchmarks.capacity: docs/operations.md, Bounds, says
# what that means and when to raise it).  The C cache (the
# one a service with the C path uses) keeps a single-key change's reply in
# 24 bytes, 30 with the table's slack when full: 240 MB at most, and only
# at that rate (the pure-Python one, about 155 bytes an entry, 1.2 GB).
REPLY_CACHE_ENTRIES = 8_000_000
# Overload: a datagram that waited longer than this in the socket's queue
# is answered BUSY instead of served (0: never).
SHED_AFTER = 0.1
# The serving thread, once its socket is empty, reads it again for this
# long, yielding the CPU between reads, before it sleeps in poll (0: it
# sleeps at once).  A datagram that comes meanwhile costs no wakeup: on
# the development VM a sleep and a wakeup cost more CPU than a request
# (benchmarks.capacity, put1 CPU: docs/operations.md, Bounds).
SPIN = 20e-6
# The Berkeley DB cache of each RAM DHT stored in Berkeley DB, in bytes:
# the most this service holds of such a DHT (0: half the machine's memory,
# at most 4 GiB; domus.storage.bsddb.ram_cache_bytes).
BDB_RAM_CACHE = 0
BDB_RAM_CACHE_MIN = 1 << 20


def descriptor_headroom() -> int:
    """How many connections the process's file descriptor limit leaves room
    for (64 kept back for files, the UDP socket and the supervisor link)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(soft - 64, 16)


@dataclasses.dataclass(frozen=True)
class Limits:
    max_connections: int = MAX_CONNECTIONS
    max_connections_per_host: int = MAX_CONNECTIONS_PER_HOST
    idle_timeout: float = IDLE_TIMEOUT
    write_timeout: float = WRITE_TIMEOUT
    output_high_water: int = OUTPUT_HIGH_WATER
    input_budget: int = INPUT_BUDGET
    max_scans: int = MAX_SCANS
    max_scans_per_client: int = MAX_SCANS_PER_CLIENT
    max_scan_keys: int = MAX_SCAN_KEYS
    udp_reply_factor: int = UDP_REPLY_FACTOR
    shed_after: float = SHED_AFTER
    reply_cache_entries: int = REPLY_CACHE_ENTRIES
    spin: float = SPIN
    bdb_ram_cache: int = BDB_RAM_CACHE

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or value != value or value < 0:
                raise ValueError(f"limit {field.name} must be a number >= 0, not {value!r}")
        for name in ("max_connections", "max_connections_per_host", "max_scans",
                     "max_scans_per_client", "max_scan_keys", "input_budget",
                     "output_high_water", "reply_cache_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"limit {name} must be at least 1")
        for name in ("idle_timeout", "write_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"limit {name} must be more than 0 seconds")
        if 0 < self.bdb_ram_cache < BDB_RAM_CACHE_MIN:
            raise ValueError(f"limit bdb_ram_cache must be 0 (automatic) or at least "
                             f"{BDB_RAM_CACHE_MIN} bytes, not {self.bdb_ram_cache}")

    @property
    def connections(self) -> int:
        """The cap on open connections in force: the configured one, or
        fewer if the file descriptor limit is lower."""
        return min(self.max_connections, descriptor_headroom())


DEFAULT = Limits()

# The bounds `domus service` takes as options (the others keep their
# defaults): field -> flag.
FLAGS = {
    "max_connections": "--max-connections",
    "max_connections_per_host": "--max-connections-per-host",
    "idle_timeout": "--idle-timeout", "write_timeout": "--write-timeout",
    "input_budget": "--input-budget", "max_scans": "--max-scans",
    "max_scan_keys": "--max-scan-keys", "udp_reply_factor": "--udp-reply-factor",
    "shed_after": "--shed-after", "reply_cache_entries": "--reply-cache-entries",
    "spin": "--spin", "bdb_ram_cache": "--bdb-ram-cache",
}


def from_options(options: object) -> Limits:
    """The bounds parsed `domus service` options give (an argparse
    namespace: each flag's value under its field's name)."""
    return Limits(**{field: getattr(options, field) for field in FLAGS})


def limit_options(limits: Limits) -> list[list[object]]:
    """The ``[flag, value]`` pairs that start a service with ``limits``
    (for its launch record: a restart keeps its bounds); defaults left out."""
    return [[flag, getattr(limits, field)] for field, flag in FLAGS.items()
            if getattr(limits, field) != getattr(DEFAULT, field)]
