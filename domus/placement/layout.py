"""Where a DHT's buckets are: its descriptor's layout, role by role.

A DHT's descriptor gives each role (``routing``, ``storage``) a list of
services with a bucket count; the initial placement is a function of those
counts alone (domus.placement.assignment: contiguous ranges in list order), which is
what the direct lookup rebuilds.  Buckets moved since (by hand, or by
rebalancing) are listed in ``<role>_moves``, bucket -> service name (bucket
numbers as decimal strings, since the descriptor is saved as JSON).  A
service a bucket moved to is listed in the role's services, with count 0 if
it had none at creation, so that its address is known.

``owners`` is the current truth: the placement, then the moves;
``ranges_of`` gives one service's part of it as sorted (first, end) ranges.
``move`` is the descriptor after one more move.

A descriptor's ``version`` counts the changes of its layout (every move,
every change of its service lists, every resize): services tag their
replies with it (domus.wire.protocol.layout_tag), and a client that sees a
newer one fetches the layout again.  ``next_version`` is what a changed
layout takes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from domus.placement.bucketmap import BucketMap
from domus.placement.bucketmap import local_ranges as ranges_of  # (first, end) ranges of one owner

ROLES = ("routing", "storage")
__all__ = ["ROLES", "initial", "owners", "moves", "move", "ranges_of", "buckets_in",
           "addresses", "next_version"]


def next_version(descriptor: dict[str, Any]) -> int:
    """The version of a layout changed from ``descriptor``'s."""
    return int(descriptor.get("version", 0)) + 1


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


def move(descriptor: dict[str, Any], role: str, bucket: int, service: str,
         address: str) -> dict[str, Any]:
    """A copy of ``descriptor`` in which ``service`` (at ``address``) holds
    ``bucket`` of ``role``; ``descriptor`` itself is left as it was.

    - The counts never change: the direct lookup rebuilds the initial
      placement from them, and misses on moved buckets (it is told
      NOT_OWNER and asks the supervisor again).
    - A bucket moved back to its initial owner is not listed as a move (a
      role with no moves has no ``<role>_moves`` at all).
    - ``service`` is added to the role's services with count 0 if it is not
      listed; no service is ever taken out.  A service listed in a DHT hosts
      it, buckets or none, so a client that still sends a request there
      with an old layout is told NOT_OWNER (and refreshes), not that the
      DHT is unknown.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, not {role!r}")
    if not 0 <= bucket < descriptor["buckets"]:
        raise ValueError(f"bucket {bucket} is not in [0, {descriptor['buckets']})")
    changed = dict(descriptor, version=next_version(descriptor))
    role_moves = {key: name for key, name in descriptor.get(f"{role}_moves", {}).items()
                  if int(key) != bucket}
    if initial(descriptor, role).get(bucket) != service:
        role_moves[str(bucket)] = service
    changed.pop(f"{role}_moves", None)
    if role_moves:
        changed[f"{role}_moves"] = dict(sorted(role_moves.items(), key=lambda item: int(item[0])))
    entries = descriptor[f"{role}_services"]
    if all(entry["name"] != service for entry in entries):
        changed[f"{role}_services"] = [*entries, {"name": service, "address": address,
                                                  "count": 0}]
    return changed
