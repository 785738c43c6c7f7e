"""domus.placement.replicas on made-up clusters: where a replicated DHT's
backups go at creation (distinct services, distinct hosts whenever there are
enough, every copy placed, each service holding about R times its primary
share), and the queries the supervisor and services make of a descriptor."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domus.placement import layout, replicas
from domus.placement.assignment import proportional_counts
from domus.placement.bucketmap import BucketMap


def placed(buckets, weights, hosts, copies):
    """(services, primary layout, backups) of a DHT created over services
    s1..sN with ``weights``, on ``hosts`` (one host name per service)."""
    services = [f"s{index + 1}" for index in range(len(weights))]
    counts = proportional_counts(buckets, weights)
    primary = BucketMap.from_counts(counts, services)
    backups = replicas.place_backups(primary, services, dict(zip(services, hosts)), copies)
    return services, primary, backups


def holders_of(primary, backups, bucket):
    return [primary.get(bucket), *(copy.get(bucket) for copy in backups)]


def totals(primary, backups):
    held = Counter()
    for copy in (primary, *backups):
        for first, end, service in copy.ranges():
            held[service] += end - first
    return held


def assert_well_placed(buckets, weights, hosts, copies):
    """Every copy of every bucket placed, on distinct services, on as many
    distinct hosts as the copies need and the hosts allow."""
    services, primary, backups = placed(buckets, weights, hosts, copies)
    host_of = dict(zip(services, hosts))
    assert len(backups) == copies - 1
    for bucket in range(buckets):
        holders = holders_of(primary, backups, bucket)
        assert None not in holders, f"bucket {bucket} lacks a copy: {holders}"
        assert len(set(holders)) == copies, f"bucket {bucket}: {holders}"
        assert len({host_of[service] for service in holders}) == min(copies, len(set(hosts))), \
            f"bucket {bucket}: {holders} on {[host_of[service] for service in holders]}"
    assert sum(totals(primary, backups).values()) == copies * buckets
    return services, primary, backups


# ------------------------------------------------------------ placement

DISTINCT = [f"h{index}" for index in range(8)]


@pytest.mark.parametrize("copies", [2, 3])
@pytest.mark.parametrize("buckets", [3, 8, 64, 1024])
@pytest.mark.parametrize("weights", [[1, 1, 1], [1, 1, 1, 1], [1] * 7, [1, 2, 3, 4],
                                     [5, 4, 3, 3, 2, 2, 1], [3, 1, 1, 1], [10, 1, 1]])
def test_copies_are_on_distinct_services_and_hosts(copies, buckets, weights):
    assert_well_placed(buckets, weights, DISTINCT[:len(weights)], copies)


@pytest.mark.parametrize("copies", [2, 3])
@pytest.mark.parametrize("buckets", [8, 64, 256])
@pytest.mark.parametrize("hosts", [
    ["a", "b", "a", "b"],                     # two services a host, in turn
    ["a", "a", "b", "b"],                     # two services a host, side by side
    ["a", "a", "b", "b", "c", "c"],
    ["a", "b", "c", "a", "b", "c"],
    ["a", "a", "a", "b", "c"],                # one crowded host
    ["a", "a", "a", "a", "b"],                # every copy must use the lone b (R=2)
    ["a", "a", "a", "a"],                     # one host: distinct services at least
    ["a", "b", "b"],
])
def test_services_sharing_hosts_get_copies_on_distinct_hosts_when_there_are_enough(
        copies, buckets, hosts):
    assert_well_placed(buckets, [1] * len(hosts), hosts, copies)


def test_two_services_of_one_host_never_hold_one_bucket_while_another_host_is_free():
    # Turning the layout by B/2 put s1's buckets on s3, s1's host-mate:
    # a bucket's both copies died with host a.
    services, primary, (backup,) = placed(64, [1, 1, 1, 1], ["a", "b", "a", "b"], 2)
    host = {"s1": "a", "s2": "b", "s3": "a", "s4": "b"}
    for bucket in range(64):
        assert host[primary.get(bucket)] != host[backup.get(bucket)], bucket
    assert totals(primary, [backup]) == {service: 32 for service in services}


@given(
    weights=st.lists(st.sampled_from([0.5, 1, 1, 1, 2, 3, 10]), min_size=2, max_size=8),
    host_numbers=st.lists(st.integers(0, 7), min_size=8, max_size=8),
    buckets=st.sampled_from([1, 2, 3, 5, 7, 8, 16, 100, 128, 256]),
    copies=st.integers(2, 3),
)
@settings(max_examples=200, deadline=None)
def test_any_cluster_gets_every_copy_placed_on_distinct_services_and_hosts(
        weights, host_numbers, buckets, copies):
    if copies > len(weights):
        copies = len(weights)
    hosts = [f"h{number}" for number in host_numbers[:len(weights)]]
    _services, primary, backups = assert_well_placed(buckets, weights, hosts, copies)
    assert max(totals(primary, backups).values()) <= buckets     # (a copy of each at most)


@pytest.mark.parametrize("buckets, weights, copies", [
    (64, [1, 1, 1, 1], 2), (64, [1, 1, 1, 1], 3), (256, [1] * 6, 2), (256, [1] * 6, 3),
    (1024, [1] * 7, 2), (1024, [1] * 7, 3), (256, [1, 2, 3, 4], 2),
    (1024, [5, 4, 3, 3, 2, 2, 1], 2), (1024, [5, 4, 3, 3, 2, 2, 1], 3), (8, [1, 1, 1], 2)])
def test_each_service_holds_r_times_its_primaries_when_none_has_over_a_share(
        copies, buckets, weights):
    counts = proportional_counts(buckets, weights)
    assert max(counts) <= buckets // copies         # (none has over a share)
    services, primary, backups = assert_well_placed(buckets, weights,
                                                    DISTINCT[:len(weights)], copies)
    assert totals(primary, backups) == {service: copies * count
                                        for service, count in zip(services, counts)}


@pytest.mark.parametrize("copies", [2, 3])
@pytest.mark.parametrize("hosts", [["a", "b"] * 3, ["a", "a", "b", "b", "c", "c"],
                                   ["a", "b", "c"] * 2])
def test_sharing_hosts_evenly_keeps_the_totals_close_to_r_times_the_primaries(copies, hosts):
    services, primary, backups = assert_well_placed(256, [1] * 6, hosts, copies)
    counts = proportional_counts(256, [1] * 6)
    held = totals(primary, backups)
    for service, count in zip(services, counts):
        assert abs(held[service] - copies * count) <= 2, (held, counts)


def test_a_service_with_over_a_share_holds_each_bucket_once_and_the_rest_is_spread():
    services, primary, (backup,) = assert_well_placed(64, [3, 1, 1, 1], DISTINCT[:4], 2)
    assert [primary.buckets(service) for service in services] == [32, 11, 11, 10]
    held = totals(primary, [backup])
    assert held["s1"] == 64                     # a copy of every bucket, no more
    assert sorted(held[service] for service in services[1:]) == [20, 22, 22]


def test_fewer_hosts_than_copies_puts_a_copy_on_every_host():
    services, primary, backups = assert_well_placed(64, [1, 1, 1, 1], ["a", "a", "b", "b"], 3)
    host = dict(zip(services, ["a", "a", "b", "b"]))
    for bucket in range(64):
        assert {host[service] for service in holders_of(primary, backups, bucket)} == {"a", "b"}


def test_placement_is_deterministic():
    first = placed(256, [1, 2, 3], ["a", "b", "c"], 3)
    again = placed(256, [1, 2, 3], ["a", "b", "c"], 3)
    assert first[2] == again[2]


def test_more_copies_than_services_is_refused_naming_both():
    primary = BucketMap.from_counts([4, 4], ["s1", "s2"])
    with pytest.raises(ValueError, match="3 copies of each bucket need 3 services that can "
                                         "store them; there are 2"):
        replicas.place_backups(primary, ["s1", "s2"], {}, 3)
    with pytest.raises(ValueError, match="there are 2"):        # (a name listed twice)
        replicas.place_backups(primary, ["s1", "s2", "s2"], {}, 3)


# ------------------------------------------------------------ choose

def test_choose_prefers_another_host_then_the_fewest_copies_then_the_first_listed():
    services = ["s1", "s2", "s3", "s4"]
    hosts = {"s1": "a", "s2": "a", "s3": "b", "s4": "b"}
    assert replicas.choose(services, hosts, {"s1"}, {"s3": 5, "s4": 5}) == "s3"
    assert replicas.choose(services, hosts, {"s1"}, {"s3": 6, "s4": 5}) == "s4"
    # s2 has fewer copies, but shares s1's host
    assert replicas.choose(services, hosts, {"s1"}, {"s2": 0, "s3": 9, "s4": 9}) == "s3"
    # no other host free: the fewest copies anywhere
    assert replicas.choose(services, hosts, {"s1", "s3"}, {"s2": 3, "s4": 2}) == "s4"
    # a service with no host known is a host of its own
    assert replicas.choose(["s1", "s2"], {}, {"s1"}, {}) == "s2"


def test_choose_refuses_when_every_service_holds_a_copy():
    with pytest.raises(ValueError, match=r"every service holds a copy already \(\['s1', 's2'\]\)"):
        replicas.choose(["s1", "s2"], {}, {"s1", "s2"}, {})


# ------------------------------------------------------------ descriptors

def descriptor(backups=None, **changes):
    """8 buckets: s1 holds 0..3, s2 4..7 (primaries); s3 listed with none."""
    base = {"id": 1, "name": "r", "buckets": 8, "version": 4, "replicas": 3,
            "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 4},
                                 {"name": "s2", "address": "127.0.0.1:2", "count": 4},
                                 {"name": "s3", "address": "127.0.0.1:3", "count": 0}]}
    if backups is not None:
        base["storage_backups"] = backups
    return {**base, **changes}


# rank 1: s2 backs up 0..3, s3 4..7; rank 2: s3 backs up 0..2, bucket 3 is
# missing, s1 backs up 4..5, 6..7 are missing
BACKUPS = [[[0, 4, "s2"], [4, 8, "s3"]], [[0, 3, "s3"], [4, 6, "s1"]]]


def test_backups_reads_each_rank_as_a_bucket_map():
    rank1, rank2 = replicas.backups(descriptor(BACKUPS))
    assert rank1.dense() == ["s2"] * 4 + ["s3"] * 4
    assert rank2.dense() == ["s3"] * 3 + [None] + ["s1"] * 2 + [None] * 2
    assert replicas.backups(descriptor()) == []                     # replicas=1
    assert replicas.backups(descriptor([[[0, 8, None]]]))[0].dense() == [None] * 8
    assert [replicas.encode(copy) for copy in replicas.backups(descriptor(BACKUPS))] == BACKUPS


def test_holders_are_the_primary_then_each_backup_present_by_rank():
    dht = descriptor(BACKUPS)
    assert replicas.holders(dht, 0) == ["s1", "s2", "s3"]
    assert replicas.holders(dht, 3) == ["s1", "s2"]             # rank 2 missing
    assert replicas.holders(dht, 5) == ["s2", "s3", "s1"]
    assert replicas.holders(dht, 7) == ["s2", "s3"]
    # a moved primary is the primary where it is now
    assert replicas.holders(descriptor(BACKUPS, storage_moves={"7": "s1"}), 7) == ["s1", "s3"]
    assert replicas.holders(descriptor(), 2) == ["s1"]


def test_missing_lists_the_gaps_of_each_rank_up_to_the_last_bucket():
    assert replicas.missing(descriptor(BACKUPS)) == [(2, 3, 4), (2, 6, 8)]
    assert replicas.missing(descriptor([[[2, 5, "s3"]]])) == [(1, 0, 2), (1, 5, 8)]
    assert replicas.missing(descriptor([[], [[0, 8, "s3"]]])) == [(1, 0, 8)]
    assert replicas.missing(descriptor([[[0, 8, "s3"]]])) == []
    assert replicas.missing(descriptor()) == []


def test_copies_held_counts_primaries_and_backups():
    assert replicas.copies_held(descriptor(BACKUPS)) == {"s1": 6, "s2": 8, "s3": 7}
    assert replicas.copies_held(descriptor()) == {"s1": 4, "s2": 4}
    moved = descriptor(BACKUPS, storage_moves={"7": "s1"})
    assert replicas.copies_held(moved) == {"s1": 7, "s2": 7, "s3": 7}


def test_with_backups_bumps_the_version_and_leaves_the_old_descriptor_alone():
    before = descriptor(BACKUPS)
    kept = repr(before)
    copies = replicas.backups(before)
    copies[1].assign(3, 4, "s3")
    after = replicas.with_backups(before, copies)
    assert after["version"] == 5 and repr(before) == kept
    assert after["storage_backups"][1] == [[0, 4, "s3"], [4, 6, "s1"]]
    assert replicas.missing(after) == [(2, 6, 8)]
    assert after["storage_services"] == before["storage_services"]     # nobody new
    # the primary layout is untouched
    assert layout.owners(after, "storage") == layout.owners(before, "storage")


def test_with_backups_lists_a_new_holder_with_count_zero_and_its_address():
    before = descriptor(BACKUPS)
    copies = replicas.backups(before)
    copies[1].assign(6, 7, "s5")
    copies[1].assign(7, 8, "s4")
    after = replicas.with_backups(before, copies, {"s4": "127.0.0.1:4"})
    assert after["storage_services"][3:] == [
        {"name": "s4", "address": "127.0.0.1:4", "count": 0},
        {"name": "s5", "address": "", "count": 0}]           # (no address known: empty)
    assert before["storage_services"][3:] == []
    # count 0: the primaries (and the direct lookup's placement) are the same
    assert layout.owners(after, "storage") == layout.owners(before, "storage")
    assert replicas.holders(after, 7) == ["s2", "s3", "s4"]
    assert replicas.copies_held(after) == {"s1": 6, "s2": 8, "s3": 7, "s4": 1, "s5": 1}
