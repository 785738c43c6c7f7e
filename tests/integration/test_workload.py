"""A long random workload against a real deployment, checked op by op
against a Python dict, plus the value-size and key-type edges.  Tests on
``any_cluster`` run against the blocking and the asyncio client alike.

Seeded: set DOMUS_TEST_SEED to replay a failure (the seed is in every
failure message)."""

from __future__ import annotations

import enum
import multiprocessing
import os
import random
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import domus
from domus.client.lookup import DENSE_TABLE_LIMIT
from domus.errors import (
    KeyTooLarge,
    KeyTypeError,
    ValueDecodeError,
    ValueTooLarge,
    ValueTypeError,
)
from domus.placement.bucketmap import BucketMap
from domus.storage import PLATFORMS
from domus.wire import protocol as wire
from domus.wire.keys import encode_key

from .support import (
    RawUdp,
    bucket_of_key,
    first_difference,
    owner_of,
    same_value,
    service_addresses,
)

SEED = int(os.environ.get("DOMUS_TEST_SEED", "1979"))
MISSING = object()

NON_ASCII = ["é", "ß", "中文", "日本語", "한국어", "Ελληνικά", "кириллица", "עברית", "العربية",
             "🦆", "👩‍👩‍👧", "e\u0301", "\u200b", "\x00", "\uffff", "\U0010ffff"]
INT_EDGES = [0, 1, -1, 2**31 - 1, -(2**31), 2**63 - 1, -(2**63), 2**63, -(2**63) - 1,
             2**64 - 1, 2**64, -(2**64), 2**127, -(2**127) + 1, 10**40, -(10**40)]


# ------------------------------------------------------------------ generators

def random_key(rng: random.Random) -> int | str | bytes:
    kind = rng.random()
    if kind < 0.35:
        shape = rng.random()
        if shape < 0.5:
            return rng.randint(-1000, 1000)
        if shape < 0.65:
            return rng.choice(INT_EDGES)
        if shape < 0.8:
            return rng.randint(-(2**63), 2**63 - 1)
        bits = rng.randint(65, 400)           # beyond 64 bits, either sign
        return rng.choice((1, -1)) * rng.getrandbits(bits)
    if kind < 0.7:
        shape = rng.random()
        if shape < 0.4:
            return "".join(rng.choice("abcdefgxyz0123456789 _-") for _ in range(rng.randint(0, 12)))
        if shape < 0.8:
            return "".join(rng.choice(NON_ASCII) for _ in range(rng.randint(1, 5)))
        if shape < 0.97:
            return str(rng.randint(-1000, 1000))  # collides with nothing: "1" is not 1
        return "\ud800" + rng.choice(NON_ASCII)   # a lone surrogate survives the trip
    shape = rng.random()
    if shape < 0.2:
        return str(rng.randint(-1000, 1000)).encode()
    return rng.randbytes(rng.randint(0, 40))


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-(2**63), 2**64 - 1)
    if kind == 3:
        return rng.randint(-100, 100)
    if kind == 4:
        return rng.choice([0.0, -0.0, 1.5, -2.25, 1e308, -1e-308, 5e-324, float("inf"),
                           float("-inf"), rng.uniform(-1e9, 1e9), rng.random()])
    if kind == 5:
        return "".join(rng.choice(NON_ASCII + ["a", "b", " "]) for _ in range(rng.randint(0, 8)))
    if kind == 6:
        return rng.randbytes(rng.randint(0, 64))
    if kind == 7:
        return ""
    if kind == 8:
        return b""
    if kind in (9, 10):
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 5))]
    keys: list[Any] = [f"f{rng.randint(0, 20)}" if rng.random() < 0.7 else rng.randint(-5, 5)
                       for _ in range(rng.randint(0, 5))]
    return {key: random_value(rng, depth + 1) for key in keys}


# ------------------------------------------------------------------ the workload

class Workload:
    """Random operations on a Dht and on a dict model; every result is
    compared with the model's."""

    def __init__(self, dht: Any, seed: int) -> None:
        self.dht = dht
        self.seed = seed
        self.rng = random.Random(seed)
        self.model: dict[Any, Any] = {}
        # A pool of keys, so that gets, deletes and overwrites hit often.
        self.pool = list({random_key(self.rng) for _ in range(1500)} | {1, "1", b"1", 0, "", b""})
        self.done = 0
        self.counts: dict[str, int] = {}

    def key(self) -> Any:
        return self.rng.choice(self.pool) if self.rng.random() < 0.9 else random_key(self.rng)

    def check(self, what: str, actual: Any, expected: Any) -> None:
        assert same_value(actual, expected), (
            f"op #{self.done} {what}: got {actual!r:.200}, expected {expected!r:.200} "
            f"(seed {self.seed}; replay with DOMUS_TEST_SEED={self.seed})")

    def check_whole(self) -> None:
        actual = dict(self.dht.items())
        problems = first_difference(actual, self.model)
        assert not problems, (f"after op #{self.done}, items() differs from the model "
                              f"(seed {self.seed}): {problems}")
        self.check("len", len(self.dht), len(self.model))

    def run(self, operations: int, whole_every: int) -> None:
        ops = [(self.op_put, 22), (self.op_setitem, 8), (self.op_getitem, 14),
               (self.op_get_default, 10), (self.op_delete, 8), (self.op_delitem, 4),
               (self.op_contains, 10), (self.op_put_many, 5), (self.op_get_many, 5),
               (self.op_len, 2), (self.op_pop, 2), (self.op_setdefault, 2)]
        functions = [function for function, _weight in ops]
        weights = [weight for _function, weight in ops]
        for self.done in range(1, operations + 1):
            operation = self.rng.choices(functions, weights)[0]
            operation()
            name = operation.__name__[3:]
            self.counts[name] = self.counts.get(name, 0) + 1
            if self.done % whole_every == 0:
                self.check_whole()
        if operations % whole_every:
            self.check_whole()      # the end, unless the last operation just checked it

    # -- operations
    def op_put(self) -> None:
        key, value = self.key(), random_value(self.rng)
        self.check(f"put({key!r})", self.dht.put(key, value), key not in self.model)
        self.model[key] = value

    def op_setitem(self) -> None:
        key, value = self.key(), random_value(self.rng)
        self.dht[key] = value
        self.model[key] = value

    def op_getitem(self) -> None:
        key = self.key()
        try:
            actual = self.dht[key]
        except KeyError as exc:
            assert key not in self.model, (f"op #{self.done}: dht[{key!r}] raised KeyError "
                                           f"but the model has it (seed {self.seed})")
            assert exc.args == (key,)
            return
        assert key in self.model, f"op #{self.done}: dht[{key!r}] = {actual!r:.80} but the " \
                                  f"model has no such key (seed {self.seed})"
        self.check(f"dht[{key!r}]", actual, self.model[key])

    def op_get_default(self) -> None:
        key = self.key()
        if self.rng.random() < 0.5:
            actual = self.dht.get(key, MISSING)
            assert actual is MISSING if key not in self.model else actual is not MISSING, \
                f"op #{self.done}: get({key!r}, default) disagrees on presence (seed {self.seed})"
            if key in self.model:
                self.check(f"get({key!r}, default)", actual, self.model[key])
        else:
            self.check(f"get({key!r})", self.dht.get(key), self.model.get(key))

    def op_delete(self) -> None:
        key = self.key()
        self.check(f"delete({key!r})", self.dht.delete(key), key in self.model)
        self.model.pop(key, None)

    def op_delitem(self) -> None:
        key = self.key()
        try:
            del self.dht[key]
        except KeyError:
            assert key not in self.model, f"op #{self.done}: del dht[{key!r}] raised " \
                                          f"KeyError but the model has it (seed {self.seed})"
            return
        assert key in self.model, f"op #{self.done}: del dht[{key!r}] succeeded on a key " \
                                  f"the model lacks (seed {self.seed})"
        del self.model[key]

    def op_contains(self) -> None:
        key = self.key()
        self.check(f"{key!r} in dht", key in self.dht, key in self.model)

    def op_put_many(self) -> None:
        items = {self.key(): random_value(self.rng) for _ in range(self.rng.randint(0, 40))}
        new = sum(key not in self.model for key in items)
        pairs: Any = items if self.rng.random() < 0.5 else list(items.items())
        self.check(f"put_many({len(items)} items)", self.dht.put_many(pairs), new)
        self.model.update(items)

    def op_get_many(self) -> None:
        keys = [self.key() for _ in range(self.rng.randint(0, 40))]
        expected = {key: self.model[key] for key in keys if key in self.model}
        actual = self.dht.get_many(keys)
        problems = first_difference(actual, expected)
        assert not problems, f"op #{self.done}: get_many differs (seed {self.seed}): {problems}"

    def op_len(self) -> None:
        self.check("len", len(self.dht), len(self.model))

    def op_pop(self) -> None:
        key = self.key()
        self.check(f"pop({key!r}, default)", self.dht.pop(key, MISSING),
                   self.model.pop(key, MISSING))

    def op_setdefault(self) -> None:
        key, value = self.key(), random_value(self.rng)
        self.check(f"setdefault({key!r})", self.dht.setdefault(key, value),
                   self.model.setdefault(key, value))


TECHNOLOGIES = [(platform, medium) for platform, spec in sorted(PLATFORMS.items())
                for medium in sorted(spec.media)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("platform, medium", TECHNOLOGIES,
                         ids=[f"{platform}-{medium}" for platform, medium in TECHNOLOGIES])
def test_random_workload_matches_a_dict(any_cluster, shared_cluster, platform, medium):
    dht = any_cluster.create_dht("workload", platform=platform, storage=medium)
    assert (dht.descriptor["platform"], dht.descriptor["storage"]) == (platform, medium)
    workload = Workload(dht, SEED)
    # (through the asyncio client each call also crosses to its loop's
    # thread and back: fewer operations keep the suite's time)
    operations = 20_000 if any_cluster is shared_cluster else 8_000
    started = time.monotonic()
    workload.run(operations, whole_every=2_500)
    elapsed = time.monotonic() - started
    assert len(workload.model) > 500, "the workload should leave a sizeable DHT behind"
    assert set(workload.counts) == {"put", "setitem", "getitem", "get_default", "delete",
                                    "delitem", "contains", "put_many", "get_many", "len", "pop",
                                    "setdefault"}
    # keys(), values() and iteration agree with items() and the model too.
    assert sorted(map(repr, dht)) == sorted(map(repr, workload.model))
    assert sorted(map(repr, dht.values())) == sorted(map(repr, workload.model.values()))
    print(f"{operations:,} ops in {elapsed:.1f}s; {len(workload.model)} records; "
          f"{workload.counts}")


@pytest.mark.parametrize("hash_name, buckets", [("blake2b", 1), ("sha256", 8),
                                                ("xxh64", 4096)])
def test_workload_with_other_hashes_and_bucket_counts(any_cluster, hash_name, buckets):
    dht = any_cluster.create_dht(f"workload-{hash_name}", hash=hash_name, buckets=buckets)
    assert dht.bucket_count == buckets
    workload = Workload(dht, SEED + buckets)
    workload.run(2_000, whole_every=1_000)
    assert sum(dht.records_by_service().values()) == len(workload.model)


def test_a_dht_with_more_buckets_than_a_client_tabulates(shared_cluster):
    """Past DENSE_TABLE_LIMIT buckets a client finds owners by floor lookups
    in its BucketMap instead of a per-bucket list; the answers are the same.
    (The blocking client only: the table is domus.client.lookup's, which
    every client shares, and a scan of 131,072 buckets is long.)"""
    buckets = DENSE_TABLE_LIMIT * 2
    dht = shared_cluster.create_dht("many-buckets", buckets=buckets, platform="domus-rbt")
    assert dht.bucket_count == buckets
    assert isinstance(dht._owners, BucketMap)
    assert dht.layout.range_count() == len(dht.descriptor["storage_services"])
    workload = Workload(dht, SEED + 7)
    # The whole comparison by key, not by a scan (a request per bucket, 131,072
    # of them, the lookups' answers being what this test is about): every key
    # of the model read back in one get_many, and the count.
    workload.check_whole = lambda: (  # type: ignore[method-assign]
        workload.check("get_many(every key)", dht.get_many(list(workload.model)),
                       workload.model),
        workload.check("len", len(dht), len(workload.model)))
    workload.run(2_000, whole_every=1_000)
    assert sum(dht.records_by_service().values()) == len(workload.model)


# ------------------------------------------------------------------ value sizes

# Sizes around the datagram limits: a request over DEFAULT_MAX_DATAGRAM goes
# over TCP; a reply over MAX_UDP_PAYLOAD makes the client ask again over TCP.
VALUE_SIZES = [0, 1, 1000, wire.DEFAULT_MAX_DATAGRAM - 100, wire.DEFAULT_MAX_DATAGRAM,
               wire.MAX_UDP_PAYLOAD - 100, wire.MAX_UDP_PAYLOAD, 70_000, 1 << 20, 3 << 20]


def test_values_of_every_size_round_trip(any_cluster):
    dht = any_cluster.create_dht("sizes")
    rng = random.Random(SEED)
    expected = {}
    for size in VALUE_SIZES:
        value = rng.randbytes(size)
        assert dht.put(f"bytes-{size}", value) is True
        expected[f"bytes-{size}"] = value
    text = "ünïcødé ✓ " * (1 << 17)  # 1.5 MiB of UTF-8
    dht["text"] = text
    expected["text"] = text
    nested = {"rows": [rng.randbytes(1 << 10) for _ in range(1024)], "n": 1}   # 1 MiB in a map
    dht.put_many({"nested": nested, "small": 1})
    expected.update(nested=nested, small=1)

    for key, value in expected.items():
        assert same_value(dht[key], value), f"{key} did not round-trip"
    assert first_difference(dht.get_many(list(expected)), expected) == []
    assert first_difference(dict(dht.items()), expected) == []
    assert len(dht) == len(expected)
    # Overwriting a big value with a small one and back works both ways.
    big_key = f"bytes-{1 << 20}"
    assert dht.put(big_key, b"small") is False
    assert dht[big_key] == b"small"
    assert dht.put(big_key, expected[big_key]) is False
    assert dht.delete(big_key) is True
    assert big_key not in dht


@pytest.mark.timeout(120)
def test_value_at_the_limit_is_stored_and_one_byte_more_is_refused(any_cluster):
    dht = any_cluster.create_dht("limits")
    header = 5  # msgpack bin 32: one type byte and a 4-byte length
    at_limit = b"\xab" * (wire.MAX_VALUE_BYTES - header)
    assert dht.put("at-limit", at_limit) is True
    assert dht["at-limit"] == at_limit

    over = b"\xcd" * (wire.MAX_VALUE_BYTES - header + 1)
    with pytest.raises(ValueTooLarge) as raised:
        dht.put("over", over)
    assert isinstance(raised.value, ValueError)
    assert str(wire.MAX_VALUE_BYTES) in str(raised.value)
    with pytest.raises(ValueTooLarge):
        dht["over"] = over
    with pytest.raises(ValueTooLarge):
        dht.put_many({"fine": 1, "over": over})
    assert "over" not in dht
    assert "fine" not in dht, "put_many stored part of a batch it refused"
    assert len(dht) == 1


def test_keys_are_as_distinct_as_in_a_dict(any_cluster):
    class Colour(enum.IntEnum):
        RED = 1

    class Name(str):
        pass

    dht = any_cluster.create_dht("identity")
    dht.put_many({1: "int", "1": "str", b"1": "bytes", 2**64 + 1: "big", -(2**64) - 1: "-big"})
    assert len(dht) == 5
    assert (dht[1], dht["1"], dht[b"1"]) == ("int", "str", "bytes")
    assert dht[2**64 + 1] == "big" and dht[-(2**64) - 1] == "-big"
    assert 2**64 not in dht and 1 - 2**64 not in dht
    # Equal keys are the same key, whatever their type, as in a dict.
    assert dht[True] == "int" and dht[Colour.RED] == "int" and dht[Name("1")] == "str"
    assert dht[bytearray(b"1")] == "bytes" and dht[memoryview(b"1")] == "bytes"
    dht[True] = "bool"
    assert dht[1] == "bool" and len(dht) == 5
    assert sorted(map(repr, dht)) == sorted(map(repr, [1, "1", b"1", 2**64 + 1, -(2**64) - 1]))
    assert all(type(key) in (int, str, bytes) for key in dht)


def test_tuple_keys_are_keys_like_any_other(any_cluster):
    dht = any_cluster.create_dht("tuples", platform="domus-rbt")
    records = {(1, "a"): 1, ("a", 1): 2, (): 3, ((1, 2), b"\x00"): 4, (True, "b"): 5,
               ("user", 7, "2026-11-25"): 6}
    assert dht.put_many(records) == 6
    assert dht[(1, "b")] == 5, "(True, 'b') is the key (1, 'b'), as in a dict"
    assert dht.get_many(list(records)) == records
    assert dht.delete(()) is True and () not in dht
    del records[()]
    assert dict(dht.items()) == records
    assert all(type(key) is tuple for key in dht)


PURE_PYTHON_PEER = """
import sys, domus
from domus.client import codec
assert codec.IMPLEMENTATION == "python", codec.IMPLEMENTATION
with domus.connect(sys.argv[1]) as cluster:
    dht = cluster.open_dht("tuple-paths")
    found = dht.get_many([(n, "c", (n, b"x")) for n in range(300)])
    assert found == {(n, "c", (n, b"x")): n for n in range(300)}, len(found)
    dht.put_many({(n, "python", (n, b"y")): -n for n in range(300)})
"""


def test_tuple_keys_land_in_one_bucket_from_the_c_and_the_python_path(shared_cluster,
                                                                      shared_deployment):
    """Written through the C codec, read through the pure-Python one in
    another process (each request names its bucket: a key hashed otherwise
    is looked for in another bucket, and missed), and back."""
    from domus.client import codec
    from domus.wire import keys

    assert codec.IMPLEMENTATION == "c"
    dht = shared_cluster.create_dht("tuple-paths", buckets=1024)
    dht.put_many({(n, "c", (n, b"x")): n for n in range(300)})
    for n in range(300):
        key = (n, "python", (n, b"y"))
        assert codec.bucket_of(dht._hasher, dht._shift, codec.encode_key(key)) == \
            keys.bucket_of(keys.encode_key(key), "xxh3", 1024)
    run = subprocess.run([sys.executable, "-c", PURE_PYTHON_PEER,
                          shared_deployment.supervisor_address],
                         env={**os.environ, "DOMUS_PURE_PYTHON": "1"}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert dht.get_many([(n, "python", (n, b"y")) for n in range(300)]) == \
        {(n, "python", (n, b"y")): -n for n in range(300)}


def test_long_keys(any_cluster):
    dht = any_cluster.create_dht("long-keys")
    longest = "x" * (wire.MAX_KEY_BYTES - 1)   # one tag byte + 8191 bytes: exactly the limit
    dht[longest] = 1
    assert dht[longest] == 1
    assert dict(dht.items()) == {longest: 1}
    with pytest.raises(KeyTooLarge):
        dht["x" * wire.MAX_KEY_BYTES] = 2
    with pytest.raises(KeyTooLarge):
        dht.put_many({"ok": 1, b"y" * wire.MAX_KEY_BYTES: 2})
    assert len(dht) == 1


# ------------------------------------------------------------------ bad keys and values

BAD_KEYS = [1.5, 2.0, float("nan"), None, (1, 2.0), ("a", [1]), [1], {"a": 1}, frozenset(),
            object()]


def test_a_key_of_the_wrong_type_raises_and_stores_nothing(any_cluster):
    dht = any_cluster.create_dht("bad-keys")
    dht["present"] = "yes"
    for bad_key in BAD_KEYS:
        attempts = {
            "put": lambda key=bad_key: dht.put(key, 1),
            "setitem": lambda key=bad_key: dht.__setitem__(key, 1),
            "getitem": lambda key=bad_key: dht[key],
            "get": lambda key=bad_key: dht.get(key),
            "contains": lambda key=bad_key: key in dht,
            "delete": lambda key=bad_key: dht.delete(key),
            "delitem": lambda key=bad_key: dht.__delitem__(key),
            "put_many": lambda key=bad_key: dht.put_many([("fine", 1), (key, 2)]),
            "get_many": lambda key=bad_key: dht.get_many(["present", key]),
        }
        for name, attempt in attempts.items():
            with pytest.raises(KeyTypeError) as raised:
                attempt()
            assert isinstance(raised.value, TypeError), name
            assert "int, str, bytes or a tuple of those" in str(raised.value), name
    assert dict(dht.items()) == {"present": "yes"}
    assert len(dht) == 1


def test_a_value_msgpack_cannot_encode_raises_and_stores_nothing(any_cluster):
    dht = any_cluster.create_dht("bad-values")
    for bad_value in [object(), 2**64, -(2**63) - 1, {1, 2}, [1, object()], {"a": {"b": {3j}}}]:
        with pytest.raises(ValueTypeError) as raised:
            dht.put("key", bad_value)
        assert isinstance(raised.value, TypeError)
        with pytest.raises(ValueTypeError):
            dht.put_many({"other": 1, "key": bad_value})
    assert len(dht) == 0
    assert "key" not in dht and "other" not in dht


# Stored bytes no Domus client writes (another program put them there, or
# they rotted): a map keyed by a list, a cut-short string, two values, a
# type byte msgpack never uses, invalid UTF-8.
NOT_MSGPACK = [b"\x81\x90\x01", b"\xa5ab", b"\x01\x02", b"\xc1", b"\xa2\xff\xfe"]


def test_a_value_no_client_wrote_is_a_value_decode_error_naming_dht_and_key(shared_cluster):
    dht = shared_cluster.create_dht("foreign-values", platform="domus-rbt")
    dht.put("good", [1, "x"])
    owners = service_addresses(shared_cluster)
    for number, raw in enumerate(NOT_MSGPACK):
        key = f"foreign-{number}"
        with RawUdp(owners[owner_of(dht, key)]) as service:
            message = wire.encode_keyed(wire.OP_PUT, service.next_id(), service.client_id,
                                        dht.id, bucket_of_key(dht, key), encode_key(key), raw)
            assert service.call(wire.OP_PUT, message[wire.REQUEST_HEADER_SIZE:])[0] == wire.ST_OK
        reads = [lambda key: dht[key], lambda key: dht.get(key),
                 lambda key: dht.get_many(["good", key]), lambda _key: dict(dht.items()),
                 lambda _key: list(dht.values()),
                 lambda key: list(dht.irange(key, key, items=True))]
        for read in reads:
            with pytest.raises(ValueDecodeError) as raised:
                read(key)
            error = raised.value
            assert isinstance(error, ValueError)
            assert (error.dht, error.key) == ("foreign-values", key)
            assert str(error).startswith(f"DHT 'foreign-values', key {key!r}: the stored "
                                         f"value ({len(raw)} byte")
            assert "could not be decoded" in str(error)
        assert key in dht                                 # nothing was lost or changed
        assert list(dht.irange(key, key)) == [key]
        dht.delete(key)
    assert dict(dht.items()) == {"good": [1, "x"]}


# ------------------------------------------------------------------ batches and scans

def test_batches_larger_than_a_datagram(any_cluster):
    dht = any_cluster.create_dht("batches")
    rng = random.Random(SEED)
    small = {number: rng.randbytes(1000) for number in range(5000)}       # ~5 MB in one call
    assert dht.put_many(small) == 5000
    assert dht.get_many(range(5000)) == small
    # Values that fill a reply datagram one or two at a time, then values that
    # do not fit one at all, mixed with absent keys and small ones.
    medium = {f"m{number}": rng.randbytes(30_000) for number in range(20)}
    large = {f"l{number}": rng.randbytes(100_000) for number in range(5)}
    assert dht.put_many(list(medium.items()) + list(large.items())) == 25
    wanted = list(medium) + list(large) + ["absent", 1, 2] + [f"absent{n}" for n in range(50)]
    rng.shuffle(wanted)
    expected = {**medium, **large, 1: small[1], 2: small[2]}
    assert first_difference(dht.get_many(wanted), expected) == []
    assert len(dht) == 5025
    assert dht.put_many(small) == 0          # all replaced, none new


@pytest.mark.timeout(120)
def test_a_scan_sees_every_stable_key_once_while_others_change(deployment, cluster):
    dht = cluster.create_dht("churn", buckets=2)     # big buckets: scans take many pages
    stable = {f"stable-{number}": "s" * 60 for number in range(6000)}
    dht.put_many(stable)
    stop = threading.Event()
    written: list[int] = []
    failures: list[BaseException] = []

    def churn() -> None:
        try:
            with domus.connect(deployment.supervisor_address, timeout=5) as other:
                churned = other.open_dht("churn")
                number = 0
                while not stop.is_set():
                    churned[f"churn-{number}"] = number
                    if number >= 20:
                        churned.delete(f"churn-{number - 20}")
                    written.append(number)
                    number += 1
        except BaseException as exc:
            failures.append(exc)

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        for _round in range(3):
            keys = [key for key, _value in dht.items()]
            assert len(keys) == len(set(keys)), "a scan returned a key twice"
            assert set(stable) <= set(keys), "a scan missed a key present all along"
            assert all(key in stable or key.startswith("churn-") for key in keys)
    finally:
        stop.set()
        writer.join(30)
    assert not failures, failures
    assert written, "the writer never ran"
    last = written[-1]
    expected = {**stable, **{f"churn-{n}": n for n in range(max(0, last - 19), last + 1)}}
    assert first_difference(dict(dht.items()), expected) == []


@pytest.mark.timeout(120)
def test_forked_workers_share_a_connection(shared_cluster):
    """A job connects once, then forks workers: each must get its own client
    id and sockets, or their requests collide in the reply cache."""
    dht = shared_cluster.create_dht("forked")
    dht["parent"] = "before fork"
    workers, per_worker = 4, 400

    def work(worker: int) -> None:
        for number in range(per_worker):
            dht[f"w{worker}-{number}"] = [worker, number]
        got = dht.get_many(f"w{worker}-{number}" for number in range(per_worker))
        ok = got == {f"w{worker}-{n}": [worker, n] for n in range(per_worker)}
        ok = ok and dht["parent"] == "before fork"
        raise SystemExit(0 if ok else 3)

    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=work, args=(worker,)) for worker in range(workers)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(60)
    assert [process.exitcode for process in processes] == [0] * workers
    assert len(dht) == 1 + workers * per_worker
    assert dht["w3-399"] == [3, 399]
    dht["parent"] = "after fork"        # the parent's own channels still work
    assert dht["parent"] == "after fork"
