"""TCP framing of large messages: domus.wire.control's frame decoder (the
service, the supervisor and the Twisted client read with it) against
Twisted's Int32StringReceiver, the reference it replaces, and the blocking
client's gathered sends and whole receives (domus.client.transport), sealed
and not, on real sockets.  (The asyncio client's frame reader is
test_aiolink.py's.)"""

from __future__ import annotations

import random
import socket
import struct
import threading
import time

import pytest
from twisted.internet.testing import StringTransport
from twisted.protocols.basic import Int32StringReceiver
from twisted.test import iosim

from domus.client import codec, transport
from domus.errors import AuthenticationError, ProtocolError
from domus.wire import auth
from domus.wire import protocol as wire
from domus.wire.control import MessageProtocol
from domus.wire.secret import Keys

KEYS = Keys.from_secret(bytes(range(32)), "a test secret")
SESSION_KEY = bytes(range(32))


class Recorder(MessageProtocol):
    """A decoder that keeps what it is given (an insecure connection, past
    its handshake)."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[bytes] = []
        self.over: list[int] = []
        self._handshake = None
        self._held = None

    def stringReceived(self, frame, tag=None):  # noqa: N802
        self.frames.append(frame)

    def lengthLimitExceeded(self, length):  # noqa: N802
        self.over.append(length)


class Reference(Int32StringReceiver):
    MAX_LENGTH = wire.MAX_FRAME_BYTES

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def stringReceived(self, frame):  # noqa: N802
        self.frames.append(frame)


def stream_of(sizes: list[int], seed: int) -> tuple[list[bytes], bytes]:
    rng = random.Random(seed)
    frames = [rng.randbytes(size) for size in sizes]
    return frames, b"".join(struct.pack(">I", len(frame)) + frame for frame in frames)


def pieces(data: bytes, seed: int, largest: int) -> list[bytes]:
    rng = random.Random(seed)
    cut, offset = [], 0
    while offset < len(data):
        size = rng.choice((1, 3, 4, 5, rng.randint(1, largest)))
        cut.append(data[offset:offset + size])
        offset += size
    return cut


@pytest.mark.parametrize("seed", range(6))
def test_the_decoder_delivers_what_twisted_does_however_the_bytes_are_cut(seed):
    sizes = [0, 1, 4, 5, 70_000, 3 << 20, 10, 0, 65_536, 200_000][seed % 3:]
    frames, data = stream_of(sizes, seed)
    ours, reference = Recorder(), Reference()
    ours.makeConnection(StringTransport())
    reference.makeConnection(StringTransport())
    for piece in pieces(data, seed, largest=300_000):
        ours.dataReceived(piece)
        reference.dataReceived(piece)
    assert ours.frames == reference.frames == frames
    assert ours.input_held() == 0


def test_a_partial_frame_is_held_and_counted_until_it_ends():
    frames, data = stream_of([1 << 20], 7)
    ours = Recorder()
    ours.makeConnection(StringTransport())
    ours.dataReceived(data[:4 + 1000])
    ours.dataReceived(data[4 + 1000:500_000])
    assert ours.frames == [] and ours.input_held() == 500_000 - 4
    ours.dataReceived(data[500_000:])
    assert ours.frames == frames and ours.input_held() == 0


def test_frames_wait_while_paused_and_come_on_resume():
    frames, data = stream_of([10, 100_000, 20], 3)
    ours = Recorder()
    ours.makeConnection(StringTransport())
    ours.pauseProducing()
    ours.dataReceived(data)
    assert ours.frames == [] and ours.input_held() == len(data)
    ours.resumeProducing()
    assert ours.frames == frames


def test_a_frame_over_the_limit_stops_the_reading():
    ours = Recorder()
    ours.makeConnection(StringTransport())
    ours.dataReceived(struct.pack(">I", wire.MAX_FRAME_BYTES + 1) + b"x" * 100)
    ours.dataReceived(struct.pack(">I", 1) + b"y")
    assert ours.over == [wire.MAX_FRAME_BYTES + 1]
    assert ours.frames == [] and ours.input_held() == 0


class SealedRecorder(MessageProtocol):
    """A decoder past a secure handshake that checks each frame as the
    protocol does and keeps it, with whether it was hashed as it came."""

    def __init__(self, session: auth.Session) -> None:
        super().__init__()
        self.frames: list[bytes] = []
        self.hashed: list[bool] = []
        self._session = session
        self._handshake = None
        self._held = None

    def connectionMade(self):  # noqa: N802
        pass                                # (no handshake: past it)

    def stringReceived(self, frame, tag=None, hashed=None):  # noqa: N802
        if hashed is not None:
            self._session.check_received(hashed, tag)
        else:
            self._session.check(frame, tag)
        self.frames.append(frame)
        self.hashed.append(hashed is not None)


@pytest.mark.parametrize("seed", range(4))
def test_large_sealed_frames_hashed_as_they_come_check_however_the_bytes_are_cut(seed):
    sending, receiving = sessions()
    rng = random.Random(seed)
    frames = [rng.randbytes(size) for size in
              (70_000, 10, 65_536 - auth.TAG_BYTES, 65_536, 1 << 20, 0, 200_001)]
    data = b"".join(struct.pack(">I", len(frame) + auth.TAG_BYTES) + sending.seal(frame)
                    for frame in frames)
    ours = SealedRecorder(receiving)
    ours.makeConnection(StringTransport())
    for piece in pieces(data, seed, largest=150_000):
        ours.dataReceived(piece)
    assert ours.frames == frames
    assert ours.hashed == [len(frame) + auth.TAG_BYTES >= 65_536 for frame in frames]
    assert ours.input_held() == 0


class SocketTransport(StringTransport):
    """A StringTransport with a real socket under it, as Twisted's TCP
    transport has (``socket``): what the decoder asks of the socket itself
    is done to a real one."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.socket = sock


def test_a_large_frame_wakes_the_reader_once_whole_and_the_next_at_every_byte():
    """While a frame of up to wire.READ_WHOLE_BYTES lacks 64 KiB or more, the
    socket is told to wake the reactor only once the rest has come
    (SO_RCVLOWAT: the bytes missing); for a larger frame, for a small rest
    and once a frame is whole, at every byte again, so that the next frame,
    however small, is read as it comes.  Every frame is delivered as sent."""
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()):
        receiving, _ = listener.accept()
    decoder = Recorder()
    decoder.makeConnection(SocketTransport(receiving))

    def fed(data: bytes) -> int:
        decoder.dataReceived(data)
        return receiving.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT)

    with receiving:
        frames = [random.Random(1).randbytes(1 << 20), b"small",
                  random.Random(2).randbytes(wire.READ_WHOLE_BYTES + 1), b"after"]
        first, small, larger, after = (struct.pack(">I", len(frame)) + frame
                                       for frame in frames)
        assert fed(first[:40_000]) == (1 << 20) - (40_000 - 4)
        assert fed(first[40_000:-30_000]) == 1         # (less than 64 KiB missing)
        assert fed(first[-30_000:]) == 1
        assert fed(small) == 1
        assert fed(larger[:40_000]) == 1               # (a frame past READ_WHOLE_BYTES)
        assert fed(larger[40_000:]) == 1
        assert fed(after[:3]) == 1
        assert fed(after[3:]) == 1
    assert decoder.frames == frames


@pytest.mark.parametrize("where", ["first byte", "middle", "last byte", "tag"])
def test_a_large_sealed_frame_changed_anywhere_does_not_check_when_hashed_as_it_comes(where):
    sending, receiving = sessions()
    frame = random.Random(5).randbytes(300_000)
    sealed = bytearray(sending.seal(frame))
    at = {"first byte": 0, "middle": 150_000, "last byte": len(frame) - 1,
          "tag": len(frame) + 3}[where]
    sealed[at] ^= 0x40
    data = struct.pack(">I", len(sealed)) + bytes(sealed)
    ours = SealedRecorder(receiving)
    ours.makeConnection(StringTransport())
    with pytest.raises(AuthenticationError):
        for piece in pieces(data, 9, largest=40_000):
            ours.dataReceived(piece)
    assert ours.frames == []


def linked(keys):
    server, client = MessageProtocol(), MessageProtocol()
    server.accepting, server.keys, client.keys = True, keys, keys
    server.control_handler = lambda body, link: len(body["blob"])
    server.data_handler = lambda frame, limit: wire.reply(wire.ST_OK, 9, frame[16:])
    pump = iosim.connect(server, iosim.makeFakeServer(server),
                         client, iosim.makeFakeClient(client), greet=False)
    pump.flush()
    return server, client, pump


def outcome(deferred):
    found = []
    deferred.addBoth(found.append)
    return found


@pytest.mark.parametrize("keys", [KEYS, None], ids=["sealed", "insecure"])
def test_large_frames_cross_a_connection_both_ways(keys):
    server, client, pump = linked(keys)
    assert client.secure == (keys is not None)
    blob = random.Random(1).randbytes(5 << 20)
    answer = outcome(client.call("store", blob=blob))
    pump.flush()
    assert answer == [len(blob)]
    request = wire.request_header(wire.OP_GET, 9, 1) + blob
    reply = outcome(client.request(request, 9))
    pump.flush()
    assert reply == [(wire.ST_OK, wire.reply(wire.ST_OK, 9, blob))]


@pytest.mark.parametrize("keys", [KEYS, None], ids=["sealed", "insecure"])
@pytest.mark.parametrize("size", [70_000, 5 << 20])
def test_a_gathered_request_crosses_a_connection_as_its_bytes_joined(keys, size):
    """A request kept in two pieces (a large PUT's head and its payload)
    arrives as the bytes the two make, and checks when sealed."""
    server, client, pump = linked(keys)
    blob = random.Random(size).randbytes(size)
    request = wire.Gathered(wire.request_header(wire.OP_GET, 9, 1) + b"head", blob)
    reply = outcome(client.request(request, 9))
    pump.flush()
    assert reply == [(wire.ST_OK, wire.reply(wire.ST_OK, 9, b"head" + blob))]


def test_a_large_sealed_frame_changed_in_flight_closes_the_connection():
    server, client, pump = linked(KEYS)
    refusals = []
    server.auth_failures = refusals.append
    blob = bytes(1 << 20)
    body = wire.encode_control(3, 4, {"op": "store", "blob": blob})
    sealed = bytearray(client._session.seal(body))
    sealed[len(sealed) // 2] ^= 1
    server.dataReceived(struct.pack(">I", len(sealed)) + bytes(sealed))
    assert refusals and server.transport.disconnecting


# ------------------------------------------------------------ the blocking client

def sessions():
    """The two ends' sessions of one connection."""
    return (auth.Session(SESSION_KEY, sends=1, receives=0),
            auth.Session(SESSION_KEY, sends=0, receives=1))


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    ours.settimeout(5.0)
    theirs.settimeout(5.0)
    yield ours, theirs
    ours.close()
    theirs.close()


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "insecure"])
@pytest.mark.parametrize("size", [0, 100, transport.LARGE_FRAME - 1, transport.LARGE_FRAME,
                                  transport.LARGE_FRAME + auth.TAG_BYTES, 4 << 20])
def test_a_frame_sent_is_the_frame_received(pair, sealed, size):
    ours, theirs = pair
    sending, receiving = sessions() if sealed else (None, None)
    message = random.Random(size).randbytes(size)
    sender = threading.Thread(target=transport._send_frame, args=(ours, message, sending))
    sender.start()
    try:
        assert transport._recv_frame(theirs, session=receiving) == message
    finally:
        sender.join()
    assert theirs.gettimeout() == 5.0


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "insecure"])
@pytest.mark.parametrize("size", [transport.LARGE_FRAME, wire.READ_WHOLE_BYTES,
                                  transport.SEND_PIECE * 5 - 7])
def test_a_gathered_message_sent_is_its_bytes_joined_received(pair, sealed, size):
    """A message in two pieces goes as the one its bytes make, whole or a
    piece at a time, the head and the payload's first bytes together."""
    ours, theirs = pair
    sending, receiving = sessions() if sealed else (None, None)
    payload = random.Random(size).randbytes(size)
    message = wire.Gathered(b"the head of a large put", payload)
    sender = threading.Thread(target=transport._send_frame, args=(ours, message, sending))
    sender.start()
    try:
        assert transport._recv_frame(theirs, session=receiving) == bytes(message)
    finally:
        sender.join()


@pytest.mark.parametrize("step", [1, 5, 23, 24, 1000])
def test_sendings_cut_a_message_into_sends_of_a_step_in_order(step):
    head, payload = b"h" * 23, bytes(range(256)) * 4
    for message in (head + payload, wire.Gathered(head, payload)):
        sends = list(transport.sendings(message, step))
        assert b"".join(b"".join(map(bytes, pieces)) for pieces in sends) == head + payload
        assert all(sum(map(len, pieces)) == step for pieces in sends[:-1])
        assert 0 < sum(map(len, sends[-1])) <= step


def get_reply(value: bytes, status: int = wire.ST_OK) -> bytes:
    """A reply to a GET whose value is ``value`` as msgpack stores bytes."""
    return wire.reply(status, 7, b"\xc6" + len(value).to_bytes(4, "big") + value)


def received(pair, message: bytes, sealed: bool, **options):
    ours, theirs = pair
    sending, receiving = sessions() if sealed else (None, None)
    sender = threading.Thread(target=transport._send_frame, args=(ours, message, sending))
    sender.start()
    try:
        return transport._recv_frame(theirs, session=receiving, **options)
    finally:
        sender.join()


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "insecure"])
@pytest.mark.parametrize("size", [transport.LARGE_FRAME, 3 << 20])
def test_a_large_get_reply_gets_its_value_in_bytes_of_its_own(pair, sealed, size):
    value = random.Random(size).randbytes(size)
    message = get_reply(value)
    reply = received(pair, message, sealed, value_reply=True)
    assert type(reply) is transport.ValueReply
    assert type(reply.value) is bytes and reply.value == value
    assert reply[2] == wire.ST_OK and reply[4:8] == message[4:8]
    assert reply.whole() == message
    assert transport.reply_size(reply) == len(message)
    assert transport.reply_size(message) == len(message)


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "insecure"])
@pytest.mark.parametrize("message", [
    get_reply(bytes(100_000), status=wire.ST_MOVING),           # not OK
    get_reply(bytes(100_000))[:-1],                              # bin 32 longer than the rest
    get_reply(bytes(100_000)) + b"x",                            # shorter
    wire.reply(wire.ST_OK, 7, b"\xdb" + (100_000).to_bytes(4, "big") + bytes(100_000)),  # str 32
    get_reply(bytes(transport.LARGE_FRAME - 20)),                # not a large frame
], ids=["moving", "long", "short", "str", "small"])
def test_any_other_reply_to_a_get_is_the_frame_as_it_came(pair, sealed, message):
    reply = received(pair, message, sealed, value_reply=True)
    assert type(reply) is bytes and reply == message


@pytest.mark.parametrize("fill", ["c", "reference"])
def test_a_sealed_large_reply_that_trickles_in_is_hashed_piece_by_piece(pair, monkeypatch,
                                                                       fill):
    """The value of a sealed large reply is hashed as its pieces come (each
    piece as the socket has it: here a few bytes to 300 KiB, with pauses)
    and lands whole in bytes of its own, with either bytes_to_fill; the
    tag, sent last, still decides."""
    if fill == "reference":
        monkeypatch.setattr(codec, "bytes_to_fill", codec.reference.bytes_to_fill)
    elif codec.accelerated is None:
        pytest.skip("the C codec is not built")
    ours, theirs = pair
    sending, receiving = sessions()
    value = random.Random(3).randbytes((1 << 20) + 3)
    sealed = struct.pack(">I", len(get_reply(value)) + auth.TAG_BYTES) + sending.seal(
        get_reply(value))
    cuts = [0, 1, 7, 30, 70_000, 70_001, 400_000, 700_000, len(sealed) - 20,
            len(sealed) - 1, len(sealed)]

    def trickle():
        for start, end in zip(cuts, cuts[1:]):
            ours.sendall(sealed[start:end])
            time.sleep(0.01)

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        reply = transport._recv_frame(theirs, session=receiving, value_reply=True)
    finally:
        sender.join()
    assert type(reply) is transport.ValueReply
    assert type(reply.value) is bytes and reply.value == value


def test_a_large_get_reply_changed_in_its_value_does_not_check(pair):
    ours, theirs = pair
    sending, receiving = sessions()
    sealed = bytearray(sending.seal(get_reply(bytes(1 << 20))))
    sealed[500_000] ^= 0x01
    sender = threading.Thread(target=ours.sendall,
                              args=(struct.pack(">I", len(sealed)) + bytes(sealed),))
    sender.start()
    try:
        with pytest.raises(AuthenticationError):
            transport._recv_frame(theirs, session=receiving, value_reply=True)
    finally:
        sender.join()


def test_a_changed_large_frame_does_not_check(pair):
    ours, theirs = pair
    sending, receiving = sessions()
    message = bytes(1 << 20)
    sealed = bytearray(sending.seal(message))
    sealed[100_000] ^= 0x80
    sender = threading.Thread(target=ours.sendall,
                              args=(struct.pack(">I", len(sealed)) + bytes(sealed),))
    sender.start()
    try:
        with pytest.raises(AuthenticationError):
            transport._recv_frame(theirs, session=receiving)
    finally:
        sender.join()


def test_a_large_frame_cut_short_times_out_and_the_socket_keeps_its_timeout(pair):
    ours, theirs = pair
    theirs.settimeout(0.2)
    ours.sendall(struct.pack(">I", 1 << 20) + bytes(1000))
    with pytest.raises(TimeoutError):
        transport._recv_frame(theirs)
    assert theirs.gettimeout() == 0.2


def test_a_large_frame_cut_by_a_close_is_a_connection_error(pair):
    ours, theirs = pair
    ours.sendall(struct.pack(">I", 1 << 20) + bytes(200_000))
    ours.close()
    with pytest.raises(ConnectionError):
        transport._recv_frame(theirs)


def test_a_frame_over_the_limit_is_refused_before_it_is_read(pair):
    ours, theirs = pair
    ours.sendall(struct.pack(">I", wire.MAX_FRAME_BYTES + auth.TAG_BYTES + 1))
    with pytest.raises(ProtocolError, match="over the"):
        transport._recv_frame(theirs)
