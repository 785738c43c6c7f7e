"""Platform ``domus-rbt``: a record tree per bucket, in RAM, ordered.

Each bucket's records are kept as bytes by a record tree
(``domus._recordtree.RecordTree``, C; see cext/recordtree.c and
docs/rbtree.md): a red-black tree whose nodes hold the encoded key and
value themselves, carved from one arena per bucket, so a record costs its
bytes plus 12 to 15 bytes, rounded up to 8 (32 bytes for an int key and an
8-byte value), not a Python object per key and per value.  Records are kept
in the order of their encoded key bytes, so a bucket's records iterate in
key order and a key range is a tree walk (``irange``), not a scan.  For str
and bytes keys that order is the keys' own order (UTF-8 preserves code
point order); see docs/protocol.md, "Keys and values", for ints.

Deletes make room for later records at once; a bucket whose free space
passes a quarter of its arena is compacted, and a bucket removed from the
store (moved away, dropped) frees its arena.  The store reports the bytes
its arenas hold (``storage_bytes``), which the service puts in its stats.

Without the C extension (or with ``DOMUS_PURE_PYTHON=1``) the repositories
are the pure-Python twin, ``domus.storage.recordtree.RecordTree``: same
behaviour, slower, and the store then reports no bytes held.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from domus.storage.base import RamStore, Repository, StorageFault
from domus.storage.recordtree import RecordMapping
from domus.storage.recordtree import RecordTree as PythonRecordTree

RecordTree: Any = PythonRecordTree
C_EXTENSION = False
if os.environ.get("DOMUS_PURE_PYTHON") != "1":
    try:
        from domus._recordtree import RecordTree
    except ImportError:  # not built: the twin serves
        RecordTree = PythonRecordTree
    else:
        C_EXTENSION = True


class RBTreeRepository(RecordTree, RecordMapping, Repository):  # type: ignore[misc]
    """A record tree that is a Repository, and a mutable mapping of bytes to
    bytes.  ``get``, ``contains`` and ``delete`` are the tree's own (C)
    methods; the service's C hot path reaches the tree through its C API
    (cext/recordtree_api.h) without calling any of these."""

    ordered = True

    def __init__(self, label: str = "bucket") -> None:
        super().__init__()
        self.label = label

    def put(self, key: bytes, value: bytes) -> bool:
        try:
            return RecordTree.put(self, key, value)  # type: ignore[no-any-return]
        except MemoryError as exc:
            raise StorageFault(f"{self.label}: no memory for a record of "
                               f"{len(key) + len(value)} bytes ({exc})") from exc

    def key_snapshot(self) -> list[bytes]:
        return list(self)

    def records(self) -> Iterator[tuple[bytes, bytes]]:
        return self.irange(items=True)  # type: ignore[no-any-return]

    def key_range(self, low: bytes | None, high: bytes | None, *,
                  inclusive: tuple[bool, bool] = (True, True), reverse: bool = False,
                  items: bool = False) -> Iterator[bytes] | Iterator[tuple[bytes, bytes]]:
        """The tree's ``irange``: O(log n) to start, O(1) amortized a step.
        Like every tree iterator it raises RuntimeError if a key is added or
        removed meanwhile, so a caller walks it within one request."""
        return self.irange(low, high, inclusive=inclusive,  # type: ignore[no-any-return]
                           reverse=reverse, items=items)

    def storage_bytes(self) -> int:
        """The bytes the bucket's arena holds (see RecordTree.bytes_held)."""
        return self.bytes_held  # type: ignore[no-any-return]

    def close(self) -> None:
        """Free the bucket's arena (its records go)."""
        self.clear()


class RecordStore(RamStore):
    """The record trees of one domus-rbt DHT on one service, one per bucket."""

    def __init__(self, label: str = "DHT", base_count: int | None = None) -> None:
        super().__init__(RBTreeRepository)
        self.label = label
        self.base_count = base_count

    def _new_repository(self, bucket: int, count: int | None) -> Repository:
        label = f"{self.label} bucket {bucket}"
        if count is not None and count != self.base_count:
            label += f" (of {count})"
        return RBTreeRepository(label)

    def storage_bytes(self) -> int | None:
        """The bytes the buckets' arenas hold, from the trees' allocator
        counts (moving buckets included); None on the pure-Python twin."""
        if not C_EXTENSION:
            return None
        return sum(repo.storage_bytes() for repo in self._repos.values())  # type: ignore[attr-defined]
