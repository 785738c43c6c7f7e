"""Bucket -> owner maps kept as ranges in a red-black tree.

A DHT's buckets are shared out as contiguous ranges (domus.placement.assignment), and
stay mostly contiguous when single buckets move.  A ``BucketMap`` stores one
entry per range, ``first bucket -> (end, owner)``, in a ``domus.rbtree``
RBTree, so

- finding a bucket's owner is a floor lookup, O(log ranges);
- the map of a DHT with 65,536 buckets over 8 services is 8 entries, not
  65,536;
- moving one bucket splits at most one range in two (and merges neighbours
  that end up with the same owner).

Invariant: ranges never overlap and neighbouring ranges never have the same
owner (they are merged), so two maps with the same bucket -> owner function
have the same ranges.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

from domus.rbtree import RBTree

Owner = TypeVar("Owner", bound=Hashable)


class BucketMap(Generic[Owner]):
    """Owners of buckets in ``[0, bucket_count)``; a bucket may have none."""

    __slots__ = ("bucket_count", "_ranges")

    def __init__(self, bucket_count: int) -> None:
        if bucket_count < 1:
            raise ValueError(f"a bucket map needs at least one bucket, not {bucket_count}")
        self.bucket_count = bucket_count
        self._ranges: RBTree = RBTree()

    @classmethod
    def from_counts(cls, counts: Sequence[int], owners: Sequence[Owner],
                    bucket_count: int | None = None) -> BucketMap[Owner]:
        """The placement of domus.placement.assignment: ``owners[i]`` holds the i-th
        run of ``counts[i]`` buckets."""
        if len(counts) != len(owners):
            raise ValueError(f"{len(counts)} counts for {len(owners)} owners")
        total = sum(counts)
        bucket_map: BucketMap[Owner] = cls(bucket_count if bucket_count is not None else total)
        first = 0
        for count, owner in zip(counts, owners):
            if count:
                bucket_map.assign(first, first + count, owner)
            first += count
        return bucket_map

    # ------------------------------------------------------------ queries
    def owner(self, bucket: int) -> Owner:
        """The owner of ``bucket``; KeyError if nobody holds it."""
        found = self._ranges.floor(bucket, None)
        if found is None or bucket >= found[1][0]:
            raise KeyError(bucket)
        return found[1][1]

    # ``bucket_map[bucket]``: what batch grouping (domus.client.codec) calls on a
    # dense table, so either can serve as a DHT's table of owners.
    __getitem__ = owner
    # Not a sequence: iterate ranges() instead.
    __iter__ = None  # type: ignore[assignment]

    def get(self, bucket: int, default: Owner | None = None) -> Owner | None:
        found = self._ranges.floor(bucket, None)
        if found is None or bucket >= found[1][0]:
            return default
        return found[1][1]

    def __contains__(self, bucket: object) -> bool:
        return isinstance(bucket, int) and self.get(bucket, None) is not None

    def ranges(self, first: int = 0, end: int | None = None) -> Iterator[tuple[int, int, Owner]]:
        """(first, end, owner) of every range meeting ``[first, end)``, in
        bucket order, clipped to it."""
        end = self.bucket_count if end is None else end
        if first >= end:
            return
        start = self._ranges.floor_key(first, first)
        for range_first, (range_end, owner) in self._ranges.irange(start, end - 1, items=True):
            low, high = max(range_first, first), min(range_end, end)
            if low < high:
                yield low, high, owner

    def buckets(self, owner: Owner) -> int:
        """How many buckets ``owner`` holds."""
        return sum(end - first for first, end, held_by in self.ranges() if held_by == owner)

    def owners(self) -> set[Owner]:
        return {owner for _first, _end, owner in self.ranges()}

    def dense(self, default: Owner | None = None) -> list[Owner | None]:
        """The map as a list indexed by bucket (the direct lookup's table)."""
        table: list[Owner | None] = [default] * self.bucket_count
        for first, end, owner in self.ranges():
            table[first:end] = [owner] * (end - first)
        return table

    def __len__(self) -> int:
        """Buckets that have an owner."""
        return sum(end - first for first, end, _owner in self.ranges())

    def range_count(self) -> int:
        return len(self._ranges)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BucketMap):
            return NotImplemented
        return (self.bucket_count == other.bucket_count
                and list(self.ranges()) == list(other.ranges()))

    def __repr__(self) -> str:
        shown = ", ".join(f"[{first}, {end}): {owner!r}" for first, end, owner in self.ranges())
        return f"BucketMap({self.bucket_count}, {{{shown}}})"

    def copy_without(self, buckets: Iterable[int]) -> BucketMap[Owner]:
        """A copy of this map in which ``buckets`` have no owner."""
        copied: BucketMap[Owner] = BucketMap(self.bucket_count)
        for first, end, owner in self.ranges():
            copied.assign(first, end, owner)
        for bucket in buckets:
            if 0 <= bucket < self.bucket_count:
                copied.assign(bucket, bucket + 1, None)
        return copied

    # ------------------------------------------------------------ changes
    def assign(self, first: int, end: int, owner: Owner | None) -> None:
        """Give buckets ``[first, end)`` to ``owner`` (None: to nobody)."""
        if not 0 <= first < end <= self.bucket_count:
            raise ValueError(f"bucket range [{first}, {end}) is not within "
                             f"[0, {self.bucket_count})")
        ranges = self._ranges
        # Cut the ranges that straddle either end, then drop what lies inside.
        self._split(first)
        self._split(end)
        for inside in list(ranges.irange(first, end - 1)):
            del ranges[inside]
        if owner is not None:
            ranges[first] = (end, owner)
            self._merge(first)  # with the range after, if it has the same owner
        # ... and the range before with the new one.
        before = ranges.floor_key(first - 1, None) if first else None
        if before is not None:
            self._merge(before)

    def _split(self, bucket: int) -> None:
        """Make ``bucket`` the first bucket of a range if a range covers it."""
        if bucket >= self.bucket_count:
            return
        found = self._ranges.floor(bucket, None)
        if found is None:
            return
        range_first, (range_end, owner) = found
        if range_first < bucket < range_end:
            self._ranges[range_first] = (bucket, owner)
            self._ranges[bucket] = (range_end, owner)

    def _merge(self, first: int) -> None:
        """Merge the range starting at ``first`` with the next one if they
        touch and share an owner."""
        end, owner = self._ranges[first]
        following = self._ranges.get(end)
        if following is not None and following[1] == owner:
            del self._ranges[end]
            self._ranges[first] = (following[0], owner)


def local_ranges(bucket_map: BucketMap, owner: Hashable) -> list[tuple[int, int]]:
    """The buckets that ``owner`` holds in ``bucket_map``, as sorted,
    disjoint, maximal ``(first, end)`` ranges.  O(ranges in the map)."""
    return [(first, end) for first, end, held_by in bucket_map.ranges() if held_by == owner]
