"""The record tree: one bucket's records as bytes, in key order.

``domus._recordtree.RecordTree`` (C, ``cext/recordtree.c``) keeps each
record -- tree links, key and value -- inside one arena of the tree's own;
``RecordTree`` here is its pure-Python twin: the same methods, the same
errors and messages, the same iteration rules, and the same allocator
*accounting* (``bytes_held``, ``_stats()``), computed by simulating the C
allocator's rules on record sizes (``_Arena``) while the records themselves
sit in a ``domus.rbtree.RBTree``.  tests/unit/test_recordtree.py holds the C
type to this one on random operation sequences; a service uses this one
only when the C extension is not built (or ``DOMUS_PURE_PYTHON=1``), and then
reports no bytes held (the simulated figure is not what Python holds).

``RecordMapping`` is the mapping behaviour both share (ordered views,
equality, ``update``, ``setdefault``, copying and pickling), written once
on top of the core methods each implements:

- ``len``, ``in``, ``[]``, ``[]=``, ``del``, ``iter`` and ``reversed`` (keys
  in bytewise order), ``get``, ``put(key, value) -> bool`` (True: the key was
  new), ``delete(key) -> bool``, ``contains``, ``pop``, ``popitem(last=True)``,
  ``clear``, ``irange(low, high, *, inclusive, reverse, items)``;
- keys and values are bytes: anything else is a TypeError, in lookups too;
  a stored key is at most 16,383 bytes (``KeyTooLarge``) and a value under
  4 GiB (``ValueTooLarge``), what the record format holds (the protocol
  allows less: 8,192 and 16 MiB);
- iterators raise RuntimeError at their next step once a key was inserted
  or removed (the tree's ``version`` moved); replacing values does not
  disturb them.

The allocator the accounting follows (see cext/recordtree.c): a record is
``HEADER_BYTES`` + key + 1 to 4 bytes of value length + value, rounded up
to ``UNIT`` bytes; records come from free blocks of exactly their size
(blocks under ``LISTED_UNITS`` units are listed when freed) or the top of
the arena, which doubles when full (whole pages once it is a mapping of
``MAP_THRESHOLD`` bytes or more); once free units pass a quarter of those
used (in an arena using ``COMPACT_MIN_BYTES`` or more) the live records
slide down over the free ones and the arena shrinks to just large enough;
an empty tree holds nothing.
"""

from __future__ import annotations

import copy as _copy
import mmap
from collections.abc import ItemsView, Iterator, KeysView, MutableMapping, ValuesView
from typing import Any

from domus.errors import KeyTooLarge, ValueTooLarge
from domus.rbtree import RBTree

__all__ = ["RecordTree", "RecordMapping", "UNIT", "HEADER_BYTES", "LISTED_UNITS",
           "MIN_CAPACITY", "MAP_THRESHOLD", "COMPACT_MIN_BYTES", "MAX_KEY_BYTES",
           "MAX_VALUE_BYTES", "MAX_ARENA_BYTES", "PAGE_SIZE", "record_bytes"]

UNIT = 8
HEADER_BYTES = 10               # two u32 links, a u16 of key length and width
LISTED_UNITS = 256
MIN_CAPACITY = 64
MAP_THRESHOLD = 64 * 1024
COMPACT_MIN_BYTES = 4096
MAX_KEY_BYTES = 0x3FFF          # 14 bits of key length (the protocol's limit is 8,192)
MAX_VALUE_BYTES = 0xFFFFFFFF    # 4 bytes of value length (the protocol's: 16 MiB)
MAX_UNITS = (1 << 31) - 1
MAX_ARENA_BYTES = MAX_UNITS * UNIT
PAGE_SIZE = mmap.PAGESIZE
ITER_CHANGED = "RecordTree changed size during iteration"
_MISSING: Any = object()


def _round_up(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _width(value_size: int) -> int:
    return 1 if value_size < 0x100 else 2 if value_size < 0x10000 else \
        3 if value_size < 0x1000000 else 4


def record_units(key_size: int, value_size: int) -> int:
    """Arena units a record of these sizes takes."""
    return -(-(HEADER_BYTES + key_size + _width(value_size) + value_size) // UNIT)


def record_bytes(key_size: int, value_size: int) -> int:
    """Arena bytes a record of these sizes takes."""
    return record_units(key_size, value_size) * UNIT


def _arena_size_for(needed: int) -> int:
    if needed < MIN_CAPACITY:
        return MIN_CAPACITY
    return _round_up(needed, PAGE_SIZE) if needed >= MAP_THRESHOLD else needed


class _Arena:
    """The C allocator's counts, kept by its rules: what the arena of a C
    tree that went through the same operations would hold."""

    def __init__(self) -> None:
        self.capacity = 0
        self.mapped = False
        self.top = 0                    # units handed out, the nil included
        self.free_units = 0
        self.listed: dict[int, int] = {}    # size in units -> free blocks
        self.free_classes = 0
        self.compactions = 0

    def release(self) -> None:
        self.capacity = self.top = self.free_units = self.free_classes = 0
        self.mapped = False
        self.listed = {}

    def _reserve(self, units: int) -> None:
        if units > MAX_UNITS:
            raise MemoryError("a RecordTree holds at most 16 GiB of records (one bucket); "
                              "use more buckets")
        needed = units * UNIT
        if needed <= self.capacity:
            return
        doubled = min(self.capacity * 2, MAX_ARENA_BYTES)
        self.capacity = _arena_size_for(max(doubled, needed))
        self.mapped = self.capacity >= MAP_THRESHOLD

    def alloc(self, units: int) -> None:
        if units < self.free_classes and self.listed.get(units):
            self.listed[units] -= 1
            self.free_units -= units
            return
        first = 1 if self.top == 0 else self.top
        self._reserve(first + units)
        self.top = first + units

    def free(self, units: int) -> None:
        self.free_units += units
        if units < LISTED_UNITS:
            self.free_classes = max(self.free_classes, units + 1)
            self.listed[units] = self.listed.get(units, 0) + 1

    def after_free(self, records: int) -> None:
        if records == 0:
            self.release()
        elif self.top * UNIT >= COMPACT_MIN_BYTES and self.free_units * 4 > self.top:
            self.top -= self.free_units
            smaller = _arena_size_for(self.top * UNIT)
            if smaller < self.capacity:
                self.capacity = smaller
                self.mapped = smaller >= MAP_THRESHOLD
            self.free_units = self.free_classes = 0
            self.listed = {}
            self.compactions += 1

    @property
    def bytes_held(self) -> int:
        arena = _round_up(self.top * UNIT, PAGE_SIZE) if self.mapped else self.capacity
        return arena + 4 * self.free_classes


def _check_key(key: Any) -> bytes:
    if not isinstance(key, bytes):
        raise TypeError(f"RecordTree keys must be bytes, not {type(key).__name__}")
    return key if type(key) is bytes else bytes(key)


def _check_record(key: Any, value: Any) -> tuple[bytes, bytes]:
    key = _check_key(key)
    if not isinstance(value, bytes):
        raise TypeError(f"RecordTree values must be bytes, not {type(value).__name__}")
    if len(key) > MAX_KEY_BYTES:
        raise KeyTooLarge(f"key of {len(key)} bytes is over the RecordTree's "
                          f"{MAX_KEY_BYTES}-byte limit")
    if len(value) > MAX_VALUE_BYTES:
        raise ValueTooLarge(f"value of {len(value)} bytes is over the RecordTree's "
                            f"{MAX_VALUE_BYTES}-byte limit")
    return key, value if type(value) is bytes else bytes(value)


def _bound(bound: Any) -> bytes | None:
    if bound is None:
        return None
    if not isinstance(bound, bytes):
        raise TypeError(f"RecordTree bounds must be bytes or None, not {type(bound).__name__}")
    return bound if type(bound) is bytes else bytes(bound)


class RecordKeys(KeysView):  # type: ignore[type-arg]
    """A RecordTree's keys, in order (reversible)."""

    __slots__ = ()

    def __reversed__(self) -> Iterator[bytes]:
        return reversed(self._mapping)  # type: ignore[call-overload]


class RecordValues(ValuesView):  # type: ignore[type-arg]
    """A RecordTree's values, in key order (reversible)."""

    __slots__ = ()

    def __iter__(self) -> Iterator[bytes]:
        return self._mapping._values()  # type: ignore[attr-defined,no-any-return]

    def __reversed__(self) -> Iterator[bytes]:
        return self._mapping._values(reverse=True)  # type: ignore[attr-defined,no-any-return]


class RecordItems(ItemsView):  # type: ignore[type-arg]
    """A RecordTree's (key, value) pairs, in key order (reversible)."""

    __slots__ = ()

    def __iter__(self) -> Iterator[tuple[bytes, bytes]]:
        return self._mapping.irange(items=True)  # type: ignore[attr-defined,no-any-return]

    def __reversed__(self) -> Iterator[tuple[bytes, bytes]]:
        return self._mapping.irange(reverse=True,  # type: ignore[attr-defined,no-any-return]
                                    items=True)


class RecordMapping(MutableMapping):  # type: ignore[type-arg]
    """The mapping behaviour of a record tree, on top of its core methods
    (C or Python): ordered, reversible views, equality with any mapping,
    ``update``, ``setdefault``, ``copy`` (also ``copy.copy`` and pickling)."""

    __slots__ = ()

    def keys(self) -> RecordKeys:
        return RecordKeys(self)

    def values(self) -> RecordValues:
        return RecordValues(self)

    def items(self) -> RecordItems:
        return RecordItems(self)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        state = getattr(self, "__dict__", None) or None
        return (type(self), (), state, None, iter(self.items()))

    def copy(self) -> Any:
        """A new tree of the same type with the same records."""
        return _copy.copy(self)


class RecordTree(RecordMapping):
    """The pure-Python twin of ``domus._recordtree.RecordTree`` (see the
    module's doc): its records in an RBTree of bytes, its allocator's counts
    simulated."""

    __slots__ = ("_records", "_arena", "_version")

    def __init__(self) -> None:
        self._records: Any = RBTree()
        self._arena = _Arena()
        self._version = 0

    # -------------------------------------------------------- core
    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, key: Any) -> bool:
        return _check_key(key) in self._records

    def contains(self, key: Any) -> bool:
        return _check_key(key) in self._records

    def __getitem__(self, key: Any) -> bytes:
        return self._records[_check_key(key)]  # type: ignore[no-any-return]

    def get(self, key: Any, default: Any = None) -> Any:
        return self._records.get(_check_key(key), default)

    def __setitem__(self, key: Any, value: Any) -> None:
        self.put(key, value)

    def put(self, key: Any, value: Any) -> bool:
        key, value = _check_record(key, value)
        units = record_units(len(key), len(value))
        old = self._records.get(key)
        arena = self._arena
        if old is None:
            arena.alloc(units)
            self._records[key] = value
            self._version += 1
            return True
        old_units = record_units(len(key), len(old))
        if old_units != units:
            arena.alloc(units)
            arena.free(old_units)
            arena.after_free(len(self._records))
        self._records[key] = value
        return False

    def _remove(self, key: bytes, value: bytes) -> None:
        del self._records[key]
        self._version += 1
        self._arena.free(record_units(len(key), len(value)))
        self._arena.after_free(len(self._records))

    def __delitem__(self, key: Any) -> None:
        key = _check_key(key)
        value = self._records.get(key)
        if value is None:
            raise KeyError(key)
        self._remove(key, value)

    def delete(self, key: Any) -> bool:
        key = _check_key(key)
        value = self._records.get(key)
        if value is None:
            return False
        self._remove(key, value)
        return True

    def pop(self, key: Any, default: Any = _MISSING) -> Any:
        key = _check_key(key)
        value = self._records.get(key)
        if value is None:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._remove(key, value)
        return value

    def popitem(self, last: bool = True) -> tuple[bytes, bytes]:
        if not self._records:
            raise KeyError("popitem(): RecordTree is empty")
        key, value = self._records.max() if last else self._records.min()
        self._remove(key, value)
        return key, value

    def clear(self) -> None:
        if self._records:
            self._version += 1
        self._records = RBTree()
        self._arena.release()

    def __iter__(self) -> Iterator[bytes]:
        return self._walk(None, None, (True, True), False, "keys")

    def __reversed__(self) -> Iterator[bytes]:
        return self._walk(None, None, (True, True), True, "keys")

    def irange(self, low: Any = None, high: Any = None, *, inclusive: Any = (True, True),
               reverse: Any = False, items: Any = False) -> Iterator[Any]:
        """Keys (or (key, value) pairs) from ``low`` to ``high`` (None:
        unbounded) in bytewise order, descending if ``reverse``."""
        low, high = _bound(low), _bound(high)
        if not (isinstance(inclusive, tuple) and len(inclusive) == 2):
            raise TypeError("inclusive must be a pair of booleans, such as (True, False)")
        return self._walk(low, high, (bool(inclusive[0]), bool(inclusive[1])),
                          bool(reverse), "items" if items else "keys")

    def _values(self, *, reverse: Any = False) -> Iterator[bytes]:
        return self._walk(None, None, (True, True), bool(reverse), "values")

    def _walk(self, low: bytes | None, high: bytes | None, inclusive: tuple[bool, bool],
              reverse: bool, mode: str) -> Iterator[Any]:
        """An iterator that raises RuntimeError at its next step once the
        version moved from what it is now."""
        version = self._version

        def steps() -> Iterator[Any]:
            # The RBTree's iterator raises only for insertions and removals,
            # which move this tree's version first: it is checked before.
            walk = None
            while True:
                if self._version != version:
                    raise RuntimeError(ITER_CHANGED)
                if walk is None:
                    walk = self._records.irange(low, high, inclusive=inclusive,
                                                reverse=reverse, items=True)
                try:
                    key, value = next(walk)
                except StopIteration:
                    return
                yield key if mode == "keys" else value if mode == "values" else (key, value)

        return steps()

    # -------------------------------------------------------- accounting
    @property
    def bytes_held(self) -> int:
        """What the C tree's allocator would hold for these records."""
        return self._arena.bytes_held

    def _stats(self) -> dict[str, Any]:
        arena = self._arena
        return {"records": len(self._records), "capacity": arena.capacity,
                "mapped": arena.mapped, "used_bytes": arena.top * UNIT,
                "free_bytes": arena.free_units * UNIT, "free_classes": arena.free_classes,
                "compactions": arena.compactions, "bytes_held": arena.bytes_held}

    def _check(self) -> None:
        """Verify the records' order and the accounting; AssertionError if
        one fails."""
        self._records._check()
        arena = self._arena
        live = sum(record_units(len(key), len(value))
                   for key, value in self._records.irange(items=True))
        if not self._records:
            if arena.top or arena.capacity or arena.free_units:
                raise AssertionError("RecordTree: no records, but an arena counted")
            return
        if live + arena.free_units + 1 != arena.top or arena.top * UNIT > arena.capacity:
            raise AssertionError("RecordTree: the arena's units do not add up")
