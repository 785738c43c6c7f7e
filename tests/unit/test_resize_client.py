"""Clients across a resize (domus.client.lookup, blocking.py, tx.py): a
request whose course fetches a layout with another bucket count starts
again, hashed anew (``Renumbered``); a scan goes on across a resize and
yields every key once.  The services are real request handlers
(domus.service.handler) on the layouts the supervisor makes
(domus.supervisor.balancer.resized); the blocking client reaches them
through channels that call them directly, the Twisted one through a fake
UDP transport, and the supervisor is a stand-in that hands out the layout
it is given."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from domus.supervisor import balancer
from test_txclient import FakeDatagramTransport, answer_from_supervisor, outcome
from twisted.internet.testing import MemoryReactorClock

from domus.client.blocking import Dht
from domus.client.transport import RequestIds
from domus.client.tx import TxCluster, TxDht
from domus.errors import ServiceUnavailable
from domus.placement import layout
from domus.service import hosted as hosted_module
from domus.service.handler import RequestHandler
from domus.wire import protocol as wire
from domus.wire.keys import bucket_of, encode_key
from domus.wire.values import pack_value as pack

DHT_ID = 9
ADDRESSES = {"s1": "127.0.0.1:7701", "s2": "127.0.0.1:7702", "s3": "127.0.0.1:7703"}


def descriptor(storage: dict[str, int], buckets: int = 8, version: int = 1) -> dict[str, Any]:
    """A DHT of ``buckets`` buckets stored by the services named, with those
    counts, in that order; s1 routes it whole."""
    return {
        "id": DHT_ID, "name": "words", "buckets": buckets, "hash": "xxh3", "storage": "ram",
        "platform": "python-dict", "routing": "chord", "lookup": "D", "state": "active",
        "version": version, "initial_buckets": buckets,
        "routing_services": [{"name": "s1", "address": ADDRESSES["s1"], "count": buckets}],
        "storage_services": [{"name": name, "address": ADDRESSES[name], "count": count}
                             for name, count in storage.items()],
    }


class Deployment:
    """Real handlers for s1..s3, the layout the supervisor holds (what
    ``open_dht`` answers) and what each service has been given."""

    def __init__(self, dht: dict[str, Any]) -> None:
        self.handlers = {name: RequestHandler(name) for name in ADDRESSES}
        self.dht = dht
        self.calls: list[str] = []
        self.reply_limit = wire.MAX_UDP_PAYLOAD
        self.give(dht)

    def give(self, dht: dict[str, Any], services=None) -> None:
        """The supervisor's layout is ``dht``, and ``services`` (default:
        the ones it involves) take it."""
        self.dht = dht
        involved = {entry["name"] for role in ("routing_services", "storage_services")
                    for entry in dht[role]}
        for name in services if services is not None else involved:
            self.handlers[name].assign(copy.deepcopy(dht))

    def drop(self, name: str) -> None:
        self.handlers[name].drop({"id": DHT_ID})

    def store(self, records: dict[bytes, bytes]) -> None:
        """Put records straight into the services that hold them now."""
        for key, value in records.items():
            for handler in self.handlers.values():
                hosted = handler.dhts.get(DHT_ID)
                if hosted is not None and hosted.bucket_of(key) in hosted.repos:
                    hosted.repos[hosted.bucket_of(key)].put(key, value)

    def close(self) -> None:
        for handler in self.handlers.values():
            handler.close()


# ------------------------------------------------------------ the blocking client

class HandlerChannel:
    """A blocking client's channel to a service: the request goes straight
    to its handler (``down``: it does not answer)."""

    def __init__(self, name: str, address: str, deployment: Deployment) -> None:
        self.name, self.address = name, address
        self.deployment = deployment
        self.down = False
        self.sent: list[bytes] = []
        self.retries = self.timeouts = self.busy = 0

    def request(self, message: bytes, dht: str = "", bucket: int | None = None,
                spin: float | None = None) -> bytes:
        self.sent.append(message)
        if self.down:
            raise ServiceUnavailable(f"service {self.name} ({self.address}) did not answer",
                                     service=self.name, address=self.address, dht=dht,
                                     bucket=bucket)
        return self.deployment.handlers[self.name].handle_fast(message,
                                                               self.deployment.reply_limit)


class Supervisor:
    def __init__(self, deployment: Deployment) -> None:
        self.deployment = deployment

    def call(self, op: str, **params: Any) -> Any:
        assert (op, params) == ("open_dht", {"name": "words"})
        self.deployment.calls.append(op)
        return copy.deepcopy(self.deployment.dht)


class Cluster:
    def __init__(self, deployment: Deployment) -> None:
        self.ids = RequestIds()
        self.supervisor = Supervisor(deployment)
        self.channels = {name: HandlerChannel(name, address, deployment)
                         for name, address in ADDRESSES.items()}

    def channel(self, name: str, address: str) -> HandlerChannel:
        assert address == ADDRESSES[name]
        return self.channels[name]


@pytest.fixture
def deployment():
    made = []

    def make(dht):
        made.append(Deployment(dht))
        return made[-1]

    yield make
    for each in made:
        each.close()


def keys_where(count: int, predicate, how_many: int = 1) -> list[bytes]:
    """Encoded str keys whose buckets among ``count`` satisfy ``predicate``."""
    found = []
    for index in itertools.count():
        key = encode_key(f"key-{index}")
        if predicate(bucket_of(key, "xxh3", count)):
            found.append(key)
            if len(found) == how_many:
                return found


def decoded(key: bytes) -> str:
    return key[1:].decode()


def test_a_request_whose_course_brings_another_bucket_count_is_hashed_again(deployment):
    """The client's layout has 8 buckets on s1.  The DHT was doubled, and
    its buckets moved to s2 and s3, and s1 let it go: s1 knows nothing of
    it, so the request's course ends by fetching the layout, which has 16
    buckets.  The key's bucket of 8 means another bucket of 16 (and another
    service): the request starts again from the key."""
    old = descriptor({"s1": 8})
    world = deployment(old)
    client = Dht(Cluster(world), old)
    new = balancer.resized(old, 16)
    new["storage_services"] = [{"name": "s2", "address": ADDRESSES["s2"], "count": 8},
                               {"name": "s3", "address": ADDRESSES["s3"], "count": 8}]
    new.pop("storage_moves", None)
    world.give(new, ["s2", "s3"])
    world.drop("s1")
    key, = keys_where(8, lambda bucket: bucket == 5)          # bucket 10 or 11 of 16: s3's
    world.store({key: pack("stored on s3")})
    assert client[decoded(key)] == "stored on s3"
    assert client.bucket_count == 16 and world.calls == ["open_dht"]
    last = client.cluster.channels["s3"].sent[-1]
    assert last[3] == wire.numbering(16)
    assert wire.decode_keyed(last)[1] == bucket_of(key, "xxh3", 16)
    assert not client.cluster.channels["s2"].sent       # (bucket 5 of 16 is s2's)
    client[decoded(key)] = "written after"
    assert world.handlers["s3"].dhts[DHT_ID].repos[bucket_of(key, "xxh3", 16)].get(key) == \
        pack("written after")


def test_a_dead_service_and_a_halving_send_the_request_to_the_new_owner(deployment):
    """The service a client sends to does not answer; the layout it then
    fetches was halved meanwhile (16 -> 8): the request starts again with
    the key's bucket of 8, at the service that stores it now."""
    old = descriptor({"s1": 8, "s2": 8}, buckets=16)
    world = deployment(old)
    cluster = Cluster(world)
    client = Dht(cluster, old)
    new = descriptor({"s3": 8}, buckets=8, version=5)
    world.give(new, ["s3"])
    cluster.channels["s2"].down = True
    key, = keys_where(16, lambda bucket: bucket == 15)
    world.store({key: pack("on s3")})
    assert client.get(decoded(key)) == "on s3"
    assert client.bucket_count == 8
    assert cluster.channels["s3"].sent[-1][3] == wire.numbering(8)


@pytest.mark.parametrize("resize", ["double", "halve"])
@pytest.mark.parametrize("reading", [False, True])
def test_a_scan_across_a_resize_yields_every_key_once(deployment, resize, reading,
                                                      monkeypatch):
    """A job iterates over the DHT (``reading``: and reads each key as it
    goes, whose replies tell it of the new layout) while the DHT is
    resized under it: every key comes once."""
    monkeypatch.setattr(hosted_module, "REGROUP_PAGE", 8)
    old = descriptor({"s1": 4, "s2": 4})
    world = deployment(old)
    client = Dht(Cluster(world), old)
    keys = [encode_key(f"key-{index}") for index in range(400)]
    records = {key: pack(index) for index, key in enumerate(keys)}
    world.store(records)
    world.reply_limit = 300                 # a few pages a bucket
    seen = []
    scan = iter(client)
    for key in scan:
        seen.append(key)
        if reading:
            assert client[key] == int(key[4:])
        if len(seen) == 70:              # bucket 1 of 8, part way
            break
    if resize == "double":
        new = balancer.resized(old, 16)
        world.give(new)
        for name in ("s1", "s2"):
            hosted = world.handlers[name].dhts[DHT_ID]
            steps = hosted.start_regroup(16)
            for _ in steps:
                pass
            world.handlers[name].refresh_fast_table(DHT_ID)
    else:
        for name in ("s1", "s2"):
            hosted = world.handlers[name].dhts[DHT_ID]
            for _ in hosted.start_regroup(4):
                pass
        new = balancer.resized(old, 4)
        world.give(new)
    for key in scan:
        seen.append(key)
        if reading:
            assert client[key] == int(key[4:])
    assert client.bucket_count == new["buckets"]
    assert len(seen) == len(set(seen)) == len(records)
    assert {encode_key(key) for key in seen} == set(records)


# ------------------------------------------------------------ the Twisted client

class TxWorld:
    """A TxCluster whose datagrams the deployment's handlers answer when
    ``deliver`` is called."""

    def __init__(self, world: Deployment) -> None:
        self.world = world
        self.reactor = MemoryReactorClock()
        self.cluster = TxCluster("127.0.0.1:7700", timeout=5.0, reactor=self.reactor)
        self.transport = FakeDatagramTransport()
        self.cluster.requests.makeConnection(self.transport)
        self.delivered = 0
        self.by_address = {tuple(address.rsplit(":", 1)): name
                           for name, address in ADDRESSES.items()}

    def deliver(self, only: str | None = None) -> None:
        """Answer what was sent (to ``only``, or to every service)."""
        pending = self.transport.sent[self.delivered:]
        self.delivered = len(self.transport.sent)
        later = []
        for message, address in pending:
            name = self.by_address[(address[0], str(address[1]))]
            if only is not None and name != only:
                later.append((message, address))
                continue
            reply = self.world.handlers[name].handle(message)
            self.cluster.requests.datagramReceived(reply, address)
        self.transport.sent[self.delivered:self.delivered] = later
        self.delivered -= len(later)


def test_a_tx_request_whose_bucket_was_numbered_before_a_refresh_is_hashed_again(
        deployment):
    """Two requests are out; the reply to one tells of a newer layout, and
    the client fetches it (16 buckets) while the other is still out.  That
    one's bucket was numbered out of 8: when its service turns out to know
    nothing of the DHT any more, it starts again, hashed anew, and is
    answered by the service that stores its key now."""
    old = descriptor({"s1": 4, "s2": 4})
    world = deployment(old)
    tx = TxWorld(world)
    client = TxDht(tx.cluster, old)
    new = descriptor({"s1": 8, "s3": 8}, buckets=16, version=2)
    world.give(new, ["s1", "s3"])
    world.drop("s2")
    on_s1, = keys_where(8, lambda bucket: bucket == 1)
    moved, = keys_where(8, lambda bucket: bucket == 5)        # 10 or 11 of 16: s3's
    world.store({on_s1: pack("one"), moved: pack("five")})
    first, second = outcome(client.get(decoded(on_s1))), outcome(client.get(decoded(moved)))
    tx.deliver("s1")
    assert first == ["one"]                     # tagged with layout 2: a fetch is under way
    calls = answer_from_supervisor(tx.reactor, new)
    assert calls == [{"op": "open_dht", "name": "words"}] and client.bucket_count == 16
    for _ in range(4):
        tx.deliver()
    assert second == ["five"], second


# ------------------------------------------------------------ learning of a resize

@pytest.mark.parametrize("strategy", ["D", "D,C,R", "C,R", "R"])
@pytest.mark.parametrize("count", [16, 4])
def test_clients_of_every_strategy_learn_the_new_count_by_themselves(deployment, strategy,
                                                                     count, monkeypatch):
    """After a doubling or a halving, a client opened before reads and
    writes every key right, and ends with the new count: from a reply's
    layout tag (a direct request the service translated), or from a
    distributed lookup the routing service refused as numbered otherwise."""
    monkeypatch.setattr(hosted_module, "REGROUP_PAGE", 1 << 20)
    old = descriptor({"s1": 4, "s2": 4})
    world = deployment(old)
    client = Dht(Cluster(world), old, lookup=strategy)
    records = {f"key-{index}": index for index in range(60)}
    world.store({encode_key(key): pack(value) for key, value in records.items()})
    if count == 16:
        world.give(balancer.resized(old, 16))
    else:
        for name in ("s1", "s2"):
            for _ in world.handlers[name].dhts[DHT_ID].start_regroup(4):
                pass
        world.give(balancer.resized(old, 4))
    for key, value in records.items():
        assert client[key] == value
        client[key] = value + 1
    assert client.bucket_count == count and client.layout_version == 2
    assert 1 <= client.stats()["refreshes"] <= 2
    fresh = Dht(Cluster(world), world.dht, lookup=strategy)
    assert {key: fresh[key] for key in records} == {key: value + 1
                                                    for key, value in records.items()}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_newer_layout_tag_makes_the_client_fetch_the_layout_at_most_so_often(deployment,
                                                                              monkeypatch):
    from domus.client import lookup

    clock = Clock()
    monkeypatch.setattr(lookup.time, "monotonic", clock)
    old = descriptor({"s1": 8}, version=254)
    world = deployment(old)
    client = Dht(Cluster(world), old)
    key = "k"
    client[key] = 1
    assert world.calls == []                          # the same layout: no fetch
    world.give(dict(old, version=256))                # tag 1: newer than 254's (tag 254)
    client[key] = 2
    assert world.calls == ["open_dht"] and client.layout_version == 256
    world.give(dict(old, version=257), [])             # the services only, at first
    world.handlers["s1"].assign(dict(old, version=258))
    client[key] = 3
    assert world.calls == ["open_dht"]                # not twice within REFRESH_INTERVAL
    clock.now += lookup.REFRESH_INTERVAL
    client[key] = 4
    assert world.calls == ["open_dht"] * 2 and client.layout_version == 257
    # A service that lags behind (an older tag) sends nobody to the supervisor.
    world.handlers["s1"].assign(dict(old, version=250))
    clock.now += lookup.REFRESH_INTERVAL
    assert client[key] == 4
    assert world.calls == ["open_dht"] * 2


def test_batches_of_a_client_that_has_not_heard_of_a_resize_land_right(deployment,
                                                                       monkeypatch):
    from domus.client import blocking

    monkeypatch.setattr(blocking, "exchange", lambda requests, dht="": [
        channel.request(message, dht) for channel, message in requests])
    old = descriptor({"s1": 8})
    world = deployment(old)
    client = Dht(Cluster(world), old)
    new = descriptor({"s2": 8, "s3": 8}, buckets=16, version=2)
    world.give(new, ["s2", "s3"])
    world.drop("s1")
    records = {f"key-{index}": index for index in range(300)}
    assert client.put_many(records) == 300
    assert client.bucket_count == 16
    for name in ("s2", "s3"):
        hosted = world.handlers[name].dhts[DHT_ID]
        for bucket, repo in hosted.repos.items():
            assert all(hosted.bucket_of(key) == bucket for key in repo.key_snapshot())
    assert sum(world.handlers[name].dhts[DHT_ID].records() for name in ("s2", "s3")) == 300
    stale = Dht(Cluster(world), old)
    assert stale.get_many(list(records) + ["absent"]) == records


def test_a_tx_batch_whose_lookups_outlast_a_refresh_to_another_count_lands_right(
        deployment):
    """A C,R client's put_many looks its buckets up (numbered out of 8);
    meanwhile the client fetches the layout (another request of the job
    did), which has 16 buckets by then.  The batch's owners and its bucket
    numbering belong together: every record ends where the new layout puts
    it."""
    old = descriptor({"s1": 4, "s2": 4})
    world = deployment(old)
    tx = TxWorld(world)
    client = TxDht(tx.cluster, old, lookup="C,R")
    refreshed = outcome(client.refresh())
    records = {f"batch-{index}": index for index in range(40)}
    stored = outcome(client.put_many(records))
    assert tx.transport.sent and stored == []               # its lookups are out
    new = balancer.resized(old, 16)
    world.give(new)
    answer_from_supervisor(tx.reactor, new)
    assert refreshed == [None] and client.bucket_count == 16
    for _ in range(20):
        tx.deliver()
    assert stored == [40], stored
    owners = layout.owners(new, "storage")
    for key, value in records.items():
        encoded = encode_key(key)
        hosted = world.handlers[owners.owner(bucket_of(encoded, "xxh3", 16))].dhts[DHT_ID]
        assert hosted.repos[hosted.bucket_of(encoded)].get(encoded) == pack(value)
    assert sum(world.handlers[name].dhts[DHT_ID].records() for name in ("s1", "s2")) == 40


def test_a_cached_lookup_numbered_out_of_the_old_count_is_not_kept(deployment):
    """A C,R client's cache holds buckets numbered out of 8; once it has
    the layout of 16, none of those entries is trusted (bucket 5 of 8 was
    s2's, bucket 5 of 16 is s1's)."""
    old = descriptor({"s1": 4, "s2": 4})
    world = deployment(old)
    client = Dht(Cluster(world), old, lookup="C,R", cache=1.0)
    records = {f"key-{index}": index for index in range(80)}
    world.store({encode_key(key): pack(value) for key, value in records.items()})
    assert {key: client[key] for key in records} == records
    assert len(client._cache) == 8
    new = balancer.resized(old, 16)
    world.give(new)
    client.refresh()
    owners = layout.owners(new, "storage")
    assert all(owners.owner(bucket) == storage.name
               for bucket, (_router, storage) in client._cache.items())
    sent = sum(len(channel.sent) for channel in client.cluster.channels.values())
    misses = client.stats()["lookups"]["C"]["misses"]
    assert {key: client[key] for key in records} == records
    assert all(owners.owner(bucket) == storage.name
               for bucket, (_router, storage) in client._cache.items())
    # Each bucket of 16 is looked up once (at most 2 hops), then each read
    # is one message: no read goes to a service that does not store it.
    assert client.stats()["lookups"]["C"]["misses"] - misses == 16
    assert sum(len(channel.sent) for channel in client.cluster.channels.values()) - sent <= \
        len(records) + 16 * 2
    assert client.stats()["redirects"] == 0


@pytest.mark.parametrize("twisted", [False, True])
def test_a_client_that_only_sends_batches_learns_of_a_resize_from_their_replies(
        deployment, monkeypatch, twisted):
    """(Else it would number its buckets out of the old count for as long
    as no bucket moves, and every one of its requests would be translated
    by the services, in Python.)"""
    from domus.client import blocking

    monkeypatch.setattr(blocking, "exchange", lambda requests, dht="": [
        channel.request(message, dht) for channel, message in requests])
    old = descriptor({"s1": 4, "s2": 4})
    world = deployment(old)
    new = balancer.resized(old, 16)
    world.give(new)
    records = {f"key-{index}": index for index in range(50)}
    if not twisted:
        client = Dht(Cluster(world), old)
        assert client.put_many(records) == 50
        assert client.bucket_count == 16
        client = Dht(Cluster(world), old)
        assert client.get_many(list(records)) == records
        assert client.bucket_count == 16
        return
    tx = TxWorld(world)
    client = TxDht(tx.cluster, old)
    stored = outcome(client.put_many(records))
    tx.deliver()
    assert stored == [50]
    answer_from_supervisor(tx.reactor, new)
    assert client.bucket_count == 16


class ChangingSupervisor(Supervisor):
    """Answers ``open_dht`` with each of ``layouts`` in turn, then the last."""

    def __init__(self, deployment: Deployment, layouts: list[dict[str, Any]]) -> None:
        super().__init__(deployment)
        self.layouts = layouts

    def call(self, op: str, **params: Any) -> Any:
        super().call(op, **params)
        return copy.deepcopy(self.layouts.pop(0) if len(self.layouts) > 1 else self.layouts[0])


def test_a_batch_fetches_the_layout_again_each_round_it_is_redirected(deployment, monkeypatch):
    # The buckets move twice while a batch is under way (a balancer's
    # rounds): the layout the first refresh brings is already stale, and
    # the next round must fetch again, not keep it (it did until the
    # batch gave up: "services disagree with the supervisor").
    from domus.client import blocking

    monkeypatch.setattr(blocking, "exchange", lambda requests, dht="": [
        channel.request(message, dht) for channel, message in requests])
    first, middle, last = (descriptor({name: 8}, version=version)
                           for version, name in ((1, "s1"), (2, "s2"), (3, "s3")))
    world = deployment(first)
    records = {encode_key(f"key-{index}"): wire.pack(index) for index in range(50)}
    world.give(last, ["s1", "s2", "s3"])
    world.store(records)
    cluster = Cluster(world)
    cluster.supervisor = ChangingSupervisor(world, [middle, last])
    client = Dht(cluster, first)
    world.handlers["s1"].dhts[DHT_ID].repos.clear()     # (s1 gave its buckets away)
    assert client.get_many([decoded(key) for key in records]) == \
        {decoded(key): index for index, key in enumerate(records)}
    assert world.calls == ["open_dht", "open_dht"]
