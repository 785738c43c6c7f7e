"""The YCSB core workloads A to F, as a generator of operations.

The same workloads, request distributions and record shape as YCSB's
``workloads/workload[a-f]`` with its defaults (``CoreWorkload``): records
of 10 fields of 100 bytes, keys ``"user" + FNV-1a-64(n)`` (``insertorder=
hashed``), the scrambled zipfian distribution (constant 0.99) for A, B, C,
E and F, "latest" for D, scans of 1 to 100 records (uniform) for E.  One
departure, said in the output: an update writes the whole record
(``writeallfields=true``), since a DHT value is one opaque blob.

Pure (no I/O): ``Workload.next()`` gives ("read"|"update"|"insert"|"scan"|
"rmw", key number, scan length); the workers turn them into requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

FIELD_COUNT = 10
FIELD_LENGTH = 100
ZIPFIAN_CONSTANT = 0.99
MAX_SCAN_LENGTH = 100
# YCSB's ScrambledZipfianGenerator draws from 10^10 items with this zeta,
# then hashes the draw into the key space.
ITEM_COUNT = 10_000_000_000
ZETAN = 26.46902820178302

WORKLOADS: dict[str, dict[str, float | str]] = {
    "A": {"read": 0.5, "update": 0.5, "distribution": "zipfian"},
    "B": {"read": 0.95, "update": 0.05, "distribution": "zipfian"},
    "C": {"read": 1.0, "distribution": "zipfian"},
    "D": {"read": 0.95, "insert": 0.05, "distribution": "latest"},
    "E": {"scan": 0.95, "insert": 0.05, "distribution": "zipfian"},
    "F": {"read": 0.5, "rmw": 0.5, "distribution": "zipfian"},
}
OPERATIONS = ("read", "update", "insert", "scan", "rmw")

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 1099511628211
_MASK = (1 << 64) - 1


def fnv64(value: int) -> int:
    """YCSB's Utils.fnvhash64 of a long: FNV-1a over its 8 bytes, low byte
    first, then Math.abs of the signed result."""
    hashed = _FNV_OFFSET
    for _ in range(8):
        hashed ^= value & 0xFF
        hashed = (hashed * _FNV_PRIME) & _MASK
        value >>= 8
    signed = hashed - (1 << 64) if hashed >> 63 else hashed
    return abs(signed) & _MASK          # (Java's Math.abs: MIN_VALUE stays as it is)


def key_name(number: int) -> str:
    return f"user{fnv64(number)}"


def zeta(count: int, theta: float) -> float:
    return sum(1.0 / (index ** theta) for index in range(1, count + 1))


class Zipfian:
    """YCSB's ZipfianGenerator over [0, items): item 0 the most popular."""

    def __init__(self, items: int, rng: random.Random, theta: float = ZIPFIAN_CONSTANT,
                 zetan: float | None = None) -> None:
        self.items, self.theta, self.rng = items, theta, rng
        self.zetan = zetan if zetan is not None else zeta(items, theta)
        self.alpha = 1.0 / (1.0 - theta)
        zeta2 = zeta(2, theta)
        self.eta = (1 - (2.0 / items) ** (1 - theta)) / (1 - zeta2 / self.zetan)
        self.half_pow = 1 + 0.5 ** theta

    def next(self) -> int:
        u = self.rng.random()
        uz = u * self.zetan
        if uz < 1.0:
            return 0
        if uz < self.half_pow:
            return 1
        return int(self.items * ((self.eta * u - self.eta + 1) ** self.alpha))


@dataclass
class Workload:
    """One client's stream of operations of workload ``name`` over
    ``records`` loaded records; its inserts take key numbers ``first_insert``,
    ``first_insert + stride``, ... (so that clients never insert the same)."""

    name: str
    records: int
    seed: int = 1
    first_insert: int | None = None
    stride: int = 1

    def __post_init__(self) -> None:
        spec = WORKLOADS[self.name.upper()]
        self.rng = random.Random(self.seed)
        self.mix = [(operation, float(spec[operation])) for operation in OPERATIONS
                    if operation in spec]
        self.distribution = spec["distribution"]
        self.scrambled = Zipfian(ITEM_COUNT, self.rng, zetan=ZETAN)
        self.inserted = self.records            # the latest key number known
        self.next_insert = self.records if self.first_insert is None else self.first_insert
        self._latest: Zipfian | None = None

    def _choose_key(self) -> int:
        if self.distribution == "latest":
            if self._latest is None:
                self._latest = Zipfian(self.inserted, self.rng)
            elif self._latest.items != self.inserted:
                # (zeta grows by the new items' terms, as YCSB's does)
                grown = self._latest.zetan + sum(
                    1.0 / (index ** ZIPFIAN_CONSTANT)
                    for index in range(self._latest.items + 1, self.inserted + 1))
                self._latest = Zipfian(self.inserted, self.rng, zetan=grown)
            return self.inserted - 1 - self._latest.next()
        return fnv64(self.scrambled.next()) % self.records

    def next(self) -> tuple[str, int, int]:
        """(operation, key number, scan length: 0 unless a scan)."""
        pick = self.rng.random()
        operation = self.mix[-1][0]
        for candidate, share in self.mix:
            if pick < share:
                operation = candidate
                break
            pick -= share
        if operation == "insert":
            number = self.next_insert
            self.next_insert += self.stride
            self.inserted = max(self.inserted, number + 1)
            return operation, number, 0
        length = self.rng.randint(1, MAX_SCAN_LENGTH) if operation == "scan" else 0
        return operation, self._choose_key(), length


def record(number: int, rng: random.Random) -> dict[str, bytes]:
    """A record of FIELD_COUNT fields of FIELD_LENGTH random bytes."""
    return {f"field{index}": rng.randbytes(FIELD_LENGTH) for index in range(FIELD_COUNT)}
