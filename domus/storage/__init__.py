"""Storage technologies: a medium (``ram`` or ``disk``) and a platform.

``PLATFORMS`` maps a platform's name to a ``Platform``: the media it can
store on, whether it keeps records in key order, and how to open the store
of one DHT on one service (``open_store(medium, home, label, durability)``;
``home`` is a directory of the DHT's own under the service's data dir, used
by disk media; ``label`` names the DHT in error messages; ``durability`` is
the disk DHT's, see domus.attributes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from domus.storage.base import FailedRepository, RamStore, Repository, StorageFault, Store
from domus.storage.pydict import DictRepository
from domus.storage.rbt import RBTreeRepository


@dataclass(frozen=True)
class Platform:
    media: frozenset[str]
    ordered: bool
    open_store: Callable[..., Store]


def _ram_store(factory: Callable[[], Repository], _medium: str, _home: str | None,
               _label: str = "", _durability: str = "none") -> Store:
    return RamStore(factory)


def _berkeley_store(method: str, medium: str, home: str | None, label: str = "DHT",
                    durability: str = "async") -> Store:
    from domus.storage.bsddb import BerkeleyStore  # imports Berkeley DB only when used

    return BerkeleyStore(method, medium, home, label, durability)


BOTH = frozenset({"ram", "disk"})
PLATFORMS: dict[str, Platform] = {
    "python-dict": Platform(frozenset({"ram"}), False, partial(_ram_store, DictRepository)),
    "domus-rbt": Platform(frozenset({"ram"}), True, partial(_ram_store, RBTreeRepository)),
    "domus-bsddb-btree": Platform(BOTH, True, partial(_berkeley_store, "btree")),
    "domus-bsddb-hash": Platform(BOTH, False, partial(_berkeley_store, "hash")),
}
MEDIA = BOTH
# Platforms the design names that later work adds; asking for one gets a
# message that says so rather than "unknown platform".
PLANNED_PLATFORMS: frozenset[str] = frozenset()

__all__ = ["PLATFORMS", "MEDIA", "PLANNED_PLATFORMS", "Platform", "Repository", "Store",
           "RamStore", "FailedRepository", "StorageFault", "DictRepository",
           "RBTreeRepository"]
