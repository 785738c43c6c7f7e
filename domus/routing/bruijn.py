"""De Bruijn graphs: buckets as bit strings, shifted one digit per hop.

With ``bucket_count = B = 2**n`` and ``degree = k = 2**j``, bucket ``x``'s
table is ``[(x*k + i) mod B for i in range(k)]``: read as an n-bit string,
``x`` drops its top j bits and appends the j-bit digit ``i``.  (When ``k >=
B`` that is every bucket, listed once.)

The metric is the exact hop distance in the graph.  After m hops from ``x``,
whatever digits were appended, the low ``n - m*j`` bits of ``x`` have become
the top bits of the result; so ``x`` reaches ``t`` in m hops exactly when
``m*j >= n`` or the low ``L = n - m*j`` bits of ``x`` equal the top L bits of
``t`` (``x``'s suffix overlaps a prefix of ``t``).  ``distance(x, t)`` is the
least such m, at most ``ceil(n/j)``.  Only overlaps of those lengths count:
an overlap of another length cannot be used, since every hop appends exactly
j bits.

From a bucket at distance m >= 1, the digit ``(t >> (m-1)*j) mod k`` (the
next j bits of ``t`` after the overlap) leads to a bucket at distance m - 1.
When j does not divide n, the first hop of a lookup from a bucket with no
usable overlap is the partial shift: m = ceil(n/j), and that digit is the
top ``n - (m-1)*j < j`` bits of ``t``, zero-padded; the bits above them are
shifted out before the lookup ends.

Why a lookup ends within ``ceil(n/j)`` service-level hops: fewest-hops hops
from the local bucket nearest to ``t`` (distance H, the service's distance)
to a bucket at H - 1, so the next service's distance is at most H - 1, and
the first service's is at most ``ceil(n/j)``.  Least-work hops from the
bucket the request was addressed to, whose distance also drops by one per
hop from at most ``ceil(n/j)``; the lookup ends when it reaches the service
routing ``t``, at the latest when the bucket is ``t`` itself.
"""

from __future__ import annotations

from collections.abc import Iterator

from domus.routing.base import Ranges, RoutingGraph, find_residue, is_power_of_two


class BruijnGraph(RoutingGraph):
    """The de Bruijn graph of degree ``degree`` (a power of two, >= 2) over
    ``bucket_count`` buckets.

    - fewest-hops: the local bucket whose suffix overlaps the longest usable
      prefix of the target, tried longest overlap first, each length tested
      on the ranges arithmetically; then the next digit of the target.
      O(ceil(n/j) * min(ranges, B/2**L * log(ranges))) for overlap length L.
    - least-work: from the bucket the request was addressed to, the next
      digit of the target: O(ceil(n/j)) integer operations and no search.
    """

    name = "bruijn"

    def __init__(self, bucket_count: int, degree: int = 2) -> None:
        super().__init__(bucket_count)
        if not is_power_of_two(degree) or degree < 2:
            raise ValueError(f"de Bruijn degree {degree!r} must be a power of two >= 2 "
                             f"(2, 4, 8, 16, ...)")
        self.degree = degree
        self.digit_bits = degree.bit_length() - 1  # degree == 2**digit_bits

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.bucket_count}, degree={self.degree})"

    def table(self, bucket: int) -> list[int]:
        """``[(bucket*k + i) mod B for i in range(min(k, B))]``."""
        self._check_bucket(bucket, "bucket")
        shifted = (bucket * self.degree) % self.bucket_count
        return [shifted + digit for digit in range(min(self.degree, self.bucket_count))]

    def approach(self, target: int) -> Iterator[int]:
        """For m = 1, 2, ...: the buckets whose low n - m*j bits are the
        target's high ones (m hops from it), each level in bucket order."""
        self._check_bucket(target, "target")
        for hops in range(1, self.hop_bound()):
            shifted = hops * self.digit_bits
            overlap = self.bits - shifted
            prefix = target >> shifted
            for high in range(1 << shifted):
                bucket = (high << overlap) | prefix
                if self.distance(bucket, target) == hops:    # (not met at a lower level)
                    yield bucket

    def hop_bound(self) -> int:
        """``ceil(log2(B) / log2(k))``, i.e. ``ceil(log_k(B))``."""
        return -(-self.bits // self.digit_bits)

    def distance(self, bucket: int, target: int) -> int:
        """The number of hops from ``bucket`` to ``target`` in the graph,
        from 0 (``bucket == target``) to ``hop_bound()``."""
        for hops in range(self.hop_bound()):
            shifted = hops * self.digit_bits
            overlap = self.bits - shifted
            if bucket & ((1 << overlap) - 1) == target >> shifted:
                return hops
        return self.hop_bound()

    def _step(self, bucket: int, target: int, hops: int) -> int:
        """From ``bucket`` at ``hops >= 1`` hops from ``target``, the table
        entry at ``hops - 1``."""
        digit = (target >> ((hops - 1) * self.digit_bits)) & (self.degree - 1)
        return (bucket * self.degree + digit) % self.bucket_count

    def _fewest_hops(self, local: Ranges, target: int) -> int:
        # The service's distance is that of its nearest local bucket: the
        # least m >= 1 for which some local bucket has low n - m*j bits equal
        # to target >> m*j.  At m = hop_bound() there is nothing to match,
        # and any local bucket will do.
        bound = self.hop_bound()
        for hops in range(1, bound):
            shifted = hops * self.digit_bits
            found = find_residue(local, 1 << (self.bits - shifted), target >> shifted,
                                 self.bucket_count)
            if found is not None:
                return self._step(found, target, hops)
        return self._step(local[0][0], target, bound)

    def _least_work(self, local: Ranges, target: int, current: int | None) -> int:
        if current is None:
            raise ValueError("bruijn least-work routing continues from the bucket the request "
                             "was addressed to: pass it as current=")
        return self._step(current, target, self.distance(current, target))
