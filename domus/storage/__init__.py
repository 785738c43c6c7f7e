"""Storage technologies: a medium (``ram`` or ``disk``) and a platform."""

from __future__ import annotations

from collections.abc import Callable

from domus.storage.base import Repository
from domus.storage.pydict import DictRepository
from domus.storage.rbt import RBTreeRepository

# platform -> (media it supports, factory of one bucket's repository)
PLATFORMS: dict[str, tuple[frozenset[str], Callable[[], Repository]]] = {
    "python-dict": (frozenset({"ram"}), DictRepository),
    "domus-rbt": (frozenset({"ram"}), RBTreeRepository),
}
MEDIA = frozenset({"ram", "disk"})
# Platforms the design names that later work adds; asking for one gets a
# message that says so rather than "unknown platform".
PLANNED_PLATFORMS = frozenset({"domus-bsddb-btree", "domus-bsddb-hash"})

__all__ = ["PLATFORMS", "MEDIA", "PLANNED_PLATFORMS", "Repository", "DictRepository",
           "RBTreeRepository"]
