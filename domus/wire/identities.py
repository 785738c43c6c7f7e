"""Who a DHT's data belongs to: the deployment's id and the DHT's stamp.

A supervisor makes its deployment's id at its first start and keeps it in
its state; it stamps each DHT it creates (a random token: DHT ids are small
integers that a supervisor started afresh would hand out again).  Every
descriptor carries both (``deployment``, ``stamp``), and a service records
them with the DHT's files.  Invariant: a service deletes a DHT's data only
when told to by a message that names that DHT's id, deployment and stamp
(``drop``, or an operator's ``discard``); a DHT that its supervisor merely
does not list is kept, and reported as a *holding* the supervisor does not
know (an orphan).  See docs/operations.md, "Orphaned DHTs".
"""

from __future__ import annotations

import os
from typing import Any

from domus.wire import checks
from domus.wire.attributes import MEDIA, NAME_PATTERN

MAX_HOLDINGS = 4096     # holdings a service may report


def new() -> str:
    """A fresh deployment id or DHT stamp: 32 random hex digits."""
    return os.urandom(16).hex()


def of(descriptor: dict[str, Any]) -> dict[str, Any]:
    """What a ``drop`` (or ``discard``) names: the DHT's id, deployment and
    stamp."""
    return {"id": descriptor["id"], "deployment": descriptor.get("deployment"),
            "stamp": descriptor.get("stamp")}


def same(recorded: dict[str, Any], named: dict[str, Any]) -> bool:
    """Whether ``named`` (from a message) names the DHT ``recorded`` (what a
    service keeps): same id, deployment and stamp.  A DHT recorded without
    an identity (hosted before identities existed, or by a test's bare
    descriptor) is named only by a message without one."""
    return (recorded.get("id") == named.get("id")
            and recorded.get("deployment") == named.get("deployment")
            and recorded.get("stamp") == named.get("stamp"))


def checked(named: dict[str, Any], *, required: bool = True) -> dict[str, Any]:
    """The id, deployment and stamp of a message, checked: an int id in
    range and hex identities (None allowed for both only if not
    ``required``)."""
    if not isinstance(named, dict):
        raise ValueError(f"a DHT must be named by a map of id, deployment and stamp, not "
                         f"{named!r}")
    identity = {"id": checks.dht_id(named.get("id"))}
    for field, what in (("deployment", "deployment id"), ("stamp", "DHT stamp")):
        value = named.get(field)
        if value is None and not required:
            identity[field] = None
        else:
            identity[field] = checks.identity(value, what)
    return identity


def checked_holdings(holdings: Any) -> list[dict[str, Any]]:
    """What a service says it holds (register, heartbeats): a list of at
    most MAX_HOLDINGS maps of id, deployment, stamp (None for data written
    before identities), name, storage, platform, whether it is loaded, and
    its records (if loaded)."""
    if holdings is None:
        return []
    if not isinstance(holdings, list) or len(holdings) > MAX_HOLDINGS:
        raise ValueError(f"holdings must be a list of at most {MAX_HOLDINGS} DHTs")
    result = []
    for holding in holdings:
        if not isinstance(holding, dict):
            raise ValueError(f"holding {holding!r} is not a map")
        entry = checked(holding, required=False)
        name = holding.get("name")
        if name is not None and not (isinstance(name, str) and NAME_PATTERN.fullmatch(name)):
            raise ValueError(f"holding {entry['id']}: DHT name {name!r} is not valid")
        storage = holding.get("storage")
        if storage is not None and storage not in MEDIA:
            raise ValueError(f"holding {entry['id']}: storage {storage!r} is not valid")
        platform = holding.get("platform")
        if platform is not None and not (isinstance(platform, str) and len(platform) <= 64):
            raise ValueError(f"holding {entry['id']}: platform {platform!r} is not valid")
        records = holding.get("records")
        if records is not None:
            checks.figure(records, "records", high=float(1 << 62), positive=False)
        entry.update(name=name, storage=storage, platform=platform,
                     loaded=bool(holding.get("loaded")), records=records)
        result.append(entry)
    return result
