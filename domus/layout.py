"""Where a DHT's buckets are: its descriptor's layout, role by role.

A DHT's descriptor gives each role (``routing``, ``storage``) a list of
services with a bucket count; the initial placement is a function of those
counts alone (domus.assignment: contiguous ranges in list order), which is
what the direct lookup rebuilds.  Buckets moved since (by hand, or by
rebalancing) are listed in ``<role>_moves``, bucket -> service name (bucket
numbers as decimal strings, since the descriptor is saved as JSON).  A
service a bucket moved to is listed in the role's services, with count 0 if
it had none at creation, so that its address is known.

``owners`` is the current truth: the placement, then the moves;
``ranges_of`` gives one service's part of it as sorted (first, end) ranges.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from domus.bucketmap import BucketMap
from domus.routing.base import local_ranges as ranges_of  # (first, end) ranges of one owner

ROLES = ("routing", "storage")
__all__ = ["ROLES", "initial", "owners", "moves", "ranges_of", "buckets_in", "addresses"]


def initial(descriptor: dict[str, Any], role: str) -> BucketMap[str]:
    """bucket -> service name as placed at creation (the counts alone)."""
    entries = descriptor[f"{role}_services"]
    return BucketMap.from_counts([entry["count"] for entry in entries],
                                 [entry["name"] for entry in entries], descriptor["buckets"])


def owners(descriptor: dict[str, Any], role: str) -> BucketMap[str]:
    """bucket -> service name now: the initial placement, then the moves."""
    layout = initial(descriptor, role)
    for bucket, name in moves(descriptor, role).items():
        layout.assign(bucket, bucket + 1, name)
    return layout


def moves(descriptor: dict[str, Any], role: str) -> dict[int, str]:
    """The buckets of ``role`` moved away from their initial placement."""
    return {int(bucket): name for bucket, name in descriptor.get(f"{role}_moves", {}).items()}


def buckets_in(ranges: list[tuple[int, int]]) -> Iterator[int]:
    for first, end in ranges:
        yield from range(first, end)


def addresses(descriptor: dict[str, Any], role: str) -> dict[str, str]:
    """service name -> address, for the services of ``role``."""
    return {entry["name"]: entry["address"] for entry in descriptor[f"{role}_services"]}
