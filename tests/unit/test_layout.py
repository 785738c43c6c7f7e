"""domus.placement.layout: a descriptor's bucket -> service maps, with moved buckets;
and a service that follows them (what it stores, what it routes, where it
sends a request for a bucket it does not store)."""

import pytest
from test_handler import DHT_ID, call, descriptor, keyed, keys_in, next_id, put

from domus.client.lookup import DirectLookup
from domus.placement import layout
from domus.service.handler import RequestHandler
from domus.storage import StorageFault
from domus.wire import protocol as wire


def moved(**moves):
    """The handler tests' 8-bucket DHT (s1 stores 0..3, s2 4..7; s1 routes
    all) with moves, and s3 added with count 0 where a bucket went to it."""
    changes = {}
    for role in ("routing", "storage"):
        role_moves = moves.get(role, {})
        if role_moves:
            changes[f"{role}_moves"] = {str(bucket): name for bucket, name in role_moves.items()}
    base = descriptor(**changes)
    for role in ("routing", "storage"):
        names = {entry["name"] for entry in base[f"{role}_services"]}
        for name in set(moves.get(role, {}).values()) - names:
            base[f"{role}_services"] = [*base[f"{role}_services"],
                                        {"name": name, "address": "127.0.0.1:3", "count": 0}]
    return base


def test_without_moves_the_owners_are_the_initial_placement():
    plain = descriptor()
    assert layout.owners(plain, "storage") == layout.initial(plain, "storage")
    assert layout.ranges_of(layout.owners(plain, "storage"), "s1") == [(0, 4)]
    assert layout.ranges_of(layout.owners(plain, "storage"), "s2") == [(4, 8)]


def test_moves_override_the_placement_bucket_by_bucket():
    with_moves = moved(storage={2: "s2", 6: "s3"}, routing={7: "s2"})
    storage = layout.owners(with_moves, "storage")
    assert [storage.owner(bucket) for bucket in range(8)] == \
        ["s1", "s1", "s2", "s1", "s2", "s2", "s3", "s2"]
    assert layout.ranges_of(storage, "s1") == [(0, 2), (3, 4)]
    assert list(layout.buckets_in(layout.ranges_of(storage, "s2"))) == [2, 4, 5, 7]
    routing = layout.owners(with_moves, "routing")
    assert layout.ranges_of(routing, "s1") == [(0, 7)]
    assert layout.ranges_of(routing, "s2") == [(7, 8)]
    # The initial placement (what the direct lookup rebuilds) is unchanged.
    assert layout.ranges_of(layout.initial(with_moves, "storage"), "s1") == [(0, 4)]
    assert layout.addresses(with_moves, "storage")["s3"] == "127.0.0.1:3"


def test_a_service_stores_exactly_its_buckets_after_moves():
    handler = RequestHandler("s1")
    handler.assign(moved(storage={2: "s2", 5: "s1"}))
    hosted = handler.dhts[DHT_ID]
    assert sorted(hosted.repos) == [0, 1, 3, 5]
    for bucket in (0, 1, 3, 5):
        assert put(handler, keys_in(bucket, 1)[0], b"v")[0] == wire.ST_OK
    status, message = put(handler, keys_in(2, 1)[0], b"v")
    assert status == wire.ST_NOT_OWNER
    assert b"does not store bucket 2" in message and b"service s2 does" in message


@pytest.mark.parametrize("routing_moves, routed", [
    ({}, [(0, 8)]),
    ({0: "s2", 5: "s2"}, [(1, 5), (6, 8)]),
])
def test_an_as_keeps_storage_refs_for_the_buckets_it_routes(routing_moves, routed):
    handler = RequestHandler("s1")
    handler.assign(moved(routing=routing_moves, storage={3: "s3"}))
    hosted = handler.dhts[DHT_ID]
    assert hosted.routed == routed
    assert hosted.routing_bucket_count == sum(end - first for first, end in routed)
    expected = {0: "s1", 1: "s1", 2: "s1", 3: "s3", 4: "s2", 5: "s2", 6: "s2", 7: "s2"}
    for first, end in routed:
        for bucket in range(first, end):
            assert hosted.storage_service(bucket) == expected[bucket]
    for bucket in set(range(8)) - {b for first, end in routed for b in range(first, end)}:
        with pytest.raises(KeyError):
            hosted.storage_service(bucket)


def test_a_bucket_moved_away_is_dropped_with_its_records():
    handler = RequestHandler("s1")
    handler.assign(descriptor())
    key = keys_in(1, 1)[0]
    put(handler, key, b"v")
    handler.assign(moved(storage={1: "s2"}))
    assert 1 not in handler.dhts[DHT_ID].repos
    assert call(handler, keyed(wire.OP_GET, key, bucket=1))[0] == wire.ST_NOT_OWNER


class NamedChannels:
    """What DirectLookup asks a cluster for: a channel per service (here,
    the name and address themselves)."""

    def channel(self, name, address):
        return (name, address)


def test_a_client_sends_each_bucket_to_its_current_storage_service():
    lookup = DirectLookup(NamedChannels(), moved(storage={2: "s3", 7: "s1"}))
    assert [lookup._owners[bucket][0] for bucket in range(8)] == \
        ["s1", "s1", "s3", "s1", "s2", "s2", "s2", "s1"]
    assert lookup._owners[2] == ("s3", "127.0.0.1:3")


# ------------------------------------------------------------ moving a bucket
def two_services(tmp_path, platform):
    """s1 and s2 of the 8-bucket DHT, each with its own data dir."""
    storage = "disk" if platform.startswith("domus-bsddb") else "ram"
    services = {}
    for name in ("s1", "s2"):
        handler = RequestHandler(name, data_dir=str(tmp_path / name))
        handler.assign(descriptor(platform=platform, storage=storage))
        services[name] = handler
    return services, dict(platform=platform, storage=storage)


def move_records(source, target, bucket, page_bytes=None):
    """Steps 1 and 2, as the supervisor drives them; the records moved."""
    hosted_source, hosted_target = source.dhts[DHT_ID], target.dhts[DHT_ID]
    hosted_source.freeze(bucket)
    offset, first, moved_count = 0, True, 0
    while offset is not None:
        records, offset = hosted_source.export(bucket, offset, page_bytes or 1 << 20)
        moved_count = hosted_target.stage(bucket, records, first)
        first = False
    return moved_count


@pytest.mark.parametrize("platform", ["python-dict", "domus-rbt", "domus-bsddb-btree"])
def test_a_bucket_moves_with_every_record_and_nothing_in_between(tmp_path, platform):
    services, attributes = two_services(tmp_path, platform)
    s1, s2 = services["s1"], services["s2"]
    keys = keys_in(2, 300, prefix="m")
    for index, key in enumerate(keys):
        assert put(s1, key, b"v%d" % index)[0] == wire.ST_OK
    s1.dhts[DHT_ID].freeze(2)
    # Frozen: every request on the bucket is MOVING, and not cached as an
    # answer (a retry with the same id is tried again later).
    request = keyed(wire.OP_PUT, keys[0], b"changed", request_id=next_id())
    assert call(s1, request)[0] == wire.ST_MOVING
    assert call(s1, keyed(wire.OP_GET, keys[0]))[0] == wire.ST_MOVING
    # The C hot path finds no repository and leaves it to Python: the same.
    assert s1.handle_fast(keyed(wire.OP_PUT, keys[1], b"x", request_id=next_id()))[2] == \
        wire.ST_MOVING
    assert s1.dhts[DHT_ID].records() == 300             # still counted here
    s1.dhts[DHT_ID].thaw(2)
    assert move_records(s1, s2, 2, page_bytes=500) == 300
    assert call(s2, keyed(wire.OP_GET, keys[0]))[0] == wire.ST_NOT_OWNER   # staged only

    after = descriptor(storage_moves={"2": "s2"}, **attributes)
    for handler in (s1, s2):
        handler.assign(after)                                # step 3
    for index, key in enumerate(keys):
        assert call(s2, keyed(wire.OP_GET, key)) == (wire.ST_OK, b"v%d" % index)
    assert 2 not in s1.dhts[DHT_ID].frozen and 2 not in s1.dhts[DHT_ID].repos
    status, message = call(s1, request)                       # the retry, after the move
    assert status == wire.ST_NOT_OWNER and b"service s2 does" in message


def test_an_aborted_move_changes_nothing(tmp_path):
    services, _attributes = two_services(tmp_path, "domus-bsddb-btree")
    s1, s2 = services["s1"], services["s2"]
    keys = keys_in(1, 50, prefix="a")
    for key in keys:
        put(s1, key, b"kept")
    move_records(s1, s2, 1)
    s1.dhts[DHT_ID].thaw(1)                                    # step 4
    s2.dhts[DHT_ID].discard(1)
    assert all(call(s1, keyed(wire.OP_GET, key)) == (wire.ST_OK, b"kept") for key in keys)
    assert 1 not in s2.dhts[DHT_ID].staged
    # The target can take the bucket afresh later.
    assert move_records(s1, s2, 1) == 50


def test_a_service_refuses_to_move_a_bucket_it_does_not_store(tmp_path):
    services, _attributes = two_services(tmp_path, "python-dict")
    with pytest.raises(StorageFault, match="does not store bucket 6"):
        services["s1"].dhts[DHT_ID].freeze(6)
    with pytest.raises(StorageFault, match="cannot take bucket 1"):
        services["s1"].dhts[DHT_ID].stage(1, [], True)


@pytest.mark.parametrize("platform", ["python-dict", "domus-bsddb-btree"])
def test_a_frozen_bucket_stays_frozen_through_a_new_descriptor(tmp_path, platform):
    """Until the supervisor thaws it or moves it away: never opened afresh
    (an empty copy served, or a second handle on its database)."""
    services, attributes = two_services(tmp_path, platform)
    s1 = services["s1"]
    key = keys_in(3, 1, prefix="f")[0]
    put(s1, key, b"kept")
    s1.dhts[DHT_ID].freeze(3)
    s1.assign(descriptor(**attributes))                  # e.g. another bucket moved
    assert call(s1, keyed(wire.OP_GET, key))[0] == wire.ST_MOVING
    s1.dhts[DHT_ID].thaw(3)
    assert call(s1, keyed(wire.OP_GET, key)) == (wire.ST_OK, b"kept")


@pytest.mark.parametrize("platform", ["python-dict", "domus-bsddb-btree"])
def test_registering_again_abandons_the_moves_under_way(tmp_path, platform):
    services, attributes = two_services(tmp_path, platform)
    s1, s2 = services["s1"], services["s2"]
    keys = keys_in(1, 10, prefix="r")
    for key in keys:
        put(s1, key, b"kept")
    move_records(s1, s2, 1)
    # Both register again (the supervisor restarted), with the old layout.
    for handler in (s1, s2):
        handler.sync([descriptor(**attributes)])
    assert all(call(s1, keyed(wire.OP_GET, key)) == (wire.ST_OK, b"kept") for key in keys)
    assert not s1.dhts[DHT_ID].frozen and not s2.dhts[DHT_ID].staged
    # A move step that comes after is refused, not half applied.
    with pytest.raises(StorageFault, match="no staged bucket 1"):
        s2.dhts[DHT_ID].stage(1, [keys[0], b"x"], False)
    # The same move can start afresh.
    assert move_records(s1, s2, 1) == 10


# ------------------------------------------------------------ layout.move
def test_a_move_lists_the_bucket_and_a_new_service_with_count_0():
    plain = descriptor()
    moved_once = layout.move(plain, "storage", 2, "s3", "127.0.0.1:3")
    assert plain == descriptor()                              # a copy
    assert moved_once == moved(storage={2: "s3"}) | {"version": 1}     # a new layout
    assert layout.move(moved_once, "storage", 3, "s3", "127.0.0.1:3")["version"] == 2
    assert [entry["count"] for entry in moved_once["storage_services"]] == [4, 4, 0]
    assert layout.owners(moved_once, "storage").owner(2) == "s3"
    assert layout.initial(moved_once, "storage") == layout.initial(plain, "storage")
    moved_twice = layout.move(moved_once, "storage", 2, "s2", "127.0.0.1:2")
    assert moved_twice["storage_moves"] == {"2": "s2"}
    assert moved_twice["storage_services"] == moved_once["storage_services"]
    routing = layout.move(moved_twice, "routing", 6, "s2", "127.0.0.1:2")
    assert routing["routing_moves"] == {"6": "s2"} and routing["storage_moves"] == {"2": "s2"}
    assert routing["routing_services"][-1] == {"name": "s2", "address": "127.0.0.1:2",
                                               "count": 0}


def test_a_bucket_moved_back_is_no_move():
    there = layout.move(moved(storage={2: "s3", 5: "s1"}), "storage", 2, "s1", "127.0.0.1:1")
    assert there["storage_moves"] == {"5": "s1"}
    back = layout.move(there, "storage", 5, "s2", "127.0.0.1:2")
    assert "storage_moves" not in back
    # The service it went to stays listed (it hosts the DHT, with nothing).
    assert [entry["name"] for entry in back["storage_services"]] == ["s1", "s2", "s3"]
    assert layout.owners(back, "storage") == layout.initial(back, "storage")


def test_a_move_outside_the_layout_is_refused():
    with pytest.raises(ValueError, match="bucket 8 is not in"):
        layout.move(descriptor(), "storage", 8, "s2", "127.0.0.1:2")
    with pytest.raises(ValueError, match="role must be one of"):
        layout.move(descriptor(), "both", 1, "s2", "127.0.0.1:2")


def test_a_staged_copy_starts_empty_whatever_was_left_on_disk(tmp_path):
    """s2 stored bucket 1 once and was down when it moved away: its file
    stayed.  Moving the bucket to s2 again copies exactly s1's records."""
    services, attributes = two_services(tmp_path, "domus-bsddb-btree")
    s1, s2 = services["s1"], services["s2"]
    s2.assign(descriptor(storage_moves={"1": "s2"}, **attributes))
    for key in keys_in(1, 7, prefix="stale"):
        put(s2, key, b"stale")
    s2.close()
    s2 = RequestHandler("s2", data_dir=str(tmp_path / "s2"))
    s2.sync([descriptor(**attributes)])                 # bucket 1 is s1's
    keys = keys_in(1, 10, prefix="c")
    for key in keys:
        put(s1, key, b"kept")
    assert move_records(s1, s2, 1) == 10
