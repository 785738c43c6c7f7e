"""Where the copies of a replicated DHT's buckets are.

A DHT with ``replicas`` R > 1 stores each bucket on R distinct services.
The first copy is the *primary*: the storage layout of the descriptor
(counts, then moves: domus.placement.layout), which clients send every
request to.  The other copies are *backups*, rank 1 to R - 1, each rank a
bucket map kept in the descriptor's ``storage_backups`` as a list of
``[first, end, service]`` ranges (a bucket no range covers has lost that
copy: it is *missing* until it is repaired).  The primary applies a write
only once every backup of its bucket has (domus.service.handler).

At creation, rank r is the primary layout turned by r * B / R buckets: with
every service holding at most B / R primaries, that puts the copies of a
bucket on distinct services, and each service holds R times its primary
share in all.  Where it does not (a service with more than B / R, or two
services on one host), the clashing ranges go to the service with the
fewest copies that is not a holder of the bucket yet, on another host if
one is left.  Pure: no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from domus.placement import layout
from domus.placement.bucketmap import BucketMap

Ranges = list[list[Any]]         # [[first, end, service], ...]


def backups(descriptor: Mapping[str, Any]) -> list[BucketMap[str]]:
    """Rank 1 to R - 1: bucket -> the service holding that copy."""
    maps = []
    for ranges in descriptor.get("storage_backups") or []:
        copy: BucketMap[str] = BucketMap(descriptor["buckets"])
        for first, end, service in ranges:
            if service:
                copy.assign(first, end, service)
        maps.append(copy)
    return maps


def encode(copy: BucketMap[str]) -> Ranges:
    return [[first, end, service] for first, end, service in copy.ranges()]


def holders(descriptor: Mapping[str, Any], bucket: int) -> list[str]:
    """The services holding ``bucket``: its primary first, then each backup
    present, by rank."""
    found = [layout.owners(descriptor, "storage").get(bucket)]
    found += [copy.get(bucket) for copy in backups(descriptor)]
    return [service for service in found if service]


def missing(descriptor: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    """(rank, first, end) of every range of buckets that lacks that copy."""
    gaps = []
    for rank, copy in enumerate(backups(descriptor), start=1):
        position = 0
        for first, end, _service in copy.ranges():
            if first > position:
                gaps.append((rank, position, first))
            position = end
        if position < descriptor["buckets"]:
            gaps.append((rank, position, descriptor["buckets"]))
    return gaps


def copies_held(descriptor: Mapping[str, Any]) -> Counter[str]:
    """service -> copies of buckets it holds, primaries and backups."""
    held: Counter[str] = Counter()
    primary = layout.owners(descriptor, "storage")
    for copy in [primary, *backups(descriptor)]:
        for first, end, service in copy.ranges():
            held[service] += end - first
    return held


def with_backups(descriptor: Mapping[str, Any], copies: Sequence[BucketMap[str]],
                 addresses: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A copy of ``descriptor`` whose backups are ``copies`` (a new layout
    version); a service they name that the storage list lacks is added to
    it with count 0 (its address from ``addresses``), so that services and
    the supervisor know where it is."""
    changed = dict(descriptor, version=layout.next_version(descriptor))
    changed["storage_backups"] = [encode(copy) for copy in copies]
    listed = {entry["name"] for entry in descriptor["storage_services"]}
    named = sorted({service for copy in copies for service in copy.owners()} - listed)
    if named:
        changed["storage_services"] = [*descriptor["storage_services"], *[
            {"name": service, "address": (addresses or {}).get(service, ""), "count": 0}
            for service in named]]
    return changed


def place_backups(primary: BucketMap[str], services: Sequence[str],
                  hosts: Mapping[str, str], replicas: int) -> list[BucketMap[str]]:
    """The backups of a DHT whose primaries are ``primary``, over
    ``services`` (which ``hosts`` maps to their host names): the primary
    layout turned by r * B / R for rank r, clashes moved (see the module's
    docstring).  ValueError if there are fewer services than copies."""
    if replicas > len(set(services)):
        raise ValueError(f"{replicas} copies of each bucket need {replicas} services that can "
                         f"store them; there are {len(set(services))}")
    count = primary.bucket_count
    held: Counter[str] = Counter()
    for first, end, service in primary.ranges():
        held[service] += end - first
    copies: list[BucketMap[str]] = []
    for rank in range(1, replicas):
        turn = rank * count // replicas
        copy: BucketMap[str] = BucketMap(count)
        for first, end, service in primary.ranges():
            for low, high in _turned(first, end, turn, count):
                copy.assign(low, high, service)
        # Every clash of this rank is taken off its service before any is
        # given to another, so that each goes where the fewest copies are.
        clashes = [(low, high, taken) for first, end, service in copy.ranges()
                   for low, high, taken in _clashes(first, end, service, primary, copies,
                                                    services, hosts)]
        for first, end, service in copy.ranges():
            held[service] += end - first
        for low, high, _taken in clashes:
            held[copy.owner(low)] -= high - low
        for low, high, taken in clashes:
            other = choose(services, hosts, taken, held)
            copy.assign(low, high, other)
            held[other] += high - low
        copies.append(copy)
    return copies


def choose(services: Sequence[str], hosts: Mapping[str, str], taken: set[str],
           held: Mapping[str, int]) -> str:
    """The service for a copy of buckets that ``taken`` hold already: one
    that holds none, on a host none of them is on if there is one, with
    the fewest copies (the first listed of those)."""
    free = [service for service in services if service not in taken]
    if not free:
        raise ValueError(f"every service holds a copy already ({sorted(taken)})")
    used_hosts = {hosts.get(service, service) for service in taken}
    apart = [service for service in free if hosts.get(service, service) not in used_hosts]
    return min(apart or free, key=lambda service: (held.get(service, 0),
                                                    services.index(service)))


def _turned(first: int, end: int, turn: int, count: int) -> list[tuple[int, int]]:
    """Range [first, end) moved ``turn`` buckets on, around ``count``."""
    low, high = first + turn, end + turn
    if high <= count:
        return [(low, high)]
    if low >= count:
        return [(low - count, high - count)]
    return [(low, count), (0, high - count)]


def _clashes(first: int, end: int, service: str, primary: BucketMap[str],
             copies: Sequence[BucketMap[str]], services: Sequence[str],
             hosts: Mapping[str, str]) -> list[tuple[int, int, set[str]]]:
    """Sub-ranges of [first, end) where ``service`` would hold a second
    copy of a bucket, or a copy on a host that holds one already while a
    service on another host is free, with the services holding its other
    copies."""
    cut = {first, end}
    for other in (primary, *copies):
        for low, high, _holder in other.ranges(first, end):
            cut.update((low, high))
    points = sorted(cut)
    host = hosts.get(service, service)
    clashes = []
    for low, high in zip(points, points[1:]):
        taken = {holder for holder in (primary.get(low), *(c.get(low) for c in copies))
                 if holder}
        used_hosts = {hosts.get(holder, holder) for holder in taken}
        if service in taken or host in used_hosts and any(
                other not in taken and hosts.get(other, other) not in used_hosts
                for other in services):
            clashes.append((low, high, taken))
    return clashes


__all__ = ["backups", "encode", "holders", "missing", "copies_held", "with_backups",
           "place_backups", "choose"]
