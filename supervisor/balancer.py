"""The balancer: where a DHT's buckets should be, and the moves that take
them there.  Pure: it reads descriptors and what services reported, and
returns moves; the supervisor carries them out (domus.supervisor.server).
Tests drive it with made-up clusters.

Targets.  For each role of a DHT, the *eligible* services are the role's
listed services, in their listed order, that are up, not draining, not
leaving the DHT (``<role>_leaving``) and (for storage) able to run the
DHT's platform; a DHT that follows the deployment
(created without a service list for that role) also takes every other up
service, appended in name order.  Each gets a share of the buckets in
proportion to its capacity (``capacity``): cores not used by other work on
its node for routing; its RAM for a RAM DHT's storage, its disk for a disk
DHT's.  The counts come from ``proportional_counts`` (within one bucket of
the exact share) and the target layout is their *contiguous placement* in
that order: the same rule as at creation.  So once every move is done the
descriptor is rebased (``rebase``: the counts become the target counts and
no moved bucket is listed), and the direct lookup rebuilds the whole layout
from the counts alone again, as the paper wants; the price is that a
joining service shifts the ranges of those listed after it.

Routing capacity uses the balancer's own slow average of what other work
uses of each node (``smoothing``), so that a burst of another job's CPU
does not move routing back and forth.

Load.  A service whose own CPU stays above ``cpu_busy`` while another
eligible one is under ``cpu_room`` is damped: its weight is multiplied by
``damping`` (down to ``min_factor``), so its share, and its load, shrink;
the factor recovers by the same step once its CPU is back under
``cpu_room``.  Nothing else changes weights, so equal services under noisy
load never trade buckets.  And a *hot* bucket (one that carries at least
``hot_share`` of the storage requests of such a busy service, from the
requests the services sample per bucket) is moved to the eligible service
with the most room, and *pinned* there for ``pin_time`` seconds: the
target layout is the counts' placement with the pinned buckets on their
pins, so the balancer does not move it back meanwhile.

A full disk.  A service whose disk is at its reserve (``disk_full`` in
its heartbeat: it refuses puts on its disk DHTs) is given no bucket of a
disk DHT's storage: no move goes there, hot buckets included, until its
heartbeats say it has room again: one that holds none of the DHT is not
eligible; for one that holds some, while the target layout would put
more there, the DHT's storage waits (only a drain's moves, elsewhere, go
on), so that no bucket is moved twice for it.  What it holds stays (a
drain moves it off by hand).

Hysteresis and budgets.  A role is rebalanced only if some service is off
its target count by more than ``tolerance`` buckets and more than
``relative_tolerance`` of its share, and that
has lasted ``settle`` seconds (a drain or ``immediate`` skips the wait);
then it is balanced until its layout is exactly the target, so shares end
within one bucket of their exact value; a
round moves at most ``max_moves`` buckets and about ``records_per_round``
records; a bucket moved within ``cooldown`` seconds is left alone unless a
drain needs it.  Every move carries its reason.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from domus.placement import layout, replicas
from domus.placement.assignment import proportional_counts
from domus.placement.bucketmap import BucketMap

ROLES = layout.ROLES


@dataclass(frozen=True)
class Settings:
    tolerance: int = 1              # buckets a share may be off target
    relative_tolerance: float = 0.1  # ... or this fraction of the share, if more
    smoothing: float = 0.05         # weight of a new CPU sample in the balancer's averages
    settle: float = 10.0            # seconds an imbalance must last
    max_moves: int = 16             # buckets moved per round
    records_per_round: int = 2_000_000
    cooldown: float = 60.0          # seconds a moved bucket is left alone
    cpu_busy: float = 85.0          # a service's own CPU %, sustained, that sheds load
    cpu_room: float = 50.0          # own CPU % under which a service can take load
    damping: float = 0.8            # weight factor per round of sustained overload
    min_factor: float = 0.25
    hot_share: float = 0.25         # of a busy service's requests, that makes a bucket hot
    pin_time: float = 600.0         # seconds a hot bucket stays where it was moved


@dataclass(frozen=True)
class Move:
    dht: str
    bucket: int
    role: str
    source: str
    target: str
    records: int | None
    why: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Memory:
    """What the balancer keeps between rounds."""
    imbalanced_since: dict[tuple[str, str], float] = field(default_factory=dict)
    active: set[tuple[str, str]] = field(default_factory=set)   # (dht, role) being balanced
    moved_at: dict[tuple[str, str, int], float] = field(default_factory=dict)
    factors: dict[str, float] = field(default_factory=dict)      # service -> load damping
    others: dict[str, float] = field(default_factory=dict)   # service -> smoothed others' CPU
    # (dht, role, bucket) -> (service, until): hot buckets moved off busy services
    pins: dict[tuple[str, str, int], tuple[str, float]] = field(default_factory=dict)
    decisions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=200))

    def note(self, now: float, text: str, **details: Any) -> None:
        """Keep a decision (``now`` on the balancer's clock, ``at`` the
        wall-clock time) for ``domus balancer status``."""
        self.decisions.append({"time": now, "at": time.time(), "decision": text, **details})


def others_busy(service: Mapping[str, Any]) -> float:
    """The fraction of its node's CPU that work other than this service
    uses now (its node's CPU less its own)."""
    cores = float((service.get("resources") or {}).get("cores") or 1)
    load = service.get("load") or {}
    node = float(load.get("node_cpu") or 0) / 100            # of the whole node
    own = float(load.get("cpu") or 0) / (100 * cores)         # this process's part
    return min(max(node - own, 0.0), 0.95)


def capacity(service: Mapping[str, Any], role: str, medium: str,
             others: float | None = None) -> float:
    """How much of ``role`` a service can take, from its registered
    resources and (routing) the CPU other work leaves it: ``others``, the
    balancer's smoothed ``others_busy``, or the last sample."""
    resources = service.get("resources") or {}
    if role == "routing":
        cores = float(resources.get("cores") or 1)
        return cores * (1 - (others_busy(service) if others is None else others))
    if medium == "disk":
        return float(resources.get("disk") or 1)
    return float(resources.get("ram") or 1)


def disk_full(service: Mapping[str, Any]) -> bool:
    """Whether a service said in its last heartbeat that its disk is at
    its reserve."""
    return bool((service.get("load") or {}).get("disk_full"))


def takes_storage(descriptor: Mapping[str, Any], service: Mapping[str, Any] | None) -> bool:
    """Whether buckets of the DHT's storage may be placed on or moved to
    ``service`` now: not onto a full disk for a disk DHT."""
    return service is not None and not (descriptor.get("storage") == "disk"
                                        and disk_full(service))


def eligible(descriptor: Mapping[str, Any], role: str, services: Mapping[str, Mapping[str, Any]],
             draining: Iterable[str] = ()) -> list[str]:
    """The services that should hold ``role`` of the DHT, in layout order."""
    leaving = set(draining) | set(descriptor.get(f"{role}_leaving", ()))
    holding = layout.owners(descriptor, role) if role == "storage" else None

    def fit(name: str) -> bool:
        service = services.get(name)
        if service is None or service.get("state") != "up" or name in leaving:
            return False
        if holding is not None and not takes_storage(descriptor, service) \
                and not holding.buckets(name):
            return False        # (a full disk that holds none of it: not a target)
        platforms = service.get("platforms")
        return role == "routing" or platforms is None or descriptor["platform"] in platforms

    listed = [entry["name"] for entry in descriptor[f"{role}_services"]]
    chosen = [name for name in listed if fit(name)]
    if role in descriptor.get("follow", ()):
        chosen += [name for name in sorted(services) if name not in listed and fit(name)]
    return chosen


def targets(descriptor: Mapping[str, Any], role: str, services: Mapping[str, Mapping[str, Any]],
            memory: Memory, draining: Iterable[str] = ()) -> dict[str, int]:
    """service -> the number of buckets it should hold, in layout order."""
    names = eligible(descriptor, role, services, draining)
    if not names:
        return {}
    weights = [capacity(services[name], role, descriptor["storage"], memory.others.get(name))
               * memory.factors.get(name, 1.0) for name in names]
    return dict(zip(names, proportional_counts(descriptor["buckets"], weights)))


def target_layout(descriptor: Mapping[str, Any], counts: Mapping[str, int],
                  pins: Mapping[int, str] | None = None) -> BucketMap[str]:
    """The counts' contiguous placement, with ``pins`` (bucket -> service)
    on their services."""
    names = list(counts)
    wanted = BucketMap.from_counts([counts[name] for name in names], names,
                                   descriptor["buckets"])
    for bucket, service in (pins or {}).items():
        if service in counts and 0 <= bucket < descriptor["buckets"]:
            wanted.assign(bucket, bucket + 1, service)
    return wanted


def pinned(descriptor: Mapping[str, Any], role: str, memory: Memory,
           now: float) -> dict[int, str]:
    """The DHT's buckets of ``role`` pinned now.  An expired pin is
    forgotten, and its role balanced to the exact target again (the bucket
    goes back: the layout is counts again)."""
    name = descriptor["name"]
    found = {}
    for key, (service, until) in list(memory.pins.items()):
        if until <= now:
            del memory.pins[key]
            memory.active.add(key[:2])
        elif key[:2] == (name, role):
            found[key[2]] = service
    return found


def hot_moves(descriptor: Mapping[str, Any], services: Mapping[str, Mapping[str, Any]],
              memory: Memory, settings: Settings, now: float,
              heat: Mapping[str, Mapping[int, float]], eligible_storage: list[str]
              ) -> list[Move]:
    """A hot bucket off each busy storage service (see the module's
    docstring), to the eligible service with the least CPU, pinned there."""
    def cpu(name: str) -> float:
        return float((services[name].get("load") or {}).get("cpu") or 0)

    room = sorted((name for name in eligible_storage if cpu(name) < settings.cpu_room
                   and takes_storage(descriptor, services.get(name))), key=cpu)
    current = layout.owners(descriptor, "storage")
    moves = []
    for name in eligible_storage:
        rates = {int(bucket): float(rate) for bucket, rate in (heat.get(name) or {}).items()}
        served = float((services[name].get("load") or {}).get("requests_per_s") or 0)
        if cpu(name) <= settings.cpu_busy or not rates or not served or not room:
            continue
        bucket, rate = max(rates.items(), key=lambda item: item[1])
        key = (descriptor["name"], "storage", bucket)
        if (rate < settings.hot_share * served or key in memory.pins
                or current.get(bucket) != name
                or now - memory.moved_at.get(key, -1e18) < settings.cooldown):
            continue
        target = room[0]
        memory.pins[key] = (target, now + settings.pin_time)
        memory.note(now, f"DHT {descriptor['name']!r}: bucket {bucket} is hot on busy {name} "
                    f"({rate:.0f} of its {served:.0f} requests/s, CPU {cpu(name):.0f}%): "
                    f"pinned to {target} for {settings.pin_time:.0f}s", dht=descriptor["name"],
                    bucket=bucket, service=name)
        moves.append(Move(descriptor["name"], bucket, "storage", name, target, None,
                          f"bucket {bucket} serves {rate:.0f} of busy {name}'s {served:.0f} "
                          f"requests/s (CPU {cpu(name):.0f}%); {target} has room "
                          f"(CPU {cpu(target):.0f}%)"))
    return moves


def adjust_for_load(services: Mapping[str, Mapping[str, Any]], memory: Memory,
                    settings: Settings, now: float) -> None:
    """One step of load damping (see the module's docstring)."""
    def cpu(name: str) -> float:
        return float((services[name].get("load") or {}).get("cpu") or 0)

    up = [name for name, service in services.items() if service.get("state") == "up"]
    for name in up:
        sample = others_busy(services[name])
        previous = memory.others.get(name, sample)
        memory.others[name] = previous + settings.smoothing * (sample - previous)
    room = [name for name in up if cpu(name) < settings.cpu_room]
    for name in up:
        factor = memory.factors.get(name, 1.0)
        if cpu(name) > settings.cpu_busy and room:
            damped = max(settings.min_factor, factor * settings.damping)
            if damped < factor:
                memory.factors[name] = damped
                memory.note(now, f"{name} is busy (CPU {cpu(name):.0f}%) while {room} have "
                            f"room: its weight factor goes to {damped:.2f}", service=name)
        elif factor < 1.0 and cpu(name) < settings.cpu_room:
            memory.factors[name] = min(1.0, factor / settings.damping)
            if memory.factors[name] == 1.0:
                del memory.factors[name]


def plan(descriptor: Mapping[str, Any], services: Mapping[str, Mapping[str, Any]],
         memory: Memory, settings: Settings, now: float | None = None, *,
         draining: Iterable[str] = (), immediate: bool = False,
         records: Mapping[str, float] | None = None,
         heat: Mapping[str, Mapping[int, float]] | None = None) -> list[Move]:
    """The moves of this round for one DHT (empty: nothing to do yet).
    ``records``: service -> records per bucket it stores (an estimate, for
    the budget and the plan's table); ``heat``: service -> bucket ->
    requests per second on its busiest buckets (sampled)."""
    now = time.monotonic() if now is None else now
    draining = set(draining)
    name = descriptor["name"]
    moves: list[Move] = []
    budget = settings.records_per_round
    for role in ROLES:
        counts = targets(descriptor, role, services, memory, draining)
        if not counts:
            continue
        current = layout.owners(descriptor, role)
        absent = sorted(service for service in current.owners()
                        if (services.get(service) or {}).get("state") != "up")
        if absent:
            # Records cannot be copied off a service that does not answer,
            # and a routing change must reach every service: wait for it.
            continue
        if role == "storage" and heat:
            moves += hot_moves(descriptor, services, memory, settings, now, heat, list(counts))
        held = {service: current.buckets(service) for service in set(counts) | current.owners()}
        leaving = {service for service in current.owners() if service not in counts}
        off = [abs(held.get(service, 0) - share) > max(settings.tolerance,
                                                       settings.relative_tolerance * share)
               for service, share in counts.items()]
        key = (name, role)
        pins = pinned(descriptor, role, memory, now)
        wanted = target_layout(descriptor, counts, pins)
        if key not in memory.active:
            if not leaving and not any(off):
                memory.imbalanced_since.pop(key, None)
                continue
            since = memory.imbalanced_since.setdefault(key, now)
            if not (immediate or leaving) and now - since < settings.settle:
                continue
            memory.active.add(key)
            memory.note(now, f"DHT {name!r}: balancing its {role}", dht=name, role=role)
        if list(current.ranges()) == list(wanted.ranges()):
            memory.active.discard(key)              # there: wait for the next imbalance
            memory.imbalanced_since.pop(key, None)
            continue
        copies = replicas.backups(descriptor) if role == "storage" else []
        differences = list(_differences(current, wanted))
        # A target with its disk at its reserve: only what must move (off
        # a leaving service) moves, and not onto it; the others wait, so
        # that no bucket is moved twice for it.
        waiting = role == "storage" and any(
            not takes_storage(descriptor, services.get(goal)) for _b, _o, goal in differences)
        for bucket, owner, goal in differences:
            if any(move.bucket == bucket and move.role == role for move in moves):
                continue                            # (a hot move already)
            if any(copy.get(bucket) == goal for copy in copies):
                continue        # (it holds a backup of it: two copies would share a service)
            must = owner in leaving
            if waiting and (not must or not takes_storage(descriptor, services.get(goal))):
                continue        # (a disk at its reserve: see above)
            if not must and now - memory.moved_at.get((name, role, bucket), -1e18) \
                    < settings.cooldown:
                continue
            estimate = (records or {}).get(owner) if role == "storage" else None
            if len(moves) >= settings.max_moves or (
                    estimate is not None and budget < estimate and moves):
                return moves
            if estimate is not None:
                budget -= int(estimate)
            moves.append(Move(name, bucket, role, owner, goal,
                              int(estimate) if estimate is not None else None,
                              _why(owner, goal, role, held, counts, leaving, services,
                                   descriptor["storage"], draining)))
    return moves


def _differences(current: BucketMap[str], wanted: BucketMap[str]):
    """(bucket, owner now, owner wanted) of every bucket whose owner
    changes, in bucket order; by ranges, not bucket by bucket."""
    for first, end, owner in current.ranges():
        for low, high, goal in wanted.ranges(first, end):
            if goal != owner:
                for bucket in range(low, high):
                    yield bucket, owner, goal


def _why(source: str, target: str, role: str, held: Mapping[str, int],
         counts: Mapping[str, int], leaving: set[str],
         services: Mapping[str, Mapping[str, Any]], medium: str, draining: set[str]) -> str:
    if source in leaving:
        cause = ("draining" if source in draining
                 else (services.get(source) or {}).get("state", "gone"))
        return f"{source} is {cause}; {target} holds {held.get(target, 0)} of its " \
               f"{counts[target]}-bucket {role} share"
    what = "cores free" if role == "routing" else f"{medium} capacity"
    return (f"{source} holds {held.get(source, 0)} {role} buckets for a share of "
            f"{counts.get(source, 0)}, {target} {held.get(target, 0)} for "
            f"{counts[target]} (shares follow {what})")


def rebase(descriptor: Mapping[str, Any]) -> dict[str, Any]:
    """The same layout, described by counts alone where it can be: each
    role whose owners are a contiguous run per service in listed order gets
    those counts and no moved buckets.  Returned as a new descriptor."""
    changed = dict(descriptor)
    for role in ROLES:
        owners = layout.owners(descriptor, role)
        runs = [(first, end, owner) for first, end, owner in owners.ranges()]
        order = [owner for _first, _end, owner in runs]
        if len(order) != len(set(order)):
            continue                      # some service holds two runs: keep the moves
        entries = {entry["name"]: entry for entry in descriptor[f"{role}_services"]}
        listed = list(entries)
        holders = [name for name in listed if name in order]
        if holders != order:
            continue                      # not in listed order
        sizes = {owner: end - first for first, end, owner in runs}
        changed[f"{role}_services"] = [dict(entry, count=sizes.get(name, 0))
                                       for name, entry in entries.items()]
        changed.pop(f"{role}_moves", None)
    return changed


def describe(descriptor: Mapping[str, Any], role: str, owners: BucketMap[str],
             entries: list[dict[str, Any]]) -> dict[str, Any]:
    """A copy of ``descriptor`` whose ``role`` lists ``entries`` (name,
    address, count: the counts must add up to the bucket count) and whose
    layout for that role is ``owners``: the buckets where ``owners``
    differs from the counts' placement are listed as moved."""
    changed = dict(descriptor)
    changed[f"{role}_services"] = entries
    changed.pop(f"{role}_moves", None)
    placed = layout.initial(changed, role)
    differences = {str(bucket): owner for bucket, _placed, owner in _differences(placed, owners)}
    if differences:
        changed[f"{role}_moves"] = differences
    return changed


def resized(descriptor: Mapping[str, Any], count: int) -> dict[str, Any]:
    """``descriptor`` with ``count`` buckets (twice or half its count, or
    any power of two times it), each role's owners following: bucket c of
    a finer count is its coarser bucket's; a coarser bucket is the owner of
    its first finer bucket's (storage must be co-located beforehand, see
    domus.service.hosted, "Resizing").  Counts are scaled in proportion,
    so a layout described by counts stays so when doubled; the other
    buckets are listed as moved.  A new layout version."""
    old = descriptor["buckets"]
    changed = dict(descriptor, buckets=count, version=layout.next_version(descriptor))
    changed["initial_buckets"] = descriptor.get("initial_buckets") or old
    for role in ROLES:
        owners = layout.owners(descriptor, role)
        scaled: BucketMap[str] = BucketMap(count)
        for first, end, owner in owners.ranges():
            if count >= old:
                scaled.assign(first * (count // old), end * (count // old), owner)
            else:
                factor = old // count
                low, high = -(-first // factor), -(-end // factor)   # (ceilings)
                if low < high:
                    scaled.assign(low, high, owner)
        entries = [dict(entry) for entry in descriptor[f"{role}_services"]]
        for entry, share in zip(entries, proportional_counts(
                count, [entry["count"] for entry in entries])):
            entry["count"] = share
        changed = describe(changed, role, scaled, entries)
    return changed


def force_out(descriptor: Mapping[str, Any], service: str,
              services: Mapping[str, Mapping[str, Any]], memory: Memory,
              draining: Iterable[str] = ()) -> dict[str, Any]:
    """``descriptor`` without ``service``: each bucket it held goes, empty,
    to the service the targets give it to, and ``service`` leaves the
    lists (its count goes to the service listed before it, or after).  For
    a service removed with the records it holds (``remove --force``)."""
    changed = dict(descriptor)
    for role in ROLES:
        entries = [dict(entry) for entry in descriptor[f"{role}_services"]]
        names = [entry["name"] for entry in entries]
        if service not in names:
            continue
        counts = targets(descriptor, role, services, memory, {*draining, service})
        if not counts:
            raise ValueError(f"no other service can take the {role} of DHT "
                             f"{descriptor['name']!r}")
        wanted = target_layout(descriptor, counts)
        owners = layout.owners(descriptor, role)
        for first, end, owner in list(owners.ranges()):
            if owner == service:
                for low, high, goal in list(wanted.ranges(first, end)):
                    owners.assign(low, high, goal)
        index = names.index(service)
        gone = entries.pop(index)
        if entries:
            heir = entries[index - 1] if index > 0 else entries[0]
            heir["count"] += gone["count"]
        known = {entry["name"] for entry in entries}
        for owner in owners.owners() - known:
            entries.append({"name": owner, "address": services[owner].get("address", ""),
                            "count": 0})
        changed = describe(changed, role, owners, entries)
    return changed


__all__ = ["Settings", "Move", "Memory", "others_busy", "capacity", "eligible", "targets",
           "target_layout", "pinned", "hot_moves", "adjust_for_load", "plan", "rebase",
           "describe", "resized", "force_out"]
