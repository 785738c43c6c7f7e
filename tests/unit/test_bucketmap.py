"""BucketMap against a dense list model: random assignments, then every
query compared bucket by bucket."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from domus.placement import assignment
from domus.placement.bucketmap import BucketMap

OWNERS = ["a", "b", "c", None]


def model_ranges(dense):
    """Maximal runs of equal owners (None: nobody), as BucketMap reports them."""
    runs = []
    for bucket, owner in enumerate(dense):
        if owner is None:
            continue
        if runs and runs[-1][1] == bucket and runs[-1][2] == owner:
            runs[-1] = (runs[-1][0], bucket + 1, owner)
        else:
            runs.append((bucket, bucket + 1, owner))
    return runs


@st.composite
def moves(draw):
    count = draw(st.sampled_from([1, 2, 7, 16, 64, 1000]))
    steps = []
    for _ in range(draw(st.integers(0, 25))):
        first = draw(st.integers(0, count - 1))
        end = draw(st.integers(first + 1, count))
        steps.append((first, end, draw(st.sampled_from(OWNERS))))
    return count, steps


@settings(max_examples=300, deadline=None)
@given(moves())
def test_random_assignments_match_a_dense_model(case):
    count, steps = case
    bucket_map: BucketMap[str] = BucketMap(count)
    dense: list[str | None] = [None] * count
    for first, end, owner in steps:
        bucket_map.assign(first, end, owner)
        dense[first:end] = [owner] * (end - first)
        # Ranges are maximal: no two neighbours share an owner.
        assert list(bucket_map.ranges()) == model_ranges(dense)
    assert bucket_map.dense() == dense
    for bucket, owner in enumerate(dense):
        assert bucket_map.get(bucket) == owner
        if owner is None:
            with pytest.raises(KeyError):
                bucket_map.owner(bucket)
        else:
            assert bucket_map.owner(bucket) == owner
    assert len(bucket_map) == sum(owner is not None for owner in dense)
    for owner in ("a", "b", "c"):
        assert bucket_map.buckets(owner) == dense.count(owner)


@settings(max_examples=200, deadline=None)
@given(moves(), st.data())
def test_ranges_clip_to_a_window(case, data):
    count, steps = case
    bucket_map: BucketMap[str] = BucketMap(count)
    dense: list[str | None] = [None] * count
    for first, end, owner in steps:
        bucket_map.assign(first, end, owner)
        dense[first:end] = [owner] * (end - first)
    low = data.draw(st.integers(0, count))
    high = data.draw(st.integers(low, count))
    window = [owner if low <= bucket < high else None for bucket, owner in enumerate(dense)]
    assert list(bucket_map.ranges(low, high)) == model_ranges(window)


@pytest.mark.parametrize("counts", [[64], [22, 21, 21], [0, 5, 0, 3], [1] * 16])
def test_from_counts_is_the_assignment_placement(counts):
    names = [f"s{index}" for index in range(len(counts))]
    bucket_map = BucketMap.from_counts(counts, names)
    assert bucket_map.dense() == [names[index] for index in assignment.placement(counts)]
    assert bucket_map.range_count() == sum(1 for count in counts if count)


def test_a_large_map_is_one_entry_per_range():
    bucket_map = BucketMap.from_counts([16384] * 4, ["a", "b", "c", "d"])
    assert bucket_map.range_count() == 4
    bucket_map.assign(100, 101, "d")       # one bucket moves: its range splits in three
    assert bucket_map.range_count() == 6
    assert bucket_map.owner(100) == "d" and bucket_map.owner(99) == bucket_map.owner(101) == "a"
    bucket_map.assign(100, 101, "a")       # and back: merged again
    assert bucket_map.range_count() == 4


def test_out_of_range_assignments_are_refused_and_change_nothing():
    bucket_map = BucketMap.from_counts([4, 4], ["a", "b"])
    before = list(bucket_map.ranges())
    for first, end in [(-1, 2), (3, 9), (5, 5), (6, 2)]:
        with pytest.raises(ValueError, match="not within"):
            bucket_map.assign(first, end, "c")
    assert list(bucket_map.ranges()) == before
    with pytest.raises(ValueError):
        BucketMap(0)
