"""How a DHT's buckets are shared out among services.

Two steps, both deterministic:

1. ``proportional_counts`` gives each service a number of buckets in
   proportion to its weight, by the largest-remainder method: every count is
   the ideal share rounded down or up, so no service is more than one bucket
   away from its ideal share, and the counts add up to the bucket count.
2. ``placement`` lays the counts out as contiguous ranges in the order the
   services are listed: the first service holds buckets ``[0, c0)``, the
   second ``[c0, c0 + c1)``, and so on.

Invariant the direct lookup relies on: the bucket -> service map of a DHT
that has not been redistributed is a function of the ordered per-service
counts alone.  The supervisor hands those counts to clients; a client
rebuilds the whole map with ``placement`` and never asks where a bucket is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any


def proportional_counts(bucket_count: int, weights: Sequence[float]) -> list[int]:
    """Split ``bucket_count`` buckets in proportion to ``weights``.

    Ties in the remainders go to the service listed first.  Weights must be
    non-negative with a positive sum.
    """
    if not weights:
        raise ValueError("cannot assign buckets to an empty set of services")
    if not all(0 <= weight < math.inf for weight in weights):
        raise ValueError(f"service weights must be finite and non-negative, got {list(weights)}")
    exact = [Fraction(weight) for weight in weights]
    total = sum(exact)
    if total <= 0:
        raise ValueError("service weights must not all be zero")
    shares = [bucket_count * weight / total for weight in exact]
    counts = [int(share) for share in shares]  # floor: shares are >= 0
    missing = bucket_count - sum(counts)
    by_remainder = sorted(range(len(shares)),
                          key=lambda index: (-(shares[index] - counts[index]), index))
    for index in by_remainder[:missing]:
        counts[index] += 1
    return counts


def placement(counts: Sequence[int]) -> list[int]:
    """The owner (an index into ``counts``) of every bucket, in bucket order."""
    owners: list[int] = []
    for index, count in enumerate(counts):
        owners.extend([index] * count)
    return owners


def buckets_of(counts: Sequence[int], index: int) -> range:
    """The buckets that the ``index``-th service holds under ``placement``."""
    start = sum(counts[:index])
    return range(start, start + counts[index])


def weight(resources: dict[str, Any], role: str, medium: str = "ram") -> float:
    """A service's weight for a role, from the resources it reported
    (domus.service.resources): cores for routing; RAM for storage in RAM,
    free disk for storage on disk."""
    if role == "routing":
        return float(resources.get("cores") or 1)
    if medium == "disk":
        return float(resources.get("disk") or 1)
    return float(resources.get("ram") or 1)
