"""Key ranges (``dht.irange``) on a real deployment: a domus-rbt DHT spread
over every service, checked against a sorted model of its records, read
through the blocking client and through the asyncio client (``reader``).

Key order is the order of encoded keys: ints, then str, then bytes; ints by
value, str by code point, bytes bytewise (docs/protocol.md, "Key encoding").
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest

import domus
from domus.errors import KeyTypeError, RemoteError
from domus.wire import protocol as wire

from .support import (
    CLIENT_TIMEOUT,
    owner_of,
    same_value,
    service_addresses,
    service_stats,
    wait_until,
)

SEED = 2024
KIND_RANK = {int: 0, str: 1, bytes: 2}


def order(key: Any) -> tuple[int, Any]:
    """The documented key order, as a sort key."""
    return KIND_RANK[type(key)], key


def model_range(model: dict[Any, Any], lo: Any = None, hi: Any = None, *,
                inclusive: tuple[bool, bool] = (True, True), reverse: bool = False,
                items: bool = False) -> list[Any]:
    """What ``dht.irange`` must yield, computed from a dict of the records."""
    def inside(key: Any) -> bool:
        if lo is not None and (order(key) < order(lo)
                               or (order(key) == order(lo) and not inclusive[0])):
            return False
        if hi is not None and (order(key) > order(hi)
                               or (order(key) == order(hi) and not inclusive[1])):
            return False
        return True

    keys = sorted((key for key in model if inside(key)), key=order, reverse=reverse)
    return [(key, model[key]) for key in keys] if items else keys


def mixed_keys(rng: random.Random, count: int) -> set[Any]:
    """Distinct keys of every kind: small and 64-bit ints of both signs, ints
    beyond 64 bits, ASCII and non-ASCII str, bytes."""
    keys: set[Any] = set()
    while len(keys) < count:
        kind = rng.randrange(7)
        if kind == 0:
            keys.add(rng.randint(0, 5000))
        elif kind == 1:
            keys.add(rng.randint(-5000, -1))
        elif kind == 2:
            keys.add(rng.randint(-(2**63), 2**63 - 1))
        elif kind == 3:
            keys.add(rng.choice((1, -1)) * rng.getrandbits(rng.randint(65, 130)))
        elif kind == 4:
            keys.add("".join(rng.choice("abcdefxyz0123-_") for _ in range(rng.randint(0, 10))))
        elif kind == 5:
            keys.add("".join(rng.choice("aé中🦆zß") for _ in range(rng.randint(1, 5))))
        else:
            keys.add(rng.randbytes(rng.randint(0, 12)))
    return keys


def range_requests(cluster: domus.Cluster) -> dict[str, int]:
    """RANGE requests each service has answered so far."""
    return {name: service_stats(address)["by_op"].get("range", 0)
            for name, address in service_addresses(cluster).items()}


@pytest.fixture(scope="module", params=[("domus-rbt", "ram"), ("domus-bsddb-btree", "disk")],
                ids=["domus-rbt", "domus-bsddb-btree-disk"])
def ordered(shared_client, request):
    """An ordered DHT over the three services of the module's shared
    deployment with 4000 mixed keys (values of ~70 bytes: each service's
    part takes more than one datagram), and its model.  Made once per
    platform: the tests that use it only read."""
    platform, medium = request.param
    dht = shared_client.create_dht(f"ordered-{platform}", platform=platform, storage=medium)
    assert len(dht.descriptor["storage_services"]) == 3
    rng = random.Random(SEED)
    model = {key: [f"value of {key!r}"[:30], rng.randint(0, 99), "v" * rng.randint(20, 50)]
             for key in mixed_keys(rng, 4000)}
    dht.put_many(model)
    assert len(dht) == len(model)
    yield dht, model
    assert len(dht) == len(model), "a test that shares this DHT changed it"
    shared_client.destroy_dht(dht.name)


@pytest.fixture(scope="module", params=["blocking", "asyncio"])
def reader(request, shared_aio_client):
    """How a test reads a DHT it made with the blocking client: through it,
    or through the asyncio client (its async iterator stepped from here)."""
    if request.param == "blocking":
        return lambda dht: dht
    return lambda dht: shared_aio_client.open_dht(dht.name)


@pytest.mark.timeout(180)
def test_irange_equals_the_sorted_model(shared_cluster, ordered, reader):
    dht, model = ordered
    dht = reader(dht)
    everything = list(dht.irange())
    expected = model_range(model)
    assert len(everything) == len(expected) == len(model)
    if everything != expected:
        wrong = next(i for i, (got, want) in enumerate(zip(everything, expected)) if got != want)
        raise AssertionError(f"irange() differs from the sorted model first at position "
                             f"{wrong}: got {everything[wrong - 1:wrong + 2]!r}, expected "
                             f"{expected[wrong - 1:wrong + 2]!r}")
    assert list(dht.irange(reverse=True)) == expected[::-1]

    before = range_requests(shared_cluster)
    got_items = list(dht.irange(items=True))
    after = range_requests(shared_cluster)
    assert [key for key, _value in got_items] == expected
    assert all(same_value(value, model[key]) for key, value in got_items)
    # Every service answered, with values in more than one page.
    pages = {name: after[name] - before[name] for name in after}
    assert all(count >= 2 for count in pages.values()), pages
    assert list(dht.irange(reverse=True, items=True)) == got_items[::-1]


RANGES = [
    dict(lo=0),
    dict(hi=-1),
    dict(lo=-100, hi=100),
    dict(lo=-100, hi=100, inclusive=(False, False)),
    dict(lo=2**63, hi=-(2**63), reverse=True),                 # lo > hi: empty
    dict(lo=-(2**64)),
    dict(lo=10, hi="m"),                                       # across kinds
    dict(lo="", hi=b"", inclusive=(True, False)),              # every str
    dict(lo="a", hi="b", reverse=True),
    dict(lo="x", items=True),
    dict(lo=b""),                                              # every bytes key
    dict(lo=b"\x80", reverse=True, items=True),
    dict(hi="中", inclusive=(True, False), reverse=True),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("bounds", RANGES, ids=repr)
def test_ranges_equal_the_sorted_model(ordered, reader, bounds):
    dht, model = ordered
    dht = reader(dht)
    got = list(dht.irange(**bounds))
    expected = model_range(model, **bounds)
    assert got == expected, (f"irange({bounds}) gave {len(got)} entries, expected "
                             f"{len(expected)}; first of each: {got[:3]!r} {expected[:3]!r}")


@pytest.mark.timeout(180)
def test_ranges_with_stored_keys_as_bounds(ordered, reader):
    dht, model = ordered
    dht = reader(dht)
    rng = random.Random(SEED + 1)
    keys = sorted(model, key=order)
    for _ in range(12):
        lo, hi = sorted(rng.sample(keys, 2), key=order)
        inclusive = (rng.random() < 0.5, rng.random() < 0.5)
        reverse = rng.random() < 0.5
        got = list(dht.irange(lo, hi, inclusive=inclusive, reverse=reverse))
        assert got == model_range(model, lo, hi, inclusive=inclusive, reverse=reverse), (
            f"irange({lo!r}, {hi!r}, inclusive={inclusive}, reverse={reverse})")
        if inclusive == (True, True):
            assert order(got[0 if not reverse else -1]) == order(lo)
            assert order(got[-1 if not reverse else 0]) == order(hi)


@pytest.mark.timeout(180)
def test_a_range_is_lazy_and_can_be_left_early(ordered, reader):
    dht, model = ordered
    dht = reader(dht)
    first_ten = []
    for key in dht.irange("a"):
        first_ten.append(key)
        if len(first_ten) == 10:
            break
    assert first_ten == model_range(model, "a")[:10]


@pytest.mark.timeout(180)
def test_large_values_come_in_many_pages_and_over_tcp(shared_cluster, reader):
    dht = shared_cluster.create_dht("big-values", platform="domus-rbt")
    rng = random.Random(SEED)
    model: dict[Any, Any] = {f"doc-{number:04d}": rng.randbytes(10_000) for number in range(300)}
    model["doc-0150-huge"] = rng.randbytes(150_000)      # does not fit a datagram at all
    model[7] = "an int among them"
    dht.put_many(model)
    written, dht = dht, reader(dht)
    before = range_requests(shared_cluster)
    got = list(dht.irange(items=True))
    after = range_requests(shared_cluster)
    assert [key for key, _value in got] == model_range(model)
    assert all(same_value(value, model[key]) for key, value in got)
    # A service sends its values a datagram at a time; the one holding the
    # huge record answers REPLY_TOO_LARGE when it is next, and the client asks
    # for that page, and so the rest of that service's range, over TCP.
    for name in after:
        held = [key for key in model if owner_of(written, key) == name]
        if "doc-0150-huge" not in held:
            least = len(held) * 10_000 // wire.MAX_UDP_PAYLOAD
            assert after[name] - before[name] >= least, (name, len(held), after, before)
    # Keys only: the same keys, in far fewer pages.
    before = range_requests(shared_cluster)
    assert list(dht.irange("doc-0100", "doc-0200", reverse=True)) == model_range(
        model, "doc-0100", "doc-0200", reverse=True)
    assert sum(range_requests(shared_cluster).values()) - sum(before.values()) == 3


def test_a_python_dict_dht_refuses_ranges_with_a_clear_error(shared_cluster, reader):
    dht = shared_cluster.create_dht("unordered", platform="python-dict")
    dht["a"] = 1
    dht = reader(dht)
    keys = dht.irange()                 # nothing is sent yet
    with pytest.raises(RemoteError) as raised:
        next(keys)
    message = str(raised.value)
    assert "uses platform python-dict, which keeps no key order" in message
    assert "domus-rbt" in message
    assert raised.value.status == wire.ST_UNSUPPORTED
    # Bad arguments are refused at once, before any request.
    with pytest.raises(KeyTypeError):
        dht.irange(1.5)
    with pytest.raises(TypeError):
        dht.irange(inclusive=True)


def test_an_empty_dht_has_empty_ranges(shared_cluster, reader):
    dht = reader(shared_cluster.create_dht("empty-ordered", platform="domus-rbt"))
    assert list(dht.irange()) == []
    assert list(dht.irange(0, "z", reverse=True, items=True)) == []


@pytest.mark.timeout(180)
def test_a_range_yields_each_stable_key_once_in_order_while_others_are_written(
        deployment, cluster):
    dht = cluster.create_dht("churned-range", platform="domus-rbt")
    stable = {f"k{number:05d}-stable": "s" * 200 for number in range(0, 12_000, 2)}
    dht.put_many(stable)
    stop = threading.Event()
    written: list[int] = []
    failures: list[BaseException] = []

    def churn() -> None:
        # Keys that fall between the stable ones, written and deleted.
        try:
            with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as other:
                churned = other.open_dht("churned-range")
                rng = random.Random(SEED)
                live: list[str] = []
                while not stop.is_set():
                    key = f"k{rng.randrange(1, 12_000, 2):05d}-churn"
                    churned[key] = "c" * rng.randint(0, 300)
                    live.append(key)
                    if len(live) > 50:
                        churned.delete(live.pop(rng.randrange(len(live))))
                    written.append(1)
        except BaseException as exc:
            failures.append(exc)

    def slowly(reverse: bool) -> list[str]:
        """The whole range, read slowly enough that pages interleave with
        the writer's changes."""
        keys = []
        for key, _value in dht.irange(reverse=reverse, items=True):
            keys.append(key)
            if len(keys) % 500 == 0:
                time.sleep(0.01)
        return keys

    writer = threading.Thread(target=churn)
    writer.start()
    churned_seen = 0
    try:
        wait_until(lambda: len(written) >= 10, timeout=15, what="the writer to start")
        for reverse in (False, True, False):
            writes = len(written)
            keys = slowly(reverse)
            assert len(written) > writes, "nothing was written during the range"
            assert keys == sorted(keys, reverse=reverse), "keys came out of order"
            assert len(keys) == len(set(keys)), "a key came twice"
            stable_seen = [key for key in keys if key.endswith("-stable")]
            assert stable_seen == sorted(stable, reverse=reverse), "a stable key was missed"
            assert all(key.endswith(("-stable", "-churn")) for key in keys)
            churned_seen += len(keys) - len(stable_seen)
    finally:
        stop.set()
        writer.join(30)
    assert not failures, failures
    assert churned_seen, "no range saw any of the writer's keys"
