"""What a service holds, and whose it is: the identity file kept with each
DHT's files, the checks on what the supervisor sends before anything is
opened or deleted, and the report of DHTs its supervisor does not know.

Each hosted DHT has a directory ``<data dir>/dhts/<id>`` (its id checked:
an int in range, so the name is digits only) holding ``identity.json``: the
DHT's id, name, medium, platform, deployment and stamp
(domus.wire.identities).  The service writes it when it first hosts the
DHT and reads it back at start.  Invariant: a DHT's directory is deleted
only by a ``drop`` or ``discard`` whose id, deployment and stamp match that
file (or the hosted DHT's descriptor); a directory whose identity differs
from a descriptor the supervisor sends is never opened as that DHT.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

from domus.wire import checks, identities
from domus.wire.attributes import MAX_BUCKETS, MEDIA, NAME_PATTERN

IDENTITY_FILE = "identity.json"
MAX_SERVICES = 1 << 16      # services a descriptor may list per role


def dht_home(data_dir: str, dht_id: Any) -> str:
    """Where a service keeps a DHT's files (DHT ids are never reused by a
    supervisor; the id is checked, so the path stays under ``data_dir``)."""
    return os.path.join(data_dir, "dhts", str(checks.dht_id(dht_id)))


def check_descriptor(descriptor: Any, platforms: Any) -> dict[str, Any]:
    """What a service checks of a descriptor from its supervisor before it
    opens, creates or deletes anything: ValueError naming the problem."""
    if not isinstance(descriptor, dict):
        raise ValueError(f"a DHT descriptor must be a map, not {type(descriptor).__name__}")
    checks.dht_id(descriptor.get("id"))
    name = descriptor.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise ValueError(f"DHT name {name!r} is not valid")
    buckets = descriptor.get("buckets")
    if (not isinstance(buckets, int) or isinstance(buckets, bool)
            or not 1 <= buckets <= MAX_BUCKETS or buckets & (buckets - 1)):
        raise ValueError(f"DHT {name!r}: bucket count {buckets!r} is not a power of two from "
                         f"1 to {MAX_BUCKETS}")
    if descriptor.get("storage", "ram") not in MEDIA:
        raise ValueError(f"DHT {name!r}: storage {descriptor.get('storage')!r} is not one of "
                         f"{sorted(MEDIA)}")
    if descriptor.get("platform") not in platforms:
        raise ValueError(f"DHT {name!r}: platform {descriptor.get('platform')!r} is not one "
                         f"this service runs ({sorted(platforms)})")
    for role in ("routing_services", "storage_services"):
        entries = descriptor.get(role)
        if not isinstance(entries, list) or len(entries) > MAX_SERVICES:
            raise ValueError(f"DHT {name!r}: {role} must be a list of services")
        for entry in entries:
            if not isinstance(entry, dict):
                raise ValueError(f"DHT {name!r}: {role} entry {entry!r} is not a map")
            checks.service_name(entry.get("name"))
            checks.address(entry.get("address"))
            count = entry.get("count")
            if not isinstance(count, int) or isinstance(count, bool) \
                    or not 0 <= count <= buckets:
                raise ValueError(f"DHT {name!r}: {role} count {count!r} is not valid")
    identities.checked(descriptor, required=False)
    return descriptor


def identity_of(descriptor: dict[str, Any]) -> dict[str, Any]:
    """What the identity file keeps of a descriptor."""
    return {"id": descriptor["id"], "name": descriptor["name"],
            "deployment": descriptor.get("deployment"), "stamp": descriptor.get("stamp"),
            "storage": descriptor.get("storage", "ram"), "platform": descriptor.get("platform")}


def conflict(recorded: dict[str, Any] | None, descriptor: dict[str, Any]) -> str | None:
    """Why ``descriptor`` must not be hosted over the DHT ``recorded`` here
    (None: it may).  Data without an identity (written by an older Domus)
    takes the first one it is given."""
    if recorded is None or recorded.get("stamp") is None:
        return None
    if (recorded.get("deployment"), recorded.get("stamp")) == (
            descriptor.get("deployment"), descriptor.get("stamp")):
        return None
    return (f"this service holds another DHT with id {descriptor['id']}: "
            f"{recorded.get('name')!r} of deployment {recorded.get('deployment')}, stamp "
            f"{recorded.get('stamp')} (the supervisor does not know it); it is kept: discard "
            f"it first (`domus service discard SERVICE {descriptor['id']}`)")


def write(data_dir: str | None, descriptor: dict[str, Any]) -> None:
    """Record the DHT's identity with its files (written whole, then
    renamed: never a partial file)."""
    if data_dir is None:
        return
    home = dht_home(data_dir, descriptor["id"])
    os.makedirs(home, exist_ok=True)
    path = os.path.join(home, IDENTITY_FILE)
    identity = identity_of(descriptor)
    if read(home) == identity:
        return
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as target:
        json.dump(identity, target, sort_keys=True)
        target.flush()
        os.fsync(target.fileno())
    os.replace(temporary, path)


def read(home: str) -> dict[str, Any] | None:
    """The identity recorded in ``home`` (None: none, or unreadable)."""
    try:
        with open(os.path.join(home, IDENTITY_FILE), encoding="utf-8") as source:
            identity = json.load(source)
    except (OSError, ValueError):
        return None
    return identity if isinstance(identity, dict) else None


def on_disk(data_dir: str | None) -> dict[int, dict[str, Any]]:
    """The DHTs whose directories are in ``data_dir`` (id -> identity;
    one without an identity file is reported with its id only)."""
    found: dict[int, dict[str, Any]] = {}
    if data_dir is None:
        return found
    try:
        entries = os.listdir(os.path.join(data_dir, "dhts"))
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or entry != str(int(entry)):
            continue
        try:
            dht_id = checks.dht_id(int(entry))
        except ValueError:
            continue
        home = os.path.join(data_dir, "dhts", entry)
        if not os.path.isdir(home):
            continue
        identity = read(home) or {}
        found[dht_id] = {"id": dht_id, "name": identity.get("name"),
                         "deployment": identity.get("deployment"),
                         "stamp": identity.get("stamp"), "storage": identity.get("storage"),
                         "platform": identity.get("platform")}
    return found


def report(identity: dict[str, Any], *, loaded: bool, records: int | None) -> dict[str, Any]:
    """A holding as a service reports it (register, heartbeats)."""
    return {**identity, "loaded": loaded, "records": records}


def remove(data_dir: str | None, dht_id: int) -> None:
    """Delete a DHT's directory (its identity checked by the caller)."""
    if data_dir is not None:
        shutil.rmtree(dht_home(data_dir, dht_id), ignore_errors=True)
