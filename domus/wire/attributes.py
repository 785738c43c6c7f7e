"""DHT attributes: their defaults and their validation.

The supervisor is the authority (it knows the services); the client calls
``check_request`` first so that an obviously wrong attribute fails before
anything is sent.
"""

from __future__ import annotations

import re
from typing import Any

from domus.errors import InvalidAttribute
from domus.wire.keys import DEFAULT_HASH, HASH_FUNCTIONS

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
ROUTING_GRAPHS = ("chord", "bruijn")
ROUTING_ALGORITHMS = ("fewest-hops", "least-work")
DEFAULT_BRUIJN_DEGREE = 2
LOOKUP_STRATEGIES = ("D", "D,C,R", "C,R", "R")
MIN_BUCKETS = 1
MAX_BUCKETS = 1 << 24
BUCKETS_PER_SERVICE = 64
MAX_REPLICAS = 3

# Storage technologies: each platform and the media it can store on.  The
# service side implements each of them (domus.storage.PLATFORMS, built from
# this table); clients and the supervisor check a DHT's attributes here.
MEDIA = frozenset({"ram", "disk"})
PLATFORM_MEDIA: dict[str, frozenset[str]] = {
    "python-dict": frozenset({"ram"}),
    "domus-rbt": frozenset({"ram"}),
    "domus-bsddb-btree": MEDIA,
    "domus-bsddb-hash": MEDIA,
}
# What a platform needs that a plain ``pip install domus`` lacks, and how to
# get it: named in the errors of a service or supervisor that cannot run it.
_BERKELEY_DB = ("Berkeley DB: pip install 'domus[bdb]' (the berkeleydb package, built "
                "against libdb, Debian's libdb-dev, or installed from a wheelhouse)")
PLATFORM_NEEDS = {"domus-bsddb-btree": _BERKELEY_DB, "domus-bsddb-hash": _BERKELEY_DB}
# Platforms the design names that later work adds; asking for one gets a
# message that says so rather than "unknown platform".
PLANNED_PLATFORMS: frozenset[str] = frozenset()

DEFAULTS: dict[str, Any] = {
    "hash": DEFAULT_HASH,
    "storage": "ram",
    "platform": "python-dict",
    "routing": "chord",
    "routing_algorithm": "fewest-hops",
    "lookup": "D",
    "replicas": 1,
    "codec": "msgpack",
}
KNOWN = {"name", "buckets", "hash", "storage", "platform", "routing", "routing_degree",
         "routing_algorithm", "lookup", "durability", "routing_services", "storage_services",
         "replicas", "codec"}
# How clients encode values (services store bytes and never decode them):
# "msgpack" (the default; what every language reads), "pickle" (any
# picklable object; only on a deployment with a secret, since unpickling
# runs code: every holder of the secret is trusted with that), "raw" (bytes
# in, bytes out).
CODECS = ("msgpack", "pickle", "raw")
# Disk DHTs: "async" (the default) acknowledges a write once it is in the
# cache and flushes every second and on a clean stop; "sync" acknowledges it
# once the Berkeley DB log holding it is on stable storage.  RAM DHTs have
# no durability ("none").
DURABILITY = ("async", "sync")


def default_bucket_count(service_count: int) -> int:
    """64 buckets per service, rounded up to a power of two: enough for the
    balancer to move load in small steps."""
    wanted = max(1, service_count) * BUCKETS_PER_SERVICE
    return 1 << (wanted - 1).bit_length()


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidAttribute(
            f"DHT name {name!r} is not valid: use 1 to 128 letters, digits, '_', '.' "
            f"or '-', starting with a letter or digit")
    return name


def create_request(name: str, **attributes: Any) -> dict[str, Any]:
    """The attributes a client's create_dht sends: those given (None means
    "the default"), service sets as lists, checked by ``check_request``."""
    given = {key: (list(value) if key.endswith("_services") and not isinstance(value, str)
                   else value)
             for key, value in attributes.items() if value is not None}
    check_request(name, given)
    return given


def check_strategy(lookup: Any) -> str:
    """A lookup strategy in its canonical spelling ("d, c,r" -> "D,C,R")."""
    if not isinstance(lookup, str):
        raise InvalidAttribute(f"lookup strategy must be a str such as 'D,C,R', not {lookup!r}")
    canonical = lookup.replace(" ", "").upper()
    if canonical not in LOOKUP_STRATEGIES:
        raise InvalidAttribute(f"lookup strategy {lookup!r} is unknown; choose one of "
                               f"{list(LOOKUP_STRATEGIES)} (D: direct, C: cached, R: random)")
    return canonical


def check_degree(graph: str, degree: Any) -> int | None:
    """The de Bruijn degree (default 2): a power of two >= 2; chord has none."""
    if graph != "bruijn":
        if degree is not None:
            raise InvalidAttribute(f"routing_degree is for bruijn graphs; {graph} has none "
                                   f"(got {degree!r})")
        return None
    if degree is None:
        return DEFAULT_BRUIJN_DEGREE
    if isinstance(degree, bool) or not isinstance(degree, int):
        raise InvalidAttribute(f"routing_degree must be an int, not {degree!r} "
                               f"({type(degree).__name__})")
    if degree < 2 or degree & (degree - 1):
        raise InvalidAttribute(f"routing_degree {degree} must be a power of two >= 2 "
                               f"(2, 4, 8, 16, ...)")
    return degree


def check_request(name: Any, attributes: dict[str, Any]) -> dict[str, Any]:
    """Validate what a client asks for; return the attributes with defaults
    filled in (bucket count and service sets may stay None: the supervisor
    decides them)."""
    check_name(name)
    unknown = set(attributes) - KNOWN
    if unknown:
        raise InvalidAttribute(f"unknown DHT attribute(s) {sorted(unknown)}; "
                               f"known ones are {sorted(KNOWN - {'name'})}")
    merged = {**DEFAULTS, **{k: v for k, v in attributes.items() if v is not None}}
    for attribute in ("hash", "storage", "platform", "routing", "routing_algorithm"):
        if not isinstance(merged[attribute], str):
            raise InvalidAttribute(f"DHT attribute {attribute!r} must be a str, not "
                                   f"{merged[attribute]!r}")
    if merged["hash"] not in HASH_FUNCTIONS:
        raise InvalidAttribute(f"hash function {merged['hash']!r} is unknown; choose one of "
                               f"{sorted(HASH_FUNCTIONS)}")
    medium, platform = merged["storage"], merged["platform"]
    if medium not in MEDIA:
        raise InvalidAttribute(f"storage medium {medium!r} is unknown; choose 'ram' or 'disk'")
    if platform not in PLATFORM_MEDIA:
        if platform in PLANNED_PLATFORMS:
            raise InvalidAttribute(f"storage platform {platform!r} is not available in this "
                                   f"version; use one of {sorted(PLATFORM_MEDIA)}")
        raise InvalidAttribute(f"storage platform {platform!r} is unknown; choose one of "
                               f"{sorted(PLATFORM_MEDIA)}")
    media = PLATFORM_MEDIA[platform]
    if medium not in media:
        raise InvalidAttribute(f"platform {platform!r} cannot store on {medium!r}; it supports "
                               f"{sorted(media)}")
    durability = merged.get("durability")
    if medium == "disk":
        durability = "async" if durability is None else durability
        if durability not in DURABILITY:
            raise InvalidAttribute(f"durability {durability!r} is unknown; choose one of "
                                   f"{list(DURABILITY)}")
    elif durability not in (None, "none"):
        raise InvalidAttribute(f"durability {durability!r} is for disk DHTs; a {medium!r} "
                               f"DHT keeps nothing to make durable")
    merged["durability"] = durability if medium == "disk" else "none"
    if merged["routing"] not in ROUTING_GRAPHS:
        raise InvalidAttribute(f"routing graph {merged['routing']!r} is unknown; choose one of "
                               f"{list(ROUTING_GRAPHS)}")
    merged["routing_degree"] = check_degree(merged["routing"], merged.get("routing_degree"))
    if merged["routing_algorithm"] not in ROUTING_ALGORITHMS:
        raise InvalidAttribute(f"routing algorithm {merged['routing_algorithm']!r} is unknown; "
                               f"choose one of {list(ROUTING_ALGORITHMS)}")
    merged["lookup"] = check_strategy(merged["lookup"])
    if merged["codec"] not in CODECS:
        raise InvalidAttribute(f"value codec {merged['codec']!r} is unknown; choose one of "
                               f"{list(CODECS)}")
    replicas = merged["replicas"]
    if isinstance(replicas, bool) or not isinstance(replicas, int) \
            or not 1 <= replicas <= MAX_REPLICAS:
        raise InvalidAttribute(f"replicas must be an int from 1 to {MAX_REPLICAS} (copies of "
                               f"each bucket, on distinct services), not {replicas!r}")
    buckets = merged.get("buckets")
    if buckets is not None:
        if isinstance(buckets, bool) or not isinstance(buckets, int):
            raise InvalidAttribute(f"bucket count must be an int, not {buckets!r} "
                                   f"({type(buckets).__name__})")
        if not MIN_BUCKETS <= buckets <= MAX_BUCKETS or buckets & (buckets - 1):
            raise InvalidAttribute(f"bucket count {buckets} must be a power of two between "
                                   f"{MIN_BUCKETS} and {MAX_BUCKETS}")
    for role in ("routing_services", "storage_services"):
        services = merged.get(role)
        if services is None:
            continue
        if isinstance(services, str):
            services = [part for part in services.split(",") if part]
        if not isinstance(services, (list, tuple)) or not all(isinstance(s, str) for s in services):
            raise InvalidAttribute(f"{role} must be a list of service names, not {services!r}")
        if not services:
            raise InvalidAttribute(f"{role} must name at least one service (or be left out "
                                   f"to use all)")
        if len(set(services)) != len(services):
            raise InvalidAttribute(f"{role} names a service twice: {list(services)}")
        merged[role] = list(services)
    return merged


# Attributes every request names (given, or by their defaults) and that a
# DHT keeps for life: an existing DHT must have these to be "the same".
_FIXED = ("hash", "storage", "platform", "routing", "routing_degree", "routing_algorithm",
          "lookup", "durability", "replicas", "codec")


def attribute_differences(descriptor: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """How an existing DHT (its descriptor) differs from a creation request
    (``check_request``'s answer), as "attribute: has X, asked for Y" lines;
    empty when it is the DHT asked for.  A bucket count matches the DHT's
    first count or its current one (it may have been resized since); a
    service set left out matches any, one given matches the services that
    hold the role now (in any order)."""
    differ = [f"{attribute}: has {descriptor.get(attribute)!r}, asked for "
              f"{wanted.get(attribute)!r}"
              for attribute in _FIXED
              if (descriptor.get(attribute) or DEFAULTS.get(attribute))
              != (wanted.get(attribute) or DEFAULTS.get(attribute))]
    buckets = wanted.get("buckets")
    if buckets is not None and buckets not in (descriptor.get("initial_buckets"),
                                               descriptor.get("buckets")):
        differ.append(f"buckets: has {descriptor.get('buckets')}, asked for {buckets}")
    for role in ("routing_services", "storage_services"):
        asked = wanted.get(role)
        held = sorted(entry["name"] for entry in descriptor.get(role, ()))
        if asked is not None and sorted(asked) != held:
            differ.append(f"{role}: has {held}, asked for {sorted(asked)}")
    return differ
