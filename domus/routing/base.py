"""What every routing graph over a DHT's buckets provides, and the bucket
ranges that a routing service (an AS) consults.

A DHT has ``bucket_count`` buckets, a power of two. Each bucket has a
routing table, its out-edges in the graph. A routing service routes a set of
buckets, given here as *local ranges*: a sorted list of disjoint half-open
``(first, end)`` ranges (``domus.placement.bucketmap.local_ranges`` gets
them from a ``BucketMap``). A distributed lookup for a target bucket is
forwarded from service to service until it reaches the one that routes the
target. At each service the next hop comes from *aggregated routing*: the
service consults the tables of all its local buckets at once and picks the
out-edge that gets closest to the target; the next service is whoever routes
that bucket.

Every graph has a metric, ``distance(bucket, target)``, which is 0 exactly at
the target.  ``next_bucket`` always returns a bucket that is strictly closer
to the target than the bucket the request was addressed to (and, for every
algorithm but bruijn's least-work, closer than every local bucket), so every
lookup ends; each graph's module says why it ends within ``hop_bound()``
service-level hops.

Nothing here looks at local buckets one by one: an AS may route 2**22
buckets in a handful of ranges, and the graphs work on the ranges with
bisection and arithmetic, so the cost of a hop depends on the number of
ranges and on log2(bucket_count), never on the number of buckets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from bisect import bisect_right
from collections.abc import Callable, Iterator, Sequence
from operator import itemgetter
from typing import ClassVar

# The largest bucket count a DHT may have: the same limit as
# domus.wire.attributes.MAX_BUCKETS (kept here so that this package imports
# nothing but the bucket map).
MAX_BUCKETS = 1 << 24

FEWEST_HOPS = "fewest-hops"
LEAST_WORK = "least-work"

Ranges = Sequence[tuple[int, int]]

_first_of = itemgetter(0)


def is_power_of_two(value: object) -> bool:
    """Whether ``value`` is an int (not a bool) that is a power of two."""
    return (isinstance(value, int) and not isinstance(value, bool) and value > 0
            and value & (value - 1) == 0)


# ---------------------------------------------------------------- ranges
def range_index(ranges: Ranges, bucket: int) -> int:
    """The index of the last range whose first bucket is <= ``bucket``, or -1
    if there is none.  O(log ranges)."""
    return bisect_right(ranges, bucket, key=_first_of) - 1


def contains(ranges: Ranges, bucket: int) -> bool:
    """Whether ``bucket`` lies in one of ``ranges``.  O(log ranges)."""
    index = range_index(ranges, bucket)
    return index >= 0 and bucket < ranges[index][1]


def floor_cyclic(ranges: Ranges, bucket: int) -> int:
    """The local bucket closest to ``bucket`` going backwards around the
    ring: the largest local bucket <= ``bucket`` or, if there is none, the
    largest local bucket of all.  ``ranges`` must not be empty.
    O(log ranges)."""
    index = range_index(ranges, bucket)
    first, end = ranges[index]  # index -1: the last range, i.e. wrap around
    return bucket if first <= bucket < end else end - 1


def find_residue(ranges: Ranges, modulus: int, residue: int, bucket_count: int) -> int | None:
    """Some local bucket ``x`` with ``x % modulus == residue``, or None.

    ``modulus`` is a power of two <= ``bucket_count`` and ``0 <= residue <
    modulus``.  The buckets with that residue are an arithmetic progression
    of ``bucket_count // modulus`` terms: when bisecting for each term is
    cheaper than a pass over the ranges, that is what it does; otherwise
    each range is tested in O(1).  O(min(ranges, terms * log ranges)).
    """
    terms = bucket_count // modulus
    if terms * len(ranges).bit_length() < len(ranges):
        for candidate in range(residue, bucket_count, modulus):
            if contains(ranges, candidate):
                return candidate
        return None
    for first, end in ranges:
        candidate = first + (residue - first) % modulus  # smallest >= first
        if candidate < end:
            return candidate
    return None


def check_ranges(ranges: Ranges, bucket_count: int) -> None:
    """Raise ValueError unless ``ranges`` are sorted, disjoint, non-empty
    ``(first, end)`` ranges within ``[0, bucket_count)``.  O(ranges); the
    routing functions assume this and do not call it on every hop."""
    previous_end = 0
    for first, end in ranges:
        if not previous_end <= first < end <= bucket_count:
            raise ValueError(
                f"local ranges must be sorted, disjoint, non-empty (first, end) ranges "
                f"within [0, {bucket_count}); got {list(ranges)!r}")
        previous_end = end


# ---------------------------------------------------------------- graphs
class RoutingGraph(ABC):
    """A routing graph over ``bucket_count`` buckets (a power of two from 1
    to 2**24) and its routing algorithms.

    ``algorithms`` names them; every graph has ``"fewest-hops"`` (the next
    hop that gets closest to the target, whatever the search costs) and
    ``"least-work"`` (O(1) or O(log) work per hop, possibly more hops).
    """

    name: ClassVar[str]
    algorithms: ClassVar[tuple[str, ...]] = (FEWEST_HOPS, LEAST_WORK)

    def __init__(self, bucket_count: int) -> None:
        if not is_power_of_two(bucket_count) or bucket_count > MAX_BUCKETS:
            raise ValueError(f"bucket count {bucket_count!r} must be a power of two between "
                             f"1 and {MAX_BUCKETS}")
        self.bucket_count = bucket_count
        self.bits = bucket_count.bit_length() - 1  # bucket_count == 2**bits

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.bucket_count})"

    # ---------------------------------------------------------- the graph
    @abstractmethod
    def table(self, bucket: int) -> list[int]:
        """The routing table of ``bucket``: its out-edges."""

    @abstractmethod
    def distance(self, bucket: int, target: int) -> int:
        """The graph's metric: >= 0, and 0 exactly when ``bucket == target``."""

    @abstractmethod
    def approach(self, target: int) -> Iterator[int]:
        """Buckets from which a lookup for ``target`` is short, nearest
        first (distance nondecreasing, ``target`` itself left out): where a
        client with a cache of lookup results starts one (aggregated
        routing from the nearest cached entry).  Lazy: take what you need."""

    @abstractmethod
    def hop_bound(self) -> int:
        """The proven upper bound on the service-level hops of a lookup, for
        every algorithm and every assignment of buckets to services."""

    # ---------------------------------------------------------- routing
    def next_bucket(self, local: Ranges, target: int, algorithm: str,
                    current: int | None = None) -> int:
        """The next hop of a lookup for ``target`` at a service that routes
        the buckets in ``local`` (sorted, disjoint ``(first, end)`` ranges).

        ``current`` is the bucket the request was addressed to (one of the
        local buckets); bruijn's least-work algorithm continues from it and
        needs it, the others do not.

        Returns ``target`` if it is local.  Otherwise returns a bucket in the
        table of some local bucket that is strictly closer to ``target``
        than ``current`` (and, except for bruijn's least-work, than every
        local bucket), so a lookup that follows it always ends.
        """
        self._check_bucket(target, "target")
        if algorithm not in self.algorithms:
            raise ValueError(f"routing algorithm {algorithm!r} is unknown for {self.name} "
                             f"graphs; choose one of {list(self.algorithms)}")
        if not local:
            raise ValueError("a routing service with no local buckets cannot route a lookup")
        if local[0][0] < 0 or local[-1][1] > self.bucket_count:
            raise ValueError(f"local ranges must lie within [0, {self.bucket_count}); "
                             f"got {list(local)!r}")
        if current is not None:
            self._check_bucket(current, "current bucket")
            if not contains(local, current):
                raise ValueError(f"current bucket {current} is not one of the local buckets")
        if contains(local, target):
            return target
        if algorithm == FEWEST_HOPS:
            return self._fewest_hops(local, target)
        return self._least_work(local, target, current)

    @abstractmethod
    def _fewest_hops(self, local: Ranges, target: int) -> int:
        """next_bucket's fewest-hops choice; ``target`` is not local."""

    @abstractmethod
    def _least_work(self, local: Ranges, target: int, current: int | None) -> int:
        """next_bucket's least-work choice; ``target`` is not local."""

    def route(self, local_of: Callable[[int], Ranges], start_bucket: int, target: int,
              algorithm: str) -> list[int]:
        """The service-level chain of a lookup for ``target`` that starts at
        the service routing ``start_bucket``.

        ``local_of(bucket)`` returns the local ranges of the service that
        routes ``bucket``.  The chain is ``[start_bucket, b1, b2, ...]``:
        each ``b`` is the bucket the previous service forwarded the request
        to, and the last one is routed by the service that routes
        ``target``; the number of hops is ``len(chain) - 1``.  Raises
        RuntimeError if a hop fails to get strictly closer (a bug: it cannot
        happen), so it never loops.
        """
        self._check_bucket(start_bucket, "start bucket")
        self._check_bucket(target, "target")
        chain = [start_bucket]
        bucket = start_bucket
        while True:
            local = local_of(bucket)
            if not contains(local, bucket):
                raise ValueError(f"local_of({bucket}) returned ranges without bucket {bucket}: "
                                 f"{list(local)!r}")
            if contains(local, target):
                return chain
            following = self.next_bucket(local, target, algorithm, current=bucket)
            if self.distance(following, target) >= self.distance(bucket, target):
                raise RuntimeError(f"{self!r} {algorithm}: hop {bucket} -> {following} does "
                                   f"not get closer to {target}")
            chain.append(following)
            bucket = following

    def _check_bucket(self, bucket: int, what: str) -> None:
        if isinstance(bucket, bool) or not isinstance(bucket, int) \
                or not 0 <= bucket < self.bucket_count:
            raise ValueError(f"{what} {bucket!r} is not a bucket of this DHT: "
                             f"use 0 to {self.bucket_count - 1}")
