"""RBTree: the C type (domus._rbtree) and the pure-Python reference
(domus.rbtree.reference) side by side.

Model-based tests drive both trees and a dict model with the same random
operations and compare every result and every exception (the two trees must
raise the same type with the same message), then check every red-black
invariant of both.  Targeted tests cover what random operations reach
poorly: iterators outliving changes, GC cycles, comparisons that raise or
change the tree, allocation failures, leaks, the C API capsule.
"""

from __future__ import annotations

import bisect
import copy
import ctypes
import gc
import os
import pickle
import sys
import weakref
from collections.abc import ItemsView, KeysView, MutableMapping, ValuesView
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)
from scale import examples

from domus.rbtree import reference as rbtree_ref

try:
    from domus import _rbtree
except ImportError:  # the extension is not built
    _rbtree = None

try:
    import _testcapi
except ImportError:
    _testcapi = None

RefTree = rbtree_ref.RBTree
CTree = _rbtree.RBTree if _rbtree is not None else None
needs_c = pytest.mark.skipif(
    _rbtree is None, reason="domus._rbtree is not built: run `python setup.py build_ext --inplace`")

IMPLEMENTATIONS = [
    pytest.param(RefTree, id="ref"),
    pytest.param(CTree, id="c", marks=needs_c),
]
TREES = [RefTree] + ([CTree] if CTree is not None else [])


# ------------------------------------------------------------------ model
def _kind(key: Any) -> tuple[str, type | None]:
    if isinstance(key, int):
        return ("int", None)
    if type(key) is bytes:
        return ("bytes", None)
    return ("object", type(key))


class ModelTree:
    """The RBTree contract on a dict, by brute force: sorted() for order."""

    def __init__(self) -> None:
        self.data: dict[Any, Any] = {}
        self.kind: tuple[str, type | None] | None = None
        self.version = 0

    def _admit(self, key: Any) -> None:
        """TypeError if a non-empty model holds keys of another kind."""
        if not self.data:
            return
        kind, key_type = _kind(key)
        if kind != self.kind[0] or (kind == "object" and self.kind[1] not in type(key).__mro__):
            raise TypeError("wrong kind")

    def _removed(self, key: Any) -> None:
        del self.data[key]
        self.version += 1
        if not self.data:
            self.kind = None

    def __len__(self) -> int:
        return len(self.data)

    def __setitem__(self, key: Any, value: Any) -> None:
        self._admit(key)
        if not self.data:
            self.kind = _kind(key)
        if key not in self.data:
            self.version += 1
        self.data[key] = value

    def __getitem__(self, key: Any) -> Any:
        self._admit(key)
        return self.data[key]

    def __delitem__(self, key: Any) -> None:
        self._admit(key)
        if key not in self.data:
            raise KeyError(key)
        self._removed(key)

    def __contains__(self, key: Any) -> bool:
        self._admit(key)
        return key in self.data

    def get(self, key: Any, default: Any = None) -> Any:
        self._admit(key)
        return self.data.get(key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._admit(key)
        if key not in self.data:
            if default:
                return default[0]
            raise KeyError(key)
        value = self.data[key]
        self._removed(key)
        return value

    def popitem(self, last: bool = True) -> tuple[Any, Any]:
        if not self.data:
            raise KeyError("empty")
        key = max(self.data) if last else min(self.data)
        item = (key, self.data[key])
        self._removed(key)
        return item

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._admit(key)
        if key not in self.data:
            self[key] = default
        return self.data[key]

    def update(self, other: dict[Any, Any]) -> None:
        for key, value in other.items():
            self[key] = value

    def clear(self) -> None:
        if self.data:
            self.version += 1
        self.data.clear()
        self.kind = None

    def sorted_keys(self) -> list[Any]:
        return sorted(self.data)

    def items(self) -> list[tuple[Any, Any]]:
        return [(key, self.data[key]) for key in self.sorted_keys()]

    def _bound(self, key: Any, floor: bool) -> Any:
        self._admit(key)
        keys = self.sorted_keys()
        if floor:
            index = bisect.bisect_right(keys, key)
            return keys[index - 1] if index else None
        index = bisect.bisect_left(keys, key)
        return keys[index] if index < len(keys) else None

    def bound(self, name: str, key: Any, *default: Any) -> Any:
        found = self._bound(key, name.startswith("floor"))
        if found is None:
            if default:
                return default[0]
            raise KeyError(key)
        return found if name.endswith("_key") else (found, self.data[found])

    def min(self) -> tuple[Any, Any]:
        if not self.data:
            raise KeyError("empty")
        return self.items()[0]

    def max(self) -> tuple[Any, Any]:
        if not self.data:
            raise KeyError("empty")
        return self.items()[-1]

    def irange(self, lo: Any, hi: Any, inclusive: tuple[bool, bool], reverse: bool,
               items: bool) -> list[Any]:
        if not self.data:
            return []
        if lo is not None:
            self._admit(lo)
        if hi is not None:
            self._admit(hi)
        chosen = [key for key in self.sorted_keys()
                  if (lo is None or lo < key or (inclusive[0] and lo == key))
                  and (hi is None or key < hi or (inclusive[1] and key == hi))]
        if reverse:
            chosen.reverse()
        return [(key, self.data[key]) for key in chosen] if items else chosen


def outcome(call: Any) -> tuple[Any, ...]:
    """("value", result) or ("error", exception type, message)."""
    try:
        result = call()
    except Exception as error:  # noqa: BLE001 - every exception is a result here
        return ("error", type(error), str(error))
    return ("value", result)


class ModelIterator:
    """What an RBTree iterator must yield: the keys in order as of its start
    (adding or removing a key breaks it), each value as it is when reached
    (overwriting a value is not a change of the tree's shape, as with dict)."""

    def __init__(self, model: ModelTree, keys: list[Any], mode: str = "keys") -> None:
        self.model = model
        self.version = model.version
        self.expected = keys
        self.mode = mode
        self.position = 0
        self.exhausted = False

    def next_outcome(self) -> tuple[Any, ...]:
        if self.exhausted:
            return ("error", StopIteration)
        if self.model.version != self.version:
            return ("error", RuntimeError)
        if self.position == len(self.expected):
            self.exhausted = True
            return ("error", StopIteration)
        key = self.expected[self.position]
        self.position += 1
        if self.mode == "items":
            return ("value", (key, self.model.data[key]))
        if self.mode == "values":
            return ("value", self.model.data[key])
        return ("value", key)


# ------------------------------------------------------------------ machine
TREES_ONLY: Any = object()
WRONG_KEYS = st.sampled_from([1.5, -2.5, "s", "zz", b"x", b"", 7, -3, (1,), 2**70])
VALUES = st.integers(0, 5)


class Name(str):
    """A str subclass: allowed in a str tree, and a tree of its own kind."""


class TreeMachine(RuleBasedStateMachine):
    """The C tree, the reference tree and the model under the same steps."""

    keys: st.SearchStrategy[Any] = st.nothing()
    iterators = Bundle("iterators")

    def __init__(self) -> None:
        super().__init__()
        self.trees = [tree_type() for tree_type in TREES]
        self.model = ModelTree()

    def any_key(self) -> st.SearchStrategy[Any]:
        return st.one_of(self.keys, self.keys, self.keys, WRONG_KEYS)

    def compare(self, operation: Any, model_operation: Any = None) -> tuple[Any, ...]:
        """Run operation on every tree and model_operation (default: the same;
        TREES_ONLY: none) on the model; results must agree, exceptions by type
        (and between the trees by message too)."""
        results = [outcome(lambda tree=tree: operation(tree)) for tree in self.trees]
        for result in results[1:]:
            assert result == results[0], (results[0], result)
        if model_operation is TREES_ONLY:
            return results[0]
        expected = outcome(lambda: (model_operation or operation)(self.model))
        assert results[0][:2] == expected[:2], (results[0], expected)
        return results[0]

    @invariant()
    def consistent(self) -> None:
        expected = self.model.items()
        for tree in self.trees:
            tree._check()
            assert len(tree) == len(expected)
            assert list(tree.items()) == expected

    @initialize(data=st.data())
    def fill(self, data: st.DataObject) -> None:
        for key in data.draw(st.lists(self.keys, max_size=12)):
            self.compare(lambda tree, key=key: tree.__setitem__(key, 0))

    @rule(data=st.data(), value=VALUES)
    def setitem(self, data: st.DataObject, value: int) -> None:
        key = data.draw(self.any_key())
        self.compare(lambda tree: tree.__setitem__(key, value))

    @rule(data=st.data())
    def delitem(self, data: st.DataObject) -> None:
        key = data.draw(self.any_key())
        self.compare(lambda tree: tree.__delitem__(key))

    @rule(data=st.data(), with_default=st.booleans())
    def pop(self, data: st.DataObject, with_default: bool) -> None:
        key = data.draw(self.any_key())
        default = ("default",) if with_default else ()
        self.compare(lambda tree: tree.pop(key, *default))

    @rule(last=st.booleans())
    def popitem(self, last: bool) -> None:
        self.compare(lambda tree: tree.popitem(last=last))

    @rule(data=st.data(), value=VALUES)
    def setdefault(self, data: st.DataObject, value: int) -> None:
        key = data.draw(self.any_key())
        self.compare(lambda tree: tree.setdefault(key, value))

    @rule(data=st.data())
    def lookups(self, data: st.DataObject) -> None:
        key = data.draw(self.any_key())
        self.compare(lambda tree: tree[key])
        self.compare(lambda tree: tree.get(key, "default"))
        self.compare(lambda tree: key in tree)
        self.compare(lambda tree: key in tree.keys(),
                     lambda model: key in model)
        self.compare(lambda tree: (key, 0) in tree.items(),
                     lambda model: model.get(key, None) == 0 if key in model else False)

    @rule(data=st.data(), name=st.sampled_from(["floor", "ceiling", "floor_key", "ceiling_key"]),
          with_default=st.booleans())
    def bound(self, data: st.DataObject, name: str, with_default: bool) -> None:
        key = data.draw(self.any_key())
        default = (None,) if with_default else ()
        self.compare(lambda tree: getattr(tree, name)(key, *default),
                     lambda model: model.bound(name, key, *default))

    @rule()
    def extremes(self) -> None:
        self.compare(lambda tree: tree.min())
        self.compare(lambda tree: tree.max())

    @rule(data=st.data(), inclusive=st.tuples(st.booleans(), st.booleans()),
          reverse=st.booleans(), items=st.booleans())
    def irange(self, data: st.DataObject, inclusive: tuple[bool, bool], reverse: bool,
               items: bool) -> None:
        lo = data.draw(st.one_of(st.none(), self.any_key()))
        hi = data.draw(st.one_of(st.none(), self.any_key()))
        self.compare(
            lambda tree: list(tree.irange(lo, hi, inclusive=inclusive, reverse=reverse,
                                          items=items)),
            lambda model: model.irange(lo, hi, inclusive, reverse, items))

    @rule()
    def iterate(self) -> None:
        self.compare(lambda tree: list(tree), lambda model: model.sorted_keys())
        self.compare(lambda tree: list(reversed(tree)), lambda model: model.sorted_keys()[::-1])
        self.compare(lambda tree: list(reversed(tree.items())), lambda model: model.items()[::-1])
        self.compare(lambda tree: list(tree.values()),
                     lambda model: [value for _key, value in model.items()])
        self.compare(lambda tree: repr(tree), TREES_ONLY)

    @rule()
    def clear(self) -> None:
        self.compare(lambda tree: tree.clear())

    @rule()
    def copy(self) -> None:
        copies = [tree.copy() for tree in self.trees]
        for tree, twin in zip(self.trees, copies):
            assert twin == tree and twin is not tree
            twin._check()
        self.trees = copies
        # live iterators stay with the old trees (and a model that is gone)
        twin_model = ModelTree()
        twin_model.data, twin_model.kind = self.model.data, self.model.kind
        self.model = twin_model

    @rule(data=st.data(), value=VALUES)
    def update(self, data: st.DataObject, value: int) -> None:
        other = {key: value for key in data.draw(st.lists(self.any_key(), max_size=4))}
        self.compare(lambda tree: tree.update(other))

    @rule(target=iterators, data=st.data(),
          kind=st.sampled_from(["keys", "reversed", "items", "values", "irange"]))
    def start_iterator(self, data: st.DataObject, kind: str) -> Any:
        model = self.model
        if kind == "irange" and model.data:
            lo = data.draw(st.one_of(st.none(), self.keys))
            hi = data.draw(st.one_of(st.none(), self.keys))
            started = outcome(lambda: model.irange(lo, hi, (True, True), False, False))
            if started[0] == "error":
                return None
            live = [tree.irange(lo, hi) for tree in self.trees]
            return live, ModelIterator(model, started[1])
        keys = model.sorted_keys()[::-1] if kind == "reversed" else model.sorted_keys()
        mode = kind if kind in ("items", "values") else "keys"
        start = {"keys": iter, "reversed": reversed, "items": lambda tree: iter(tree.items()),
                 "values": lambda tree: iter(tree.values()), "irange": lambda tree: tree.irange()}
        return [start[kind](tree) for tree in self.trees], ModelIterator(model, keys, mode)

    @rule(pair=iterators, steps=st.integers(1, 3))
    def advance_iterator(self, pair: Any, steps: int) -> None:
        if pair is None or pair[1].model is not self.model:
            return
        live, model_iterator = pair
        for _ in range(steps):
            results = [outcome(lambda iterator=iterator: next(iterator)) for iterator in live]
            for result in results[1:]:
                assert result == results[0]
            assert results[0][:2] == model_iterator.next_outcome()

    @rule(pair=consumes(iterators))
    def drop_iterator(self, pair: Any) -> None:
        del pair


MACHINE_SETTINGS = settings(max_examples=examples(250), stateful_step_count=50, deadline=None,
                            suppress_health_check=list(HealthCheck))


class IntTrees(TreeMachine):
    keys = st.one_of(
        st.integers(-8, 8),
        st.sampled_from([2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**64, -2**64, 2**100, -2**100]),
        st.booleans(),
        st.integers(),
    )


class BytesTrees(TreeMachine):
    keys = st.lists(st.sampled_from([b"\x00", b"a", b"b", b"abcdefgh"]), max_size=4).map(
        b"".join)


class StrTrees(TreeMachine):
    keys = st.one_of(st.text(alphabet="abc", max_size=4),
                     st.text(alphabet="ab", max_size=2).map(Name))


TestIntTrees = IntTrees.TestCase
TestIntTrees.settings = MACHINE_SETTINGS
TestBytesTrees = BytesTrees.TestCase
TestBytesTrees.settings = MACHINE_SETTINGS
TestStrTrees = StrTrees.TestCase
TestStrTrees.settings = MACHINE_SETTINGS


# ------------------------------------------------------------------ targeted
class Named(RefTree):
    """A subclass with attributes (module level, to be picklable)."""


SUBCLASSES = {RefTree: Named}
if CTree is not None:
    class NamedC(CTree):
        """A subclass with attributes (module level, to be picklable)."""

    SUBCLASSES[CTree] = NamedC

@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
class TestMapping:
    def test_constructors_like_dict(self, tree_type: Any) -> None:
        assert list(tree_type({3: "c", 1: "a"}).items()) == [(1, "a"), (3, "c")]
        assert list(tree_type([(b"b", 2), (b"a", 1)]).items()) == [(b"a", 1), (b"b", 2)]
        assert list(tree_type(y=2, x=1).items()) == [("x", 1), ("y", 2)]
        assert list(tree_type({"a": 1}, b=2).items()) == [("a", 1), ("b", 2)]
        with pytest.raises(TypeError, match="at most 1 argument"):
            tree_type({}, {})
        with pytest.raises(ValueError, match="element #1 has length 3"):
            tree_type([(1, 2), (1, 2, 3)])
        with pytest.raises(TypeError, match="element #0 to a sequence"):
            tree_type([1])

    def test_is_a_mutable_mapping(self, tree_type: Any) -> None:
        tree = tree_type({1: "a"})
        assert isinstance(tree, MutableMapping)
        assert isinstance(tree.keys(), KeysView)
        assert isinstance(tree.values(), ValuesView)
        assert isinstance(tree.items(), ItemsView)
        with pytest.raises(TypeError):
            hash(tree)

    def test_repr(self, tree_type: Any) -> None:
        assert repr(tree_type()) == "RBTree()"
        assert repr(tree_type({2: "b", 1: "a"})) == "RBTree({1: 'a', 2: 'b'})"
        tree = tree_type()
        tree["self"] = tree
        assert repr(tree) == "RBTree({'self': RBTree(...)})"
        assert repr(tree_type({1: 2}).items()) == "RBTreeItems([(1, 2)])"

    def test_equality(self, tree_type: Any) -> None:
        tree = tree_type({1: "a", 2: "b"})
        assert tree == {2: "b", 1: "a"}
        assert tree != {1: "a", 2: "c"}
        assert tree != {1: "a"}
        assert tree == tree_type({2: "b", 1: "a"})
        assert tree != [(1, "a"), (2, "b")]
        assert tree_type() == {}
        # a key of another kind is simply not there
        assert tree != {b"x": "a", b"y": "b"}
        assert tree_type({(1,): 1}) != {"x": 1}
        for other_type in TREES:
            assert tree == other_type({1: "a", 2: "b"})

    def test_views_behave_like_dict_views(self, tree_type: Any) -> None:
        tree = tree_type({1: "a", 2: "b", 3: "c"})
        as_dict = dict(tree)
        for other in ({2, 4}, [2, 4], as_dict.keys()):
            assert tree.keys() & other == as_dict.keys() & other
            assert tree.keys() | other == as_dict.keys() | other
            assert tree.keys() - other == as_dict.keys() - other
            assert tree.keys() ^ other == as_dict.keys() ^ other
            assert other - tree.keys() == other - as_dict.keys()
        assert tree.items() & {(1, "a"), (1, "b")} == {(1, "a")}
        assert tree.keys() == {1, 2, 3} and tree.keys() <= {1, 2, 3, 4}
        assert tree.keys() < {1, 2, 3, 4} and not tree.keys() > {1, 2, 3, 4}
        assert tree.items() == as_dict.items()
        assert tree.keys().isdisjoint([5, 6]) and not tree.keys().isdisjoint([3])
        assert (2, "b") in tree.items() and (2, "x") not in tree.items()
        assert 5 not in tree.items() and (1, 2, 3) not in tree.items()
        assert "c" in tree.values() and "z" not in tree.values()
        assert list(reversed(tree.values())) == ["c", "b", "a"]
        assert len(tree.keys()) == len(tree.items()) == len(tree.values()) == 3

    def test_popitem_and_extremes(self, tree_type: Any) -> None:
        tree = tree_type({5: "e", 1: "a", 3: "c"})
        assert tree.min() == (1, "a") and tree.max() == (5, "e")
        assert tree.popitem() == (5, "e")
        assert tree.popitem(last=False) == (1, "a")
        assert tree.popitem(False) == (3, "c")
        for empty_call in (tree.popitem, tree.min, tree.max):
            with pytest.raises(KeyError):
                empty_call()

    def test_floor_and_ceiling(self, tree_type: Any) -> None:
        tree = tree_type({10: "a", 20: "b", 30: "c"})
        assert tree.floor(25) == (20, "b") and tree.floor(20) == (20, "b")
        assert tree.ceiling(25) == (30, "c") and tree.ceiling(30) == (30, "c")
        assert tree.floor_key(9, None) is None and tree.ceiling_key(31, "none") == "none"
        with pytest.raises(KeyError) as raised:
            tree.floor(5)
        assert raised.value.args == (5,)
        with pytest.raises(KeyError):
            tree.ceiling_key(35)
        assert tree.floor(2**80) == (30, "c") and tree.ceiling(-2**80) == (10, "a")

    def test_irange(self, tree_type: Any) -> None:
        tree = tree_type((key, str(key)) for key in range(10))
        assert list(tree.irange(3, 6)) == [3, 4, 5, 6]
        assert list(tree.irange(3, 6, inclusive=(False, False))) == [4, 5]
        assert list(tree.irange(3, 6, reverse=True)) == [6, 5, 4, 3]
        assert list(tree.irange(None, 1, items=True)) == [(0, "0"), (1, "1")]
        assert list(tree.irange(8)) == [8, 9]
        assert list(tree.irange(6, 3)) == []
        assert list(tree.irange(2, 2, inclusive=(True, False))) == []
        with pytest.raises(TypeError, match="inclusive"):
            tree.irange(1, 2, inclusive=[True, True])
        with pytest.raises(TypeError, match="kind"):
            tree.irange(b"a")
        assert list(tree_type().irange("any", b"kind")) == []

    def test_kinds(self, tree_type: Any) -> None:
        tree = tree_type({1: "a"})
        before = list(tree.items())
        for wrong in (b"x", "x", 1.5, (1,), bytearray(b"x")):
            for operation in (lambda k: tree.__setitem__(k, 1), tree.__getitem__,
                              tree.__delitem__, tree.__contains__, tree.get, tree.pop,
                              tree.setdefault, tree.floor, tree.ceiling_key):
                with pytest.raises(TypeError) as raised:
                    operation(wrong)
                message = str(raised.value)
                assert message.startswith("RBTree holds keys of kind 'int'; got a key of kind")
                assert f"({type(wrong).__name__})" in message or "'bytes'" in message
            assert list(tree.items()) == before
            tree._check()
        # bool and int subclasses are ints, ordered by value
        tree[True] = "true"
        assert tree[1] == "true" and list(tree) == [1]
        # the kind is forgotten when the tree is empty
        del tree[1]
        tree["x"] = 1
        with pytest.raises(TypeError, match=r"'object' \(str\).*'int'"):
            tree[1] = 1
        tree.clear()
        tree[b"x"] = 1
        with pytest.raises(TypeError, match=r"'bytes'.*'object' \(bytearray\)"):
            tree[bytearray(b"x")] = 1

    def test_object_keys_must_share_the_first_type(self, tree_type: Any) -> None:
        tree = tree_type({"b": 1})
        tree[Name("a")] = 2  # an instance of str
        assert list(tree) == ["a", "b"]
        named = tree_type({Name("a"): 1})
        with pytest.raises(TypeError, match=r"'object' \(Name\).*'object' \(str\)"):
            named["b"] = 2
        tuples = tree_type({(2, "b"): 1, (1, "z"): 2, (1, "a"): 3})
        assert list(tuples) == [(1, "a"), (1, "z"), (2, "b")]
        assert tuples.floor((1, "q")) == ((1, "a"), 3)
        lists = tree_type({(1,): 0})
        lists.clear()
        lists[[2]] = "unhashable keys are fine"
        lists[[1]] = 1
        assert list(lists) == [[1], [2]] and lists[[2]] == "unhashable keys are fine"

    def test_big_ints_order_with_small_ones(self, tree_type: Any) -> None:
        keys = [0, -1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64 + 1, -2**200, 2**200, True]
        tree = tree_type((key, key) for key in keys)
        tree._check()
        assert list(tree) == sorted(set(keys))
        assert tree.floor(2**63 + 5) == (2**63, 2**63)
        assert tree.ceiling(-2**63 - 5) == (-2**63 - 1, -2**63 - 1)
        assert 2**64 + 1 in tree and 2**64 not in tree

    def test_bytes_that_share_their_first_eight_bytes(self, tree_type: Any) -> None:
        keys = [b"", b"\x00", b"a", b"a\x00", b"abcdefgh", b"abcdefgh\x00", b"abcdefghi",
                b"abcdefgg\xff", b"\xff" * 9, b"abcdefg"]
        tree = tree_type((key, len(key)) for key in keys)
        tree._check()
        assert list(tree) == sorted(keys)
        assert tree[b"abcdefgh\x00"] == 9 and b"abcdefgh\x01" not in tree
        assert tree.floor_key(b"abcdefgh\x01") == b"abcdefgh\x00"

    def test_int_subclass_comparisons_are_ignored(self, tree_type: Any) -> None:
        class Backwards(int):
            def __lt__(self, other: object) -> bool:
                return int(self) > int(other)  # type: ignore[call-overload]

        tree = tree_type((Backwards(key), key) for key in (3, 1, 2))
        assert list(tree) == [1, 2, 3]

    def test_setdefault_get_pop(self, tree_type: Any) -> None:
        tree = tree_type()
        assert tree.setdefault(1, "a") == "a" and tree.setdefault(1, "b") == "a"
        assert tree.setdefault(2) is None
        assert tree.get(3) is None and tree.get(3, "x") == "x"
        assert tree.pop(1) == "a" and tree.pop(1, "gone") == "gone"
        with pytest.raises(KeyError):
            tree.pop(1)
        with pytest.raises(KeyError) as raised:
            tree_type()[(1, 2)]
        assert raised.value.args == ((1, 2),)

    def test_pickle_and_copy(self, tree_type: Any) -> None:
        for items in ({1: "a", 2**70: [1]}, {b"k": 1}, {"s": (1, 2)}, {}):
            tree = tree_type(items)
            for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
                restored = pickle.loads(pickle.dumps(tree, protocol))
                assert type(restored) is tree_type and restored == tree
                restored._check()
            for twin in (tree.copy(), copy.copy(tree), copy.deepcopy(tree)):
                assert type(twin) is tree_type and twin == tree and twin is not tree
                twin._check()
        tree = tree_type({1: [1]})
        assert copy.copy(tree)[1] is tree[1] and copy.deepcopy(tree)[1] is not tree[1]
        looped = tree_type()
        looped[1] = looped
        restored = pickle.loads(pickle.dumps(looped))
        assert restored[1] is restored

    def test_subclass(self, tree_type: Any) -> None:
        subclass = SUBCLASSES[tree_type]
        tree = subclass({2: "b", 1: "a"})
        tree.label = "ranges"
        assert repr(tree) == f"{subclass.__name__}({{1: 'a', 2: 'b'}})"
        restored = pickle.loads(pickle.dumps(tree))
        assert type(restored) is subclass and restored.label == "ranges" and restored == tree
        assert type(tree.copy()) is subclass and tree.copy() == tree
        assert isinstance(tree, MutableMapping)

    def test_update_from_another_tree_and_itself(self, tree_type: Any) -> None:
        tree = tree_type({1: "a"})
        tree.update(tree)
        tree.update(tree_type({0: "z", 1: "b"}))
        assert list(tree.items()) == [(0, "z"), (1, "b")]
        empty = tree_type()
        empty.update(tree)
        empty._check()
        assert empty == tree
        with pytest.raises(TypeError, match="kind"):
            empty.update(a=1)

    def test_check_detects_disorder(self, tree_type: Any) -> None:
        """_check can fail: keys whose order changes after insertion leave
        the tree unordered."""
        class Shifty:
            def __init__(self, rank: int) -> None:
                self.rank = rank

            def __lt__(self, other: Shifty) -> bool:
                return self.rank < other.rank

        keys = [Shifty(rank) for rank in range(20)]
        tree = tree_type((key, None) for key in keys)
        tree._check()
        keys[5].rank = 100
        with pytest.raises(AssertionError, match="not strictly ascending"):
            tree._check()


def test_reference_check_detects_corruption() -> None:
    tree = RefTree((key, key) for key in range(20))
    tree._check()
    tree._root.red = True
    with pytest.raises(AssertionError, match="root"):
        tree._check()
    tree._root.red = False
    tree._root.left.parent = tree._root.right
    with pytest.raises(AssertionError, match="parent"):
        tree._check()
    tree = RefTree((key, key) for key in range(20))
    tree._extreme(tree._root, False).red = not tree._extreme(tree._root, False).red
    with pytest.raises(AssertionError, match="black heights|red child"):
        tree._check()
    tree = RefTree((key, key) for key in range(20))
    tree._size += 1
    with pytest.raises(AssertionError, match="size"):
        tree._check()


# ------------------------------------------------------------------ iterators
@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
class TestIterators:
    STARTS = {
        "keys": iter,
        "reversed": reversed,
        "items": lambda tree: iter(tree.items()),
        "values": lambda tree: iter(tree.values()),
        "irange": lambda tree: tree.irange(1, 8, items=True),
    }

    @pytest.mark.parametrize("start", STARTS)
    def test_insert_or_remove_invalidates(self, tree_type: Any, start: str) -> None:
        for change in (lambda tree: tree.__setitem__(100, 0), lambda tree: tree.__delitem__(5),
                       lambda tree: tree.popitem(), lambda tree: tree.clear(),
                       lambda tree: tree.update({-1: 0})):
            tree = tree_type((key, key) for key in range(10))
            iterator = self.STARTS[start](tree)
            next(iterator)
            change(tree)
            for _ in range(3):  # and it stays invalid
                with pytest.raises(RuntimeError, match="changed size during iteration"):
                    next(iterator)

    @pytest.mark.parametrize("start", STARTS)
    def test_replacing_values_is_fine(self, tree_type: Any, start: str) -> None:
        tree = tree_type((key, key) for key in range(10))
        iterator = self.STARTS[start](tree)
        seen = []
        for item in iterator:
            seen.append(item)
            for key in range(10):
                tree[key] = -key
            tree.setdefault(3, "ignored")
        assert len(seen) == {"irange": 8}.get(start, 10)

    def test_deleting_the_current_node(self, tree_type: Any) -> None:
        tree = tree_type((key, str(key)) for key in range(50))
        iterator = iter(tree.items())
        for _ in range(10):
            key, _value = next(iterator)
        del tree[key]
        with pytest.raises(RuntimeError):
            next(iterator)
        for key in list(tree):
            del tree[key]
        with pytest.raises(RuntimeError):
            next(iterator)
        tree.update((key, key) for key in range(100))  # new storage
        with pytest.raises(RuntimeError):
            next(iterator)

    def test_clearing_while_iterating(self, tree_type: Any) -> None:
        tree = tree_type((key, key) for key in range(20))
        iterator = tree.irange(5, reverse=True)
        assert next(iterator) == 19
        tree.clear()
        with pytest.raises(RuntimeError):
            next(iterator)
        tree.clear()  # an empty tree stays empty: nothing more changed
        with pytest.raises(RuntimeError):
            next(iterator)

    def test_iterator_keeps_the_tree_alive(self, tree_type: Any) -> None:
        tree = tree_type((key, [key]) for key in range(30))
        iterator = iter(tree.items())
        next(iterator)
        del tree
        gc.collect()
        assert [key for key, _value in iterator] == list(range(1, 30))
        assert next(iterator, "done") == "done"

    def test_exhausted_iterator_stays_exhausted(self, tree_type: Any) -> None:
        tree = tree_type({1: 1})
        iterator = iter(tree)
        assert list(iterator) == [1]
        tree[2] = 2
        assert list(iterator) == []

    def test_iterator_of_an_empty_tree(self, tree_type: Any) -> None:
        tree = tree_type()
        iterator = iter(tree)
        tree[1] = 1
        with pytest.raises(RuntimeError):
            next(iterator)


# ------------------------------------------------------------------ errors
class Touchy:
    """An object key whose comparison raises against a chosen rank."""

    poison: int | None = None

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __lt__(self, other: Touchy) -> bool:
        if Touchy.poison in (self.rank, other.rank):
            raise ArithmeticError(f"cannot compare {self.rank}")
        return self.rank < other.rank

    def __repr__(self) -> str:
        return f"Touchy({self.rank})"


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
class TestErrorsLeaveTheTreeIntact:
    def test_comparison_that_raises(self, tree_type: Any) -> None:
        keys = [Touchy(rank) for rank in range(0, 40, 2)]
        tree = tree_type((key, key.rank) for key in keys)
        before = list(tree.items())
        Touchy.poison = 13
        try:
            for operation in (lambda k: tree.__setitem__(k, 0), tree.__getitem__,
                              tree.__delitem__, tree.__contains__, tree.pop, tree.floor,
                              tree.ceiling, tree.setdefault, lambda k: tree.irange(k)):
                with pytest.raises(ArithmeticError):
                    operation(Touchy(13))
                assert list(tree.items()) == before
                tree._check()
            Touchy.poison = 20  # a key in the tree, met on the way to 21
            with pytest.raises(ArithmeticError):
                tree[Touchy(21)] = 0
            with pytest.raises(ArithmeticError):
                tree.pop(Touchy(21), None)
        finally:
            Touchy.poison = None
        assert list(tree.items()) == before
        tree._check()

    def test_comparison_that_changes_the_tree(self, tree_type: Any) -> None:
        tree = tree_type()

        class Meddler(Touchy):
            def __lt__(self, other: Touchy) -> bool:
                if self.rank == 99 and tree:
                    tree.popitem()
                return self.rank < other.rank

        for rank in range(10):
            tree[Meddler(rank)] = rank
        with pytest.raises(RuntimeError, match="changed during a key comparison"):
            tree[Meddler(99)] = 0
        assert len(tree) == 9 and all(key.rank != 99 for key in tree)
        tree._check()
        with pytest.raises(RuntimeError, match="changed during a key comparison"):
            tree.floor(Meddler(99))
        tree._check()

    def test_value_whose_deletion_changes_the_tree(self, tree_type: Any) -> None:
        tree = tree_type()

        class Janitor:
            def __del__(self) -> None:
                tree.clear()
                tree.update({-1: "after"})

        for key in range(10):
            tree[key] = key
        tree[5] = Janitor()
        tree[5] = "replaced"  # the old value's __del__ clears and refills the tree
        assert list(tree.items()) == [(-1, "after")]
        tree[7] = Janitor()
        del tree[7]
        tree._check()
        assert list(tree.items()) == [(-1, "after")]

    def test_failing_update_keeps_what_it_stored(self, tree_type: Any) -> None:
        tree = tree_type({1: "a"})
        with pytest.raises(TypeError):
            tree.update([(2, "b"), ("x", "c"), (3, "d")])
        assert list(tree.items()) == [(1, "a"), (2, "b")]  # like dict.update
        tree._check()


@needs_c
@pytest.mark.skipif(_testcapi is None or not hasattr(_testcapi, "set_nomemory"),
                    reason="needs _testcapi.set_nomemory to make allocations fail")
def test_memory_errors_leave_the_tree_intact() -> None:
    """Fail the n-th allocation of each operation, for every n until the
    operation succeeds: each failure is a MemoryError and a whole tree."""
    operations = {
        "insert": lambda tree: tree.__setitem__(10**6, "new"),
        "copy": lambda tree: tree.copy(),
        "popitem": lambda tree: tree.popitem(),
        "floor": lambda tree: tree.floor(5),
        "irange": lambda tree: list(tree.irange(3, 9, items=True)),
        "update": lambda tree: tree.update({-key: key for key in range(20)}),
    }
    for name, operation in operations.items():
        for size in (7, 8, 15):  # 7 and 15 items: the next insertion grows the storage
            failures = 0
            for start in range(200):
                tree = CTree((key, str(key)) for key in range(size))
                before = list(tree.items())
                _testcapi.set_nomemory(start, start + 1)
                try:
                    operation(tree)
                except MemoryError:
                    failures += 1
                else:
                    break
                finally:
                    _testcapi.remove_mem_hooks()
                tree._check()
                if name != "update":  # update keeps what it stored before failing
                    assert list(tree.items()) == before, name
            assert start < 199, f"{name} never succeeded"
            if name in ("insert", "copy", "update") and size in (7, 15):
                assert failures > 0, f"no allocation of {name} was failed"


# ------------------------------------------------------------------ GC, leaks
@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_cycle_through_a_value_is_collected(tree_type: Any) -> None:
    class Holder:
        pass

    gc.collect()
    holder = Holder()
    tree = tree_type({1: holder, 2: "x"})
    holder.tree = tree
    iterator = iter(tree)  # an iterator in the cycle too
    holder.iterator = iterator
    collected = weakref.ref(holder)
    del holder, tree, iterator
    gc.collect()
    assert collected() is None


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_cycle_through_a_key_is_collected(tree_type: Any) -> None:
    class Key:
        def __init__(self, rank: int) -> None:
            self.rank = rank

        def __lt__(self, other: Key) -> bool:
            return self.rank < other.rank

    key = Key(1)
    tree = tree_type({key: 1})
    key.tree = tree  # the cycle goes through the key alone
    key_ref = weakref.ref(key)
    del key, tree
    gc.collect()
    assert key_ref() is None


def _workload(tree_type: Any) -> None:
    """A bit of everything, errors included."""
    for kind_keys in (list(range(-300, 300, 3)) + [2**70 + key for key in range(20)],
                      [bytes([key % 7]) * (key % 11) + str(key).encode() for key in range(300)],
                      [f"key-{key}" for key in range(300)]):
        tree = tree_type()
        for key in kind_keys:
            tree[key] = [key]
        tree.update({key: key for key in kind_keys[::7]})
        for key in kind_keys[::3]:
            del tree[key]
        for key in kind_keys[::5]:
            tree.pop(key, None)
            tree.get(key)
            tree.setdefault(key, (key,))
            tree.floor(key, None)
            tree.ceiling_key(key, None)
        list(tree.irange(kind_keys[10], kind_keys[200], items=True, reverse=True))
        list(tree.items()), list(tree.values()), list(reversed(tree))
        repr(tree)
        pickle.loads(pickle.dumps(tree))
        tree.copy(), copy.deepcopy(tree)
        tree.keys() & set(kind_keys[:30])
        for wrong in (1.5, object(), b"x", 3):
            try:
                tree[wrong] = 1
            except TypeError:
                pass
        try:
            tree[kind_keys[1]]
        except KeyError:
            pass
        iterator = iter(tree)
        next(iterator)
        tree[kind_keys[2]] = 0
        try:
            next(iterator)
        except RuntimeError:
            pass
        tree.popitem(), tree.popitem(last=False)
        tree == dict(tree)  # noqa: B015
        while tree:
            tree.popitem()
        tree.clear()


def _blocks_are_counted() -> bool:
    """sys.getallocatedblocks counts pymalloc blocks; under PYTHONMALLOC=malloc
    (as in `make check-c`) it stays 0 and means nothing."""
    before = sys.getallocatedblocks()
    hold = [object() for _ in range(1000)]
    counted = sys.getallocatedblocks() - before >= 500
    del hold
    return counted


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_no_leaks(tree_type: Any) -> None:
    if not _blocks_are_counted():
        pytest.skip("sys.getallocatedblocks does not count allocations here "
                    f"(PYTHONMALLOC={os.environ.get('PYTHONMALLOC', '')!r})")
    _workload(tree_type)  # warm caches (interned strings, type caches, ...)
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(5):
        _workload(tree_type)
    gc.collect()
    grown = sys.getallocatedblocks() - before
    assert grown < 100, f"{grown} blocks more after 5 rounds"


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_references_are_returned(tree_type: Any) -> None:
    value = object()
    key = 2**100 + 12345  # an object of its own, not a cached small int
    key_bytes = b"some key of ours"
    baseline = [sys.getrefcount(value), sys.getrefcount(key), sys.getrefcount(key_bytes)]
    tree = tree_type()
    for number in range(1000):
        tree[number] = value
    tree[key] = value
    tree.setdefault(key, value)
    tree.get(-1, value)
    tree.pop(-1, value)
    tree.floor(-5, value)
    twin = tree.copy()
    items = list(tree.items())
    for number in range(0, 1000, 2):
        del tree[number]
    tree.pop(key)
    bytes_tree = tree_type({key_bytes: value})
    bytes_tree[b"some key of ours"] = value  # an equal key: the first one stays
    del items, twin, bytes_tree
    tree.clear()
    tree[key] = value
    del tree
    gc.collect()
    assert [sys.getrefcount(value), sys.getrefcount(key), sys.getrefcount(key_bytes)] == baseline


# ------------------------------------------------------------------ C API
@needs_c
def test_capsule_api() -> None:
    capsule = _rbtree._C_API
    assert type(capsule).__name__ == "PyCapsule"
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype = ctypes.c_void_p
    get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
    address = get_pointer(capsule, b"domus._rbtree._C_API")

    pointer = ctypes.c_void_p
    function = ctypes.PYFUNCTYPE  # keeps the GIL, raises a Python error if one is set

    class API(ctypes.Structure):
        _fields_ = [
            ("type", pointer),
            ("get", function(pointer, ctypes.py_object, ctypes.py_object)),
            ("put", function(ctypes.c_int, ctypes.py_object, ctypes.py_object, ctypes.py_object)),
            ("remove", function(ctypes.c_int, ctypes.py_object, ctypes.py_object)),
            ("contains", function(ctypes.c_int, ctypes.py_object, ctypes.py_object)),
            ("size", function(ctypes.c_ssize_t, ctypes.py_object)),
        ]

    api = API.from_address(address)
    assert api.type == id(CTree)
    tree = CTree()
    value = "a value"
    assert api.put(tree, 5, value) == 1 and api.put(tree, 5, value) == 0
    assert api.put(tree, 3, "other") == 1 and api.size(tree) == 2
    assert api.get(tree, 5) == id(value) and api.get(tree, 4) is None
    assert api.contains(tree, 3) == 1 and api.contains(tree, 4) == 0
    with pytest.raises(TypeError, match="kind"):
        api.put(tree, b"bytes", value)
    with pytest.raises(TypeError, match="kind"):
        api.get(tree, "str")
    assert api.remove(tree, 3) == 1 and api.remove(tree, 3) == 0
    assert dict(tree) == {5: value}
    tree._check()
