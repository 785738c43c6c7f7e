"""domus.service.udp: the UDP data path read straight from the reactor, with
the C hot path and with the pure-Python loop."""

import socket
import time

import pytest

from domus.service.handler import RequestHandler
from domus.service.udp import UdpServer
from domus.wire import protocol as wire

DHT_ID = 1


def descriptor():
    return {
        "id": DHT_ID, "name": "t", "buckets": 4, "hash": "xxh3", "storage": "ram",
        "platform": "python-dict", "routing": "chord", "lookup": "D", "state": "active",
        "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 4}],
        "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 4}],
    }


class FakeReactor:
    def __init__(self):
        self.readers = []
        self.later = []

    def addReader(self, reader):
        self.readers.append(reader)

    def removeReader(self, reader):
        if reader in self.readers:
            self.readers.remove(reader)

    def callLater(self, delay, function, *args):
        self.later.append((function, args))


def make_handler(path):
    handler = RequestHandler("s1")
    handler.assign(descriptor())
    if path == "python":
        handler.fast = None
    elif handler.fast is None:
        pytest.skip("the C hot path is off (DOMUS_PURE_PYTHON=1, or domus._hotpath not built)")
    return handler


@pytest.fixture(params=["c", "python"])
def path(request):
    return request.param


def served(server, client, requests, reactor, expected=None):
    """Send ``requests`` and let the reactor call doRead until ``expected``
    replies (one per request by default) came; returns them in order."""
    for request in requests:
        client.send(request)
    expected = len(requests) if expected is None else expected
    replies = []
    deadline = time.monotonic() + 5
    while len(replies) < expected and time.monotonic() < deadline:
        for reader in list(reactor.readers):
            assert reader.doRead() is None
        try:
            while True:
                replies.append(client.recv(65536))
        except BlockingIOError:
            pass
    return replies


def request(op, request_id, key=b"\x03k", value=b""):
    return wire.encode_keyed(op, request_id, 7, DHT_ID, 0, key, value)


@pytest.mark.parametrize("family", ["ipv4", "ipv6"])
def test_requests_are_answered_as_the_handler_answers_them(path, family):
    host = "127.0.0.1" if family == "ipv4" else "::1"
    if family == "ipv6":
        try:
            socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).bind(("::1", 0))
        except OSError as exc:
            pytest.skip(f"no IPv6 loopback (::1) here: {exc}")
    reference = make_handler("python")
    handler = make_handler(path)
    reactor = FakeReactor()
    server = UdpServer(handler, host, 0)
    server.start(reactor)
    client = socket.socket(server.socket.family, socket.SOCK_DGRAM)
    client.connect(server.address[:2])
    client.setblocking(False)
    try:
        requests = [request(wire.OP_PUT, 1, value=b"v" * 3000), request(wire.OP_GET, 2),
                    wire.request_header(wire.OP_PING, 3, 7),         # Python answers
                    request(wire.OP_DELETE, 4), b"junk"]             # junk: no answer
        replies = served(server, client, requests, reactor, expected=4)
        assert replies == [reference.handle(data) for data in requests[:4]]
        assert handler.requests == 5
        # every byte in and out counted once, by whichever path read or
        # sent it (C reads all it serves; the fallback sends the PING's reply)
        fast = handler.fast
        assert server.bytes_received + (fast.bytes_received if fast else 0) == \
            sum(map(len, requests))
        assert server.bytes_sent + (fast.bytes_sent if fast else 0) == sum(map(len, replies))
        assert server.bytes_sent == (len(replies[2]) if fast else sum(map(len, replies)))
    finally:
        client.close()
        server.stop()


def test_stopping_removes_the_reader_and_closes_the_socket(path):
    reactor = FakeReactor()
    server = UdpServer(make_handler(path), "127.0.0.1", 0)
    server.start(reactor)
    assert reactor.readers == [server]
    address = server.address
    server.stop()
    assert reactor.readers == []
    assert server.fileno() == -1
    assert server.socket.fileno() == -1
    server.stop()                                        # twice is fine
    rebound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rebound.bind(address)                                # the port is free again
    rebound.close()


def test_an_error_while_serving_is_logged_and_serving_goes_on():
    handler = make_handler("c")

    class Broken:
        def serve(self, fd, fallback, max_datagrams):
            raise RuntimeError("bug")

    real = handler.fast
    handler.fast = Broken()
    server = UdpServer(handler, "127.0.0.1", 0)
    reactor = FakeReactor()
    server.start(reactor)
    try:
        assert server.doRead() is None              # anything else drops the socket
        assert handler.counters["internal_errors"] == 1
        handler.fast = real
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.connect(server.address)
        client.setblocking(False)
        assert served(server, client, [request(wire.OP_GET, 1)], reactor) == [
            wire.reply(wire.ST_NOT_FOUND, 1)]
        client.close()
    finally:
        server.stop()


def test_a_socket_the_reactor_gave_up_on_is_served_again(path):
    reactor = FakeReactor()
    server = UdpServer(make_handler(path), "127.0.0.1", 0)
    server.start(reactor)
    reactor.removeReader(server)                        # what the reactor does first
    server.connectionLost(RuntimeError("EPOLLERR"))
    for function, args in reactor.later:
        function(*args)
    assert reactor.readers == [server]
    server.stop()
    reactor.later.clear()
    server.connectionLost(RuntimeError("closed"))       # stopped: stays stopped
    assert reactor.later == [] and reactor.readers == []


def test_errors_left_by_icmp_do_not_stop_the_python_loop():
    handler = make_handler("python")
    reactor = FakeReactor()
    server = UdpServer(handler, "127.0.0.1", 0)
    server.start(reactor)
    try:
        server.socket.setsockopt(socket.IPPROTO_IP, getattr(socket, "IP_RECVERR", 11), 1)
    except OSError as exc:
        server.stop()
        pytest.skip(f"IP_RECVERR not supported here: {exc}")
    try:
        gone = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        gone.bind(("127.0.0.1", 0))
        nobody = gone.getsockname()
        gone.close()
        server.socket.sendto(b"hello?", nobody)        # port unreachable comes back
        time.sleep(0.05)
        client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        client.connect(server.address)
        client.setblocking(False)
        assert served(server, client, [request(wire.OP_GET, 1)], reactor) == [
            wire.reply(wire.ST_NOT_FOUND, 1)]
        assert server.recv_errors == 1
        client.close()
    finally:
        server.stop()
