"""domus.placement.replicas on made-up clusters: where a replicated DHT's
backups go at creation (distinct services, distinct hosts whenever there are
enough, every copy placed, each service holding about R times its primary
share), and the queries the supervisor and services make of a descriptor."""

from __future__ import annotations

from collections import Counter

import pytest

from domus.placement import replicas
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


@pytest.mark.parametrize("copies", [2, 3])
@pytest.mark.parametrize("hosts", [["a", "b"] * 3, ["a", "a", "b", "b", "c", "c"],
                                   ["a", "b", "c"] * 2])
def test_sharing_hosts_evenly_keeps_the_totals_close_to_r_times_the_primaries(copies, hosts):
    services, primary, backups = assert_well_placed(256, [1] * 6, hosts, copies)
    counts = proportional_counts(256, [1] * 6)
    held = totals(primary, backups)
    for service, count in zip(services, counts):
        assert abs(held[service] - copies * count) <= 2, (held, counts)
