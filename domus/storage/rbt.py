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
from domus.storage.base import MappingRepository


class RBTreeRepository(RBTree, MappingRepository):  # type: ignore[misc]
    """An RBTree that is a Repository.  ``get`` and ``contains`` are the
    tree's own C methods; the service's C hot path reaches the tree through
    its C API without calling these at all."""

    ordered = True
    get = RBTree.get
    contains = RBTree.__contains__


    def key_range(self, low: bytes | None, high: bytes | None, *,
                  inclusive: tuple[bool, bool] = (True, True), reverse: bool = False,
                  items: bool = False) -> Iterator[bytes] | Iterator[tuple[bytes, bytes]]:
        """The tree's ``irange``: O(log n) to start, O(1) amortized a step.
        Like every tree iterator it raises RuntimeError if a key is added or
        removed meanwhile, so a caller walks it within one request."""
        return self.irange(low, high, inclusive=inclusive, reverse=reverse, items=items)
