"""domus.placement.assignment: proportional bucket counts and their placement."""

from fractions import Fraction

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from domus.placement.assignment import buckets_of, placement, proportional_counts

weight = st.one_of(
    st.integers(0, 10**6),
    st.floats(0, 1e12, allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 0.0, 1, 5e-324, 1e-300, 0.1, 1 / 3]),
)
weights_strategy = st.lists(weight, min_size=1, max_size=40)
bucket_counts = st.one_of(st.integers(0, 1 << 20), st.sampled_from([1, 2, 64, 256, 1 << 16]))


def ideal_shares(bucket_count, weights):
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    return [bucket_count * w / total for w in exact]


@settings(deadline=None, max_examples=250)
@given(bucket_counts, weights_strategy)
def test_counts_add_up_and_stay_within_one_bucket_of_the_ideal_share(bucket_count, weights):
    assume(sum(Fraction(w) for w in weights) > 0)
    counts = proportional_counts(bucket_count, weights)
    assert len(counts) == len(weights)
    assert sum(counts) == bucket_count
    for count, share in zip(counts, ideal_shares(bucket_count, weights)):
        assert type(count) is int
        assert count >= 0
        assert abs(count - share) < 1


@settings(deadline=None, max_examples=100)
@given(bucket_counts, weights_strategy)
def test_counts_are_deterministic(bucket_count, weights):
    assume(sum(Fraction(w) for w in weights) > 0)
    first = proportional_counts(bucket_count, weights)
    assert proportional_counts(bucket_count, list(weights)) == first
    assert proportional_counts(bucket_count, tuple(weights)) == first


def test_zero_weight_services_get_no_buckets():
    assert proportional_counts(64, [0, 3, 0, 1]) == [0, 48, 0, 16]


def test_equal_weights_share_evenly():
    assert proportional_counts(256, [1.5] * 4) == [64] * 4
    assert proportional_counts(256, [7, 7]) == [128, 128]


def test_ties_in_the_remainder_go_to_the_service_listed_first():
    assert proportional_counts(3, [1, 1]) == [2, 1]
    assert proportional_counts(1, [1, 1, 1]) == [1, 0, 0]
    assert proportional_counts(5, [1, 1, 1]) == [2, 2, 1]


def test_the_largest_remainder_gets_the_spare_bucket():
    # shares 1.2, 1.8: the second is further from its floor.
    assert proportional_counts(3, [2, 3]) == [1, 2]


def test_weights_are_compared_exactly_not_in_floating_point():
    # 0.1 + 0.2 != 0.3 in floats; the shares still come out exact.
    assert proportional_counts(10, [0.1, 0.2, 0.7]) == [1, 2, 7]
    assert proportional_counts(64, [1e-300, 1e-300]) == [32, 32]


def test_no_buckets_gives_zero_counts():
    assert proportional_counts(0, [1, 2]) == [0, 0]


@pytest.mark.parametrize("weights, message", [
    ([], "empty"),
    ([1, -1], "non-negative"),
    ([-0.5], "non-negative"),
    ([0, 0, 0], "zero"),
    ([0.0], "zero"),
])
def test_bad_weights_raise_value_error(weights, message):
    with pytest.raises(ValueError, match=message):
        proportional_counts(64, weights)


def test_an_infinite_weight_raises_value_error():
    with pytest.raises(ValueError, match="finite"):
        proportional_counts(64, [1.0, float("inf")])


def test_nan_weight_raises_value_error():
    with pytest.raises(ValueError):
        proportional_counts(64, [1.0, float("nan")])


# ------------------------------------------------------------ placement

def test_placement_is_contiguous_ranges_in_service_order():
    assert placement([2, 0, 3, 1]) == [0, 0, 2, 2, 2, 3]
    assert placement([]) == []
    assert placement([0, 4]) == [1, 1, 1, 1]


def test_buckets_of_matches_the_example():
    counts = [2, 0, 3, 1]
    assert buckets_of(counts, 0) == range(0, 2)
    assert list(buckets_of(counts, 1)) == []
    assert buckets_of(counts, 2) == range(2, 5)
    assert buckets_of(counts, 3) == range(5, 6)


@settings(deadline=None, max_examples=150)
@given(st.lists(st.integers(0, 100), max_size=30))
def test_placement_covers_every_bucket_once_in_order(counts):
    owners = placement(counts)
    assert len(owners) == sum(counts)
    assert owners == sorted(owners)           # contiguous, in service order
    for index, count in enumerate(counts):
        assert owners.count(index) == count


@settings(deadline=None, max_examples=150)
@given(st.lists(st.integers(0, 100), min_size=1, max_size=30))
def test_buckets_of_agrees_with_placement(counts):
    owners = placement(counts)
    covered = []
    for index in range(len(counts)):
        held = buckets_of(counts, index)
        assert len(held) == counts[index]
        assert all(owners[bucket] == index for bucket in held)
        covered.extend(held)
    assert covered == list(range(len(owners)))


@settings(deadline=None, max_examples=100)
@given(st.integers(0, 12).map(lambda power: 1 << power), weights_strategy)
def test_direct_lookup_rebuilds_the_same_map_from_counts_alone(bucket_count, weights):
    # What the supervisor computes and what a client rebuilds from the
    # per-service counts it was handed are the same bucket -> service map.
    assume(sum(Fraction(w) for w in weights) > 0)
    counts = proportional_counts(bucket_count, weights)
    owners = placement(counts)
    assert len(owners) == bucket_count
    assert placement(list(counts)) == owners
    for bucket, owner in enumerate(owners):
        assert bucket in buckets_of(counts, owner)
