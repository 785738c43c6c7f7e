"""RecordTree: the C type (domus._recordtree) and its pure-Python twin
(domus.storage.recordtree) side by side.

Model-based tests drive both trees and a dict model with the same random
operations -- records of every size class, keys that share prefixes, live
iterators, wrong types -- and compare every result and every exception (same
type, same message), the allocator's accounting of the two trees (the twin
simulates the C allocator's rules: they must hold the same bytes), and every
invariant of the C tree's arena (``_check``).  Targeted tests cover memory
reuse, compaction and the bytes held, iterators that outlive changes, the
repository's mapping behaviour, leaks and the C API capsule.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import random
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from scale import examples

from domus.errors import KeyTooLarge
from domus.storage import recordtree
from domus.storage.rbt import RBTreeRepository
from domus.storage.recordtree import RecordMapping
from domus.storage.recordtree import RecordTree as TwinTree

try:
    from domus import _recordtree
except ImportError:  # the extension is not built
    _recordtree = None

needs_c = pytest.mark.skipif(_recordtree is None,
                             reason="domus._recordtree is not built: run "
                                    "`python setup.py build_ext --inplace`")

if _recordtree is not None:
    class CTree(_recordtree.RecordTree, RecordMapping):
        """The C core with the shared mapping behaviour, as the repository
        has it."""
else:
    CTree = None

IMPLEMENTATIONS = [pytest.param(TwinTree, id="twin"),
                   pytest.param(CTree, id="c", marks=needs_c)]


def outcome(call: Any) -> tuple[str, Any]:
    """What a call did: ("ok", result) or ("raise", type, message)."""
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001 - every exception is compared
        return ("raise", (type(exc), str(exc)))
    if hasattr(result, "__next__"):
        result = list(result)
    return ("ok", result)


def model_outcome(call: Any) -> tuple[str, Any]:
    """As outcome, for the model, whose errors are compared by type only."""
    kind, result = outcome(call)
    return (kind, result[0]) if kind == "raise" else (kind, result)


# ------------------------------------------------------------------ records
# Keys from a small alphabet with shared prefixes (so descents compare
# past the first 8 bytes), of 0 to 20 bytes; values of every width and of
# sizes around the listed/unlisted boundary (256 units = 2,048 bytes).
key_strategy = st.one_of(
    st.binary(max_size=3),
    st.builds(lambda tail: b"prefix-shared-" + tail, st.binary(max_size=6)),
    st.binary(min_size=8, max_size=20))
value_sizes = st.one_of(st.integers(0, 24), st.integers(250, 260),
                        st.integers(2030, 2060), st.integers(65_530, 65_540))
value_strategy = st.builds(lambda size, byte: bytes([byte]) * size, value_sizes,
                           st.integers(0, 255))
not_bytes = st.sampled_from([None, 1, "text", bytearray(b"x"), memoryview(b"x"), (b"x",)])


@needs_c
class TreeMachine(RuleBasedStateMachine):
    """C tree, twin and a dict model, step by step."""

    def __init__(self) -> None:
        super().__init__()
        self.c = CTree()
        self.twin = TwinTree()
        self.model: dict[bytes, bytes] = {}
        self.version = 0                     # the model's: insertions, removals
        self.iterators: list[tuple[Any, Any, list[Any], int]] = []

    def compare(self, call: Any) -> Any:
        c = outcome(lambda: call(self.c))
        twin = outcome(lambda: call(self.twin))
        assert c == twin
        return c

    def known_key(self, data: Any) -> bytes:
        if self.model and data.draw(st.booleans()):
            return data.draw(st.sampled_from(sorted(self.model)))
        return data.draw(key_strategy)

    @rule(key=key_strategy, value=value_strategy)
    def put(self, key: bytes, value: bytes) -> None:
        result = self.compare(lambda tree: tree.put(key, value))
        assert result == ("ok", key not in self.model)
        if key not in self.model:
            self.version += 1
        self.model[key] = value

    @rule(data=st.data(), value=value_strategy)
    def replace(self, data: Any, value: bytes) -> None:
        key = self.known_key(data)
        self.compare(lambda tree: tree.__setitem__(key, value))
        if key not in self.model:
            self.version += 1
        self.model[key] = value

    @rule(data=st.data())
    def read(self, data: Any) -> None:
        key = self.known_key(data)
        assert self.compare(lambda tree: tree.get(key)) == ("ok", self.model.get(key))
        assert self.compare(lambda tree: tree.get(key, b"default")) == \
            ("ok", self.model.get(key, b"default"))
        assert self.compare(lambda tree: key in tree) == ("ok", key in self.model)
        assert self.compare(lambda tree: tree.contains(key)) == ("ok", key in self.model)
        assert self.compare(lambda tree: tree[key])[0] == model_outcome(
            lambda: self.model[key])[0]

    @rule(data=st.data(), how=st.sampled_from(["delete", "del", "pop", "pop-default"]))
    def remove(self, data: Any, how: str) -> None:
        key = self.known_key(data)
        present = key in self.model
        if how == "delete":
            assert self.compare(lambda tree: tree.delete(key)) == ("ok", present)
        elif how == "del":
            result = self.compare(lambda tree: tree.__delitem__(key))
            assert result[0] == ("ok" if present else "raise")
        elif how == "pop":
            result = self.compare(lambda tree: tree.pop(key))
            assert result == (("ok", self.model[key]) if present else
                              ("raise", (KeyError, repr(key))))
        else:
            assert self.compare(lambda tree: tree.pop(key, None)) == \
                ("ok", self.model.get(key))
        if present:
            del self.model[key]
            self.version += 1

    @rule(last=st.booleans())
    def popitem(self, last: bool) -> None:
        result = self.compare(lambda tree: tree.popitem(last=last))
        if not self.model:
            assert result == ("raise", (KeyError, "'popitem(): RecordTree is empty'"))
            return
        key = max(self.model) if last else min(self.model)
        assert result == ("ok", (key, self.model.pop(key)))
        self.version += 1

    @rule()
    def clear(self) -> None:
        self.compare(lambda tree: tree.clear())
        if self.model:
            self.version += 1
        self.model.clear()

    @rule(data=st.data())
    def wrong_types(self, data: Any) -> None:
        wrong = data.draw(not_bytes)
        calls = [lambda tree: tree.get(wrong), lambda tree: wrong in tree,
                 lambda tree: tree[wrong], lambda tree: tree.put(wrong, b"v"),
                 lambda tree: tree.put(b"k", wrong), lambda tree: tree.delete(wrong),
                 lambda tree: tree.pop(wrong, None),
                 lambda tree: tree.irange(inclusive=[True, True])]
        if wrong is not None:                       # (None is no bound)
            calls += [lambda tree: tree.irange(wrong), lambda tree: tree.irange(None, wrong)]
        for call in calls:
            kind, _result = self.compare(call)
            assert kind == "raise"

    @rule(low=st.none() | key_strategy, high=st.none() | key_strategy,
          inclusive=st.tuples(st.booleans(), st.booleans()), reverse=st.booleans(),
          items=st.booleans())
    def walk(self, low: Any, high: Any, inclusive: Any, reverse: bool, items: bool) -> None:
        result = self.compare(lambda tree: tree.irange(low, high, inclusive=inclusive,
                                                       reverse=reverse, items=items))
        keys = [key for key in sorted(self.model, reverse=reverse)
                if (low is None or key > low or (inclusive[0] and key == low))
                and (high is None or key < high or (inclusive[1] and key == high))]
        assert result == ("ok", [(key, self.model[key]) for key in keys] if items else keys)

    @rule()
    def whole(self) -> None:
        ordered = sorted(self.model)
        assert self.compare(lambda tree: list(tree)) == ("ok", ordered)
        assert self.compare(lambda tree: list(reversed(tree))) == ("ok", ordered[::-1])
        assert self.compare(lambda tree: list(tree.values())) == \
            ("ok", [self.model[key] for key in ordered])
        assert self.compare(lambda tree: list(reversed(tree.items()))) == \
            ("ok", [(key, self.model[key]) for key in ordered[::-1]])
        assert self.c == self.model and self.twin == self.model

    @rule(reverse=st.booleans(), items=st.booleans())
    def start_iterating(self, reverse: bool, items: bool) -> None:
        if len(self.iterators) < 4:
            self.iterators.append((self.c.irange(reverse=reverse, items=items),
                                   self.twin.irange(reverse=reverse, items=items),
                                   [], self.version))

    @rule(data=st.data())
    def step_an_iterator(self, data: Any) -> None:
        """A live iterator goes on after values were replaced (even moved by
        it), and raises once a key was inserted or removed."""
        if not self.iterators:
            return
        index = data.draw(st.integers(0, len(self.iterators) - 1))
        c_iterator, twin_iterator, seen, version = self.iterators[index]
        c = outcome(lambda: next(c_iterator))
        twin = outcome(lambda: next(twin_iterator))
        assert c == twin
        if version != self.version:
            assert c == ("raise", (RuntimeError, recordtree.ITER_CHANGED))
            del self.iterators[index]
        elif c[0] == "raise":
            assert c[1][0] is StopIteration
            del self.iterators[index]
        else:
            seen.append(c[1])

    @invariant()
    def agree(self) -> None:
        assert len(self.c) == len(self.twin) == len(self.model)
        self.c._check()
        self.twin._check()
        assert self.c._stats() == self.twin._stats()
        assert self.c.bytes_held == self.twin.bytes_held


TestTreeMachine = TreeMachine.TestCase
TestTreeMachine.settings = settings(max_examples=examples(150), stateful_step_count=60,
                                    deadline=None, suppress_health_check=list(HealthCheck))


# ------------------------------------------------------------------ the module

@needs_c
def test_the_twin_keeps_the_c_types_constants():
    for name in ("UNIT", "HEADER_BYTES", "LISTED_UNITS", "MIN_CAPACITY", "MAP_THRESHOLD",
                 "COMPACT_MIN_BYTES", "MAX_KEY_BYTES", "MAX_VALUE_BYTES", "MAX_ARENA_BYTES",
                 "PAGE_SIZE"):
        assert getattr(recordtree, name) == getattr(_recordtree, name), name


@needs_c
def test_the_c_api_capsule_names_the_type():
    assert type(_recordtree._C_API).__name__ == "PyCapsule"
    assert "domus._recordtree._C_API" in repr(_recordtree._C_API)


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_a_small_record_takes_32_bytes(tree_type: Any) -> None:
    # An int key as the protocol encodes it (9 bytes) and an 8-byte value as
    # msgpack packs it (10 bytes): 10 bytes of header, 1 of value length.
    assert recordtree.record_bytes(9, 10) == 32
    assert recordtree.record_bytes(31, 102) == 144          # 30-char str key, 100-byte value
    tree = tree_type()
    rng = random.Random(5)
    for _ in range(100_000):
        tree.put(b"\x01" + rng.randbytes(8), b"\xc4\x08" + rng.randbytes(8))
    stats = tree._stats()
    assert stats["used_bytes"] == 8 + 32 * len(tree)        # the nil unit, then the records
    assert stats["mapped"]
    assert tree.bytes_held == -(-stats["used_bytes"] // recordtree.PAGE_SIZE) * \
        recordtree.PAGE_SIZE
    assert tree.bytes_held / len(tree) < 32.1


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_an_empty_tree_holds_nothing(tree_type: Any) -> None:
    tree = tree_type()
    assert tree.bytes_held == 0
    tree[b"k"] = b"v"
    assert 0 < tree.bytes_held <= 64
    del tree[b"k"]
    assert tree.bytes_held == 0
    for number in range(1000):
        tree[b"%d" % number] = b"v" * 100
    tree.clear()
    assert tree.bytes_held == 0 and len(tree) == 0 and list(tree) == []


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_deleted_records_make_room_for_new_ones(tree_type: Any) -> None:
    """Fill, delete most, fill again: the memory of the deleted records
    holds the new ones, and the bytes held come back to the first fill's."""
    tree = tree_type()
    rng = random.Random(11)
    records = 50_000
    for number in range(records):
        tree.put(b"\x01" + number.to_bytes(8, "big"), rng.randbytes(rng.randint(5, 40)))
    first = tree.bytes_held
    for number in range(0, records, 10):
        for gone in range(number, number + 9):
            del tree[b"\x01" + gone.to_bytes(8, "big")]
    assert len(tree) == records // 10
    assert tree.bytes_held < first / 3                     # compacted: memory given back
    for number in range(records, records + records * 9 // 10):
        tree.put(b"\x01" + number.to_bytes(8, "big"), rng.randbytes(rng.randint(5, 40)))
    assert len(tree) == records
    assert abs(tree.bytes_held - first) <= first / 10
    tree._check()


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_free_blocks_are_reused_before_the_arena_grows(tree_type: Any) -> None:
    tree = tree_type()
    for number in range(2000):
        tree.put(b"k%05d" % number, b"v" * 20)
    used = tree._stats()["used_bytes"]
    for number in range(0, 2000, 8):                        # an eighth: no compaction
        del tree[b"k%05d" % number]
    assert tree._stats()["compactions"] == 0
    assert tree._stats()["free_bytes"] > 0
    for number in range(0, 2000, 8):                        # records of the same size
        tree.put(b"n%05d" % number, b"w" * 20)
    assert tree._stats()["used_bytes"] == used
    assert tree._stats()["free_bytes"] == 0
    tree._check()


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_values_that_change_size_move_and_are_still_found(tree_type: Any) -> None:
    tree = tree_type()
    model = {}
    rng = random.Random(3)
    for number in range(3000):
        key = b"%04d" % (number % 500)
        value = rng.randbytes(rng.choice([1, 30, 300, 3000]))
        tree[key] = value
        model[key] = value
    assert dict(tree.items()) == model
    assert list(tree) == sorted(model)
    assert tree._stats()["compactions"] > 0
    tree._check()


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_errors_name_the_problem_and_change_nothing(tree_type: Any) -> None:
    tree = tree_type()
    tree[b"k"] = b"v"
    before = tree._stats()
    with pytest.raises(TypeError, match="RecordTree keys must be bytes, not str"):
        tree["k"] = b"v"
    with pytest.raises(TypeError, match="RecordTree values must be bytes, not int"):
        tree[b"k"] = 1
    with pytest.raises(TypeError, match="RecordTree keys must be bytes, not int"):
        _ = 1 in tree
    with pytest.raises(KeyTooLarge, match="key of 16384 bytes is over the RecordTree's "
                                          "16383-byte limit"):
        tree.put(b"k" * 16384, b"v")
    with pytest.raises(TypeError, match="bounds must be bytes or None, not int"):
        tree.irange(1)
    with pytest.raises(TypeError, match="inclusive must be a pair of booleans"):
        tree.irange(inclusive=(True,))
    with pytest.raises(KeyError):
        tree[b"absent"]
    tree.put(b"k" * 16383, b"")                             # the largest key
    del tree[b"k" * 16383]
    assert tree._stats()["records"] == before["records"] == 1 and tree[b"k"] == b"v"


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_an_empty_key_and_an_empty_value_are_records(tree_type: Any) -> None:
    tree = tree_type()
    assert tree.put(b"", b"") is True
    assert tree.put(b"\x00", b"") is True
    assert list(tree.items()) == [(b"", b""), (b"\x00", b"")]
    assert tree.put(b"", b"x") is False and tree[b""] == b"x"
    tree._check()


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_keys_are_in_bytewise_order_past_their_first_eight_bytes(tree_type: Any) -> None:
    keys = [b"abcdefgh", b"abcdefgh\x00", b"abcdefgh\x01", b"abcdefghi", b"abcdefg",
            b"abcdefgi", b"\xff" * 9, b"\xff" * 8, b"", b"abcdefghabcdefgh",
            b"abcdefghabcdefgg\xff"]
    tree = tree_type()
    for key in keys:
        tree[key] = key
    assert list(tree) == sorted(keys)
    for key in keys:
        assert tree[key] == key


# ------------------------------------------------------------------ iterators

@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_iterators_survive_values_that_move(tree_type: Any) -> None:
    """Replacing values while iterating is fine, as with dict, even when
    the new value's size moves the record and compacts the arena."""
    tree = tree_type()
    for number in range(2000):
        tree[b"%05d" % number] = b"x" * 10
    seen = []
    for key in tree:
        seen.append(key)
        tree[key] = b"y" * 500                              # every record moves
    assert seen == sorted(seen) and len(seen) == 2000
    assert set(tree.values()) == {b"y" * 500}
    for key, _value in tree.items():
        tree[key] = b"z"                                    # and back: compactions
    assert tree._stats()["compactions"] > 0
    assert list(tree.values()) == [b"z"] * 2000


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS)
def test_iterators_raise_once_a_key_is_added_or_removed_and_stay_exhausted(tree_type):
    tree = tree_type()
    tree.update({b"a": b"1", b"b": b"2", b"c": b"3"})
    for change in (lambda: tree.put(b"d", b"4"), lambda: tree.delete(b"d"),
                   lambda: tree.clear()):
        iterator = iter(tree)
        next(iterator)
        change()
        with pytest.raises(RuntimeError, match="RecordTree changed size during iteration"):
            next(iterator)
        with pytest.raises(StopIteration):
            next(iterator)
        tree.update({b"a": b"1", b"b": b"2", b"c": b"3"})
    unstarted = tree.irange(b"b")
    tree[b"e"] = b"5"
    with pytest.raises(RuntimeError):
        next(unstarted)


@needs_c
def test_an_iterator_keeps_its_tree_alive_and_a_cycle_through_it_is_collected():
    repo = RBTreeRepository()
    repo[b"k"] = b"v"
    iterator = iter(repo)
    del repo
    gc.collect()
    assert list(iterator) == [b"k"]
    repo = RBTreeRepository()
    repo[b"k"] = b"v"
    repo.walker = iter(repo)                                # a cycle through the iterator
    del repo
    assert gc.collect() >= 2


# ------------------------------------------------------------------ the repository

def test_the_repository_is_a_mapping_of_bytes_like_a_dict():
    repo = RBTreeRepository("DHT 't' bucket 3")
    assert isinstance(repo, MutableMapping) and isinstance(repo, Mapping)
    repo.update({b"b": b"2", b"a": b"1"})
    repo.setdefault(b"c", b"3")
    assert repo == {b"a": b"1", b"b": b"2", b"c": b"3"}
    assert repo != {b"a": b"1"}
    assert list(repo.keys()) == [b"a", b"b", b"c"]
    assert list(reversed(repo.keys())) == [b"c", b"b", b"a"]
    assert list(repo.values()) == [b"1", b"2", b"3"]
    assert list(repo.items())[0] == (b"a", b"1")
    assert (b"a", b"1") in repo.items() and b"1" in repo.values()
    assert repo.keys() & {b"a", b"z"} == {b"a"}
    assert repr(repo) == "RBTreeRepository({b'a': b'1', b'b': b'2', b'c': b'3'})"
    for clone in (repo.copy(), copy.copy(repo), copy.deepcopy(repo),
                  pickle.loads(pickle.dumps(repo))):
        assert type(clone) is RBTreeRepository and clone == repo
        assert clone.label == "DHT 't' bucket 3"
        clone[b"d"] = b"4"
        assert b"d" not in repo
    with pytest.raises(TypeError):
        hash(repo)
    assert repo.popitem(last=False) == (b"a", b"1")
    assert repo.pop(b"c") == b"3" and len(repo) == 1


def test_the_repository_reports_memory_errors_as_a_storage_fault(monkeypatch):
    from domus.storage import StorageFault, rbt

    def out_of_memory(self, key, value):
        raise MemoryError("no room")

    repo = RBTreeRepository("DHT 't' bucket 3")
    monkeypatch.setattr(rbt, "RecordTree", type("Full", (), {"put": out_of_memory}))
    with pytest.raises(StorageFault, match="DHT 't' bucket 3: no memory for a record of "
                                           "3 bytes"):
        repo.put(b"ke", b"y")


# ------------------------------------------------------------------ leaks

@needs_c
@pytest.mark.skipif(os.environ.get("PYTHONMALLOC", "").startswith("malloc"),
                    reason="sys.getallocatedblocks() counts nothing under PYTHONMALLOC=malloc")
def test_no_leaks():
    def churn() -> None:
        tree = CTree()
        rng = random.Random(1)
        for number in range(3000):
            tree.put(b"%d" % rng.randrange(1000), rng.randbytes(rng.choice([3, 300, 3000])))
            if number % 3 == 0:
                tree.pop(b"%d" % rng.randrange(1000), None)
        list(tree.irange(b"1", b"5", items=True))
        iterator = iter(tree)
        next(iterator)
        tree.put(b"new key", b"v")
        with pytest.raises(RuntimeError):
            next(iterator)
        with pytest.raises(TypeError):
            tree.put("k", b"v")
        tree.clear()

    churn()
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(5):
        churn()
    gc.collect()
    assert sys.getallocatedblocks() - before < 50


@pytest.mark.parametrize("tree_type", IMPLEMENTATIONS + [
    pytest.param(getattr(_recordtree, "RecordTree", None), id="c-core", marks=needs_c)])
def test_pickling_and_copying_keep_every_record(tree_type: Any) -> None:
    tree = tree_type()
    for number in range(300):
        tree.put(b"%03d" % number, b"v" * number)
    for clone in (pickle.loads(pickle.dumps(tree)), copy.copy(tree), copy.deepcopy(tree)):
        assert type(clone) is tree_type
        assert list(clone.irange(items=True)) == list(tree.irange(items=True))
        clone.put(b"new", b"")
        assert len(clone) == len(tree) + 1
