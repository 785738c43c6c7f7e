"""Storage faults: a bucket whose Berkeley DB file is corrupt gives
STORAGE_ERROR naming the bucket, a disk that fills up or a RAM Berkeley DB
whose cache is full gives STORAGE_FULL; the service goes on serving its
other buckets and loses nothing it had stored.  Through the C hot path
too: it declines what fails, and the Python handler reports it."""

from __future__ import annotations

import itertools
import os
import subprocess

import pytest

from domus.service.handler import RequestHandler
from domus.service.hosted import dht_home
from domus.storage import StorageFault, bsddb
from domus.wire import protocol as wire
from domus.wire.keys import bucket_of, encode_key

DHT_ID = 1
BUCKETS = 8


def descriptor(platform="domus-bsddb-btree", storage="disk"):
    return {
        "id": DHT_ID, "name": "faulty", "buckets": BUCKETS, "hash": "xxh3",
        "storage": storage, "platform": platform, "routing": "chord", "lookup": "D",
        "state": "active",
        "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": BUCKETS}],
        "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": BUCKETS}],
    }


def key_in(bucket, prefix="k"):
    number = 0
    while True:
        encoded = encode_key(f"{prefix}{number}")
        if bucket_of(encoded, "xxh3", BUCKETS) == bucket:
            return encoded
        number += 1


REQUEST_IDS = itertools.count(1)


def request(op, key, value=b""):
    return wire.encode_keyed(op, next(REQUEST_IDS), 7, DHT_ID, bucket_of(key, "xxh3", BUCKETS),
                             key, value)


def status_and_message(reply):
    return reply[2], reply[wire.REPLY_HEADER_SIZE:]


@pytest.mark.parametrize("platform", ["domus-bsddb-btree", "domus-bsddb-hash"])
def test_a_corrupt_bucket_file_fails_that_bucket_only(tmp_path, platform):
    home = dht_home(str(tmp_path), DHT_ID)
    os.makedirs(home)
    with open(os.path.join(home, "bucket-3.db"), "wb") as corrupt:
        corrupt.write(b"this is not a Berkeley DB file" * 100)
    handler = RequestHandler("s1", data_dir=str(tmp_path))
    handler.assign(descriptor(platform))

    bad, good = key_in(3), key_in(2)
    for op in (wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS):
        value = b"v" if op == wire.OP_PUT else b""
        status, message = status_and_message(handler.handle(request(op, bad, value)))
        assert status == wire.ST_STORAGE_ERROR
        assert b"DHT 'faulty' bucket 3" in message and b"bucket-3.db" in message
    assert handler.handle(request(wire.OP_PUT, good, b"v"))[2] == wire.ST_OK
    assert handler.handle(request(wire.OP_GET, good))[wire.REPLY_HEADER_SIZE:] == b"v"
    assert handler.counters["storage_errors"] == 4
    assert handler.counters["internal_errors"] == 0
    with open(os.path.join(home, "bucket-3.db"), "rb") as kept:   # left for inspection
        assert kept.read().startswith(b"this is not")


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs as a service's data dir (needs root)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount_point)],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a small tmpfs here: {exc}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_gives_a_storage_error_and_keeps_what_was_stored(small_disk):
    handler = RequestHandler("s1", data_dir=small_disk)
    handler.assign(descriptor())
    # As transports call it: the C hot path first (it declines what fails),
    # then the Python handler; with DOMUS_PURE_PYTHON=1, the Python handler.
    handle = handler.handle_fast
    value = os.urandom(60_000)
    stored = []
    status = wire.ST_OK
    for number in range(2_000):                        # 120 MB into 4 MiB
        key = encode_key(number)
        reply = handle(request(wire.OP_PUT, key, value), wire.MAX_UDP_PAYLOAD)
        status, message = status_and_message(reply)
        if status != wire.ST_OK:
            break
        stored.append(key)
        if number % 50 == 0:
            handler.flush()
    else:
        pytest.fail("120 MB went into a 4 MiB disk without an error")
    # (This handler watches no reserve: the device itself fills.)
    assert status == wire.ST_STORAGE_FULL, message
    assert b"DHT 'faulty' bucket" in message
    assert b"no space left on the device" in message or b"its filesystem has" in message
    assert handler.counters["internal_errors"] == 0
    if handler.fast is not None:
        assert handler.fast.requests >= len(stored) and handler.fast.fallbacks >= 1
    # What was acknowledged before the disk filled is still there.
    for key in stored[:40]:
        reply = handle(request(wire.OP_GET, key), 1 << 20)
        assert status_and_message(reply) == (wire.ST_OK, value)
    assert handler.stats()["dhts"]["faulty"]["records"] == len(stored)


def test_a_full_ram_cache_gives_a_storage_error_and_keeps_what_was_stored(monkeypatch):
    # (Berkeley DB looks for room for 4 s before it fails a put; the C path
    # declines such a put, noting the cache full, and the Python handler
    # refuses it, and every later put, at once: test_full_ram_cache.py.)
    monkeypatch.setattr(bsddb, "ram_cache_bytes", lambda: 1 << 20)
    handler = RequestHandler("s1")
    handler.assign(descriptor(storage="ram"))
    # As transports call it: the C hot path first (it declines what fails),
    # then the Python handler; with DOMUS_PURE_PYTHON=1, the Python handler.
    handle = handler.handle_fast
    value = os.urandom(1_000)
    stored = []
    try:
        for number in range(5_000):                    # 5 MB into a 1 MiB cache
            key = encode_key(number)
            status, message = status_and_message(handle(request(wire.OP_PUT, key, value)))
            if status != wire.ST_OK:
                break
            stored.append(key)
        else:
            pytest.fail("5 MB went into a 1 MiB cache without an error")
        # A full cache is StorageFull for the client, as a full disk is.
        assert status == wire.ST_STORAGE_FULL, message
        assert b"DHT 'faulty' bucket" in message
        assert b"its Berkeley DB cache (1 MiB, in memory) is full" in message
        assert b"Cannot allocate memory" in message
        assert handler.counters == dict(handler.counters, storage_full=1, storage_errors=0,
                                        internal_errors=0)
        batch = wire.encode_put_many(next(REQUEST_IDS), 7, DHT_ID, [
            (bucket_of(key, "xxh3", BUCKETS), key, value) for key in
            [encode_key(f"more{number}") for number in range(50)]])
        assert handle(batch)[2] == wire.ST_STORAGE_FULL
        if handler.fast is not None:
            assert handler.fast.requests == len(stored)
            assert handler.fast.fallbacks == 2
        for key in stored:
            assert status_and_message(handle(request(wire.OP_GET, key))) == (wire.ST_OK, value)
        assert handle(request(wire.OP_DELETE, stored[0]))[2] == wire.ST_OK
        assert handler.stats()["dhts"]["faulty"]["records"] >= len(stored) - 1
    finally:
        handler.close()


def test_deactivating_a_ram_dht_onto_a_full_disk_keeps_it_active_and_whole(small_disk):
    handler = RequestHandler("s1", data_dir=small_disk)
    handler.assign(descriptor("python-dict", "ram"))
    value = os.urandom(60_000)
    keys = [encode_key(number) for number in range(200)]          # 12 MB, a 4 MiB disk
    for key in keys:
        assert handler.handle(request(wire.OP_PUT, key, value))[2] == wire.ST_OK
    inactive = dict(descriptor("python-dict", "ram"), state="inactive")
    with pytest.raises(StorageFault, match="cannot save its records") as failure:
        handler.assign(inactive)
    assert "No space left on device" in str(failure.value)
    assert handler.dhts[DHT_ID].active
    assert os.listdir(dht_home(small_disk, DHT_ID)) == ["identity.json"]   # no partial snapshot
    for key in keys:
        reply = handler.handle(request(wire.OP_GET, key), 1 << 20)
        assert status_and_message(reply) == (wire.ST_OK, value)


def test_a_ram_store_found_full_refuses_puts_at_once_until_a_delete_or_a_dropped_bucket():
    """The Python repository's side of a cache found full (``room``, shared
    with C and by every bucket of the store): a put is StorageFull at once,
    untried (Berkeley DB would search four seconds), until a delete or a
    bucket dropped gives room back."""
    store = bsddb.BerkeleyStore("btree", "ram", None, "DHT 'full'", "none", 4)
    try:
        first, second = store.open(0), store.open(1)
        first.put(b"a", b"1")
        first.put(b"b", b"2")
        second.put(b"c", b"3")
        for undo in (lambda: first.delete(b"a"), lambda: store.remove(1)):
            store.room[0] = 1
            for repo in (first, second):
                with pytest.raises(bsddb.StorageFullFault,
                                   match="none is tried until records are deleted"):
                    repo.put(b"new", b"x")
            assert first.get(b"b") == b"2" and first.get(b"new") is None
            undo()
            assert store.room[0] == 0
            assert first.put(b"new", b"x") is True
            first.delete(b"new")
    finally:
        store.close()

