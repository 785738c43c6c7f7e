"""Deactivating and activating a DHT on one service (domus.service.hosted,
domus.storage.snapshot), driven through the request handler as the
supervisor and clients drive it, with real files under a data dir."""

import os

import pytest
from test_handler import DHT_ID, HELD, call, descriptor, keyed, keys_in, put

from domus.service.handler import RequestHandler
from domus.service.hosted import dht_home
from domus.storage import PLATFORMS, snapshot
from domus.storage.base import StorageFault
from domus.wire import protocol as wire

RAM_PLATFORMS = sorted(name for name, platform in PLATFORMS.items() if "ram" in platform.media)
DISK_PLATFORMS = sorted(name for name, platform in PLATFORMS.items()
                        if "disk" in platform.media)


def get(handler, key):
    """GET as over TCP (a reply may be as large as a value)."""
    return call(handler, keyed(wire.OP_GET, key), wire.MAX_FRAME_BYTES)


def handler_with(data_dir, **changes):
    handler = RequestHandler("s1", data_dir=str(data_dir) if data_dir else None)
    handler.assign(descriptor(**changes))
    return handler


def fill(handler, per_bucket=50):
    """Records in every bucket stored here; returns key -> value."""
    stored = {}
    for bucket in HELD:
        for index, key in enumerate(keys_in(bucket, per_bucket, prefix=f"b{bucket}-")):
            value = f"value {bucket}/{index}".encode() * (1 + index % 7)
            assert put(handler, key, value)[0] == wire.ST_OK
            stored[key] = value
    return stored


def assert_serves(handler, stored):
    for key, value in stored.items():
        assert get(handler, key) == (wire.ST_OK, value)


@pytest.mark.parametrize("platform", RAM_PLATFORMS)
def test_a_ram_dht_is_saved_released_and_loaded_back(tmp_path, platform):
    handler = handler_with(tmp_path, platform=platform)
    stored = fill(handler)
    answer = handler.assign(descriptor(platform=platform, state="inactive"))
    assert answer == {"state": "inactive", "records": len(stored)}
    hosted = handler.dhts[DHT_ID]
    assert hosted.records() == 0 and hosted.store is None
    assert os.path.exists(snapshot.snapshot_path(dht_home(str(tmp_path), DHT_ID)))
    some_key = next(iter(stored))
    assert get(handler, some_key)[0] == wire.ST_INACTIVE

    answer = handler.assign(descriptor(platform=platform, state="active"))
    assert answer == {"state": "active", "records": len(stored)}
    assert_serves(handler, stored)
    assert handler.dhts[DHT_ID].records() == len(stored)
    # Loaded records are the DHT's again, and the snapshot is gone.
    assert not snapshot.exists(dht_home(str(tmp_path), DHT_ID))


@pytest.mark.parametrize("platform", DISK_PLATFORMS)
def test_a_disk_dht_closes_its_files_and_reopens_them(tmp_path, platform):
    handler = handler_with(tmp_path, platform=platform, storage="disk")
    stored = fill(handler)
    answer = handler.assign(descriptor(platform=platform, storage="disk", state="inactive"))
    assert answer == {"state": "inactive", "records": len(stored)}
    assert handler.dhts[DHT_ID].store is None
    assert not snapshot.exists(dht_home(str(tmp_path), DHT_ID))   # the files are the data
    handler.assign(descriptor(platform=platform, storage="disk", state="active"))
    assert_serves(handler, stored)


def test_an_inactive_ram_dht_survives_a_service_restart(tmp_path):
    first = handler_with(tmp_path, platform="domus-rbt")
    stored = fill(first)
    first.assign(descriptor(platform="domus-rbt", state="inactive"))
    first.close()                               # the service stops
    second = RequestHandler("s1", data_dir=str(tmp_path))
    second.sync([descriptor(platform="domus-rbt", state="inactive")])
    assert get(second, next(iter(stored)))[0] == wire.ST_INACTIVE
    second.sync([descriptor(platform="domus-rbt", state="active")])
    assert_serves(second, stored)


def test_a_snapshot_left_by_a_crash_during_activation_is_loaded_at_start(tmp_path):
    """The snapshot is deleted only after its records are loaded, before any
    request is served: one still there holds exactly the DHT's records."""
    first = handler_with(tmp_path)
    stored = fill(first)
    first.assign(descriptor(state="inactive"))
    second = RequestHandler("s1", data_dir=str(tmp_path))
    second.sync([descriptor(state="active")])    # as if the supervisor had rolled back
    assert_serves(second, stored)


def test_deactivating_a_ram_dht_without_a_data_dir_is_refused_and_keeps_it(tmp_path):
    handler = handler_with(None)
    stored = fill(handler, per_bucket=5)
    with pytest.raises(StorageFault, match="no data dir"):
        handler.assign(descriptor(state="inactive"))
    assert handler.dhts[DHT_ID].active
    assert_serves(handler, stored)


def test_a_damaged_snapshot_keeps_the_dht_inactive_and_the_file(tmp_path):
    handler = handler_with(tmp_path)
    stored = fill(handler)
    handler.assign(descriptor(state="inactive"))
    path = snapshot.snapshot_path(dht_home(str(tmp_path), DHT_ID))
    with open(path, "r+b") as damaged:
        damaged.seek(os.path.getsize(path) // 2)
        byte = damaged.read(1)
        damaged.seek(-1, os.SEEK_CUR)
        damaged.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(StorageFault, match="damaged") as failure:
        handler.assign(descriptor(state="active"))
    assert path in str(failure.value)
    hosted = handler.dhts[DHT_ID]
    assert not hosted.active and hosted.records() == 0 and hosted.store is None
    assert os.path.exists(path)
    # Requests are told why, not just "inactive".
    status, body = get(handler, next(iter(stored)))
    assert status == wire.ST_STORAGE_ERROR and b"damaged" in body
    # The supervisor rolls back to inactive: plain INACTIVE again.
    handler.assign(descriptor(state="inactive"))
    assert get(handler, next(iter(stored)))[0] == wire.ST_INACTIVE


def test_a_snapshot_of_another_dht_is_refused(tmp_path):
    handler = handler_with(tmp_path)
    fill(handler, per_bucket=3)
    handler.assign(descriptor(state="inactive"))
    home = dht_home(str(tmp_path), DHT_ID)
    other = dht_home(str(tmp_path), DHT_ID + 1)
    os.makedirs(other)
    os.rename(snapshot.snapshot_path(home), snapshot.snapshot_path(other))
    stranger = RequestHandler("s1", data_dir=str(tmp_path))
    with pytest.raises(StorageFault, match=f"DHT id {DHT_ID}, not {DHT_ID + 1}"):
        stranger.assign(descriptor(id=DHT_ID + 1, name="other"))


def test_destroying_an_inactive_dht_deletes_its_snapshot(tmp_path):
    handler = handler_with(tmp_path)
    fill(handler, per_bucket=3)
    handler.assign(descriptor(state="inactive"))
    assert handler.drop({"id": DHT_ID})
    assert not os.path.exists(dht_home(str(tmp_path), DHT_ID))


def test_snapshots_hold_large_values_and_many_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(snapshot, "CHUNK_RECORDS", 7)
    handler = handler_with(tmp_path, platform="domus-rbt")
    stored = fill(handler, per_bucket=40)
    big = keys_in(HELD[0], 1, prefix="big-")[0]
    stored[big] = os.urandom(wire.MAX_VALUE_BYTES)
    put(handler, big, stored[big])
    handler.assign(descriptor(platform="domus-rbt", state="inactive"))
    handler.assign(descriptor(platform="domus-rbt", state="active"))
    assert_serves(handler, stored)


def test_a_missing_snapshot_is_an_error_not_an_empty_dht(tmp_path):
    handler = handler_with(tmp_path)
    stored = fill(handler, per_bucket=5)
    saved = handler.assign(descriptor(state="inactive"))["records"]
    os.unlink(snapshot.snapshot_path(dht_home(str(tmp_path), DHT_ID)))   # a wiped disk
    with pytest.raises(StorageFault, match=f"saved {saved} records .* but 0 are in"):
        handler.assign(descriptor(state="active", saved={"s1": saved}))
    assert not handler.dhts[DHT_ID].active
    assert get(handler, next(iter(stored)))[0] == wire.ST_STORAGE_ERROR


def test_the_count_saved_is_checked_on_activation(tmp_path):
    handler = handler_with(tmp_path)
    fill(handler, per_bucket=5)
    saved = handler.assign(descriptor(state="inactive"))["records"]
    answer = handler.assign(descriptor(state="active", saved={"s1": saved, "s2": 99}))
    assert answer == {"state": "active", "records": saved}
