"""Every storage platform on every medium it supports behaves as a dict of
bytes keyed by bytes: the same random operations against a dict model, key
ranges on the ordered ones, large values, and what a disk store keeps when
it is closed and opened again."""

from __future__ import annotations

import os
import random
import signal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domus.storage import PLATFORMS, rbt

TECHNOLOGIES = [(platform, medium) for platform, spec in sorted(PLATFORMS.items())
                for medium in sorted(spec.media)]
ORDERED = [(platform, medium) for platform, medium in TECHNOLOGIES
           if PLATFORMS[platform].ordered]


def open_store(platform: str, medium: str, home: str, durability: str | None = None):
    """A store as a service opens it: durability as domus.wire.attributes fills it
    in (none in RAM, async on disk) unless given."""
    if durability is None:
        durability = "async" if medium == "disk" else "none"
    return PLATFORMS[platform].open_store(medium, home, "DHT 't'", durability)


@pytest.fixture(params=TECHNOLOGIES, ids=[f"{p}-{m}" for p, m in TECHNOLOGIES])
def technology(request):
    return request.param


def test_the_technologies_are_the_designs():
    assert set(TECHNOLOGIES) == {
        ("python-dict", "ram"), ("domus-rbt", "ram"),
        ("domus-bsddb-btree", "ram"), ("domus-bsddb-btree", "disk"),
        ("domus-bsddb-hash", "ram"), ("domus-bsddb-hash", "disk")}


keys = st.binary(max_size=12)
operations = st.lists(st.tuples(st.sampled_from(["put", "get", "delete", "contains"]), keys,
                                st.binary(max_size=40)), max_size=120)


@pytest.mark.parametrize("platform, medium", TECHNOLOGIES)
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=operations)
def test_random_operations_match_a_dict(tmp_path_factory, platform, medium, ops):
    store = open_store(platform, medium, str(tmp_path_factory.mktemp("store")))
    try:
        repo = store.open(3)
        model: dict[bytes, bytes] = {}
        for op, key, value in ops:
            if op == "put":
                assert repo.put(key, value) == (key not in model)
                model[key] = value
            elif op == "get":
                assert repo.get(key) == model.get(key)
            elif op == "delete":
                assert repo.delete(key) == (key in model)
                model.pop(key, None)
            else:
                assert repo.contains(key) == (key in model)
            assert len(repo) == len(model)
        assert sorted(repo.key_snapshot()) == sorted(model)
        if PLATFORMS[platform].ordered:
            assert repo.key_snapshot() == sorted(model)       # in key order
    finally:
        store.destroy()


@pytest.mark.parametrize("platform, medium", ORDERED)
@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(stored=st.lists(keys, max_size=40, unique=True), low=st.none() | keys,
       high=st.none() | keys, inclusive=st.tuples(st.booleans(), st.booleans()),
       reverse=st.booleans(), items=st.booleans())
def test_ordered_platforms_walk_key_ranges(tmp_path_factory, platform, medium, stored, low,
                                           high, inclusive, reverse, items):
    store = open_store(platform, medium, str(tmp_path_factory.mktemp("store")))
    try:
        repo = store.open(0)
        for key in stored:
            repo.put(key, key[::-1])
        expected = [key for key in sorted(stored)
                    if (low is None or low < key or (inclusive[0] and key == low))
                    and (high is None or key < high or (inclusive[1] and key == high))]
        if reverse:
            expected.reverse()
        if items:
            expected = [(key, key[::-1]) for key in expected]
        got = list(repo.key_range(low, high, inclusive=inclusive, reverse=reverse,
                                  items=items))
        assert got == expected
    finally:
        store.destroy()


def test_unordered_platforms_refuse_key_ranges(tmp_path):
    store = open_store("domus-bsddb-hash", "ram", str(tmp_path))
    try:
        repo = store.open(0)
        assert not repo.ordered
        with pytest.raises(NotImplementedError, match="keeps no key order"):
            repo.key_range(None, None)
    finally:
        store.destroy()


def test_buckets_are_separate_and_large_values_round_trip(technology, tmp_path):
    store = open_store(*technology, str(tmp_path))
    try:
        first, second = store.open(0), store.open(1)
        big = os.urandom(16 * 1024 * 1024)
        assert first.put(b"k", big)
        assert second.put(b"k", b"small")
        assert first.get(b"k") == big and second.get(b"k") == b"small"
        rng = random.Random(7)
        values = {rng.randbytes(8): rng.randbytes(rng.randint(0, 70_000)) for _ in range(200)}
        for key, value in values.items():
            second.put(key, value)
        assert all(second.get(key) == value for key, value in values.items())
        assert len(first) == 1 and len(second) == 201
        with pytest.raises(ValueError, match="already open"):
            store.open(0)
    finally:
        store.destroy()


@pytest.mark.parametrize("platform", ["domus-bsddb-btree", "domus-bsddb-hash"])
def test_a_disk_store_keeps_its_buckets_across_close_and_open(platform, tmp_path):
    home = str(tmp_path / "dht")
    store = open_store(platform, "disk", home)
    repo = store.open(5)
    for number in range(1000):
        repo.put(b"key-%d" % number, b"value-%d" % number)
    repo.delete(b"key-7")
    store.open(6).put(b"other", b"bucket")
    store.close()
    assert sorted(os.listdir(home)) == ["bucket-5.db", "bucket-6.db"]

    store = open_store(platform, "disk", home)
    try:
        repo = store.open(5)
        assert len(repo) == 999
        assert repo.get(b"key-999") == b"value-999" and not repo.contains(b"key-7")
        assert store.open(6).get(b"other") == b"bucket"
        store.remove(6)                                   # a bucket that moved away
        assert sorted(os.listdir(home)) == ["bucket-5.db"]
    finally:
        store.destroy()
    assert not os.path.exists(home)


def test_stores_count_the_bytes_they_hold(technology, tmp_path):
    """Berkeley DB counts its pages, the record trees of domus-rbt their
    arenas; a dict of Python objects cannot tell."""
    platform, medium = technology
    home = str(tmp_path / "dht")
    store = open_store(platform, medium, home)
    try:
        if platform == "python-dict" or (platform == "domus-rbt" and not rbt.C_EXTENSION):
            store.open(0).put(b"k", b"v")
            assert store.storage_bytes() is None            # Python objects: cannot tell
            return
        assert store.storage_bytes() == 0                   # no bucket open yet
        repos = [store.open(0), store.open(1)]
        sizes = [store.storage_bytes()]
        if platform.startswith("domus-bsddb"):
            assert sizes[0] > 0                             # a database's first pages
        else:
            assert sizes[0] == 0                            # an empty tree holds nothing
        for batch in range(3):
            for number in range(3000):
                repos[number % 2].put(b"key-%d-%d" % (batch, number), b"v" * 50)
            sizes.append(store.storage_bytes())
        assert sizes == sorted(sizes) and len(set(sizes)) == len(sizes)
        assert sizes[-1] - sizes[0] >= 9000 * 60            # the records' bytes, at least
        if medium == "disk":
            store.flush()
            on_disk = sum(entry.stat().st_size for entry in os.scandir(home))
            assert store.storage_bytes() == on_disk
        store.remove(1)
        assert store.storage_bytes() == repos[0].storage_bytes() < sizes[-1]
    finally:
        store.destroy()


def test_a_ram_store_keeps_nothing_on_disk(tmp_path):
    home = tmp_path / "dht"
    for platform in ("domus-bsddb-btree", "domus-bsddb-hash"):
        store = open_store(platform, "ram", str(home))
        store.open(0).put(b"k", b"v")
        store.flush()
        store.close()
        assert not home.exists()
        store = open_store(platform, "ram", str(home))
        assert store.open(0).get(b"k") is None            # RAM: gone with the store
        store.destroy()


@pytest.mark.parametrize("platform", ["domus-bsddb-btree", "domus-bsddb-hash"])
def test_sync_durability_keeps_every_acknowledged_write_through_a_kill(platform, tmp_path):
    """A child process writes to a sync disk store and tells the parent of
    each put as it returns; the parent kills it with SIGKILL mid-stream,
    opens the store again (Berkeley DB recovers from its log) and finds
    every acknowledged write."""
    home = str(tmp_path / "dht")
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:                                        # the writer
        try:
            os.close(read_end)
            store = open_store(platform, "disk", home, durability="sync")
            repo = store.open(1)
            for number in range(1_000_000):
                repo.put(b"key-%d" % number, b"value-%d" % number)
                os.write(write_end, number.to_bytes(4, "big"))
        finally:
            os._exit(0)
    os.close(write_end)
    acknowledged = []
    with os.fdopen(read_end, "rb") as acks:
        while len(acknowledged) < 300:
            acknowledged.append(int.from_bytes(acks.read(4), "big"))
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        while chunk := acks.read(4):
            if len(chunk) == 4:
                acknowledged.append(int.from_bytes(chunk, "big"))
    store = open_store(platform, "disk", home, durability="sync")
    try:
        repo = store.open(1)
        assert len(repo) >= len(acknowledged)
        missing = [number for number in acknowledged
                   if repo.get(b"key-%d" % number) != b"value-%d" % number]
        assert not missing, f"{len(missing)} acknowledged writes lost, e.g. {missing[:5]}"
    finally:
        store.destroy()
