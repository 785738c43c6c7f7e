"""The scalability suite's YCSB generator (benchmarks/scalability/ycsb.py)
against what YCSB's CoreWorkload does."""

from collections import Counter

import pytest

from benchmarks.scalability import ycsb


def test_keys_are_ycsbs_hashed_ones():
    # YCSB's first keys with insertorder=hashed (Utils.fnvhash64, Math.abs)
    assert ycsb.key_name(0) == "user6284781860667377211"
    assert ycsb.key_name(1) == "user8517097267634966620"
    assert len({ycsb.key_name(n) for n in range(10_000)}) == 10_000


@pytest.mark.parametrize("name", "ABCDEF")
def test_each_workload_mixes_its_operations_in_its_proportions(name):
    stream = ycsb.Workload(name, 1000, seed=5)
    seen = Counter(stream.next()[0] for _ in range(20_000))
    wanted = {op: share for op, share in ycsb.WORKLOADS[name].items() if op != "distribution"}
    assert set(seen) == set(wanted)
    for operation, share in wanted.items():
        assert abs(seen[operation] / 20_000 - share) < 0.02, (operation, seen)


def test_zipfian_requests_are_skewed_and_stay_in_range():
    stream = ycsb.Workload("C", 1000, seed=9)
    keys = Counter(stream.next()[1] for _ in range(50_000))
    assert all(0 <= key < 1000 for key in keys)
    hottest = sum(count for _key, count in keys.most_common(10))
    assert hottest / 50_000 > 0.10          # 1 % of the keys, over 10 % of the requests
    assert len(keys) > 500                  # yet most keys are asked for


def test_latest_favours_new_records_and_inserts_never_collide():
    clients = [ycsb.Workload("D", 1000, seed=s, first_insert=1000 + s, stride=3)
               for s in range(3)]
    inserted = [[n for op, n, _ in (c.next() for _ in range(5000)) if op == "insert"]
                for c in clients]
    flat = [n for numbers in inserted for n in numbers]
    assert len(flat) == len(set(flat)) and min(flat) >= 1000
    reads = [n for op, n, _ in (clients[0].next() for _ in range(5000)) if op == "read"]
    assert sum(n >= 900 for n in reads) / len(reads) > 0.3   # the newest 10 %: a third of reads


def test_scans_are_1_to_100_records():
    stream = ycsb.Workload("E", 1000, seed=2)
    lengths = [length for op, _n, length in (stream.next() for _ in range(5000))
               if op == "scan"]
    assert min(lengths) >= 1 and max(lengths) <= ycsb.MAX_SCAN_LENGTH
    assert max(lengths) > 90 and min(lengths) < 10


def test_records_are_ten_fields_of_a_hundred_bytes():
    import random

    record = ycsb.record(3, random.Random(1))
    assert sorted(record) == [f"field{i}" for i in range(10)]
    assert all(len(value) == 100 for value in record.values())
