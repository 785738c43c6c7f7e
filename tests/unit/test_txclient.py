"""domus.client.tx without sockets: timers on a Clock, datagrams captured by a
fake UDP transport, the supervisor (where one is needed) a MessageProtocol
over an in-memory connection."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from twisted.internet import defer
from twisted.internet.error import ConnectionRefusedError as TxConnectionRefused
from twisted.internet.task import Clock
from twisted.internet.testing import MemoryReactorClock
from twisted.python.failure import Failure
from twisted.test import iosim

from domus.client.tx import DatagramRequests, TxChannel, TxCluster, TxDht, connect
from domus.errors import (
    DataLost,
    DhtInactive,
    DomusError,
    KeyTypeError,
    ServiceBusy,
    ServiceUnavailable,
    StorageError,
    SupervisorUnreachable,
    UnknownDht,
    ValueDecodeError,
    ValueTooLarge,
)
from domus.wire import protocol as wire
from domus.wire.control import ControlError, MessageProtocol
from domus.wire.keys import bucket_of, encode_key

S1 = ("127.0.0.1", 7701)
S2 = ("127.0.0.1", 7702)


class FakeDatagramTransport:
    """The UDP transport boundary: records what would go on the wire."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, tuple[str, int]]] = []

    def write(self, datagram: bytes, address: tuple[str, int]) -> None:
        self.sent.append((datagram, address))


class ReadableDatagramTransport(FakeDatagramTransport):
    """A transport with datagrams waiting in its socket buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.protocol: DatagramRequests | None = None
        self.inbox: list[tuple[bytes, tuple[str, int]]] = []

    def doRead(self) -> None:
        inbox, self.inbox = self.inbox, []
        for datagram, address in inbox:
            self.protocol.datagramReceived(datagram, address)


def reply_to(message: bytes, status: int = wire.ST_OK, body: bytes = b"") -> bytes:
    return wire.reply_prefix(status) + message[4:8] + body


def request(request_id: int, body: bytes = b"") -> bytes:
    return wire.request_header(wire.OP_GET, request_id, 42) + body


def outcome(deferred: defer.Deferred) -> list[Any]:
    """What ``deferred`` fired with so far: [] if nothing yet."""
    fired: list[Any] = []
    deferred.addBoth(fired.append)
    return fired


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def udp(clock: Clock) -> tuple[DatagramRequests, FakeDatagramTransport]:
    requests = DatagramRequests(clock)
    transport = FakeDatagramTransport()
    requests.makeConnection(transport)
    return requests, transport


def channel_to(requests: DatagramRequests, deadline: float = 5.0, name: str = "s1",
               address: tuple[str, int] = S1) -> TxChannel:
    return TxChannel(name, f"{address[0]}:{address[1]}", requests=requests, deadline=deadline)


# ---------------------------------------------------------------- retries

def test_a_lost_reply_is_retried_with_the_same_bytes(clock, udp) -> None:
    requests, transport = udp
    channel = channel_to(requests)
    message = request(7, b"body")
    result = outcome(channel.request(message, "words", 3))
    assert transport.sent == [(message, S1)]
    clock.advance(0.24)
    assert len(transport.sent) == 1
    clock.advance(0.01)
    assert transport.sent == [(message, S1), (message, S1)]
    answer = reply_to(message, wire.ST_OK, b"value")
    requests.datagramReceived(answer, S1)
    assert result == [answer]
    assert (channel.retries, channel.timeouts) == (1, 1)
    assert requests.pending == {} and clock.getDelayedCalls() == []


def test_retries_follow_the_sync_clients_rule(clock, udp) -> None:
    """First timeout 0.25 s, doubling, the last one cut to end at the deadline."""
    requests, transport = udp
    channel = channel_to(requests, deadline=5.0)
    result = outcome(channel.request(request(1), "words", 0))
    send_times = []
    while not result:
        send_times.extend([clock.seconds()] * (len(transport.sent) - len(send_times)))
        clock.advance(0.125)
    assert send_times == [0.0, 0.25, 0.75, 1.75, 3.75]
    assert clock.seconds() == 5.0
    assert isinstance(result[0].value, ServiceUnavailable)
    assert channel.retries == 4


def test_the_deadline_is_capped_like_the_sync_clients() -> None:
    requests = DatagramRequests(Clock())
    assert channel_to(requests, deadline=60.0).deadline == 15.0
    assert channel_to(requests, deadline=0.1).first_timeout == 0.1


def test_the_deadline_names_the_service_dht_and_bucket(clock, udp) -> None:
    requests, transport = udp
    channel = channel_to(requests, deadline=1.0)
    result = outcome(channel.request(request(9), "words", 7))
    clock.advance(0.25)
    clock.advance(0.5)
    assert result == [] and len(transport.sent) == 3
    clock.advance(0.25)
    error = result[0].value
    assert isinstance(error, ServiceUnavailable)
    assert (error.service, error.address, error.dht, error.bucket) == (
        "s1", "127.0.0.1:7701", "words", 7)
    text = str(error)
    for part in ("s1", "127.0.0.1:7701", "bucket 7", "'words'", "1.0s"):
        assert part in text
    assert requests.pending == {} and clock.getDelayedCalls() == []


def test_a_late_reply_for_an_answered_id_is_ignored(clock, udp) -> None:
    requests, transport = udp
    channel = channel_to(requests)
    message = request(11)
    result = outcome(channel.request(message))
    clock.advance(0.25)  # the first reply was slow: the request went out twice
    answer = reply_to(message, wire.ST_OK, b"first")
    requests.datagramReceived(answer, S1)
    requests.datagramReceived(reply_to(message, wire.ST_OK, b"second"), S1)
    assert result == [answer]
    assert requests.late_replies == 1
    clock.advance(60)
    assert len(transport.sent) == 2 and clock.getDelayedCalls() == []


def test_a_reply_waiting_in_the_socket_beats_the_retry_timer(clock) -> None:
    """The reactor was busy past the timeout while the reply sat unread."""
    requests = DatagramRequests(clock)
    transport = ReadableDatagramTransport()
    transport.protocol = requests
    requests.makeConnection(transport)
    channel = channel_to(requests, deadline=1.0)
    message = request(13)
    result = outcome(channel.request(message))
    transport.inbox.append((reply_to(message, body=b"in time"), S1))
    clock.advance(2.0)
    assert result == [reply_to(message, body=b"in time")]
    assert len(transport.sent) == 1 and channel.retries == 0


def test_a_reply_after_the_deadline_is_ignored(clock, udp) -> None:
    requests, _transport = udp
    channel = channel_to(requests, deadline=1.0)
    message = request(12)
    result = outcome(channel.request(message))
    clock.advance(1.0)
    requests.datagramReceived(reply_to(message), S1)
    assert isinstance(result[0].value, ServiceUnavailable) and len(result) == 1
    assert requests.late_replies == 1


def test_replies_are_matched_by_id_in_any_order(udp) -> None:
    requests, _transport = udp
    first, second = channel_to(requests), channel_to(requests, name="s2", address=S2)
    one, two = request(1), request(2)
    results = [outcome(first.request(one)), outcome(second.request(two))]
    requests.datagramReceived(reply_to(two, body=b"2"), S2)
    requests.datagramReceived(reply_to(one, body=b"1"), S1)
    assert [fired[0][-1:] for fired in results] == [b"1", b"2"]


def test_stray_datagrams_are_counted_and_dropped(udp) -> None:
    requests, _transport = udp
    result = outcome(channel_to(requests).request(request(5)))
    for junk in (b"", b"\xd1\x01", request(5), b"\x00" * 8):
        requests.datagramReceived(junk, S1)
    assert result == [] and requests.stray == 4


def test_requests_beyond_the_window_wait_their_turn(clock) -> None:
    requests = DatagramRequests(clock, window=2)
    transport = FakeDatagramTransport()
    requests.makeConnection(transport)
    channel = channel_to(requests, deadline=1.0)
    messages = [request(n) for n in range(3)]
    results = [outcome(channel.request(message)) for message in messages]
    assert [sent for sent, _ in transport.sent] == messages[:2]
    clock.advance(0.5)
    requests.datagramReceived(reply_to(messages[0]), S1)
    assert transport.sent[-1][0] == messages[2]
    clock.advance(0.9)  # the queued request's deadline runs from its own first send
    assert results[1] and isinstance(results[1][0].value, ServiceUnavailable)
    assert results[2] == []
    requests.datagramReceived(reply_to(messages[2]), S1)
    assert results[2] == [reply_to(messages[2])]


def test_requests_waiting_behind_a_dead_service_fail_with_the_first(clock) -> None:
    requests = DatagramRequests(clock, window=1)
    requests.makeConnection(FakeDatagramTransport())
    channel = channel_to(requests, deadline=1.0)
    results = [outcome(channel.request(request(n), "words", n)) for n in range(3)]
    for _ in range(4):
        clock.advance(0.25)
    errors = [fired[0].value for fired in results]
    assert all(isinstance(error, ServiceUnavailable) for error in errors)
    assert [error.bucket for error in errors] == [0, 1, 2]
    assert requests.pending == {} and not channel.waiting and channel.in_flight == 0


def test_cancelling_a_request_frees_its_slot(clock) -> None:
    requests = DatagramRequests(clock, window=1)
    transport = FakeDatagramTransport()
    requests.makeConnection(transport)
    channel = channel_to(requests)
    first = channel.request(request(1))
    second = outcome(channel.request(request(2)))
    first.addErrback(lambda failure: failure.trap(defer.CancelledError))
    first.cancel()
    assert transport.sent[-1][0] == request(2)
    requests.datagramReceived(reply_to(request(2)), S1)
    assert second == [reply_to(request(2))]
    assert requests.pending == {} and clock.getDelayedCalls() == []


def test_close_fails_what_is_outstanding(clock, udp) -> None:
    requests, _transport = udp
    result = outcome(channel_to(requests).request(request(1)))
    requests.close()
    assert isinstance(result[0].value, DomusError)
    assert clock.getDelayedCalls() == []
    later = outcome(channel_to(requests).request(request(2)))
    assert isinstance(later[0].value, DomusError)


# ---------------------------------------------------------------- the DHT

def descriptor(counts: list[int], dht_id: int = 5) -> dict[str, Any]:
    services = [{"name": f"s{index + 1}", "address": f"127.0.0.1:{7701 + index}",
                 "count": count} for index, count in enumerate(counts)]
    return {"name": "words", "id": dht_id, "buckets": sum(counts), "hash": "xxh3",
            "routing": "chord", "lookup": "D",
            "storage_services": services, "routing_services": services}


@pytest.fixture
def reactor() -> MemoryReactorClock:
    return MemoryReactorClock()


@pytest.fixture
def cluster(reactor) -> tuple[TxCluster, FakeDatagramTransport]:
    cluster = TxCluster("127.0.0.1:7700", timeout=5.0, reactor=reactor)
    transport = FakeDatagramTransport()
    cluster.requests.makeConnection(transport)
    return cluster, transport


def answer_from_supervisor(reactor: MemoryReactorClock, answer: dict[str, Any]) -> list[dict]:
    """Complete the client's pending connection to a supervisor that answers
    every control call with ``answer``; returns the calls it received."""
    calls: list[dict[str, Any]] = []
    supervisor = MessageProtocol()
    supervisor.accepting = True          # (it speaks the handshake first; insecure here)
    supervisor.control_handler = lambda body, link: calls.append(body) or answer
    (_host, _port, factory, _timeout, _bind), = reactor.tcpClients
    link = factory.buildProtocol(None)
    iosim.connect(supervisor, iosim.makeFakeServer(supervisor),
                  link, iosim.makeFakeClient(link)).flush()
    return calls


def test_put_sends_the_sync_clients_message(cluster) -> None:
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([4, 4]))
    created = outcome(dht.put("apple", [3, "x"]))
    (message, address), = transport.sent
    key = encode_key("apple")
    bucket = bucket_of(key, "xxh3", 8)
    op, request_id, client_id = wire.decode_request_header(message)
    assert (op, client_id) == (wire.OP_PUT, cluster.ids.client_id)
    assert message == wire.encode_keyed(wire.OP_PUT, request_id, client_id, 5, bucket, key,
                                        msgpack.packb([3, "x"], use_bin_type=True),
                                        wire.numbering(8))
    assert address == (S1 if bucket < 4 else S2)
    cluster.requests.datagramReceived(reply_to(message, wire.ST_OK, b"\x01"), address)
    assert created == [True]


def test_get_decodes_values_and_defaults(cluster) -> None:
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8]))
    value, default, missing = (outcome(dht.get("a")), outcome(dht.get("b", "dflt")),
                               outcome(dht.getitem("c")))
    for (message, _), status in zip(transport.sent, (wire.ST_OK, wire.ST_NOT_FOUND,
                                                     wire.ST_NOT_FOUND)):
        body = msgpack.packb({"n": 1}) if status == wire.ST_OK else b""
        cluster.requests.datagramReceived(reply_to(message, status, body), S1)
    assert value == [{"n": 1}] and default == ["dflt"]
    assert isinstance(missing[0].value, KeyError)


def test_a_value_no_client_wrote_fails_with_a_value_decode_error(cluster) -> None:
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8]))
    one, many = outcome(dht.get(b"k1")), outcome(dht.get_many(["a", "b"]))
    (get, _), (get_many, _) = transport.sent
    foreign = b"\x81\x90\x01"          # a map keyed by a list: not a value
    cluster.requests.datagramReceived(reply_to(get, wire.ST_OK, foreign), S1)
    encoded = wire.decode_get_many(get_many)[1]
    values = [foreign if key == encode_key("b") else msgpack.packb(1) for _bucket, key in encoded]
    cluster.requests.datagramReceived(
        wire.encode_get_many_reply(wire.U32.unpack_from(get_many, 4)[0], values), S1)
    for result, key in ((one, b"k1"), (many, "b")):
        error = result[0].value
        assert isinstance(error, ValueDecodeError)
        assert (error.dht, error.key) == ("words", key)
        assert str(error).startswith(f"DHT 'words', key {key!r}: the stored value (3 bytes) "
                                     f"could not be decoded")


@pytest.mark.parametrize(("status", "error"), [(wire.ST_STORAGE_ERROR, StorageError),
                                               (wire.ST_TOO_LARGE, ValueTooLarge)])
def test_error_replies_raise_what_the_sync_client_raises(cluster, status, error) -> None:
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8]))
    result = outcome(dht.delete("k"))
    cluster.requests.datagramReceived(reply_to(transport.sent[0][0], status, b"why"), S1)
    assert isinstance(result[0].value, error)
    assert "s1" in str(result[0].value)


def test_bad_keys_fail_the_deferred_and_send_nothing(cluster) -> None:
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8]))
    results = [outcome(dht.put(1.5, 1)), outcome(dht.contains(None)),
               outcome(dht.get_many(["ok", ("a", 1.5)]))]
    assert all(isinstance(fired[0].value, KeyTypeError) for fired in results)
    assert transport.sent == []


def test_not_owner_refreshes_the_layout_once_for_many_requests(reactor, cluster) -> None:
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8, 0]))
    results = [outcome(dht.put(key, key)) for key in ("a", "b", "c")]
    assert {address for _, address in transport.sent} == {S1}
    for message, address in list(transport.sent):
        cluster.requests.datagramReceived(reply_to(message, wire.ST_NOT_OWNER, b"moved"),
                                          address)

    assert [port for _host, port, *_rest in reactor.tcpClients] == [7700]
    calls = answer_from_supervisor(reactor, descriptor([0, 8]))
    assert calls == [{"op": "open_dht", "name": "words"}]
    retried = transport.sent[3:]
    assert len(retried) == 3 and {address for _, address in retried} == {S2}
    for message, address in retried:
        cluster.requests.datagramReceived(reply_to(message, wire.ST_OK, b"\x01"), address)
    assert results == [[True], [True], [True]]
    stats = dht.stats()
    assert (stats["refreshes"], stats["lookups"]["D"]["misses"]) == (1, 3)


def test_a_silent_service_whose_bucket_moved_is_left_for_the_new_owner(reactor,
                                                                        cluster) -> None:
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8, 0]))
    created = outcome(dht.put("k", 1))
    for _ in range(20):
        reactor.advance(0.25)
    assert created == [] and {address for _, address in transport.sent} == {S1}
    calls = answer_from_supervisor(reactor, descriptor([0, 8]))
    assert calls == [{"op": "open_dht", "name": "words"}]
    message, address = transport.sent[-1]
    assert address == S2
    cluster.requests.datagramReceived(reply_to(message, wire.ST_OK, b"\x01"), S2)
    assert created == [True]


def test_a_silent_service_that_still_owns_the_bucket_is_unavailable(reactor, cluster) -> None:
    cluster, _transport = cluster
    dht = TxDht(cluster, descriptor([8]))
    result = outcome(dht.get("k"))
    for _ in range(20):
        reactor.advance(0.25)
    answer_from_supervisor(reactor, descriptor([8]))
    assert isinstance(result[0].value, ServiceUnavailable)
    assert result[0].value.service == "s1"


def test_connect_fails_clearly_when_the_supervisor_refuses(reactor) -> None:
    result = outcome(connect("127.0.0.1:7700", timeout=5.0, reactor=reactor))
    (_host, _port, factory, _timeout, _bind), = reactor.tcpClients
    factory.clientConnectionFailed(reactor.connectors[0], Failure(TxConnectionRefused()))
    error = result[0].value
    assert isinstance(error, SupervisorUnreachable)
    assert "127.0.0.1:7700" in str(error) and "DOMUS_SUPERVISOR" in str(error)


def test_connect_gives_up_at_the_timeout(reactor) -> None:
    result = outcome(connect("127.0.0.1:7700", timeout=3.0, reactor=reactor))
    reactor.advance(2.9)
    assert result == []
    reactor.advance(0.1)
    assert isinstance(result[0].value, SupervisorUnreachable)
    assert "within 3.0s" in str(result[0].value)


def test_a_moving_bucket_is_asked_again_after_a_pause(reactor, cluster) -> None:
    """MOVING acknowledged nothing: the put goes again after a short pause,
    and again, until the bucket answers; as it was (the same request id: a
    replicated bucket's backup may have applied it, and its reply cache
    knows it by that id)."""
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8]))
    created = outcome(dht.put("k", 1))
    for tries in range(1, 4):
        message, address = transport.sent[-1]
        cluster.requests.datagramReceived(reply_to(message, wire.ST_MOVING, b"moving"), address)
        assert created == [] and len(transport.sent) == tries      # pausing, not sending
        reactor.advance(0.5)
        assert len(transport.sent) == tries + 1
        assert transport.sent[-1][0] == message
    cluster.requests.datagramReceived(reply_to(transport.sent[-1][0], wire.ST_OK, b"\x01"), S1)
    assert created == [True]
    stats = dht.stats()
    assert stats["moving_waits"] == 3 and stats["lookups"]["D"]["hits"] == 1


def test_a_redirect_is_followed_when_the_strategy_has_nothing_else(reactor, cluster) -> None:
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8, 0]))
    got = outcome(dht.get("k"))
    message, address = transport.sent[0]
    assert address == S1
    redirect = wire.not_owner_reply(message[4:8], "s2", "127.0.0.1:7702", "moved to s2")
    cluster.requests.datagramReceived(redirect, address)
    message, address = transport.sent[1]
    assert address == S2
    cluster.requests.datagramReceived(reply_to(message, wire.ST_OK, b"\xa1v"), address)
    assert got == ["v"]
    stats = dht.stats()
    assert stats["redirects"] == 1 and stats["refreshes"] == 0
    assert stats["lookups"]["D"]["misses"] == 1 and stats["direct_misses"] == 1


@pytest.mark.parametrize("status, error", [(wire.ST_DATA_LOST, DataLost),
                                           (wire.ST_STORAGE_ERROR, StorageError),
                                           (wire.ST_INACTIVE, DhtInactive)])
def test_an_error_at_the_end_of_a_course_is_raised_not_taken_for_an_answer(
        reactor, cluster, status, error) -> None:
    """A redirect followed, and the service it leads to fails the request:
    the caller gets that failure (it used to get the error reply as if it
    were a value, or a put's False)."""
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8, 0]))
    put = outcome(dht.put("k", 1))
    message, address = transport.sent[0]
    cluster.requests.datagramReceived(
        wire.not_owner_reply(message[4:8], "s2", "127.0.0.1:7702", "moved"), address)
    message, address = transport.sent[1]
    cluster.requests.datagramReceived(reply_to(message, status, b"it failed"), address)
    assert len(put) == 1 and put[0].check(error), put


def test_a_service_that_does_not_know_the_dht_sends_the_client_to_the_supervisor(
        reactor, cluster) -> None:
    # (a service taken off the DHT's lists, or the DHT destroyed: the
    # supervisor knows which)
    cluster, transport = cluster
    dht = TxDht(cluster, descriptor([8]))
    result = outcome(dht.delete("k"))
    cluster.requests.datagramReceived(reply_to(transport.sent[0][0], wire.ST_UNKNOWN_DHT,
                                               b"why"), S1)
    assert result == []                     # not the answer yet: it asks the supervisor
    calls = []

    def refuse(body, link):
        calls.append(body)
        raise ControlError("UnknownDht", "no DHT named 'words'")

    supervisor = MessageProtocol()
    supervisor.accepting = True
    supervisor.control_handler = refuse
    (_host, _port, factory, _timeout, _bind), = reactor.tcpClients
    link = factory.buildProtocol(None)
    iosim.connect(supervisor, iosim.makeFakeServer(supervisor),
                  link, iosim.makeFakeClient(link)).flush()
    assert calls == [{"op": "open_dht", "name": "words"}]
    assert isinstance(result[0].value, UnknownDht)
    assert "no longer exists" in str(result[0].value)


# ---------------------------------------------------------------- overload

def test_busy_is_backed_off_and_the_same_bytes_sent_again(clock, udp) -> None:
    requests, transport = udp
    channel = channel_to(requests)
    message = request(9, b"body")
    result = outcome(channel.request(message, "words", 3))
    requests.datagramReceived(reply_to(message, wire.ST_BUSY), S1)
    assert result == [] and len(transport.sent) == 1
    # The backoff (jittered: 0.5 to 1.5 times BUSY_BACKOFF) holds the resend.
    clock.advance(wire.BUSY_BACKOFF * 0.49)
    assert len(transport.sent) == 1
    clock.advance(wire.BUSY_BACKOFF * 1.02)
    assert transport.sent == [(message, S1)] * 2
    answer = reply_to(message, wire.ST_OK, b"value")
    requests.datagramReceived(answer, S1)
    assert result == [answer]
    assert (channel.busy, channel.timeouts) == (1, 0)
    assert requests.pending == {} and clock.getDelayedCalls() == []


def test_a_service_busy_until_the_deadline_is_service_busy(clock, udp) -> None:
    requests, transport = udp
    channel = channel_to(requests, deadline=1.0)
    message = request(10)
    result = outcome(channel.request(message, "words", 4))
    while not result:
        if len(transport.sent) > channel.busy:
            requests.datagramReceived(reply_to(message, wire.ST_BUSY), S1)
        clock.advance(0.01)
    assert isinstance(result[0].value, ServiceBusy)
    assert isinstance(result[0].value, ServiceUnavailable)
    assert "too busy" in str(result[0].value) and "s1" in str(result[0].value)
    assert (result[0].value.dht, result[0].value.bucket) == ("words", 4)
    # (by the deadline; the fake clock's hundred steps of 0.01 s may add
    # up to a hair over 1.0, as floats do)
    assert clock.seconds() <= 1.0 + 1e-9
    assert channel.busy >= 3           # backed off, doubling, several times
    assert all(sent == (message, S1) for sent in transport.sent)
