"""The clients when a replicated DHT's primary dies: a request that meets a
dead primary waits for the supervisor to promote a backup (it asks for the
layout again until its deadline), then is sent again *as it was*, the same
bytes and request id, so that a copy which took it from the dead primary
answers it from its reply cache; a DHT with one copy does not wait.

The blocking client over real loopback UDP (a dead service is a port with
nothing listening), the supervisor's answers scripted; the Twisted client
as test_txclient.py drives it (a Clock, captured datagrams, a supervisor
over an in-memory connection)."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from test_transport import serve  # noqa: F401  (the fixture)
from test_txclient import FakeDatagramTransport, outcome, reply_to
from twisted.internet.testing import MemoryReactorClock
from twisted.test import iosim

from domus.client.blocking import Cluster, Dht
from domus.client.tx import TxCluster, TxDht
from domus.errors import ServiceUnavailable
from domus.wire import protocol as wire
from domus.wire.control import MessageProtocol
from domus.wire.keys import encode_key

S1 = ("127.0.0.1", 7701)
S2 = ("127.0.0.1", 7702)


def descriptor(primary: str, copies: int, addresses: dict[str, str]) -> dict[str, Any]:
    """8 buckets, every primary on ``primary``; the other service backs
    them up when ``copies`` is 2."""
    backup = next(name for name in addresses if name != primary)
    services = [{"name": name, "address": address, "count": 8 if name == primary else 0}
                for name, address in addresses.items()]
    described = {"name": "words", "id": 5, "buckets": 8, "hash": "xxh3", "routing": "chord",
                 "lookup": "D", "replicas": copies, "version": 1 if primary == "s1" else 2,
                 "storage_services": services, "routing_services": services}
    if copies > 1:
        described["storage_backups"] = [[[0, 8, backup]]]
    return described


# ------------------------------------------------------------ the blocking client

class ScriptedSupervisor:
    """The supervisor's side of the blocking client's link: ``open_dht``
    answers with the layouts given, one a call, then the last one again.
    The deployment it stands for runs --insecure: no MACs."""

    secure = False

    def __init__(self, layouts: list[dict[str, Any]]) -> None:
        self.layouts = layouts
        self.calls = 0

    def call(self, op: str, timeout: float | None = None, **params: Any) -> Any:
        assert (op, params) == ("open_dht", {"name": "words"})
        self.calls += 1
        return self.layouts[min(self.calls, len(self.layouts)) - 1]

    def close(self) -> None:
        pass


def answer_ok(request: bytes) -> bytes:
    """A backup promoted: OK to anything (a new key; a value "v" for each
    key asked)."""
    op = request[2]
    if op == wire.OP_PUT_MANY:
        count = len(wire.decode_put_many(request)[1])
        return wire.reply_prefix(wire.ST_OK) + request[4:8] + wire.U16X2.pack(count, count)
    if op == wire.OP_GET_MANY:
        count = len(wire.decode_get_many(request)[1])
        return wire.encode_get_many_reply(wire.U32.unpack_from(request, 4)[0],
                                          [b"\xa1v"] * count)
    return wire.reply_prefix(wire.ST_OK) + request[4:8] + b"\x01"


def nothing_listening() -> str:
    """The address of a UDP port nobody listens on: a service killed."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    host, port = probe.getsockname()
    probe.close()
    return f"{host}:{port}"


@pytest.fixture
def failing_over(serve):  # noqa: F811
    """make(copies, old_answers, timeout) -> (dht, what s1 was sent, the
    backup): a DHT whose primary s1 is dead and whose backup s2 answers
    OK to anything; the supervisor names s1 the primary ``old_answers``
    times, then s2."""
    clusters = []

    def make(copies: int, old_answers: int, timeout: float):
        backup = serve(lambda number, data: [answer_ok(data)])
        addresses = {"s1": nothing_listening(), "s2": backup.address}
        before = descriptor("s1", copies, addresses)
        cluster = Cluster("127.0.0.1:1", timeout=timeout)
        clusters.append(cluster)
        cluster.supervisor = ScriptedSupervisor(
            [before] * old_answers + [descriptor("s2", copies, addresses)])
        dead = cluster.channel("s1", addresses["s1"])
        sent: list[bytes] = []
        request = dead.request

        def recorded(message: bytes, *args: Any) -> bytes:
            sent.append(message)
            return request(message, *args)

        dead.request = recorded                   # (what the dead primary was sent)
        return Dht(cluster, before), sent, backup

    yield make
    for cluster in clusters:
        cluster.close()


def test_a_blocking_put_that_meets_a_dead_primary_is_sent_again_as_it_was(failing_over):
    dht, sent, backup = failing_over(copies=2, old_answers=3, timeout=2.0)
    assert dht.put("apple", 3) is True
    # the supervisor was asked until it named the new primary
    assert dht.cluster.supervisor.calls == 4
    (message,) = sent
    assert backup.received == [message]           # the same bytes: request id and all
    assert wire.decode_request_header(message)[0] == wire.OP_PUT
    assert encode_key("apple") in message
    assert dht.stats()["refreshes"] == 4


def test_a_blocking_delete_waits_for_the_new_primary_too(failing_over):
    dht, sent, backup = failing_over(copies=2, old_answers=2, timeout=2.0)
    assert dht.delete("apple") is True
    assert backup.received == sent


def test_a_dht_with_one_copy_does_not_wait_for_a_new_primary(failing_over):
    dht, sent, backup = failing_over(copies=1, old_answers=1, timeout=2.0)
    with pytest.raises(ServiceUnavailable) as failed:
        dht.put("apple", 3)
    assert failed.value.service == "s1"
    assert dht.cluster.supervisor.calls == 1 and backup.received == []


def test_a_replicated_dht_waits_no_longer_than_the_clients_deadline(failing_over):
    import time

    dht, sent, backup = failing_over(copies=2, old_answers=1000, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(ServiceUnavailable):
        dht.put("apple", 3)
    assert time.monotonic() - started < 3.0
    assert dht.cluster.supervisor.calls >= 3 and backup.received == []


def test_blocking_batches_wait_for_the_new_primary_too(failing_over):
    dht, sent, backup = failing_over(copies=2, old_answers=2, timeout=2.0)
    assert dht.put_many({"apple": 1, "pear": 2, "plum": 3}) == 3
    assert dht.cluster.supervisor.calls == 3
    assert [wire.decode_request_header(message)[0] for message in backup.received] == \
        [wire.OP_PUT_MANY]
    (put_many,) = backup.received
    assert sorted(key for _bucket, key, _value in wire.decode_put_many(put_many)[1]) == \
        sorted(encode_key(key) for key in ("apple", "pear", "plum"))
    assert dht.get_many(["apple", "pear"]) == {"apple": "v", "pear": "v"}


def test_blocking_batches_of_a_dht_with_one_copy_do_not_wait(failing_over):
    """One copy: a batch that meets a dead service asks the supervisor once
    whether its buckets are elsewhere now; they are not, so it fails at
    once (no waiting for a promotion that cannot come)."""
    dht, sent, backup = failing_over(copies=1, old_answers=10, timeout=2.0)
    for batch in (lambda: dht.put_many({"apple": 1}), lambda: dht.get_many(["apple"])):
        with pytest.raises(ServiceUnavailable):
            batch()
    assert dht.cluster.supervisor.calls == 2 and backup.received == []


def test_blocking_batches_of_a_dht_with_one_copy_follow_a_drained_service(failing_over):
    """One copy, and the service a batch went to was drained and removed
    since the client learnt the layout: the batch asks the supervisor,
    which names the new owner, and goes there as it was."""
    dht, _sent, backup = failing_over(copies=1, old_answers=0, timeout=2.0)
    assert dht.put_many({"apple": 1, "pear": 2}) == 2
    assert dht.get_many(["apple", "pear"]) == {"apple": "v", "pear": "v"}
    assert len(backup.received) == 2 and dht.cluster.supervisor.calls == 1


# ------------------------------------------------------------ the Twisted client

class TxSupervisor:
    """A supervisor over an in-memory connection to the client, answering
    ``open_dht`` with the layouts given, one a call, then the last again."""

    def __init__(self, reactor: MemoryReactorClock, layouts: list[dict[str, Any]]) -> None:
        self.layouts = layouts
        self.calls = 0
        protocol = MessageProtocol()
        protocol.accepting = True        # (it speaks the handshake first; insecure here)
        protocol.control_handler = self.answer
        (_host, _port, factory, _timeout, _bind), = reactor.tcpClients
        link = factory.buildProtocol(None)
        self.pump = iosim.connect(protocol, iosim.makeFakeServer(protocol),
                                  link, iosim.makeFakeClient(link))
        self.pump.flush()

    def answer(self, body: dict[str, Any], link: Any) -> dict[str, Any]:
        assert body == {"op": "open_dht", "name": "words"}
        self.calls += 1
        return self.layouts[min(self.calls, len(self.layouts)) - 1]


def tx_layouts(copies: int) -> tuple[dict[str, Any], dict[str, Any]]:
    addresses = {"s1": "127.0.0.1:7701", "s2": "127.0.0.1:7702"}
    return descriptor("s1", copies, addresses), descriptor("s2", copies, addresses)


def silence(reactor: MemoryReactorClock, seconds: float) -> None:
    for _ in range(int(seconds / 0.25)):
        reactor.advance(0.25)


@pytest.fixture
def tx():
    reactor = MemoryReactorClock()
    cluster = TxCluster("127.0.0.1:7700", timeout=5.0, reactor=reactor)
    transport = FakeDatagramTransport()
    cluster.requests.makeConnection(transport)
    return reactor, cluster, transport


def test_a_twisted_put_that_meets_a_dead_primary_is_sent_again_as_it_was(tx):
    reactor, cluster, transport = tx
    before, after = tx_layouts(2)
    dht = TxDht(cluster, before)
    created = outcome(dht.put("apple", 3))
    silence(reactor, 5.0)                          # s1 never answers: its deadline passes
    message = transport.sent[0][0]
    assert {sent for sent in transport.sent} == {(message, S1)}
    supervisor = TxSupervisor(reactor, [before, before, after])
    for _ in range(5):                             # (it asks again every 0.1 s)
        reactor.advance(0.1)
        supervisor.pump.flush()
    assert supervisor.calls == 3
    assert transport.sent[-1] == (message, S2)     # the same bytes, to the new primary
    assert created == []
    cluster.requests.datagramReceived(reply_to(message, wire.ST_OK, b"\x01"), S2)
    assert created == [True]


def test_twisted_batches_wait_for_the_new_primary_too(tx):
    reactor, cluster, transport = tx
    before, after = tx_layouts(2)
    dht = TxDht(cluster, before)
    stored = outcome(dht.put_many({"apple": 1, "pear": 2}))
    silence(reactor, 5.0)
    assert {address for _message, address in transport.sent} == {S1}
    supervisor = TxSupervisor(reactor, [before, after])
    for _ in range(3):
        reactor.advance(0.1)
        supervisor.pump.flush()
    message, address = transport.sent[-1]
    assert address == S2 and wire.decode_request_header(message)[0] == wire.OP_PUT_MANY
    cluster.requests.datagramReceived(answer_ok(message), S2)
    assert stored == [2]


def test_a_twisted_dht_with_one_copy_does_not_wait(tx):
    reactor, cluster, transport = tx
    before, after = tx_layouts(1)
    dht = TxDht(cluster, before)
    result = outcome(dht.put("apple", 3))
    silence(reactor, 5.0)
    supervisor = TxSupervisor(reactor, [before, after])
    for _ in range(5):
        reactor.advance(0.1)
        supervisor.pump.flush()
    assert supervisor.calls == 1
    assert isinstance(result[0].value, ServiceUnavailable)
    assert {address for _message, address in transport.sent} == {S1}


def test_a_twisted_replicated_dht_gives_up_at_its_deadline(tx):
    reactor, cluster, transport = tx
    before, _after = tx_layouts(2)
    dht = TxDht(cluster, before)
    result = outcome(dht.put("apple", 3))
    silence(reactor, 5.0)
    supervisor = TxSupervisor(reactor, [before])
    for _ in range(60):                            # 6 s: past the 5 s deadline
        reactor.advance(0.1)
        supervisor.pump.flush()
    assert isinstance(result[0].value, ServiceUnavailable)
    assert 30 <= supervisor.calls <= 55
    assert {address for _message, address in transport.sent} == {S1}


# ------------------------------------------------------------ lost buckets

LOST = (b"bucket 3 of DHT 'words' lost its records with service s1 (every copy was there); "
        b"`domus dht accept-loss words` (cluster.accept_loss) serves it again, empty")


def test_a_lost_bucket_raises_data_lost_never_a_key_error(serve):  # noqa: F811
    from domus.errors import DataLost

    service = serve(lambda number, data: [wire.reply_prefix(wire.ST_DATA_LOST) + data[4:8]
                                          + LOST])
    cluster = Cluster("127.0.0.1:1", timeout=2.0)
    try:
        dht = Dht(cluster, descriptor("s1", 1, {"s1": service.address, "s2": service.address}))
        for attempt in (lambda: dht["apple"], lambda: dht.get("apple", "default"),
                        lambda: "apple" in dht, lambda: dht.delete("apple"),
                        lambda: dht.put("apple", 1), lambda: len(dht), lambda: list(dht),
                        lambda: list(dht.items()), lambda: dht.get_many(["apple", "pear"])):
            with pytest.raises(DataLost) as lost:
                attempt()
            assert "bucket 3 of DHT 'words' lost its records with service s1" in str(lost.value)
            assert "accept-loss words" in str(lost.value)
            assert not isinstance(lost.value, KeyError)
    finally:
        cluster.close()


def test_a_twisted_client_raises_data_lost_too(tx):
    from domus.errors import DataLost

    reactor, cluster, transport = tx
    before, _after = tx_layouts(1)
    dht = TxDht(cluster, before)
    got = outcome(dht.get("apple"))
    cluster.requests.datagramReceived(reply_to(transport.sent[0][0], wire.ST_DATA_LOST, LOST),
                                      S1)
    assert isinstance(got[0].value, DataLost) and "service s1" in str(got[0].value)
