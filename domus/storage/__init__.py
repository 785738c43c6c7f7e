"""Storage technologies: a medium (``ram`` or ``disk``) and a platform.

``PLATFORMS`` maps a platform's name to a ``Platform``: the media it can
store on, whether it keeps records in key order, and how to open the store
of one DHT on one service (``open_store(medium, home, label, durability)``;
``home`` is a directory of the DHT's own under the service's data dir, used
by disk media; ``label`` names the DHT in error messages; ``durability`` is
the disk DHT's, see domus.wire.attributes; ``base_count``, the bucket count
the DHT was created with, names its parts, see domus.storage.base.Store).
Which platforms exist and on which media is
``domus.wire.attributes.PLATFORM_MEDIA``, shared with clients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, partial

from domus.storage.base import (
    FailedRepository,
    RamStore,
    Repository,
    StorageFault,
    StorageFullFault,
    Store,
    UnavailableStore,
)
from domus.storage.pydict import DictRepository
from domus.storage.rbt import RBTreeRepository, RecordStore
from domus.wire.attributes import MEDIA, PLANNED_PLATFORMS, PLATFORM_MEDIA, PLATFORM_NEEDS


@dataclass(frozen=True)
class Platform:
    media: frozenset[str]
    ordered: bool
    open_store: Callable[..., Store]


def _ram_store(factory: Callable[[], Repository], _medium: str, _home: str | None,
               _label: str = "", _durability: str = "none",
               base_count: int | None = None) -> Store:
    return RamStore(factory)


def _record_store(_medium: str, _home: str | None, label: str = "DHT",
                  _durability: str = "none", base_count: int | None = None) -> Store:
    return RecordStore(label, base_count)


def _berkeley_store(method: str, medium: str, home: str | None, label: str = "DHT",
                    durability: str = "async", base_count: int | None = None) -> Store:
    try:
        from domus.storage.bsddb import BerkeleyStore  # imports Berkeley DB only when used
    except ImportError as exc:
        return UnavailableStore(f"{label}: this service cannot store platform "
                                f"'domus-bsddb-{method}' ({exc}); it needs "
                                f"{PLATFORM_NEEDS['domus-bsddb-' + method]}")
    return BerkeleyStore(method, medium, home, label, durability, base_count)


# platform -> (keeps key order, how to open a store); its media are the wire's.
_IMPLEMENTATIONS: dict[str, tuple[bool, Callable[..., Store]]] = {
    "python-dict": (False, partial(_ram_store, DictRepository)),
    "domus-rbt": (True, _record_store),
    "domus-bsddb-btree": (True, partial(_berkeley_store, "btree")),
    "domus-bsddb-hash": (False, partial(_berkeley_store, "hash")),
}
PLATFORMS: dict[str, Platform] = {
    name: Platform(PLATFORM_MEDIA[name], *_IMPLEMENTATIONS[name]) for name in PLATFORM_MEDIA
}

@cache
def available_platforms() -> tuple[str, ...]:
    """The platforms this process can open stores of: every one whose
    library imports (Berkeley DB's is an optional extra)."""
    names = []
    for name in PLATFORMS:
        if name.startswith("domus-bsddb-"):
            try:
                import berkeleydb.db  # noqa: F401
            except ImportError:
                continue
        names.append(name)
    return tuple(names)


__all__ = ["PLATFORMS", "available_platforms", "MEDIA", "PLANNED_PLATFORMS", "Platform",
           "Repository", "Store", "RamStore", "FailedRepository", "StorageFault",
           "StorageFullFault", "DictRepository", "RBTreeRepository", "RecordStore"]
