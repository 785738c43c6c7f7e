"""The pure-Python reference of ``domus._rbtree.RBTree``.

It is the model the C type is tested against and its readable documentation:
the same methods, errors and messages, and the same tree shapes (both follow
CLRS, "Introduction to Algorithms", chapter 13; this one with parent links
and a nil sentinel as in the book, the C one with a path stack).
``domus.rbtree`` falls back to it when the extension is not built.

Rules both implementations keep:

- Keys are of one *kind*, fixed by the first key and forgotten when the tree
  is empty: ``"int"`` (int and subclasses, ordered by value), ``"bytes"``
  (exact bytes) or ``"object"`` (instances of the first key's type, ordered
  by ``<``).  A key of another kind raises TypeError, in lookups too.
- Object keys are compared with ``<`` only, one comparison per level of a
  descent, plus one to tell an equal key from a greater one.  A comparison
  that raises leaves the tree unchanged; one that changes the tree raises
  RuntimeError.
- The version counts insertions, removals and clears; iterators raise
  RuntimeError once it moved.  Replacing a value does not move it.
"""

from __future__ import annotations

import threading
from collections.abc import (
    Callable,
    ItemsView,
    Iterable,
    Iterator,
    KeysView,
    Mapping,
    MutableMapping,
    ValuesView,
)
from types import GenericAlias
from typing import Any

__all__ = ["RBTree", "RBTreeIterator", "RBTreeKeys", "RBTreeValues", "RBTreeItems"]

_MISSING: Any = object()
ITER_CHANGED = "RBTree changed size during iteration"
COMPARE_CHANGED = "RBTree changed during a key comparison"
MODE_KEYS, MODE_VALUES, MODE_ITEMS = range(3)
CEIL, HIGHER, FLOOR, LOWER = range(4)


def _key_kind(key: object) -> str:
    if isinstance(key, int):
        return "int"
    if type(key) is bytes:
        return "bytes"
    return "object"


def _describe_kind(kind: str, key_type: type) -> str:
    if kind == "object":
        return f"'object' ({key_type.__name__})"
    return f"'{kind}'"


class _Node:
    """A tree node; ``order`` is what the node is ordered by: the int value of
    an int key (subclasses' __lt__ ignored), else the key itself."""

    __slots__ = ("key", "order", "value", "left", "right", "parent", "red")

    def __init__(self, key: Any, order: Any, value: Any, nil: _Node | None) -> None:
        self.key = key
        self.order = order
        self.value = value
        self.left = self.right = self.parent = nil  # type: ignore[assignment]
        self.red = True


# Trees and views being repr'd, per thread: a tree that contains itself
# shows as RBTree(...).
_repr_running: set[tuple[int, int]] = set()


def _repr_guard(method: Callable[[Any], str]) -> Callable[[Any], str]:
    def guarded(self: Any) -> str:
        token = (id(self), threading.get_ident())
        if token in _repr_running:
            return f"{type(self).__name__}(...)"
        _repr_running.add(token)
        try:
            return method(self)
        finally:
            _repr_running.discard(token)

    guarded.__name__ = method.__name__
    guarded.__doc__ = method.__doc__
    return guarded


class RBTree:
    """An ordered mutable mapping kept in a red-black tree.

    ``RBTree()``, ``RBTree(mapping_or_pairs)``, ``RBTree(**kwargs)`` as dict.
    Keys are of one kind, fixed by the first key and forgotten when the tree
    is empty: 'int' (int and its subclasses, bool included, ordered by
    value), 'bytes' (exact bytes) or 'object' (instances of the first key's
    type, ordered by <).  A key of another kind raises TypeError, in lookups
    too (``key in tree``, get, floor...).  Lookups, insertions, removals,
    floor and ceiling are O(log n).  Iterators raise RuntimeError once a key
    was inserted or removed; replacing a value does not disturb them.
    """

    __slots__ = ("_nil", "_root", "_size", "_version", "_kind", "_key_type", "__weakref__")

    __hash__ = None  # type: ignore[assignment]
    __class_getitem__ = classmethod(GenericAlias)

    def __new__(cls, *args: Any, **kwargs: Any) -> RBTree:
        self = super().__new__(cls)
        nil = _Node(None, None, None, None)
        nil.left = nil.right = nil.parent = nil
        nil.red = False
        self._nil = nil
        self._root = nil
        self._size = 0
        self._version = 0
        self._kind: str | None = None
        self._key_type: type | None = None
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if len(args) > 1:
            raise TypeError(f"RBTree expected at most 1 argument, got {len(args)}")
        self._update(args[0] if args else _MISSING, kwargs)

    # ------------------------------------------------------------ kinds
    def _order(self, key: Any) -> Any:
        """What ``key`` is ordered by in this tree (which has a kind);
        TypeError if the key is of another kind."""
        kind = self._kind
        if kind == "int":
            if isinstance(key, int):
                return int.__index__(key)
        elif kind == "bytes":
            if type(key) is bytes:
                return key
        elif _key_kind(key) == "object" and self._key_type in type(key).__mro__:
            return key
        assert self._key_type is not None or kind != "object"
        raise TypeError(
            f"RBTree holds keys of kind {_describe_kind(kind, self._key_type)}; "  # type: ignore[arg-type]
            f"got a key of kind {_describe_kind(_key_kind(key), type(key))} "
            "(the first key fixes the kind until the tree is empty)")

    def _less(self, a: Any, b: Any) -> bool:
        """a < b between orders.  Object keys run Python code, which must
        not change the tree."""
        if self._kind != "object":
            return a < b
        version = self._version
        less = True if a < b else False
        if self._version != version:
            raise RuntimeError(COMPARE_CHANGED)
        return less

    # ------------------------------------------------------------ searching
    def _find(self, order: Any) -> _Node | None:
        """The node with a key equal to ``order``: descend with key < node,
        then ask node < key of the last node that was not greater."""
        nil = self._nil
        node, candidate = self._root, nil
        while node is not nil:
            if self._less(order, node.order):
                node = node.left
            else:
                candidate = node
                node = node.right
        if candidate is not nil and not self._less(candidate.order, order):
            return candidate
        return None

    def _lookup(self, key: Any) -> _Node | None:
        if not self._size:
            return None
        return self._find(self._order(key))

    def _bound(self, order: Any, which: int) -> _Node:
        """The node with the smallest key >= (CEIL), > (HIGHER), or the
        largest <= (FLOOR), < (LOWER) ``order``; nil if none."""
        nil = self._nil
        node, candidate = self._root, nil
        ascending = which in (CEIL, HIGHER)
        node_first = which in (CEIL, LOWER)
        while node is not nil:
            if node_first:
                less = self._less(node.order, order)
            else:
                less = self._less(order, node.order)
            take = less if which in (LOWER, HIGHER) else not less
            if take:
                candidate = node
            go_left = take if ascending else not take
            node = node.left if go_left else node.right
        return candidate

    def _extreme(self, node: _Node, right: bool) -> _Node:
        nil = self._nil
        if node is nil:
            return nil
        if right:
            while node.right is not nil:
                node = node.right
        else:
            while node.left is not nil:
                node = node.left
        return node

    def _step(self, node: _Node, forward: bool) -> _Node:
        """The in-order successor (forward) or predecessor of node, or nil."""
        nil = self._nil
        if forward:
            if node.right is not nil:
                return self._extreme(node.right, False)
            parent = node.parent
            while parent is not nil and node is parent.right:
                node, parent = parent, parent.parent
            return parent
        if node.left is not nil:
            return self._extreme(node.left, True)
        parent = node.parent
        while parent is not nil and node is parent.left:
            node, parent = parent, parent.parent
        return parent

    # ------------------------------------------------------------ rebalancing
    def _rotate_left(self, x: _Node) -> None:
        y = x.right
        x.right = y.left
        if y.left is not self._nil:
            y.left.parent = x
        y.parent = x.parent
        if x.parent is self._nil:
            self._root = y
        elif x is x.parent.left:
            x.parent.left = y
        else:
            x.parent.right = y
        y.left = x
        x.parent = y

    def _rotate_right(self, x: _Node) -> None:
        y = x.left
        x.left = y.right
        if y.right is not self._nil:
            y.right.parent = x
        y.parent = x.parent
        if x.parent is self._nil:
            self._root = y
        elif x is x.parent.right:
            x.parent.right = y
        else:
            x.parent.left = y
        y.right = x
        x.parent = y

    def _insert_fixup(self, z: _Node) -> None:
        while z.parent.red:
            parent, grand = z.parent, z.parent.parent
            if parent is grand.left:
                uncle = grand.right
                if uncle.red:
                    parent.red = uncle.red = False
                    grand.red = True
                    z = grand
                    continue
                if z is parent.right:
                    z = parent
                    self._rotate_left(z)
                    parent = z.parent
                parent.red = False
                grand.red = True
                self._rotate_right(grand)
            else:
                uncle = grand.left
                if uncle.red:
                    parent.red = uncle.red = False
                    grand.red = True
                    z = grand
                    continue
                if z is parent.left:
                    z = parent
                    self._rotate_right(z)
                    parent = z.parent
                parent.red = False
                grand.red = True
                self._rotate_left(grand)
        self._root.red = False

    def _transplant(self, u: _Node, v: _Node) -> None:
        """Put v where u is; v may be nil, whose parent is then set (the
        delete fixup reads it)."""
        if u.parent is self._nil:
            self._root = v
        elif u is u.parent.left:
            u.parent.left = v
        else:
            u.parent.right = v
        v.parent = u.parent

    def _delete_node(self, z: _Node) -> None:
        nil = self._nil
        y = z
        removed_red = y.red
        if z.left is nil:
            x = z.right
            self._transplant(z, z.right)
        elif z.right is nil:
            x = z.left
            self._transplant(z, z.left)
        else:
            y = self._extreme(z.right, False)
            removed_red = y.red
            x = y.right
            if y.parent is z:
                x.parent = y
            else:
                self._transplant(y, y.right)
                y.right = z.right
                y.right.parent = y
            self._transplant(z, y)
            y.left = z.left
            y.left.parent = y
            y.red = z.red
        if not removed_red:
            self._delete_fixup(x)

    def _delete_fixup(self, x: _Node) -> None:
        while x is not self._root and not x.red:
            parent = x.parent
            if x is parent.left:
                sibling = parent.right
                if sibling.red:
                    sibling.red = False
                    parent.red = True
                    self._rotate_left(parent)
                    sibling = parent.right
                if not sibling.left.red and not sibling.right.red:
                    sibling.red = True
                    x = parent
                    continue
                if not sibling.right.red:
                    sibling.left.red = False
                    sibling.red = True
                    self._rotate_right(sibling)
                    sibling = parent.right
                sibling.red = parent.red
                parent.red = False
                sibling.right.red = False
                self._rotate_left(parent)
            else:
                sibling = parent.left
                if sibling.red:
                    sibling.red = False
                    parent.red = True
                    self._rotate_right(parent)
                    sibling = parent.left
                if not sibling.left.red and not sibling.right.red:
                    sibling.red = True
                    x = parent
                    continue
                if not sibling.left.red:
                    sibling.right.red = False
                    sibling.red = True
                    self._rotate_left(sibling)
                    sibling = parent.left
                sibling.red = parent.red
                parent.red = False
                sibling.left.red = False
                self._rotate_right(parent)
            x = self._root
        x.red = False

    # ------------------------------------------------------------ operations
    def _insert(self, key: Any, value: Any, replace: bool) -> tuple[bool, _Node]:
        """Insert (key, value), or replace the value of an equal key if
        ``replace``.  (True, new node) or (False, existing node); on error
        the tree is unchanged."""
        adopted = self._kind is None
        if adopted:
            self._kind = _key_kind(key)
            self._key_type = type(key) if self._kind == "object" else None
        try:
            order = self._order(key)
            nil = self._nil
            node, parent, candidate = self._root, nil, nil
            went_right = False
            while node is not nil:
                parent = node
                went_right = not self._less(order, node.order)
                if went_right:
                    candidate = node
                    node = node.right
                else:
                    node = node.left
            if candidate is not nil and not self._less(candidate.order, order):
                if replace:
                    candidate.value = value
                return False, candidate
        except BaseException:
            if adopted:
                self._kind = self._key_type = None
            raise
        new = _Node(key, order, value, nil)
        new.parent = parent
        if parent is nil:
            self._root = new
        elif went_right:
            parent.right = new
        else:
            parent.left = new
        self._insert_fixup(new)
        self._size += 1
        self._version += 1
        return True, new

    def _remove(self, node: _Node) -> None:
        self._delete_node(node)
        self._size -= 1
        self._version += 1
        if not self._size:
            self._root = self._nil
            self._kind = self._key_type = None

    def _clone_from(self, other: RBTree) -> None:
        """Make this empty tree a copy of ``other``, with the same shape."""
        nil, other_nil = self._nil, other._nil

        def copy(node: _Node, parent: _Node) -> _Node:
            if node is other_nil:
                return nil
            twin = _Node(node.key, node.order, node.value, nil)
            twin.red = node.red
            twin.parent = parent
            twin.left = copy(node.left, twin)
            twin.right = copy(node.right, twin)
            return twin

        if not other._size:
            return
        self._root = copy(other._root, nil)
        self._size = other._size
        self._kind, self._key_type = other._kind, other._key_type
        self._version += 1

    def _update(self, other: Any, kwargs: dict[str, Any]) -> None:
        if other is not _MISSING:
            if isinstance(other, RBTree):
                if other is self:
                    pass
                elif not self._size:
                    self._clone_from(other)
                else:
                    for key, value in other.items():
                        self[key] = value
            elif type(other) is dict:
                for key, value in other.items():
                    self[key] = value
            elif hasattr(other, "keys"):
                for key in other.keys():
                    self[key] = other[key]
            else:
                self._update_from_pairs(other)
        for key, value in kwargs.items():
            self[key] = value

    def _update_from_pairs(self, pairs: Iterable[Any]) -> None:
        for index, item in enumerate(pairs):
            try:
                item_iterator = iter(item)
            except TypeError:
                raise TypeError(f"cannot convert RBTree update sequence element #{index} "
                                "to a sequence") from None
            pair = tuple(item_iterator)
            if len(pair) != 2:
                raise ValueError(f"RBTree update sequence element #{index} has length "
                                 f"{len(pair)}; 2 is required")
            self[pair[0]] = pair[1]

    # ------------------------------------------------------------ mapping
    def __len__(self) -> int:
        return self._size

    def __getitem__(self, key: Any) -> Any:
        node = self._lookup(key)
        if node is None:
            raise KeyError(key)
        return node.value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._insert(key, value, True)

    def __delitem__(self, key: Any) -> None:
        node = self._lookup(key)
        if node is None:
            raise KeyError(key)
        self._remove(node)

    def __contains__(self, key: Any) -> bool:
        return self._lookup(key) is not None

    def __iter__(self) -> Iterator[Any]:
        return RBTreeIterator(self, MODE_KEYS, False)

    def __reversed__(self) -> Iterator[Any]:
        """An iterator over the keys in descending order."""
        return RBTreeIterator(self, MODE_KEYS, True)

    def get(self, key: Any, default: Any = None, /) -> Any:
        """The value of key, or default.  A key of another kind than the
        tree's raises TypeError."""
        node = self._lookup(key)
        return default if node is None else node.value

    def pop(self, key: Any, default: Any = _MISSING, /) -> Any:
        """Remove key and return its value; if absent return default, or
        raise KeyError."""
        node = self._lookup(key)
        if node is None:
            if default is _MISSING:
                raise KeyError(key)
            return default
        self._remove(node)
        return node.value

    def popitem(self, last: Any = True) -> tuple[Any, Any]:
        """Remove and return the (key, value) item with the largest key (the
        smallest if last is false); KeyError if empty."""
        if not self._size:
            raise KeyError("popitem(): RBTree is empty")
        node = self._extreme(self._root, bool(last))
        self._remove(node)
        return node.key, node.value

    def setdefault(self, key: Any, default: Any = None, /) -> Any:
        """The value of key; if absent, insert key with default first."""
        return self._insert(key, default, False)[1].value

    def update(self, *args: Any, **kwargs: Any) -> None:
        """Store the items of a mapping (anything with keys()) or of an
        iterable of pairs, then the keyword arguments, like dict.update."""
        if len(args) > 1:
            raise TypeError(f"update expected at most 1 argument, got {len(args)}")
        self._update(args[0] if args else _MISSING, kwargs)

    def clear(self) -> None:
        """Remove every item; the tree forgets its key kind."""
        if self._size:
            self._version += 1
        self._root = self._nil
        self._size = 0
        self._kind = self._key_type = None

    def keys(self) -> RBTreeKeys:
        """A set-like view of the keys, in ascending order."""
        return RBTreeKeys(self)

    def values(self) -> RBTreeValues:
        """A view of the values, in key order."""
        return RBTreeValues(self)

    def items(self) -> RBTreeItems:
        """A set-like view of the (key, value) items, in key order."""
        return RBTreeItems(self)

    def copy(self) -> RBTree:
        """A shallow copy, in O(n)."""
        if type(self) is not RBTree:
            return type(self)(self)
        twin = RBTree()
        twin._clone_from(self)
        return twin

    __copy__ = copy

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle support: rebuilt empty, then filled, so a tree may contain
        itself."""
        state = getattr(self, "__dict__", None) or None
        return type(self), (), state, None, RBTreeIterator(self, MODE_ITEMS, False)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Mapping):
            return NotImplemented
        if len(other) != self._size:
            return False
        for key, value in self.items():
            try:
                other_value = other[key]
            except (KeyError, TypeError):
                return False
            if not (value is other_value or value == other_value):
                return False
        return True

    @_repr_guard
    def __repr__(self) -> str:
        name = type(self).__name__
        if not self._size:
            return f"{name}()"
        shown = ", ".join(f"{key!r}: {value!r}" for key, value in self.items())
        return f"{name}({{{shown}}})"

    # ------------------------------------------------------------ order
    def _bound_query(self, key: Any, default: Any, which: int) -> _Node | None:
        if not self._size:
            node = None
        else:
            found = self._bound(self._order(key), which)
            node = None if found is self._nil else found
        if node is None and default is _MISSING:
            raise KeyError(key)
        return node

    def floor(self, key: Any, default: Any = _MISSING, /) -> Any:
        """The (key, value) item with the largest key <= key; if none,
        default, or KeyError(key).  O(log n)."""
        node = self._bound_query(key, default, FLOOR)
        return default if node is None else (node.key, node.value)

    def ceiling(self, key: Any, default: Any = _MISSING, /) -> Any:
        """The (key, value) item with the smallest key >= key; if none,
        default, or KeyError(key).  O(log n)."""
        node = self._bound_query(key, default, CEIL)
        return default if node is None else (node.key, node.value)

    def floor_key(self, key: Any, default: Any = _MISSING, /) -> Any:
        """The largest key <= key; if none, default, or KeyError(key)."""
        node = self._bound_query(key, default, FLOOR)
        return default if node is None else node.key

    def ceiling_key(self, key: Any, default: Any = _MISSING, /) -> Any:
        """The smallest key >= key; if none, default, or KeyError(key)."""
        node = self._bound_query(key, default, CEIL)
        return default if node is None else node.key

    def min(self) -> tuple[Any, Any]:
        """The (key, value) item with the smallest key; KeyError if empty."""
        if not self._size:
            raise KeyError("min(): RBTree is empty")
        node = self._extreme(self._root, False)
        return node.key, node.value

    def max(self) -> tuple[Any, Any]:
        """The (key, value) item with the largest key; KeyError if empty."""
        if not self._size:
            raise KeyError("max(): RBTree is empty")
        node = self._extreme(self._root, True)
        return node.key, node.value

    def irange(self, lo: Any = None, hi: Any = None, *, inclusive: Any = (True, True),
               reverse: Any = False, items: Any = False) -> Iterator[Any]:
        """An iterator over the keys (or (key, value) items) in [lo, hi],
        None meaning unbounded; inclusive says whether each bound belongs to
        the range.  O(log n) to start, O(1) amortized per step."""
        reverse, items = bool(reverse), bool(items)
        if not (isinstance(inclusive, tuple) and len(inclusive) == 2):
            raise TypeError("irange(): inclusive must be a tuple of two bools")
        lo_inclusive, hi_inclusive = bool(inclusive[0]), bool(inclusive[1])
        mode = MODE_ITEMS if items else MODE_KEYS
        if not self._size:
            return RBTreeIterator(self, mode, reverse)
        lo_order = None if lo is None else self._order(lo)
        hi_order = None if hi is None else self._order(hi)
        # Start at one end of the range; the iterator checks the other.
        if reverse:
            start, start_order, start_inclusive = hi, hi_order, hi_inclusive
            stop, stop_order, stop_inclusive = lo, lo_order, lo_inclusive
        else:
            start, start_order, start_inclusive = lo, lo_order, lo_inclusive
            stop, stop_order, stop_inclusive = hi, hi_order, hi_inclusive
        if start is None:
            first = self._extreme(self._root, reverse)
        elif reverse:
            first = self._bound(start_order, FLOOR if start_inclusive else LOWER)
        else:
            first = self._bound(start_order, CEIL if start_inclusive else HIGHER)
        iterator = RBTreeIterator(self, mode, reverse, first)
        if stop is not None:
            iterator._set_stop(stop_order, stop_inclusive)
        return iterator

    # ------------------------------------------------------------ _check
    def _check(self) -> None:
        """Verify every red-black invariant; AssertionError if one fails."""
        nil = self._nil
        if nil.red or nil.left is not nil or nil.right is not nil:
            raise AssertionError("RBTree nil sentinel was changed")
        if not self._size:
            if self._root is not nil or self._kind is not None or self._key_type is not None:
                raise AssertionError("empty RBTree keeps a root or a kind")
            return
        if self._kind is None or (self._kind == "object") != (self._key_type is not None):
            raise AssertionError("RBTree has items but no consistent kind")
        root = self._root
        if root is nil or root.parent is not nil or root.red:
            raise AssertionError("RBTree root is missing, has a parent or is red")
        seen: set[int] = set()

        def check(node: _Node, depth: int) -> int:
            """Black height of the subtree at node."""
            if node is nil:
                return 1
            if id(node) in seen:
                raise AssertionError(f"RBTree reaches the node of {node.key!r} twice")
            seen.add(id(node))
            if depth > 2 * 64:
                raise AssertionError("RBTree is deeper than a red-black tree can be")
            for child in (node.left, node.right):
                if child is not nil and child.parent is not node:
                    raise AssertionError(f"RBTree node of {child.key!r} has a wrong parent link")
            if node.red and (node.left.red or node.right.red):
                raise AssertionError(f"RBTree red node of {node.key!r} has a red child")
            order = self._order(node.key)  # TypeError if of another kind
            if order is not node.key if self._kind == "object" else order != node.order:
                raise AssertionError(f"RBTree node of {node.key!r} caches a wrong order")
            left, right = check(node.left, depth + 1), check(node.right, depth + 1)
            if left != right:
                raise AssertionError(f"RBTree black heights differ below {node.key!r}")
            return left + (not node.red)

        check(root, 0)
        if len(seen) != self._size:
            raise AssertionError(f"RBTree size is {self._size} but it has {len(seen)} nodes")
        node = self._extreme(root, False)
        following = self._step(node, True)
        while following is not nil:
            if not self._less(node.order, following.order):
                raise AssertionError(
                    f"RBTree keys are not strictly ascending at {following.key!r}")
            node, following = following, self._step(following, True)


class RBTreeIterator:
    """An iterator over an RBTree in key order.  It raises RuntimeError once a
    key was inserted or removed."""

    __slots__ = ("_tree", "_version", "_mode", "_reverse", "_next", "_stop", "_inclusive")

    def __init__(self, tree: RBTree, mode: int, reverse: bool, first: _Node | None = None
                 ) -> None:
        self._tree: RBTree | None = tree
        self._version = tree._version
        self._mode = mode
        self._reverse = reverse
        if first is None:
            first = tree._extreme(tree._root, reverse)
        self._next = first
        self._stop: Any = _MISSING
        self._inclusive = False

    def _set_stop(self, order: Any, inclusive: bool) -> None:
        self._stop = order
        self._inclusive = inclusive

    def __iter__(self) -> RBTreeIterator:
        return self

    def _beyond(self, node: _Node) -> bool:
        tree, stop = self._tree, self._stop
        assert tree is not None
        if not self._reverse:
            if self._inclusive:
                return tree._less(stop, node.order)
            return not tree._less(node.order, stop)
        if self._inclusive:
            return tree._less(node.order, stop)
        return not tree._less(stop, node.order)

    def __next__(self) -> Any:
        tree = self._tree
        if tree is None:
            raise StopIteration
        if tree._version != self._version:
            raise RuntimeError(ITER_CHANGED)
        node = self._next
        if node is tree._nil or (self._stop is not _MISSING and self._beyond(node)):
            self._tree = None
            raise StopIteration
        self._next = tree._step(node, not self._reverse)
        if self._mode == MODE_KEYS:
            return node.key
        if self._mode == MODE_VALUES:
            return node.value
        return node.key, node.value


class _View:
    __slots__ = ("_tree",)
    _mode = MODE_KEYS

    def __init__(self, tree: RBTree) -> None:
        self._tree = tree

    def __len__(self) -> int:
        return self._tree._size

    def __iter__(self) -> Iterator[Any]:
        return RBTreeIterator(self._tree, self._mode, False)

    def __reversed__(self) -> Iterator[Any]:
        """An iterator in descending key order."""
        return RBTreeIterator(self._tree, self._mode, True)

    @_repr_guard
    def __repr__(self) -> str:
        return f"{type(self).__name__}({list(self)!r})"


def _set_like(other: object) -> bool:
    return isinstance(other, (set, frozenset, RBTreeKeys, RBTreeItems)) or type(other) in (
        type({}.keys()), type({}.items()))


class _SetView(_View):
    """The set operations of dict views: set(left) <op> right, for either
    operand order."""

    __slots__ = ()
    __hash__ = None  # type: ignore[assignment]

    def __and__(self, other: Any) -> set[Any]:
        result = set(self)
        result.intersection_update(other)
        return result

    def __rand__(self, other: Any) -> set[Any]:
        result = set(other)
        result.intersection_update(self)
        return result

    def __or__(self, other: Any) -> set[Any]:
        result = set(self)
        result.update(other)
        return result

    def __ror__(self, other: Any) -> set[Any]:
        result = set(other)
        result.update(self)
        return result

    def __xor__(self, other: Any) -> set[Any]:
        result = set(self)
        result.symmetric_difference_update(other)
        return result

    def __rxor__(self, other: Any) -> set[Any]:
        result = set(other)
        result.symmetric_difference_update(self)
        return result

    def __sub__(self, other: Any) -> set[Any]:
        result = set(self)
        result.difference_update(other)
        return result

    def __rsub__(self, other: Any) -> set[Any]:
        result = set(other)
        result.difference_update(self)
        return result

    def isdisjoint(self, other: Iterable[Any]) -> bool:
        """True if the view and the iterable have no element in common."""
        return set(self).isdisjoint(other)

    def _compare(self, other: Any, compare: Callable[[Any, Any], Any]) -> Any:
        if not _set_like(other):
            return NotImplemented
        theirs = other if isinstance(other, (set, frozenset)) else set(other)
        return compare(set(self), theirs)

    def __eq__(self, other: object) -> Any:
        return self._compare(other, lambda a, b: a == b)

    def __ne__(self, other: object) -> Any:
        return self._compare(other, lambda a, b: a != b)

    def __lt__(self, other: Any) -> Any:
        return self._compare(other, lambda a, b: a < b)

    def __le__(self, other: Any) -> Any:
        return self._compare(other, lambda a, b: a <= b)

    def __gt__(self, other: Any) -> Any:
        return self._compare(other, lambda a, b: a > b)

    def __ge__(self, other: Any) -> Any:
        return self._compare(other, lambda a, b: a >= b)


class RBTreeKeys(_SetView):
    """The keys of an RBTree, in key order; a set-like view."""

    __slots__ = ()

    def __contains__(self, key: Any) -> bool:
        return key in self._tree


class RBTreeValues(_View):
    """The values of an RBTree, in key order."""

    __slots__ = ()
    _mode = MODE_VALUES

    def __contains__(self, value: Any) -> bool:
        for held in self:
            if held is value or held == value:
                return True
        return False


class RBTreeItems(_SetView):
    """The (key, value) items of an RBTree, in key order; a set-like view."""

    __slots__ = ()
    _mode = MODE_ITEMS

    def __contains__(self, item: Any) -> bool:
        if not isinstance(item, tuple) or len(item) != 2:
            return False
        node = self._tree._lookup(item[0])
        if node is None:
            return False
        return node.value is item[1] or node.value == item[1]


MutableMapping.register(RBTree)
KeysView.register(RBTreeKeys)
ValuesView.register(RBTreeValues)
ItemsView.register(RBTreeItems)
