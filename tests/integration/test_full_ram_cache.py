"""A RAM DHT kept in Berkeley DB fills its cache (`--bdb-ram-cache`),
through a real service and the blocking client.

Berkeley DB cannot evict a RAM database's pages: a put that finds no room
searches for four seconds (it sleeps a second four times) before it fails.
The C path used to fail it, then hand it to Python, which searched four
seconds more: eight seconds, past the client's five, so the client was
told the service did not answer (ServiceUnavailable), not that the cache
was full.  Now the first such put is StorageFull within the client's
deadline, the next ones at once, until a delete gives room back; what was
stored stays readable throughout, and the service serves other DHTs."""

from __future__ import annotations

import time

import pytest

from domus.client.blocking import DEFAULT_TIMEOUT
from domus.errors import StorageFull

from .conftest import _stop_all, start_deployment

CACHE = 2 << 20
VALUE = b"r" * 2000


@pytest.mark.timeout(180)
def test_a_full_ram_cache_is_storage_full_for_the_client_at_once_and_loses_nothing(tmp_path):
    deployment = start_deployment(tmp_path, services=1,
                                  service_args=("--bdb-ram-cache", str(CACHE)))
    try:
        with deployment.connect(timeout=DEFAULT_TIMEOUT) as cluster:
            dht = cluster.create_dht("cache", buckets=4, platform="domus-bsddb-btree",
                                     storage="ram")
            other = cluster.create_dht("other", buckets=4)
            stored = []
            refused_after = None
            for number in range(4 * CACHE // len(VALUE)):
                started = time.monotonic()
                try:
                    dht[number] = VALUE
                except StorageFull as full:
                    refused_after = time.monotonic() - started
                    message = str(full)
                    break
                stored.append(number)
            else:
                pytest.fail(f"{4 * CACHE} bytes went into a {CACHE}-byte cache")
            # (the client's deadline is DEFAULT_TIMEOUT: a slower answer
            # would have been ServiceUnavailable, not StorageFull)
            assert refused_after < DEFAULT_TIMEOUT, refused_after
            assert "cache" in message and "is full" in message, message
            assert "delete records, or store the DHT on disk" in message, message
            assert len(stored) > 100
            # The next puts are refused without another search, and the
            # service goes on serving the other DHT meanwhile.
            started = time.monotonic()
            for number in range(-20, 0):
                with pytest.raises(StorageFull, match="none is tried until records are deleted"):
                    dht[number] = VALUE
                other[number] = number
            assert time.monotonic() - started < 2.0
            assert dht.get_many(stored) == {number: VALUE for number in stored}
            assert len(dht) == len(stored)
            # A delete gives room back: puts are tried again, and fit.
            for number in stored[:50]:
                del dht[number]
            for number in range(10):
                dht[f"again{number}"] = VALUE
            assert dht["again9"] == VALUE
            assert len(dht) == len(stored) - 50 + 10
            assert other.get_many(range(-20, 0)) == {number: number for number in range(-20, 0)}
    finally:
        _stop_all(deployment)
