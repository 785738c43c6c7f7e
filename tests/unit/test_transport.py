"""domus.client.transport.ServiceChannel on real loopback UDP sockets: the same
retry rule whether the first try is made in C (domus._codec.roundtrip) or in
Python."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from domus.client import codec, transport
from domus.client.transport import ServiceChannel
from domus.errors import ServiceBusy, ServiceUnavailable
from domus.wire import auth
from domus.wire import protocol as wire
from domus.wire.secret import Keys

try:  # directly: the C round trip is tested under DOMUS_PURE_PYTHON=1 too
    from domus._codec import roundtrip
except ImportError:
    roundtrip = None


@pytest.fixture(params=["c", "python"])
def first_try(request, monkeypatch):
    """Which round trip the channel makes first."""
    if request.param == "c":
        if roundtrip is None:
            pytest.skip("domus._codec is not built")
        monkeypatch.setattr(transport, "_roundtrip", roundtrip)
    else:
        monkeypatch.setattr(transport, "_roundtrip", None)
    return request.param


class Service:
    """A UDP socket on loopback answering requests as ``behave`` says:
    behave(number of the datagram, request) -> datagrams to send back."""

    def __init__(self, behave):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        host, port = self.sock.getsockname()
        self.address = f"{host}:{port}"
        self.behave = behave
        self.received = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(65536)
            except TimeoutError:
                continue
            self.received.append(data)
            for datagram in self.behave(len(self.received), data):
                self.sock.sendto(datagram, peer)

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def serve():
    services = []

    def start(behave):
        service = Service(behave)
        services.append(service)
        return service

    yield start
    for service in services:
        service.close()


def request(request_id):
    return wire.request_header(wire.OP_GET, request_id, 1) + b"\x00" * 10 + b"\x03k"


def ok(data, body=b""):
    return wire.reply_prefix(wire.ST_OK) + data[4:8] + body


def test_a_reply_comes_back(first_try, serve):
    service = serve(lambda number, data: [ok(data, b"value")])
    channel = ServiceChannel("s1", service.address, deadline=2.0, first_timeout=0.5)
    try:
        assert channel.request(request(5)) == ok(request(5), b"value")
        assert (channel.timeouts, channel.retries) == (0, 0)
    finally:
        channel.close()


def test_stale_replies_are_skipped(first_try, serve):
    service = serve(lambda number, data: [b"\xd1\x01", wire.reply(wire.ST_OK, 999),
                                          ok(data, b"mine")])
    channel = ServiceChannel("s1", service.address, deadline=2.0, first_timeout=0.5)
    try:
        assert channel.request(request(6)) == ok(request(6), b"mine")
    finally:
        channel.close()


def test_a_lost_datagram_is_sent_again(first_try, serve):
    service = serve(lambda number, data: [] if number == 1 else [ok(data)])
    channel = ServiceChannel("s1", service.address, deadline=2.0, first_timeout=0.05)
    try:
        assert channel.request(request(7)) == ok(request(7))
        assert (channel.timeouts, channel.retries) == (1, 1)
        assert service.received == [request(7)] * 2  # the same bytes again
        # The socket is back to its first timeout for the next request.
        assert channel.sock.gettimeout() == 0.05
    finally:
        channel.close()


def test_a_silent_service_is_unavailable_after_the_deadline(first_try, serve):
    service = serve(lambda number, data: [])
    channel = ServiceChannel("s1", service.address, deadline=0.3, first_timeout=0.05)
    try:
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="did not answer within 0.3s") as raised:
            channel.request(request(8), "words", 3)
        assert 0.3 <= time.monotonic() - started < 1.5
        assert (raised.value.dht, raised.value.bucket) == ("words", 3)
        assert channel.retries >= 2 and channel.timeouts == channel.retries + 1
        assert all(data == request(8) for data in service.received)
        assert channel.sock.gettimeout() == 0.05
    finally:
        channel.close()


def test_nothing_listening_is_refused_three_times(first_try):
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    host, port = probe.getsockname()
    address = f"{host}:{port}"
    probe.close()
    channel = ServiceChannel("s1", address, deadline=5.0, first_timeout=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable, match="refused the request"):
            channel.request(request(9))
        assert time.monotonic() - started < 2.0  # 3 refusals, not the deadline
    finally:
        channel.close()


# ------------------------------------------------------------ a secure deployment

KEYS = Keys.from_secret(bytes(range(32)), "test secret")
OTHER = Keys.from_secret(bytes(range(1, 33)), "another deployment's")


def sealed_ok(data, body=b"", key=KEYS.data, stamp=None):
    """The reply to the sealed request ``data``, sealed as a secure service
    seals it (for the request's own time, unless ``stamp`` says otherwise)."""
    request, its_stamp = auth.open_request(KEYS.data, data)
    return auth.seal_reply(key, ok(request, body), request[8:16],
                           its_stamp if stamp is None else stamp)


def test_a_secure_request_goes_sealed_and_its_reply_comes_back_opened(first_try, serve):
    service = serve(lambda number, data: [sealed_ok(data, b"value")])
    channel = ServiceChannel("s1", service.address, deadline=2.0, first_timeout=0.5, keys=KEYS)
    try:
        before = auth.now_seconds()
        assert channel.request(request(5)) == ok(request(5), b"value")
        opened = auth.open_request(KEYS.data, service.received[0])
        assert opened is not None and opened[0] == request(5)
        assert before <= int.from_bytes(opened[1], "big") <= auth.now_seconds()
        assert (channel.timeouts, channel.retries) == (0, 0)
    finally:
        channel.close()


def test_a_secure_channel_skips_forged_replies_without_a_retry(first_try, serve):
    def forge(number, data):
        request_, stamp = auth.open_request(KEYS.data, data)
        honest = sealed_ok(data, b"mine")
        return [ok(request_, b"unsealed"), sealed_ok(data, b"evil", key=OTHER.data),
                sealed_ok(data, b"evil", stamp=b"\0\0\0\0"), honest[:-1], honest[:12],
                auth.seal_reply(KEYS.data, ok(request_, b"evil"), b"\0" * 8, stamp), honest]

    service = serve(forge)
    channel = ServiceChannel("s1", service.address, deadline=2.0, first_timeout=0.5, keys=KEYS)
    try:
        assert channel.request(request(6)) == ok(request(6), b"mine")
        assert (channel.timeouts, channel.retries) == (0, 0)
        assert len(service.received) == 1
    finally:
        channel.close()


def test_a_late_reply_to_the_first_try_is_taken_after_a_retry(first_try, serve,
                                                              monkeypatch):
    # The service answers the first try only once the retry has come (and
    # the retry not at all): the reply, sealed for the first try's time,
    # must still open, whichever round trip made that first try.  (Each try
    # is sealed a second after the one before, so that only the first try's
    # time opens that reply.)
    seconds = iter(range(auth.now_seconds() - 3, auth.now_seconds() + 100))
    monkeypatch.setattr(transport, "_wall_clock", lambda: next(seconds))
    monkeypatch.setattr(auth, "seal_request", lambda key, message: auth.seal_request_reference(
        key, message, next(seconds)))
    first = []

    def late(number, data):
        first.append(data)
        return [sealed_ok(first[0], b"late")] if number == 2 else []

    service = serve(late)
    channel = ServiceChannel("s1", service.address, deadline=2.0, first_timeout=0.05,
                             keys=KEYS)
    try:
        assert channel.request(request(7)) == ok(request(7), b"late")
        assert (channel.timeouts, channel.retries) == (1, 1)
        opened = [auth.open_request(KEYS.data, data) for data in service.received]
        assert [request_ for request_, _stamp in opened] == [request(7)] * 2
        assert opened[0][1] != opened[1][1]
    finally:
        channel.close()


def test_a_secure_channel_given_only_forgeries_is_unavailable_after_the_deadline(
        first_try, serve):
    service = serve(lambda number, data: [sealed_ok(data, key=OTHER.data)])
    channel = ServiceChannel("s1", service.address, deadline=0.3, first_timeout=0.05,
                             keys=KEYS)
    try:
        with pytest.raises(ServiceUnavailable, match="did not answer within 0.3s"):
            channel.request(request(8))
    finally:
        channel.close()


# ------------------------------------------------------------ the spin

def test_the_spin_comes_from_the_environment_in_microseconds():
    assert transport.spin_from_environment({}) == transport.DEFAULT_SPIN_US / 1e6
    assert transport.spin_from_environment({"DOMUS_CLIENT_SPIN_US": " "}) == 30e-6
    assert transport.spin_from_environment({"DOMUS_CLIENT_SPIN_US": "0"}) == 0.0
    assert transport.spin_from_environment({"DOMUS_CLIENT_SPIN_US": "250"}) == 250e-6
    assert transport.spin_from_environment({"DOMUS_CLIENT_SPIN_US": "10000"}) == 0.01


def test_a_change_to_a_replicated_dht_spins_longer_unless_spinning_is_off():
    # (it waits for the backups too: see "Waiting for a reply")
    assert transport.replicated_spin(30e-6) == pytest.approx(
        30e-6 * transport.REPLICATED_SPIN_FACTOR)
    assert transport.replicated_spin(0.0) == 0.0           # DOMUS_CLIENT_SPIN_US=0: never
    assert transport.replicated_spin(0.01) == codec.MAX_SPIN   # what roundtrip takes


@pytest.mark.parametrize("text", ["-1", "10001", "fast", "nan", "1e9"])
def test_a_bad_spin_setting_is_refused_naming_the_variable(text):
    with pytest.raises(ValueError, match="DOMUS_CLIENT_SPIN_US must be a number"):
        transport.spin_from_environment({"DOMUS_CLIENT_SPIN_US": text})


def busy(data):
    return wire.reply_prefix(wire.ST_BUSY) + data[4:8]


def test_busy_is_backed_off_and_the_same_bytes_sent_again(first_try, serve):
    service = serve(lambda number, data: [busy(data)] if number <= 3 else [ok(data, b"v")])
    channel = ServiceChannel("s1", service.address, deadline=2.0, first_timeout=0.5)
    try:
        started = time.monotonic()
        assert channel.request(request(11)) == ok(request(11), b"v")
        # Three backoffs of at least half of 50, 100 and 200 ms (jittered).
        assert time.monotonic() - started >= 0.5 * 0.35
        assert (channel.busy, channel.timeouts) == (3, 0)
        assert service.received == [request(11)] * 4
    finally:
        channel.close()


def test_a_service_busy_until_the_deadline_is_service_busy(first_try, serve):
    service = serve(lambda number, data: [busy(data)])
    channel = ServiceChannel("s1", service.address, deadline=0.6, first_timeout=0.2)
    try:
        started = time.monotonic()
        with pytest.raises(ServiceBusy, match="service s1 .* too busy") as raised:
            channel.request(request(12), "words", 2)
        assert time.monotonic() - started < 0.6 + 0.3
        assert (raised.value.dht, raised.value.bucket) == ("words", 2)
        assert channel.busy >= 2
        assert all(data == request(12) for data in service.received)
    finally:
        channel.close()


def test_a_batch_backs_off_busy_entries_and_gets_every_reply(serve):
    service = serve(lambda number, data: [busy(data)] if number % 3 == 1 else [ok(data)])
    channel = ServiceChannel("s1", service.address, deadline=2.0, first_timeout=0.5)
    try:
        messages = [request(20 + n) for n in range(10)]
        replies = transport.exchange([(channel, message) for message in messages])
        assert replies == [ok(message) for message in messages]
        assert channel.busy >= 3 and channel.timeouts == 0
    finally:
        channel.close()


class TcpService:
    """A TCP port beside a UDP Service (same port number, as a service's):
    the insecure handshake, then each request answered with
    ``answer(number of the request, request)``."""

    def __init__(self, port, answer):
        from domus.wire import auth

        self.listener = socket.create_server(("127.0.0.1", port))
        self.answer = answer
        self.received = []
        self._auth = auth
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self):
        try:
            connection, _peer = self.listener.accept()
        except OSError:
            return
        with connection:
            accepting = self._auth.Accepting(None)
            transport._send_frame(connection, accepting.hello())
            answer, _session = accepting.proof(transport._recv_frame(connection))
            transport._send_frame(connection, answer)
            while True:
                try:
                    message = transport._recv_frame(connection)
                except (ConnectionError, OSError):
                    return
                self.received.append(message)
                transport._send_frame(connection, self.answer(len(self.received), message))

    def close(self):
        self.listener.close()


def test_gets_whose_values_are_past_a_datagram_go_over_tcp_until_one_is_not(first_try, serve):
    service = serve(lambda number, data: [wire.reply_prefix(wire.ST_REPLY_TOO_LARGE)
                                          + data[4:8] + b"ask over TCP"])
    big, small = b"b" * 70_000, b"s" * 10
    tcp = TcpService(int(service.address.rsplit(":", 1)[1]),
                     lambda number, data: ok(data, big if number <= 2 else small))
    channel = ServiceChannel("s1", service.address, deadline=2.0, first_timeout=0.5)
    try:
        assert channel.request(request(1)) == ok(request(1), big)    # UDP, then TCP
        assert (len(service.received), len(tcp.received)) == (1, 1)
        assert channel.request(request(2)) == ok(request(2), big)    # TCP at once
        assert channel.request(request(3)) == ok(request(3), small)  # TCP at once: small
        assert (len(service.received), len(tcp.received)) == (1, 3)
        channel.request(request(4))                                   # UDP first again
        assert len(service.received) == 2
    finally:
        channel.close()
        tcp.close()
