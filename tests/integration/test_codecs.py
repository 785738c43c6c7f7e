"""A DHT's ``codec`` attribute on a real deployment: msgpack (the default),
pickle (any picklable object, only on a deployment with a secret) and raw
(bytes in, bytes out), through the blocking and the asyncio client."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import fractions
import uuid

import pytest

import domus
from domus.errors import AuthenticationError, InvalidAttribute, ValueTypeError
from domus.wire import secret

from .conftest import start_deployment
from .support import CLIENT_TIMEOUT


@dataclasses.dataclass(frozen=True)
class Reading:
    """A job's own class (pickled by reference to this module)."""

    sensor: str
    at: datetime.datetime
    value: decimal.Decimal
    tags: frozenset[str] = frozenset()


VALUES = {
    "datetime": datetime.datetime(2026, 11, 25, 23, 30, 1, 123456,
                                  tzinfo=datetime.timezone(datetime.timedelta(hours=2))),
    "date": datetime.date(1979, 5, 1),
    "set": {1, "two", (3, 4)},
    "frozenset": frozenset({b"x"}),
    "decimal": decimal.Decimal("3.14159265358979323846264338327950288"),
    "fraction": fractions.Fraction(1, 3),
    "dataclass": Reading("t1", datetime.datetime(2026, 1, 1), decimal.Decimal("-0.5"),
                         frozenset({"lab"})),
    "tuple": (1, (2, 3), "four"),          # a tuple stays a tuple (msgpack makes a list)
    "uuid": uuid.UUID(int=42),
    "big int": 2**200,
    "complex": 3 - 4j,
    "nested": {"readings": [Reading("t2", datetime.datetime(2026, 2, 2), decimal.Decimal(1))]},
}


def test_pickle_round_trips_any_picklable_value(any_cluster):
    dht = any_cluster.create_dht("pickled", codec="pickle")
    assert dht.codec == "pickle"
    assert any_cluster.dht_info("pickled")["codec"] == "pickle"
    for key, value in VALUES.items():
        assert dht.put(key, value) is True
    for key, value in VALUES.items():
        got = dht[key]
        assert got == value and type(got) is type(value), key
    assert dht.get_many(list(VALUES) + ["absent"]) == VALUES
    assert dht.put_many({("batch", n): Reading(f"s{n}", datetime.datetime(2026, 3, n + 1),
                                               decimal.Decimal(n)) for n in range(20)}) == 20
    everything = dict(dht.items())
    assert everything[("batch", 7)] == Reading("s7", datetime.datetime(2026, 3, 8),
                                               decimal.Decimal(7))
    assert {key: everything[key] for key in VALUES} == VALUES
    with pytest.raises(ValueTypeError, match="cannot pickle a value of type function"):
        dht.put("lambda", lambda: None)
    with pytest.raises(ValueTypeError):
        dht.put_many({"fine": 1, "lock": __import__("threading").Lock()})
    assert "fine" not in dht and "lambda" not in dht


def test_raw_stores_bytes_as_they_are_and_refuses_anything_else(any_cluster):
    dht = any_cluster.create_dht("raw", codec="raw")
    payload = bytes(range(256)) * 10
    assert dht.put("blob", payload) is True
    assert dht["blob"] == payload
    dht["view"] = memoryview(b"abc")
    dht["array"] = bytearray(b"\x00\x01")
    assert dht.get_many(["blob", "view", "array"]) == {"blob": payload, "view": b"abc",
                                                       "array": b"\x00\x01"}
    for bad in ("text", 1, None, [b"x"]):
        with pytest.raises(ValueTypeError, match="codec 'raw' stores bytes"):
            dht.put("bad", bad)
        with pytest.raises(ValueTypeError, match="codec 'raw' stores bytes"):
            dht.put_many({"ok": b"1", "bad": bad})
    assert sorted(dht) == ["array", "blob", "view"]


def test_msgpack_is_the_default_and_still_refuses_other_types(any_cluster):
    dht = any_cluster.create_dht("plain")
    assert dht.codec == "msgpack"
    with pytest.raises(ValueTypeError):
        dht.put("set", {1, 2})
    dht.put("tuple", (1, 2))
    assert dht["tuple"] == [1, 2]
    with pytest.raises(InvalidAttribute, match="codec 'json' is unknown"):
        any_cluster.create_dht("json", codec="json")


def test_a_dht_opened_later_or_elsewhere_decodes_with_its_own_codec(any_cluster,
                                                                   shared_cluster):
    """The codec is the DHT's attribute, kept by the supervisor: a handle
    opened by another client (of either kind) decodes with it."""
    shared_cluster.create_dht("layers", codec="pickle")["when"] = VALUES["datetime"]
    dht = any_cluster.open_dht("layers")
    assert dht.codec == "pickle" and dht["when"] == VALUES["datetime"]


def test_pickle_is_refused_on_a_deployment_without_a_secret(tmp_path, monkeypatch):
    monkeypatch.delenv(secret.ENVIRONMENT, raising=False)
    deployment = start_deployment(tmp_path, services=1,
                                  supervisor_args=("--balance", "manual", "--insecure"))
    try:
        with domus.connect(deployment.supervisor_address, timeout=CLIENT_TIMEOUT) as cluster:
            assert cluster.secure is False
            with pytest.raises(InvalidAttribute, match="codec 'pickle' needs a deployment "
                                                       "with a secret"):
                cluster.create_dht("objects", codec="pickle")
            assert cluster.list_dhts() == []
            raw = cluster.create_dht("bytes", codec="raw")     # the others are fine
            raw["k"] = b"v"
            assert raw["k"] == b"v"
    finally:
        deployment.stop_everything()


def test_a_client_without_authentication_refuses_a_pickle_dht():
    """Defence in depth: were a pickle DHT ever served without a secret (a
    deployment restarted --insecure), clients refuse to unpickle it."""
    from domus.client.blocking import Dht

    class Insecure:
        secure = False
        ids = None

        def channel(self, name: str, address: str) -> object:
            return object()

    descriptor = {"id": 1, "name": "objects", "buckets": 1, "hash": "xxh3", "codec": "pickle",
                  "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 1}],
                  "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 1}]}
    with pytest.raises(AuthenticationError, match="stores pickles"):
        Dht(Insecure(), descriptor)
