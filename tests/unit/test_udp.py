"""domus.service.udp: the UDP data path read straight from the reactor, with
the C hot path and with the pure-Python loop."""

import os
import select
import socket
import sys
import time

import pytest

from domus.service import limits, udp
from domus.service.handler import RequestHandler
from domus.service.udp import Shedder, UdpServer
from domus.wire import protocol as wire

try:
    from domus._hotpath import Baton
except ImportError:     # (not built: the thread's tests skip with the C path's)
    Baton = None

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
        # (An insecure deployment: a reply is at most UDP_REPLY_FACTOR times
        # its request; the 3,000-byte value is REPLY_TOO_LARGE.)
        assert replies == [reference.handle(data, len(data) * limits.UDP_REPLY_FACTOR)
                           for data in requests[:4]]
        assert replies[1][2] == wire.ST_REPLY_TOO_LARGE
        assert handler.requests == 5
        # every byte in and out counted once, by whichever path read or
        # sent it (C reads all it serves; the fallback sends the PING's reply)
        fast = handler.fast
        assert server.bytes_received + (fast.bytes_received if fast else 0) == \
            sum(map(len, requests))
        assert server.bytes_sent + (fast.bytes_sent if fast else 0) == sum(map(len, replies))
        # (Python answers the PING, and the GET whose value is over the bound)
        assert server.bytes_sent == (len(replies[1]) + len(replies[2]) if fast
                                     else sum(map(len, replies)))
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


# ------------------------------------------------------------ overload

def test_the_shedder_tells_a_standing_queue_from_a_burst():
    shedder = Shedder(0.1)
    # A burst after a pause: 300 ms old at first, drained within the
    # interval: nothing is shed.
    assert not any(shedder.shed(10.0 + n * 0.001, 0.3 - n * 0.003) for n in range(90))
    # A few late datagrams (a process not scheduled) are not a queue.
    assert not any(shedder.shed(15.0 + n * 0.01, 0.5) for n in range(30))
    assert not shedder.shed(15.3, 0.5)
    # A standing queue: every datagram of a whole interval waited > 0.1 s.
    assert not any(shedder.shed(20.0 + n * 0.002, 0.15) for n in range(50))
    assert shedder.shed(20.1, 0.15)                          # behind from the next interval
    assert not shedder.shed(20.11, 0.06)                     # (what waited less is served)
    for n in range(40):
        shedder.shed(20.12 + n * 0.001, 0.12)
    # It stays behind until an interval where one waited < 0.05 s.
    assert shedder.shed(20.21, 0.12) and shedder.behind
    for n in range(40):
        shedder.shed(20.22 + n * 0.001, 0.12)
    shedder.shed(20.25, 0.01)
    assert not shedder.shed(20.32, 0.2) and not shedder.behind
    assert shedder.retry_after() == 100


def test_the_retry_after_doubles_while_the_service_stays_behind():
    shedder = Shedder(0.1)
    waits = []
    for interval in range(8):
        for n in range(40):
            shedder.shed(30.0 + interval * 0.1 + n * 0.0025 + 0.0001, 0.5)
        waits.append(shedder.retry_after())
    assert waits == [100, 100, 200, 400, 800, 1600, 2000, 2000]


@pytest.fixture
def arrival_stamps():
    """Linux stamps datagrams on arrival only once some socket asked for it
    (and turns that on a little later, in the background): until then a
    datagram is stamped when it is read, and looks fresh.  A socket of
    ours asks, and a probe datagram shows when arrival stamps are on."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.setsockopt(socket.SOL_SOCKET, udp.SO_TIMESTAMPNS, 1)
    probe.bind(("127.0.0.1", 0))
    deadline = time.monotonic() + 10
    try:
        while True:
            probe.sendto(b"probe", probe.getsockname())
            sent = time.time()
            time.sleep(0.05)            # (the age a stamp on arrival shows)
            _data, ancillary, _flags, _peer = probe.recvmsg(64, 64)
            received = udp.received_at(ancillary)
            if received is not None and received - sent < 0.02:
                break
            assert time.monotonic() < deadline, "datagrams are not stamped on arrival"
        yield
    finally:
        probe.close()


def test_a_standing_queue_is_shed_with_busy_and_the_rest_served(path, arrival_stamps):
    handler = make_handler(path)
    handler.limits = limits.Limits(shed_after=0.05)
    reactor = FakeReactor()
    server = UdpServer(handler, "127.0.0.1", 0)
    server.start(reactor)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.connect(server.address[:2])
    client.setblocking(False)
    try:
        # Datagrams queue up over 0.6 s while the service reads nothing
        # (their age is what is tested: the pauses make it).
        requests = []
        for step in range(60):
            for n in range(5):
                requests.append(request(wire.OP_GET, step * 5 + n))
                client.send(requests[-1])
            time.sleep(0.01)
        replies = served(server, client, [], reactor, expected=len(requests))
        statuses = [reply[2] for reply in replies]
        assert len(replies) == len(requests)
        assert set(statuses) == {wire.ST_BUSY, wire.ST_NOT_FOUND}
        # Each BUSY carries a retry-after: 100 ms, doubling with each
        # interval the service stayed behind, at most 2 s.
        waits = {wire.busy_retry_after(reply) for reply in replies if reply[2] == wire.ST_BUSY}
        assert all(len(reply) == wire.REPLY_HEADER_SIZE + 2 for reply in replies
                   if reply[2] == wire.ST_BUSY)
        assert waits <= {0.1, 0.2, 0.4, 0.8, 1.6, 2.0} and 0.1 in waits
        assert handler.stats()["shed"] == statuses.count(wire.ST_BUSY)
    finally:
        client.close()
        server.stop()


def drained(reactor, client):
    """Let the reactor read until a turn answers nothing more; returns the
    replies (some requests may have been dropped).  (Both paths send their
    replies before doRead returns, and loopback delivers them at once.)"""
    replies = []
    while True:
        for reader in list(reactor.readers):
            assert reader.doRead() is None
        before = len(replies)
        try:
            while True:
                replies.append(client.recv(65536))
        except BlockingIOError:
            pass
        if len(replies) == before:
            return replies


def test_a_buffer_too_small_for_a_standing_queue_sheds_once_the_kernel_drops(path,
                                                                             arrival_stamps):
    """A socket buffer that holds less than shed_after of work: no datagram
    waits that long, the kernel drops the rest, and clients would only
    time out.  The drops make the service behind, and it sheds what
    waited more than half the longest wait of the interval that dropped."""
    handler = make_handler(path)
    handler.limits = limits.Limits(shed_after=5.0)      # (no queue here stands that long)
    reactor = FakeReactor()
    server = UdpServer(handler, "127.0.0.1", 0)
    server.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    server.start(reactor)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    client.connect(server.address[:2])
    client.setblocking(False)
    try:
        # One interval: far more than the buffer holds, at once.
        for n in range(1000):
            client.send(request(wire.OP_GET, n))
        time.sleep(0.02)
        first = drained(reactor, client)
        assert 32 <= len(first) < 1000                  # (the kernel dropped the rest)
        assert {reply[2] for reply in first} == {wire.ST_NOT_FOUND}
        # The next interval: behind, since the kernel dropped datagrams.
        time.sleep(0.1)
        for n in range(1000, 1100):
            client.send(request(wire.OP_GET, n))
        time.sleep(0.05)
        second = drained(reactor, client)
        statuses = [reply[2] for reply in second]
        assert len(second) == 100 and statuses.count(wire.ST_BUSY) >= 90
        assert handler.stats()["shed"] == statuses.count(wire.ST_BUSY)
        drops = handler.stats()["kernel_drops"] if path == "c" else server.shedder.drops
        assert drops == 1000 - len(first)
    finally:
        client.close()
        server.stop()


# ------------------------------------------------------------ the serving thread

def epoll_reactor():
    epollreactor = pytest.importorskip("twisted.internet.epollreactor")
    return epollreactor.EPollReactor()


def threaded_server(handler, reactor, **options):
    server = UdpServer(handler, "127.0.0.1", 0, **options)
    server.start(reactor)
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.connect(server.address)
    client.setblocking(False)
    return server, client


def iterated(reactor, client, expected, seconds=5.0):
    """Turn the reactor (which lets the serving thread in while it waits)
    until ``expected`` replies came; returns them as they came."""
    replies = []
    deadline = time.monotonic() + seconds
    while len(replies) < expected and time.monotonic() < deadline:
        reactor.iterate(0.01)
        try:
            while True:
                replies.append(client.recv(65536))
        except BlockingIOError:
            pass
    return replies


def test_the_serving_thread_answers_as_the_handler_does():
    reference = make_handler("python")
    handler = make_handler("c")
    reactor = epoll_reactor()
    server, client = threaded_server(handler, reactor)
    try:
        assert server.threaded and handler.stats()["serving_thread"]
        assert server not in reactor.getReaders()          # the thread reads it
        requests = [request(wire.OP_PUT, 1, value=b"v" * 30), request(wire.OP_GET, 2),
                    wire.request_header(wire.OP_PING, 3, 7),      # queued for Python
                    request(wire.OP_DELETE, 4), request(wire.OP_GET, 5), b"junk"]
        replies = []
        for data in requests[:5]:    # one at a time: the same state as the reference's
            client.send(data)
            replies += iterated(reactor, client, 1)
        assert replies == [reference.handle(data, len(data) * limits.UDP_REPLY_FACTOR)
                           for data in requests[:5]]
        client.send(requests[5])                                  # junk: no answer
        deadline = time.monotonic() + 5
        while handler.requests < 6 and time.monotonic() < deadline:
            reactor.iterate(0.01)
        assert handler.requests == 6
        answered = replies
        assert handler.fast.requests == 4 and handler.fast.fallbacks == 2   # PING, junk
        # a burst: answered in batches, every one once
        burst = [request(wire.OP_PUT, 100 + n, key=b"\x03" + bytes([n]), value=b"x")
                 for n in range(200)]
        for data in burst:
            client.send(data)
        replies = iterated(reactor, client, len(burst))
        assert sorted(replies) == sorted(wire.reply(wire.ST_OK, 100 + n, b"\x01")
                                         for n in range(200))
        # every byte in and out counted once, by whichever side read or sent it
        assert handler.fast.bytes_received == sum(map(len, requests + burst))
        assert handler.fast.bytes_sent + server.bytes_sent == sum(map(len, answered + replies))
        assert server.bytes_sent == len(answered[2])                  # the PING's
    finally:
        client.close()
        server.stop()
    assert not server.threaded and not handler.fast.threaded
    assert reactor.getReaders() == [reactor.waker] if hasattr(reactor, "waker") else True


def test_no_request_is_served_while_the_reactor_thread_runs_python():
    # The baton: the reactor thread holds it except while it waits in epoll,
    # so a request is never served while Python's state is half-updated.
    handler = make_handler("c")
    reactor = epoll_reactor()
    server, client = threaded_server(handler, reactor)
    try:
        client.send(request(wire.OP_PUT, 1, value=b"v"))
        assert iterated(reactor, client, 1) == [wire.reply(wire.ST_OK, 1, b"\x01")]
        # The reactor thread is busy here (not in epoll): nothing is served.
        client.send(request(wire.OP_GET, 2))
        ready, _, _ = select.select([client], [], [], 0.3)
        assert ready == [] and handler.fast.requests == 1
        assert iterated(reactor, client, 1) == [wire.reply(wire.ST_OK, 2, b"v")]
    finally:
        client.close()
        server.stop()


def test_the_serving_thread_serves_while_the_reactor_thread_runs_released():
    # UdpServer.released: the reactor thread lets go of the baton for work
    # that changes nothing C reads (the service's load sampling), and the
    # serving thread answers meanwhile, taking the GIL from this thread.
    handler = make_handler("c")
    reactor = epoll_reactor()
    server, client = threaded_server(handler, reactor)
    baton = reactor._poller.baton
    try:
        client.send(request(wire.OP_PUT, 1, value=b"v"))
        assert iterated(reactor, client, 1) == [wire.reply(wire.ST_OK, 1, b"\x01")]
        assert baton.held
        with server.released():
            assert not baton.held
            client.send(request(wire.OP_GET, 2))
            deadline = time.monotonic() + 5
            reply = None
            while reply is None and time.monotonic() < deadline:    # Python keeps running
                try:
                    reply = client.recv(65536)
                except BlockingIOError:
                    sum(range(1000))
            assert reply == wire.reply(wire.ST_OK, 2, b"v")
            # a burst of several batches, handled while this thread runs
            # Python: every one answered once
            burst = [request(wire.OP_PUT, 100 + n, key=b"\x03b" + bytes([n]), value=b"x")
                     for n in range(200)]
            for data in burst:
                client.send(data)
            replies = []
            deadline = time.monotonic() + 5
            while len(replies) < len(burst) and time.monotonic() < deadline:
                try:
                    replies.append(client.recv(65536))
                except BlockingIOError:
                    sum(range(1000))
            assert sorted(replies) == sorted(wire.reply(wire.ST_OK, 100 + n, b"\x01")
                                             for n in range(200))
            with server.held():                     # the baton again, for a while
                assert baton.held
                client.send(request(wire.OP_GET, 2))
                ready, _, _ = select.select([client], [], [], 0.3)
                assert ready == []
            assert not baton.held
            replies = []
            while not replies and time.monotonic() < deadline + 5:
                try:
                    replies.append(client.recv(65536))
                except BlockingIOError:
                    sum(range(1000))
            assert replies == [wire.reply(wire.ST_OK, 2, b"v")]
        assert baton.held
        with server.held():                         # (held already: nothing changes)
            assert baton.held
        assert baton.held
        # Outside it, nothing is served until the reactor waits in epoll.
        client.send(request(wire.OP_GET, 3))
        ready, _, _ = select.select([client], [], [], 0.3)
        assert ready == [] and handler.fast.requests == 203
        assert iterated(reactor, client, 1) == [wire.reply(wire.ST_OK, 3, b"v")]
        # An exception in the body still takes the baton back.
        with pytest.raises(KeyError), server.released():
            {}["missing"]
        assert baton.held
    finally:
        client.close()
        server.stop()


def test_a_service_samples_its_load_and_writes_to_its_supervisor_without_the_baton(tmp_path):
    # What a service's heartbeat does that changes nothing C reads (the load
    # sample, the write to the supervisor's link, which the reactor sends a
    # turn later) runs released; the stats it reads from the repositories
    # are read holding the baton.
    from domus.service.server import DomusService
    from domus.wire.control import MessageProtocol

    service = DomusService(supervisor="127.0.0.1:1", listen="127.0.0.1:1",
                           data_dir=str(tmp_path / "s1"), name="s1")
    if service.handler.fast is None:
        pytest.skip("the C hot path is off (DOMUS_PURE_PYTHON=1, or domus._hotpath not built)")
    reactor = epoll_reactor()
    service.udp = UdpServer(service.handler, "127.0.0.1", 0)
    service.udp.start(reactor)
    baton = reactor._poller.baton
    seen = []

    class Transport:
        def doWrite(self):          # (the reactor calls it when the socket takes more)
            seen.append(("write", baton.held))

    try:
        link = MessageProtocol()
        link.transport, link.clock = Transport(), reactor
        service.link_made(link)
        sample, stats = service.sampler.sample, service.handler.stats
        service.sampler.sample = lambda *args: seen.append(("sample", baton.held)) or sample(*args)
        service.handler.stats = lambda: seen.append(("stats", baton.held)) or stats()
        service.link, service.registered = link, True
        service._heartbeat()
        link.transport.doWrite()
        assert seen == [("sample", False), ("stats", True), ("write", False)]
        assert baton.held and len(link._held) == 1      # (the heartbeat, queued to send)
        # As its timer runs it: released, the stats read holding the baton.
        seen.clear()
        with service._released():
            service._heartbeat()
            assert not baton.held
        assert seen == [("sample", False), ("stats", True)] and len(link._held) == 2
    finally:
        service.udp.stop()


def test_released_without_a_serving_thread_changes_nothing():
    handler = make_handler("c")
    reactor = epoll_reactor()
    server, client = threaded_server(handler, reactor, serve_thread=False)
    try:
        with server.released():                    # (no baton: the body just runs)
            client.send(request(wire.OP_GET, 1))
        assert iterated(reactor, client, 1) == [wire.reply(wire.ST_NOT_FOUND, 1)]
    finally:
        client.close()
        server.stop()


def test_the_serving_thread_can_be_switched_off():
    handler = make_handler("c")
    reactor = epoll_reactor()
    server, client = threaded_server(handler, reactor, serve_thread=False)
    try:
        assert not server.threaded and server in reactor.getReaders()
        client.send(request(wire.OP_GET, 1))
        assert iterated(reactor, client, 1) == [wire.reply(wire.ST_NOT_FOUND, 1)]
        assert not handler.stats()["serving_thread"]
    finally:
        client.close()
        server.stop()


def test_without_an_epoll_reactor_the_reactor_reads_the_socket():
    handler = make_handler("c")
    reactor = FakeReactor()
    server = UdpServer(handler, "127.0.0.1", 0, serve_thread=True)
    server.start(reactor)
    assert reactor.readers == [server] and not server.threaded
    server.stop()


def test_a_stopped_serving_thread_frees_the_port_and_the_fast_path():
    handler = make_handler("c")
    reactor = epoll_reactor()
    server, client = threaded_server(handler, reactor)
    address = server.address
    client.close()
    server.stop()
    server.stop()                                        # twice is fine
    rebound = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rebound.bind(address)
    rebound.close()
    assert sys.getrefcount(handler.fast) == sys.getrefcount(make_handler("c").fast)
    with pytest.raises(RuntimeError):
        handler.fast.stop_thread() or Baton().release()   # not held here


def test_a_forked_child_stops_without_the_parents_thread():
    handler = make_handler("c")
    reactor = epoll_reactor()
    server, client = threaded_server(handler, reactor)
    try:
        child = os.fork()
        if child == 0:                                    # pragma: no cover (the child)
            code = 1
            try:       # (a child must not touch the reactor: its epoll is the parent's)
                assert not handler.fast.threaded          # the thread is the parent's
                handler.fast.stop_thread()                # must not wait for it
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        client.send(request(wire.OP_GET, 1))              # the parent still serves
        assert iterated(reactor, client, 1) == [wire.reply(wire.ST_NOT_FOUND, 1)]
    finally:
        client.close()
        server.stop()
