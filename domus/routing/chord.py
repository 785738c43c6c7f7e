"""Chord: finger tables over the ring of buckets.

With ``bucket_count = B = 2**n``, bucket ``x``'s table holds its fingers
``(x + 2**i) mod B`` for ``i`` in ``range(n)``.  The metric is the clockwise
distance ``(t - x) mod B`` from ``x`` to the target ``t``.

Why a lookup ends within ``n = log2(B)`` service-level hops, whatever the
buckets' owners: let ``D`` be the smallest clockwise distance from a local
bucket to ``t`` (``D > 0`` until the service routes ``t``) and ``p`` the local
bucket at that distance.  Least-work hops to ``p + 2**h``, where ``2**h`` is
the highest set bit of ``D``; that bucket is at ``D - 2**h < 2**h`` from ``t``.
Fewest-hops hops to the candidate nearest to ``t`` among the fingers of all
local buckets, which includes that one, so it is at least as near.  Either
way the next service's ``D`` is below ``2**h``: the highest set bit of ``D``
drops by at least one per hop, and ``D < 2**n`` at the start, so ``D`` is 0
after at most ``n`` hops.  (At bucket level, one bucket per service, both
algorithms clear the highest bit of the distance each hop: popcount(D) hops.)
"""

from __future__ import annotations

from collections.abc import Iterator

from domus.routing.base import Ranges, RoutingGraph, floor_cyclic


class ChordGraph(RoutingGraph):
    """Chord over ``bucket_count`` buckets.

    - fewest-hops: the finger nearest to the target (clockwise, without
      overshooting) among all fingers of all local buckets, found with one
      cyclic floor lookup per finger size: O(log2(B) * log(ranges)).
    - least-work: from the local bucket that precedes the target most
      closely, the one finger given by the highest set bit of the remaining
      distance: O(log(ranges)).
    """

    name = "chord"

    def table(self, bucket: int) -> list[int]:
        """``[(bucket + 2**i) mod B for i in range(log2(B))]``."""
        self._check_bucket(bucket, "bucket")
        return [(bucket + (1 << finger)) % self.bucket_count for finger in range(self.bits)]

    def distance(self, bucket: int, target: int) -> int:
        """The clockwise distance ``(target - bucket) mod B``."""
        return (target - bucket) % self.bucket_count

    def approach(self, target: int) -> Iterator[int]:
        """The buckets before ``target`` on the ring, nearest first."""
        self._check_bucket(target, "target")
        mask = self.bucket_count - 1
        return ((target - distance) & mask for distance in range(1, self.bucket_count))

    def hop_bound(self) -> int:
        """``log2(B)``."""
        return self.bits

    def _fewest_hops(self, local: Ranges, target: int) -> int:
        # A finger of size 2**i lands nearest to the target from the local
        # bucket nearest below (target - 2**i), cyclically: that bucket x
        # makes (target - 2**i - x) mod B, the finger's remaining distance,
        # smallest.  A finger that overshoots the target would be at
        # B - 2**i + (target - x) mod B, farther than the least-work finger,
        # so the minimum never overshoots.
        mask = self.bucket_count - 1
        best_bucket = best_distance = -1
        for finger in range(self.bits):
            aim = (target - (1 << finger)) & mask
            remaining = (aim - floor_cyclic(local, aim)) & mask
            if best_distance < 0 or remaining < best_distance:
                best_bucket, best_distance = (target - remaining) & mask, remaining
                if remaining == 0:
                    break
        return best_bucket

    def _least_work(self, local: Ranges, target: int, current: int | None) -> int:
        closest = floor_cyclic(local, target)  # target is not local: closest != target
        remaining = (target - closest) % self.bucket_count
        return (closest + (1 << (remaining.bit_length() - 1))) % self.bucket_count
