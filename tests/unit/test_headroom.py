"""A service's disk reserve (domus.storage.headroom) and stores that will
not open: puts on disk DHTs refused with STORAGE_FULL at the reserve while
reads and deletes go on, writes taken again by themselves once space is
back; a store that cannot be opened answers STORAGE_ERROR naming the DHT,
the bucket, the path and the cause (never INACTIVE) and is opened again,
with backoff, as soon as it can be.  The free space is injected where a
test drives the states; the tests marked ``small_disk`` fill a real tmpfs
(root only)."""

from __future__ import annotations

import itertools
import os
import subprocess
from contextlib import contextmanager

import pytest

from domus.service.handler import RECLAIM_INTERVAL, RETRY_DELAYS, RequestHandler
from domus.service.hosted import dht_home
from domus.storage import headroom
from domus.storage.headroom import MIB, Headroom, Reserve, parse_reserve
from domus.wire import protocol as wire
from domus.wire.keys import bucket_of, encode_key

pytest.importorskip("berkeleydb")

DHT_ID = 1
RAM_ID = 2
BUCKETS = 8
REQUEST_IDS = itertools.count(1)


def descriptor(dht_id=DHT_ID, name="full", storage="disk", platform="domus-bsddb-btree",
               durability="sync"):
    return {
        "id": dht_id, "name": name, "buckets": BUCKETS, "hash": "xxh3", "storage": storage,
        "platform": platform, "durability": durability, "routing": "chord", "lookup": "D",
        "state": "active",
        "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": BUCKETS}],
        "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": BUCKETS}],
    }


def request(op, key, value=b"", dht_id=DHT_ID):
    return wire.encode_keyed(op, next(REQUEST_IDS), 7, dht_id, bucket_of(key, "xxh3", BUCKETS),
                             key, value)


def status_and_message(reply):
    return reply[2], reply[wire.REPLY_HEADER_SIZE:]


class Space:
    """A filesystem's (free, total) as a test sets it."""

    def __init__(self, free, total=1 << 40):
        self.free, self.total = free, total

    def __call__(self, _path):
        return self.free, self.total


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# ------------------------------------------------------------ the reserve
@pytest.mark.parametrize("text, size", [("0", 0), ("1048576", 1 << 20), ("512m", 512 << 20),
                                        ("2G", 2 << 30), ("1.5GiB", 3 << 29), ("64 MB", 64 << 20),
                                        ("10k", 10 << 10), ("1t", 1 << 40)])
def test_a_reserve_is_a_size(text, size):
    assert parse_reserve(text) == Reserve(size=size)


def test_a_reserve_is_a_percentage_of_the_filesystem():
    assert parse_reserve("5%").bytes_of(1000 * MIB) == 50 * MIB
    assert parse_reserve("0.5 %").bytes_of(1 << 40) == (1 << 40) // 200


@pytest.mark.parametrize("text", ["", "lots", "-5m", "5x", "m", "91%", "5%%", "1e9", "2 GB/s",
                                  "ib"])
def test_a_reserve_that_is_neither_is_refused_saying_what_a_reserve_is(text):
    with pytest.raises(ValueError, match="neither a size|at most 90%"):
        parse_reserve(text)


def test_the_default_reserve_is_1_percent_within_its_bounds():
    default = headroom.DEFAULT
    assert default.bytes_of(1 << 40) == 1 << 30                  # capped at 1 GiB
    assert default.bytes_of(20 << 30) == int((20 << 30) / 100)   # 1 %
    assert default.bytes_of(1 << 30) == 64 * MIB                  # at least 64 MiB
    assert default.bytes_of(100 * MIB) == 25 * MIB                # a quarter of a small one


def test_headroom_states_follow_the_free_space():
    space = Space(10 << 30)
    room = Headroom("/data", Reserve(size=100 * MIB), "s1", space)
    assert room.state == headroom.OK and room.refusal() is None
    space.free = 100 * MIB + headroom.MARGIN - 1
    assert room.sample() and room.state == headroom.NEAR
    assert room.refusal() is None
    space.free = 100 * MIB - 1
    message = room.refusal("a put on DHT 'x'")       # (asks the filesystem itself)
    assert room.full and message is not None
    assert "service s1 refused a put on DHT 'x'" in message
    assert "100.0 MiB free under /data, reserve 100.0 MiB" in message
    assert room.report() == {"free_disk": float(100 * MIB - 1), "disk_total": float(1 << 40),
                             "disk_reserve": float(100 * MIB), "disk_full": True}
    space.free = 100 * MIB + headroom.hysteresis(100 * MIB) - 1     # not enough back yet
    assert room.refusal() is not None and room.full
    space.free = 100 * MIB + headroom.hysteresis(100 * MIB)
    assert room.refusal() is None and room.state == headroom.NEAR
    space.free = 100 * MIB - 1
    assert room.refusal() is not None
    assert room.refused == 3


def test_free_space_is_looked_at_less_often_the_farther_it_is_from_the_reserve(tmp_path):
    # Ten looks a second within the margin (and past the reserve); far from
    # it, only as seldom as writes at the margin's rate (64 MiB a tenth of a
    # second) could not reach the margin between two looks, and at least
    # once a second; every tenth of a second again while a store waits to
    # be opened again.
    space = Space(10 << 30)
    room = Headroom("/data", Reserve(size=100 * MIB), "s1", space)
    assert room.next_interval() == headroom.LONGEST_INTERVAL
    space.free = 100 * MIB + headroom.MARGIN + 32 * MIB            # half a tenth away
    room.sample()
    assert room.state == headroom.OK
    assert room.next_interval() == headroom.SAMPLE_INTERVAL
    space.free = 100 * MIB + headroom.MARGIN + 320 * MIB           # half a second away
    room.sample()
    assert room.next_interval() == pytest.approx(0.5)
    space.free = 100 * MIB + headroom.MARGIN - 1
    room.sample()
    assert room.state == headroom.NEAR and room.next_interval() == headroom.SAMPLE_INTERVAL
    space.free = 0
    room.sample()
    assert room.full and room.next_interval() == headroom.SAMPLE_INTERVAL

    handler = RequestHandler("s1", data_dir=str(tmp_path), clock=Clock())
    handler.headroom = Headroom(str(tmp_path), Reserve(size=MIB), "s1", Space(10 << 30))
    assert handler.storage_interval() == headroom.LONGEST_INTERVAL
    home = dht_home(str(tmp_path), DHT_ID)
    os.makedirs(os.path.dirname(home))
    with open(home, "w") as blocking:          # a store that will not open
        blocking.write("not a directory")
    handler.sync([descriptor()])
    assert handler.storage_interval() == headroom.SAMPLE_INTERVAL


def test_writes_resume_a_little_above_the_reserve():
    assert headroom.hysteresis(2 * MIB) == 2 * MIB
    assert headroom.hysteresis(100 * MIB) == 12.5 * MIB
    assert headroom.hysteresis(1 << 30) == headroom.MARGIN


# ------------------------------------------------------------ the handler at the reserve
def watched(tmp_path, space, reserve=Reserve(size=8 * MIB), clock=None):
    handler = RequestHandler("s1", data_dir=str(tmp_path), clock=clock or Clock())
    handler.headroom = Headroom(str(tmp_path), reserve, "s1", space)
    handler.assign(descriptor())
    handler.assign(descriptor(RAM_ID, "cache", "ram", "python-dict", "none"))
    return handler


def test_at_the_reserve_puts_on_disk_dhts_are_refused_and_reads_and_deletes_go_on(tmp_path):
    space = Space(1 << 40)
    handler = watched(tmp_path, space)
    handle = handler.handle_fast
    keys = [encode_key(number) for number in range(40)]
    for key in keys:
        assert handle(request(wire.OP_PUT, key, b"v" * 100))[2] == wire.ST_OK
    space.free = 8 * MIB - 1
    handler.tend_storage()
    assert handler.headroom.full
    status, message = status_and_message(handle(request(wire.OP_PUT, encode_key("new"), b"v")))
    assert status == wire.ST_STORAGE_FULL
    assert message.startswith(b"service s1 refused a put on DHT 'full': its disk is at its "
                              b"reserve (8.0 MiB free under " + str(tmp_path).encode())
    batch = wire.encode_put_many(next(REQUEST_IDS), 7, DHT_ID, [
        (bucket_of(key, "xxh3", BUCKETS), key, b"w") for key in [encode_key("a"), keys[0]]])
    assert handle(batch)[2] == wire.ST_STORAGE_FULL
    # A put_if_absent fills as a put does; a delete_if frees as a delete does.
    assert handle(request(wire.OP_PUT_IF_ABSENT, encode_key("new"), b"v"))[2] == \
        wire.ST_STORAGE_FULL
    assert status_and_message(handle(request(wire.OP_DELETE_IF, keys[39],
                                             wire.value_digest(b"v" * 100)))) == \
        (wire.ST_OK, b"\x01")
    # Nothing of either was stored; what was is read, and deleted.
    assert handle(request(wire.OP_GET, encode_key("new")))[2] == wire.ST_NOT_FOUND
    assert status_and_message(handle(request(wire.OP_GET, keys[0]))) == (wire.ST_OK, b"v" * 100)
    for key in keys[:20]:
        assert handle(request(wire.OP_DELETE, key))[2] == wire.ST_OK
    assert handle(request(wire.OP_CONTAINS, keys[30]))[2] == wire.ST_OK
    # A RAM DHT on the same service is not held back.
    assert handle(request(wire.OP_PUT, encode_key("r"), b"v", RAM_ID))[2] == wire.ST_OK
    assert handler.counters["storage_full"] == 3
    assert handler.stats()["dhts"]["full"]["records"] == 19
    # Space back: writes are taken again without anyone doing anything.
    space.free = 1 << 40
    handler.tend_storage()
    assert handle(request(wire.OP_PUT, encode_key("new"), b"v"))[2] == wire.ST_OK
    assert handle(batch)[2] == wire.ST_OK
    assert handler.stats()["dhts"]["full"]["records"] == 22      # (keys[0], [39] deleted)


def test_near_the_reserve_the_c_path_leaves_puts_to_python_which_asks_the_disk(tmp_path):
    space = Space(1 << 40)
    handler = watched(tmp_path, space)
    if handler.fast is None:
        pytest.skip("the C hot path is not built")
    key = encode_key("k")
    assert handler.handle_fast(request(wire.OP_PUT, key, b"v"))[2] == wire.ST_OK
    assert handler.fast.fallbacks == 0
    space.free = 9 * MIB                  # near: not refused yet, but each put looks
    handler.tend_storage()
    assert handler.headroom.state == headroom.NEAR
    assert handler.handle_fast(request(wire.OP_PUT, key, b"w"))[2] == wire.ST_OK
    assert handler.fast.fallbacks == 1
    space.free = 7 * MIB                  # (filled from outside: no sample taken since)
    assert handler.handle_fast(request(wire.OP_PUT, key, b"x"))[2] == wire.ST_STORAGE_FULL
    assert handler.handle_fast(request(wire.OP_GET, key))[wire.REPLY_HEADER_SIZE:] == b"w"
    fallbacks = handler.fast.fallbacks
    assert handler.handle_fast(request(wire.OP_GET, key))[2] == wire.ST_OK
    assert handler.fast.fallbacks == fallbacks          # reads stay in C
    space.free = 1 << 40
    handler.tend_storage()
    assert handler.handle_fast(request(wire.OP_PUT, key, b"y"))[2] == wire.ST_OK
    assert handler.fast.fallbacks == fallbacks          # and puts are back in C


def test_the_timer_looks_at_the_disk_released_and_acts_only_holding_the_baton(tmp_path):
    # The service runs tend_storage's looking inside UdpServer.released (the
    # serving thread serves meanwhile); what changes what C reads (the fast
    # table, once the state changes) runs after it, holding the baton again.
    space = Space(1 << 40)
    handler = watched(tmp_path, space)
    inside = []
    asked = []
    fast_table_updates = []
    update = handler._update_fast_table

    def asking(path):
        asked.append(bool(inside))
        return space(path)

    def updating(dht_id):
        fast_table_updates.append(bool(inside))
        update(dht_id)

    handler.headroom._space = asking
    handler._update_fast_table = updating

    @contextmanager
    def released():
        inside.append(True)
        try:
            yield
        finally:
            inside.pop()

    handler.tend_storage(released)                  # nothing to do: all of it released
    assert asked == [True] and fast_table_updates == []
    space.free = 9 * MIB                            # near the reserve: the state changes
    handler.tend_storage(released)
    assert handler.headroom.state == headroom.NEAR
    assert asked == [True, True] and fast_table_updates and not any(fast_table_updates)
    assert handler.headroom.free == 9 * MIB
    space.free = (1 << 40) - 1                      # back: changed again, held again
    fast_table_updates.clear()
    handler.tend_storage(released)
    assert handler.headroom.state == headroom.OK and handler.headroom.free == (1 << 40) - 1
    assert fast_table_updates and not any(fast_table_updates)
    fast_table_updates.clear()
    space.free = (1 << 40) - 2                      # no change: only the figures move
    handler.tend_storage(released)
    assert handler.headroom.free == (1 << 40) - 2 and fast_table_updates == []

    # As the service's timer runs it: all of it released, acting held.
    @contextmanager
    def held():
        inside.append(False)
        try:
            yield
        finally:
            inside.pop()

    def timer():
        with released():
            handler.tend_storage(released, lambda: held())

    def asking_in_timer(path):
        asked.append(inside[-1])
        return space(path)

    def updating_in_timer(dht_id):
        fast_table_updates.append(inside[-1])
        update(dht_id)

    asked.clear()
    handler.headroom._space = asking_in_timer
    handler._update_fast_table = updating_in_timer
    timer()
    assert asked == [True] and fast_table_updates == []
    space.free = 9 * MIB
    timer()
    assert handler.headroom.state == headroom.NEAR
    assert asked == [True, True] and fast_table_updates and not any(fast_table_updates)


def database_bytes(tmp_path):
    home = dht_home(str(tmp_path), DHT_ID)
    return sum(os.path.getsize(os.path.join(home, name)) for name in os.listdir(home)
               if not name.startswith(("log.", "__db")))


def test_deletes_before_the_timer_first_sees_a_restarted_dhts_buckets_are_given_back(tmp_path):
    """A service that starts again at its reserve: its storage timer first
    runs before the supervisor hands it its DHTs, and the job deletes
    records before the timer's next look.  Those deletes still give their
    pages back (a bucket's records are counted when it opens, not when the
    timer first sees it), so the disk leaves its reserve by itself."""
    space = Space(1 << 40)
    first = watched(tmp_path, space)
    keys = [encode_key(number) for number in range(3000)]
    for key in keys:
        assert first.handle_fast(request(wire.OP_PUT, key, b"v" * 1000))[2] == wire.ST_OK
    first.close()

    clock = Clock()
    space.free = 8 * MIB - 1                # (at the reserve from the start)
    handler = RequestHandler("s1", data_dir=str(tmp_path), clock=clock)
    handler.headroom = Headroom(str(tmp_path), Reserve(size=8 * MIB), "s1", space)
    assert handler.headroom.full
    handler.tend_storage()                  # (the first tick: no DHT here yet)
    handler.assign(descriptor())
    before = database_bytes(tmp_path)
    for key in keys[:2500]:
        assert handler.handle_fast(request(wire.OP_DELETE, key))[2] == wire.ST_OK
    for _tick in range(3):
        clock.now += RECLAIM_INTERVAL
        handler.tend_storage()
    assert database_bytes(tmp_path) < before / 2, (before, database_bytes(tmp_path))
    for key in keys[2500:]:
        assert status_and_message(handler.handle_fast(request(wire.OP_GET, key))) == (
            wire.ST_OK, b"v" * 1000)
    handler.close()


def test_a_bucket_is_not_staged_onto_a_service_at_its_reserve(tmp_path):
    space = Space(1 << 40)
    handler = watched(tmp_path, space)
    hosted = handler.dhts[DHT_ID]
    space.free = 0
    handler.tend_storage()
    from domus.storage import StorageFullFault
    moving = [b for b in range(BUCKETS) if b not in hosted.repos] or [BUCKETS - 1]
    hosted.repos.pop(moving[0], None)
    with pytest.raises(StorageFullFault, match="refused bucket .* at its reserve"):
        hosted.stage(moving[0], [encode_key("a"), b"v"], True)


# ------------------------------------------------------------ a store that will not open
def test_a_store_that_will_not_open_says_why_and_serves_once_it_opens(tmp_path):
    clock = Clock()
    home = dht_home(str(tmp_path), DHT_ID)
    os.makedirs(os.path.dirname(home))
    with open(home, "w") as blocking:          # a file where its directory should be
        blocking.write("not a directory")
    handler = RequestHandler("s1", data_dir=str(tmp_path), clock=clock)
    handler.sync([descriptor()])               # as at registration: logged, not raised
    key = encode_key("k")
    for op, value in ((wire.OP_PUT, b"v"), (wire.OP_GET, b""), (wire.OP_DELETE, b"")):
        status, message = status_and_message(handler.handle(request(op, key, value)))
        assert status == wire.ST_STORAGE_ERROR         # never INACTIVE
        bucket = bucket_of(key, "xxh3", BUCKETS)
        assert message.startswith(f"bucket {bucket} of DHT 'full' is not served on service "
                                  f"s1: DHT 'full': cannot open its Berkeley DB environment "
                                  f"({home}): ".encode())
        assert b"tries again by itself" in message
    stats = handler.stats()["dhts"]["full"]
    assert stats["active"] is False and "cannot open" in stats["problem"]
    # Retried with backoff, not before its time.
    handler.retry_storage()
    assert handler.dhts[DHT_ID].retries == 1
    handler.retry_storage()
    assert handler.dhts[DHT_ID].retries == 1
    os.remove(home)                            # the operator fixes it
    clock.now += RETRY_DELAYS[1]
    assert handler.retry_storage() == ["full"]
    assert handler.handle_fast(request(wire.OP_PUT, key, b"v"))[2] == wire.ST_OK
    assert handler.handle_fast(request(wire.OP_GET, key))[wire.REPLY_HEADER_SIZE:] == b"v"
    assert "problem" not in handler.stats()["dhts"]["full"]


def test_a_bucket_that_will_not_open_is_retried_alone(tmp_path):
    clock = Clock()
    home = dht_home(str(tmp_path), DHT_ID)
    os.makedirs(home)
    with open(os.path.join(home, "bucket-3.db"), "wb") as corrupt:
        corrupt.write(b"not a Berkeley DB file" * 100)
    handler = RequestHandler("s1", data_dir=str(tmp_path), clock=clock)
    handler.assign(descriptor(durability="async"))
    failed = handler.stats()["dhts"]["full"]["failed_buckets"]
    assert list(failed) == [3] and "bucket-3.db" in failed[3]
    os.remove(os.path.join(home, "bucket-3.db"))
    handler.retry_storage()
    assert "failed_buckets" not in handler.stats()["dhts"]["full"]
    number = next(n for n in itertools.count() if bucket_of(encode_key(n), "xxh3", BUCKETS) == 3)
    assert handler.handle_fast(request(wire.OP_PUT, encode_key(number), b"v"))[2] == wire.ST_OK


# ------------------------------------------------------------ a real small disk
@pytest.fixture
def small_disk(tmp_path):
    """An 8 MiB tmpfs (needs root; unmounted after the test)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)],
                       check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"filling a real disk needs a small tmpfs, which needs root: {exc}")
    try:
        yield str(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.mark.parametrize("platform", ["domus-bsddb-btree", "domus-bsddb-hash"])
def test_a_real_disk_refuses_at_its_reserve_and_deletes_give_the_room_back(small_disk,
                                                                          platform):
    clock = Clock()
    handler = RequestHandler("s1", data_dir=small_disk, clock=clock)
    handler.headroom = Headroom(small_disk, Reserve(size=2 * MIB), "s1")
    handler.assign({**descriptor(platform=platform)})
    handle = handler.handle_fast
    stored = []
    for number in itertools.count():
        key = encode_key(number)
        status, message = status_and_message(handle(request(wire.OP_PUT, key, os.urandom(1000))))
        if status != wire.ST_OK:
            break
        stored.append(key)
        if number % 100 == 0:
            handler.flush()                     # (the service's checkpoints, each second)
            handler.tend_storage()
    assert status == wire.ST_STORAGE_FULL, message
    assert b"its disk is at its reserve" in message          # refused before the device filled
    assert headroom.filesystem_space(small_disk)[0] >= MIB
    assert len(stored) > 1000
    for number, key in enumerate(stored):                     # every one of them deleted
        assert handle(request(wire.OP_DELETE, key))[2] == wire.ST_OK, number
        if number % 100 == 0:
            handler.tend_storage()              # (the service's timer, each 0.1 s)
    clock.now += RECLAIM_INTERVAL
    handler.tend_storage()                                    # gives the pages back
    assert not handler.headroom.full, handler.headroom.free
    assert handle(request(wire.OP_PUT, encode_key("again"), b"v"))[2] == wire.ST_OK
