"""What only the asyncio client has: its event loops (asyncio's default and
uvloop), thousands of requests outstanding under the per-service window,
cancelled requests, its errors.  Its behaviour as a dict is the blocking
client's suite (``any_cluster`` in test_workload.py and test_codecs.py)."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

import domus.aio
from domus.client.aio import INPUT_BYTES
from domus.client.evented import WINDOW
from domus.client.transport import LARGE_FRAME
from domus.errors import (
    KeyTypeError,
    RemoteError,
    ServiceUnavailable,
    SupervisorUnreachable,
    UnknownDht,
    ValueTooLarge,
)
from domus.wire import protocol as wire

from .support import CLIENT_TIMEOUT, service_stats

try:
    import uvloop
except ImportError:         # (the test extra installs it; a bare install may not)
    uvloop = None

LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    uvloop is None, reason="uvloop is not installed"))]


def run(loop: str, coroutine):
    if loop == "uvloop":
        return uvloop.run(coroutine)
    return asyncio.run(coroutine)


@pytest.mark.parametrize("loop", LOOPS)
def test_thousands_outstanding_on_either_loop(shared_cluster, shared_deployment, loop):
    shared_cluster.create_dht(f"aio-{loop}", buckets=32)

    async def job() -> dict:
        async with domus.aio.connect(shared_deployment.supervisor_address,
                                     timeout=CLIENT_TIMEOUT) as cluster:
            dht = await cluster.open_dht(f"aio-{loop}")
            created = await asyncio.gather(*(dht.put(("n", n), [n, str(n)])
                                             for n in range(5000)))
            assert created == [True] * 5000
            # the window held: never more than WINDOW datagrams in flight per service
            assert all(channel.in_flight == 0 for channel in cluster.requests.channels)
            values = await asyncio.gather(*(dht.get(("n", n)) for n in range(5000)))
            assert values == [[n, str(n)] for n in range(5000)]
            found = await dht.get_many([("n", n) for n in range(0, 5000, 7)] + ["absent"])
            assert found == {("n", n): [n, str(n)] for n in range(0, 5000, 7)}
            keys = {key async for key in dht}
            assert keys == {("n", n) for n in range(5000)}
            assert await dht.length() == 5000
            assert sum((await dht.records_by_service()).values()) == 5000
            deleted = await asyncio.gather(*(dht.delete(("n", n)) for n in range(0, 5000, 2)))
            assert deleted == [True] * 2500
            assert await dht.contains(("n", 1)) and not await dht.contains(("n", 0))
            return dht.stats()

    stats = run(loop, job())
    assert stats["retries"] == 0 or stats["timeouts"] >= stats["retries"]
    assert len(shared_cluster.open_dht(f"aio-{loop}")) == 2500


def test_concurrent_pops_give_each_value_to_one_task(shared_cluster, shared_deployment):
    """pop(key, default) from many tasks at once: each key's value goes to
    exactly one of them, the others get the default, never KeyError;
    without a default an absent key is KeyError (as for the blocking
    client's pop)."""
    dht_name = "aio-pops"
    keys = [f"p{number}" for number in range(200)]
    shared_cluster.create_dht(dht_name).put_many({key: key.upper() for key in keys})

    async def job() -> list:
        async with domus.aio.connect(shared_deployment.supervisor_address,
                                     timeout=CLIENT_TIMEOUT) as cluster:
            dht = await cluster.open_dht(dht_name)
            popped = await asyncio.gather(*(dht.pop(key, None)
                                            for key in keys for _ in range(4)))
            with pytest.raises(KeyError):
                await dht.pop(keys[0])
            assert await dht.pop(keys[0], "default") == "default"
            return popped

    popped = run("asyncio", job())
    assert sorted(value for value in popped if value is not None) == \
        sorted(key.upper() for key in keys)
    assert len(shared_cluster.open_dht(dht_name)) == 0


@pytest.mark.parametrize("loop", LOOPS)
def test_key_ranges_are_async_iterators_on_either_loop(shared_cluster, shared_deployment, loop):
    """(Every case of irange is test_range.py's, through this client too.)"""
    shared_cluster.create_dht(f"aio-range-{loop}", platform="domus-rbt")
    shared_cluster.create_dht(f"aio-unordered-{loop}", platform="python-dict")

    async def job() -> None:
        async with domus.aio.connect(shared_deployment.supervisor_address,
                                     timeout=CLIENT_TIMEOUT) as cluster:
            dht = await cluster.open_dht(f"aio-range-{loop}")
            await dht.put_many({n: -n for n in range(-300, 300)} | {"a": 1, b"b": 2})
            assert [key async for key in dht.irange(-5, 5, inclusive=(False, True))] == list(
                range(-4, 6))
            assert [pair async for pair in dht.irange(290, "z", reverse=True, items=True)] == [
                ("a", 1), *((n, -n) for n in range(299, 289, -1))]
            with pytest.raises(KeyTypeError):
                dht.irange(1.5)         # (at once: nothing is sent)
            first = []
            async for key in dht.irange():
                first.append(key)
                if len(first) == 3:
                    break
            assert first == [-300, -299, -298]
            unordered = await cluster.open_dht(f"aio-unordered-{loop}")
            keys = unordered.irange()
            with pytest.raises(RemoteError, match="keeps no key order"):
                await anext(keys)

    run(loop, job())


def test_the_window_bounds_what_is_in_flight(shared_cluster, shared_deployment):
    shared_cluster.create_dht("aio-window", buckets=4, storage_services=["s1"])

    async def job() -> int:
        async with domus.aio.connect(shared_deployment.supervisor_address) as cluster:
            dht = await cluster.open_dht("aio-window")
            puts = [asyncio.ensure_future(dht.put(n, n)) for n in range(2000)]
            await asyncio.sleep(0)
            most = 0
            while not all(put.done() for put in puts):
                most = max([most, *(channel.in_flight for channel in cluster.requests.channels)])
                await asyncio.sleep(0)
            await asyncio.gather(*puts)
            return most

    most = asyncio.run(job())
    assert 1 <= most <= WINDOW
    assert len(shared_cluster.open_dht("aio-window")) == 2000


def test_cancelled_requests_free_their_slots(shared_cluster, shared_deployment):
    shared_cluster.create_dht("aio-cancel")

    async def job() -> None:
        async with domus.aio.connect(shared_deployment.supervisor_address) as cluster:
            dht = await cluster.open_dht("aio-cancel")
            puts = [asyncio.ensure_future(dht.put(n, n)) for n in range(500)]
            await asyncio.sleep(0)
            for put in puts[100:]:
                put.cancel()
            await asyncio.gather(*puts, return_exceptions=True)
            assert not cluster.requests.pending
            assert all(channel.in_flight == 0 and not channel.waiting
                       for channel in cluster.requests.channels)
            assert await dht.put("after", 1) is True   # the client still works
            assert await dht.get_many(range(100)) == {n: n for n in range(100)}

    asyncio.run(job())


def test_errors_are_domus_errors(shared_cluster, shared_deployment):
    shared_cluster.create_dht("aio-errors")

    async def job() -> None:
        async with domus.aio.connect(shared_deployment.supervisor_address) as cluster:
            with pytest.raises(UnknownDht):
                await cluster.open_dht("no-such-dht")
            dht = await cluster.open_dht("aio-errors")
            with pytest.raises(KeyTypeError):
                await dht.put(1.5, 1)
            with pytest.raises(ValueTooLarge):
                await dht.put("big", b"x" * wire.MAX_VALUE_BYTES)
            with pytest.raises(KeyError):
                await dht.getitem("absent")
            assert await dht.get("absent", "default") == "default"
            # a value that needs TCP both ways
            assert await dht.put("large", b"y" * 200_000) is True
            assert await dht.get("large") == b"y" * 200_000
            # (a large bytes value goes as its msgpack header and itself,
            # joined into the message: PUT_IF_ABSENT's too)
            assert await dht.setdefault("large default", b"z" * 300_000) == b"z" * 300_000
            assert await dht.setdefault("large default", b"w" * 300_000) == b"z" * 300_000
        with pytest.raises(Exception, match="closed"):
            await dht.put("after close", 1)

    asyncio.run(job())


@pytest.mark.parametrize("loop", LOOPS)
def test_large_values_of_every_kind_come_back_as_they_were(shared_cluster, shared_deployment,
                                                           loop):
    # A large GET reply whose value is msgpack bin 32 is read with the value
    # apart, into bytes of its own (transport.ValueReply); a str, a list or a
    # raw DHT's value is decoded from the whole frame.  Sizes about the
    # reader's thresholds: a datagram, its input buffer, a large frame.
    shared_cluster.create_dht(f"aio-large-{loop}")
    shared_cluster.create_dht(f"aio-large-raw-{loop}", codec="raw")
    values = {"str": "é" * 100_000, "list": list(range(40_000)), "bytes": os.urandom(300_000),
              "nested": [os.urandom(70_000), "x"], "4 MiB": os.urandom(4 << 20)}
    values |= {f"bytes {size}": os.urandom(size) for size in (
        wire.DEFAULT_MAX_DATAGRAM, INPUT_BYTES * 4 + 1, LARGE_FRAME - 13, LARGE_FRAME)}
    tricky = b"\xc6" + (100_000).to_bytes(4, "big") + os.urandom(100_000)
    raw_values = {"tricky": tricky, "raw": os.urandom(1 << 20)}

    async def job() -> None:
        async with domus.aio.connect(shared_deployment.supervisor_address) as cluster:
            dht = await cluster.open_dht(f"aio-large-{loop}")
            for key, value in values.items():
                await dht.put(key, value)
            for key, value in values.items():
                got = await dht.get(key)
                assert got == value and type(got) is type(value)
                assert await dht.getitem(key) == value
            assert await asyncio.gather(*(dht.get(key) for key in values)) == list(
                values.values())
            raw = await cluster.open_dht(f"aio-large-raw-{loop}")
            for key, value in raw_values.items():
                await raw.put(key, value)
                got = await raw.get(key)
                assert got == value and type(got) is bytes

    run(loop, job())


def test_gets_of_large_values_go_over_tcp_at_once_until_one_is_small(shared_cluster,
                                                                     shared_deployment):
    """After a GET whose reply was past a datagram (asked over UDP, answered
    REPLY_TOO_LARGE, asked again over TCP), the next GETs to that service go
    over TCP at once, as the blocking client's do, until one's reply would
    have fitted a datagram: the service answers REPLY_TOO_LARGE once."""
    shared_cluster.create_dht("aio-tcp-gets", buckets=1)
    (service,) = {entry["name"]: entry["address"] for entry in shared_cluster.services()
                  if entry["buckets"].get("aio-tcp-gets", {}).get("storage")}.values()
    big = os.urandom(100_000)

    def too_large() -> int:
        return service_stats(service)["by_status"].get("reply_too_large", 0)

    async def job() -> None:
        async with domus.aio.connect(shared_deployment.supervisor_address) as cluster:
            dht = await cluster.open_dht("aio-tcp-gets")
            await dht.put_many({"big": big, "big2": big, "small": 1})
            before = too_large()
            for key in ("big", "big2", "big", "small"):
                await dht.get(key)
            assert too_large() == before + 1      # (the first GET only)
            assert await dht.get("big") == big    # over UDP again: REPLY_TOO_LARGE
            assert too_large() == before + 2
            assert await asyncio.gather(dht.get("big"), dht.get("big2")) == [big, big]
            assert too_large() == before + 2

    asyncio.run(job())


def test_a_silent_service_and_an_absent_supervisor_are_clear_errors(shared_deployment):
    silent = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    silent.bind(("127.0.0.1", 0))
    address = f"127.0.0.1:{silent.getsockname()[1]}"

    async def job() -> None:
        async with domus.aio.connect(shared_deployment.supervisor_address,
                                     timeout=1.0) as cluster:
            channel = cluster.channel("ghost", address)
            message = wire.encode_length(cluster.ids.next(), cluster.ids.client_id, 1)
            with pytest.raises(ServiceUnavailable, match="ghost .* did not answer within 1.0s"):
                await channel.request(message, "d")
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        listener.close()
        with pytest.raises(SupervisorUnreachable, match=f"127.0.0.1:{port}"):
            await domus.aio.connect(f"127.0.0.1:{port}", timeout=1.0)

    try:
        asyncio.run(job())
    finally:
        silent.close()
