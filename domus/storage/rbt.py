"""Platform ``domus-rbt``: the C red-black tree (domus.rbtree) per bucket,
in RAM, ordered.

Records are kept in the order of their encoded key bytes, so a bucket's
records iterate in key order and a key range is a tree walk (``irange``),
not a scan.  For str and bytes keys that order is the keys' own order
(UTF-8 preserves code point order); see docs/protocol.md, "Key encoding",
for ints.
"""

from __future__ import annotations

from collections.abc import Iterator

from domus.rbtree import RBTree
from domus.storage.base import Repository


class RBTreeRepository(RBTree, Repository):  # type: ignore[misc]
    """An RBTree that is a Repository.  ``get`` and ``contains`` are the
    tree's own C methods; the service's C hot path reaches the tree through
    its C API without calling these at all."""

    get = RBTree.get
    contains = RBTree.__contains__

    def put(self, key: bytes, value: bytes) -> bool:
        created = key not in self
        self[key] = value
        return created

    def delete(self, key: bytes) -> bool:
        return self.pop(key, None) is not None

    def key_snapshot(self) -> list[bytes]:
        return list(self)

    def key_range(self, low: bytes | None, high: bytes | None) -> Iterator[bytes]:
        """Keys in ``[low, high]`` (None: unbounded), in order."""
        return self.irange(low, high)
