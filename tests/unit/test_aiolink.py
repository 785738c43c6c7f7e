"""The asyncio client's TCP link (domus.client.aio._Link): its frame reader
(_FrameReader, an asyncio.BufferedProtocol) against the messages sent,
however the bytes are cut; a large GET reply's value in bytes of its own,
as the blocking client reads it (tests/unit/test_framing.py); the frame
over the limit, the tag that does not check and the peer's close, each an
error at once that closes the connection; the handshake; and the channel's
one reconnect when a connection is cut."""

from __future__ import annotations

import asyncio
import random
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from domus.client import aio, transport
from domus.client.aio import INPUT_BYTES, AioChannel, DatagramRequests, _FrameReader, _Link
from domus.errors import AuthenticationError, ProtocolError
from domus.wire import auth
from domus.wire import protocol as wire
from domus.wire.secret import Keys

try:
    import uvloop
except ImportError:         # (the test extra installs it; a bare install may not)
    uvloop = None

KEYS = Keys.from_secret(bytes(range(32)), "a test secret")
SESSION_KEY = bytes(range(32))
LOOPS = ["asyncio", pytest.param("uvloop", marks=pytest.mark.skipif(
    uvloop is None, reason="uvloop is not installed"))]


def run(loop: str, coroutine: Any) -> Any:
    return uvloop.run(coroutine) if loop == "uvloop" else asyncio.run(coroutine)


def sessions() -> tuple[auth.Session, auth.Session]:
    """(the service's session, the client's) of one connection."""
    return (auth.Session(SESSION_KEY, sends=0, receives=1),
            auth.Session(SESSION_KEY, sends=1, receives=0))


def framed(message: bytes, session: auth.Session | None = None) -> bytes:
    """``message`` as the peer puts it on the wire (sealed by ``session``)."""
    tag = session.tag(message) if session is not None else b""
    return struct.pack(">I", len(message) + len(tag)) + message + tag


def get_reply(value: bytes, status: int = wire.ST_OK) -> bytes:
    """A reply to a GET whose value is ``value`` as msgpack stores bytes."""
    return wire.reply(status, 7, b"\xc6" + len(value).to_bytes(4, "big") + value)


class Transport:
    """What a _FrameReader asks of its transport, recorded."""

    def __init__(self) -> None:
        self.closed = False
        self.written: list[bytes] = []

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def writelines(self, parts: Any) -> None:
        self.written.append(b"".join(parts))


def reader_of(session: auth.Session | None = None, value_reply: bool = False,
              connecting: auth.Connecting | None = None) -> _FrameReader:
    reader = _FrameReader(connecting, session)
    reader.connection_made(Transport())     # type: ignore[arg-type]
    reader.value_reply = value_reply
    return reader


def feed(reader: _FrameReader, data: bytes, most: Callable[[], int] = lambda: 1 << 30) -> None:
    """Give ``data`` to ``reader`` as a transport does: into the buffer it
    hands out, at most ``most()`` bytes a read (and no more than it asks)."""
    view = memoryview(data)
    while view:
        buffer = reader.get_buffer(-1)
        assert len(buffer) > 0
        count = min(len(buffer), len(view), most())
        buffer[:count] = view[:count]
        del buffer                  # (as a transport lets it go before the next)
        reader.buffer_updated(count)
        view = view[count:]


def read(reader: _FrameReader, count: int) -> list[bytes]:
    """The next ``count`` frames (TimeoutError if they do not come)."""
    async def reading() -> list[bytes]:
        return [await asyncio.wait_for(reader.read(), 5) for _ in range(count)]

    return asyncio.run(reading())


def failure(reader: _FrameReader) -> BaseException:
    """What the next read raises (there must be no frame left)."""
    try:
        read(reader, 1)
    except BaseException as exc:        # noqa: BLE001 (the test looks at it)
        return exc
    raise AssertionError("the read gave a frame")


CUTS = {
    "whole": lambda _random: (lambda: 1 << 30),
    "one byte a read": lambda _random: (lambda: 1),
    "random": lambda random_cuts: (lambda: random_cuts.choice([1, 2, 3, 5, 17, 4096, 70_000])),
}
# Frames of every size around the reader's thresholds: the input buffer
# (INPUT_BYTES), a large frame the blocking client reads whole and a GET
# reply it splits (transport.LARGE_FRAME), a frame shorter than a tag.
SIZES = [0, 1, 15, 16, 17, 100, INPUT_BYTES - 1, INPUT_BYTES, INPUT_BYTES + auth.TAG_BYTES,
         transport.LARGE_FRAME, 200_000]


def messages_of_every_size() -> list[bytes]:
    draw = random.Random(1)
    return [draw.randbytes(size) for size in SIZES] + [
        get_reply(draw.randbytes(transport.LARGE_FRAME)),
        get_reply(draw.randbytes(100)),
        get_reply(bytes(100_000), status=wire.ST_MOVING),
        get_reply(draw.randbytes(300_000)),
    ]


def as_blocking_client_reads(message: bytes, session: auth.Session | None,
                             value_reply: bool) -> bytes:
    """What transport._recv_frame gives for ``message`` (as sent)."""
    size = len(message) + (auth.TAG_BYTES if session is not None else 0)
    if value_reply and transport.value_reply_split(size, session):
        return transport.value_reply(message[:transport.VALUE_HEAD],
                                     message[transport.VALUE_HEAD:])
    return message


@pytest.mark.parametrize("cut", list(CUTS))
@pytest.mark.parametrize("value_reply", [True, False], ids=["get", "other"])
@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "insecure"])
def test_the_frames_read_are_the_messages_sent_however_the_bytes_are_cut(sealed, value_reply,
                                                                        cut):
    sending, receiving = sessions() if sealed else (None, None)
    messages = messages_of_every_size()
    reader = reader_of(receiving, value_reply)
    feed(reader, b"".join(framed(message, sending) for message in messages),
         CUTS[cut](random.Random(7)))
    frames = read(reader, len(messages))
    for message, frame in zip(messages, frames, strict=True):
        expected = as_blocking_client_reads(message, sending, value_reply)
        assert type(frame) is type(expected)
        if type(frame) is transport.ValueReply:
            assert type(frame.value) is bytes
            assert frame.whole() == message and frame.value == expected.value
        else:
            assert frame == message
    assert not reader.transport.closed


def test_a_large_get_reply_gives_its_value_in_bytes_of_its_own():
    value = random.Random(5).randbytes(200_000)
    sending, receiving = sessions()
    reader = reader_of(receiving, value_reply=True)
    feed(reader, framed(get_reply(value), sending), lambda: 8192)
    (reply,) = read(reader, 1)
    assert type(reply) is transport.ValueReply
    assert type(reply.value) is bytes and reply.value == value
    assert transport.reply_size(reply) == len(get_reply(value))


def test_many_small_frames_come_out_of_one_read():
    messages = [wire.reply(wire.ST_OK, number, b"x" * number) for number in range(100)]
    stream = b"".join(framed(message) for message in messages)
    assert len(stream) < INPUT_BYTES
    reader = reader_of()
    buffer = reader.get_buffer(-1)
    buffer[:len(stream)] = stream
    del buffer
    reader.buffer_updated(len(stream))
    assert len(reader.frames) == 100
    assert read(reader, 100) == messages


def test_a_get_reply_is_read_up_to_its_value_then_into_the_value_itself():
    """The first bytes of a large value are not copied out of the input
    buffer: while a GET's reply is awaited the reader asks for its prefix
    and head only, then hands out the value's own bytes."""
    value = random.Random(6).randbytes(100_000)
    reader = reader_of(value_reply=True)
    assert len(reader.get_buffer(-1)) == aio.FRAME.size + transport.VALUE_HEAD
    stream = framed(get_reply(value))
    feed(reader, stream[:aio.FRAME.size + transport.VALUE_HEAD])
    assert len(reader.get_buffer(-1)) == len(value)
    feed(reader, stream[aio.FRAME.size + transport.VALUE_HEAD:])
    assert read(reader, 1)[0].value == value


def test_a_frame_over_the_limit_is_refused_before_it_is_read_and_closes():
    reader = reader_of()
    feed(reader, struct.pack(">I", wire.MAX_FRAME_BYTES + auth.TAG_BYTES) + bytes(10))
    assert reader.failure is None and reader._incoming is not None  # (at the limit: read)
    reader = reader_of()
    feed(reader, framed(b"before") + struct.pack(">I", wire.MAX_FRAME_BYTES + auth.TAG_BYTES + 1))
    assert reader.transport.closed
    assert read(reader, 1) == [b"before"]
    with pytest.raises(ProtocolError, match=f"over the {wire.MAX_FRAME_BYTES}-byte limit"):
        raise failure(reader)


def test_a_handshake_frame_over_4096_bytes_is_refused():
    reader = reader_of(connecting=auth.Connecting(None, "the test service"))
    feed(reader, struct.pack(">I", 4096 + auth.TAG_BYTES + 1))
    assert reader.transport.closed
    with pytest.raises(ProtocolError, match="over the 4096-byte limit"):
        raise failure(reader)


@pytest.mark.parametrize("where", [
    "small", "large", "value", "head", "tag", "shorter than a tag", "unsealed"])
def test_a_frame_whose_tag_does_not_check_raises_and_closes(where):
    sending, receiving = sessions()
    value = random.Random(8).randbytes(300_000)
    message = get_reply(value) if where in ("value", "head", "tag") else \
        random.Random(9).randbytes(300_000 if where == "large" else 100)
    good = framed(b"first", sending)
    if where == "shorter than a tag":
        bad = struct.pack(">I", 10) + bytes(10)
    elif where == "unsealed":
        bad = framed(message)
    else:
        bad = bytearray(framed(message, sending))
        at = {"small": 50, "large": 150_000, "value": 200_000, "head": 6,
              "tag": len(bad) - 1}[where]
        bad[at] ^= 0x01
    reader = reader_of(receiving, value_reply=True)
    feed(reader, good + bytes(bad) + framed(b"after", sending), lambda: 65536)
    assert reader.transport.closed
    assert read(reader, 1) == [b"first"]
    with pytest.raises(AuthenticationError, match="did not check"):
        raise failure(reader)
    with pytest.raises(AuthenticationError):        # (and so on: nothing after it is read)
        raise failure(reader)


def test_the_handshake_is_answered_as_it_comes_and_seals_what_follows_at_once():
    """A frame that comes in the same read as the verdict is read with the
    session the verdict gives: a forged one does not pass unchecked."""
    accepting = auth.Accepting(KEYS)
    reader = reader_of(connecting=auth.Connecting(KEYS, "the test service"))
    feed(reader, framed(accepting.hello()))
    (proof,) = reader.transport.written
    answer, service_session = accepting.proof(proof[4:])
    sealed = framed(b"sealed", service_session)
    feed(reader, framed(answer) + sealed + framed(b"forged") + framed(b"late", service_session))
    hello, verdict, frame = read(reader, 3)
    assert frame == b"sealed" and reader.session is not None
    with pytest.raises(AuthenticationError):
        raise failure(reader)


def test_a_refused_handshake_is_an_authentication_error():
    reader = reader_of(connecting=auth.Connecting(KEYS, "the test service"))
    feed(reader, framed(auth.Accepting(KEYS).hello()))
    feed(reader, framed(auth.Accepting.refusal("not you")))
    assert read(reader, 1)      # (the HELLO)
    with pytest.raises(AuthenticationError, match="not you"):
        raise failure(reader)
    assert reader.transport.closed


def test_writes_wait_while_the_transport_is_past_its_high_water_mark():
    async def job() -> None:
        reader = reader_of()
        await reader.drain()
        reader.pause_writing()
        waiting = asyncio.ensure_future(reader.drain())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        reader.resume_writing()
        await asyncio.wait_for(waiting, 5)
        reader.pause_writing()
        waiting = asyncio.ensure_future(reader.drain())
        await asyncio.sleep(0)
        reader.connection_lost(None)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(waiting, 5)

    asyncio.run(job())


# ------------------------------------------------ on a real connection

@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    yield ours, theirs
    ours.close()
    theirs.close()


async def connected(sock: socket.socket, **options: Any) -> _FrameReader:
    _transport, reader = await asyncio.get_running_loop().create_connection(
        lambda: _FrameReader(**options), sock=sock)
    return reader


@pytest.mark.parametrize("between", [False, True], ids=["mid-frame", "between frames"])
@pytest.mark.parametrize("loop", LOOPS)
def test_the_peer_closing_fails_the_read_at_once(pair, loop, between):
    ours, theirs = pair

    async def job() -> float:
        reader = await connected(ours)
        started = time.monotonic()
        theirs.sendall(framed(b"whole") + (b"" if between else
                                           struct.pack(">I", 1 << 20) + bytes(200_000)))
        theirs.shutdown(socket.SHUT_RDWR)
        assert await asyncio.wait_for(reader.read(), 30) == b"whole"
        with pytest.raises(ConnectionError, match="closed" if between else "mid-frame"):
            await asyncio.wait_for(reader.read(), 30)
        return time.monotonic() - started

    assert run(loop, job()) < 5.0


@pytest.mark.parametrize("sealed", [True, False], ids=["sealed", "insecure"])
@pytest.mark.parametrize("size", [transport.LARGE_FRAME, aio.SEND_PIECE + 1, 3 << 20])
@pytest.mark.parametrize("gathered", [False, True], ids=["bytes", "gathered"])
@pytest.mark.parametrize("loop", LOOPS)
def test_a_large_frame_sent_a_piece_at_a_time_is_the_frame_whole(pair, loop, sealed, size,
                                                                  gathered):
    """A large message (bytes, or a head and a payload never joined) goes
    a piece at a time, each hashed as it is handed over and let drain
    before the next: the bytes on the wire are those of the frame sealed
    whole, the peer reading slowly (a small socket buffer, the transport
    past its high-water mark), and the frames after it are numbered on."""
    ours, theirs = pair
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
    whole = random.Random(size).randbytes(size)
    message = wire.Gathered(whole[:29], whole[29:]) if gathered else whole
    ends = sessions() if sealed else (None, None)
    expected = framed(whole, ends[0]) + framed(b"after", ends[0])
    sending = sessions()[0] if sealed else None
    received = bytearray()

    def drain() -> None:
        theirs.settimeout(10)
        while len(received) < len(expected):
            received.extend(theirs.recv(65536))
            time.sleep(0.0005)

    async def job() -> None:
        reader = await connected(ours)
        await aio._send_large(reader.transport, reader, message, sending)
        aio._write_frame(reader.transport, b"after", sending)
        while reader.transport.get_write_buffer_size():     # (all sent before the loop ends)
            await asyncio.sleep(0.001)

    taker = threading.Thread(target=drain)
    taker.start()
    try:
        run(loop, job())
    finally:
        taker.join()
    assert bytes(received) == expected


@pytest.mark.parametrize("loop", LOOPS)
def test_a_large_value_is_copied_once_on_its_way_in(pair, loop):
    """The value handed on is the buffer the socket was read into: reading
    a 4 MiB value allocates its 4 MiB once (StreamReader: three times)."""
    ours, theirs = pair
    value = random.Random(3).randbytes(4 << 20)
    sending, receiving = sessions()
    stream = framed(get_reply(value), sending)

    async def job() -> tuple[Any, int]:
        reader = await connected(ours, session=receiving)
        reader.value_reply = True
        sender = threading.Thread(target=theirs.sendall, args=(stream,))
        tracemalloc.start()
        try:
            sender.start()
            reply = await asyncio.wait_for(reader.read(), 30)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
            sender.join()
        return reply, peak

    reply, peak = run(loop, job())
    assert type(reply) is transport.ValueReply and reply.value == value
    assert peak < len(value) * 1.5


# ------------------------------------------------ the link and its channel

class TcpService:
    """A Domus-like TCP service on this loop, without a secret: the
    handshake, then each request answered by ``answer(connection number,
    message)``: the bytes to send, and whether to close the connection
    after them."""

    def __init__(self, answer: Callable[[int, bytes], tuple[bytes, bool]]) -> None:
        self.answer = answer
        self.connections = 0
        self.received: list[bytes] = []
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def link(self) -> _Link:
        """Start serving and open a link to it (insecure)."""
        host, port = (await self.start()).split(":")
        return await _Link.open(host, int(port), None, "the test service", 5.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        accepting = auth.Accepting(None)
        writer.write(framed(accepting.hello()))
        try:
            answer, _session = accepting.proof(await self._frame(reader))
            writer.write(framed(answer))
            while True:
                message = await self._frame(reader)
                self.received.append(message)
                sent, close = self.answer(number, message)
                writer.write(sent)
                await writer.drain()
                if close:
                    break
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    @staticmethod
    async def _frame(reader: asyncio.StreamReader) -> bytes:
        (size,) = struct.unpack(">I", await reader.readexactly(4))
        return await reader.readexactly(size)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def get_request(request_id: int) -> bytes:
    return wire.request_header(wire.OP_GET, request_id, 42) + b"key"


@pytest.mark.parametrize("loop", LOOPS)
def test_a_reply_cut_mid_frame_is_asked_again_on_a_new_connection(loop):
    value = random.Random(4).randbytes(300_000)

    def answer(connection: int, message: bytes) -> tuple[bytes, bool]:
        whole = framed(wire.reply(wire.ST_OK, int.from_bytes(message[4:8], "big"),
                                  b"\xc6" + len(value).to_bytes(4, "big") + value))
        return (whole[:100_000], True) if connection == 1 else (whole, False)

    async def job() -> tuple[bytes, int]:
        service = TcpService(answer)
        address = await service.start()
        requests = DatagramRequests(asyncio.get_running_loop())
        channel = AioChannel("s1", address, requests=requests, deadline=30.0)
        try:
            started = time.monotonic()
            reply = await channel.request_tcp(get_request(5))
            assert time.monotonic() - started < 10      # (not the deadline)
            return reply, service.connections
        finally:
            channel.close()
            service.close()

    reply, connections = run(loop, job())
    assert connections == 2
    assert type(reply) is transport.ValueReply and reply.value == value


@pytest.mark.parametrize("loop", LOOPS)
def test_replies_to_other_requests_are_passed_over_and_a_timeout_closes_the_link(loop):
    def answer(_connection: int, message: bytes) -> tuple[bytes, bool]:
        request_id = int.from_bytes(message[4:8], "big")
        if request_id == 9:
            return framed(wire.reply(wire.ST_OK, 8, b"stale")), False     # never its own
        return framed(wire.reply(wire.ST_OK, 99, b"other")) + \
            framed(wire.reply(wire.ST_OK, request_id, b"mine")), False

    async def job() -> None:
        service = TcpService(answer)
        link = await service.link()
        try:
            assert (await link.exchange(get_request(7), 5.0)).endswith(b"mine")
            with pytest.raises(TimeoutError):
                await link.exchange(get_request(9), 0.2)
            assert link.closed
        finally:
            link.close()
            service.close()

    run(loop, job())


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cancelled_exchange_closes_the_link(loop):

    def answer(_connection: int, message: bytes) -> tuple[bytes, bool]:
        request_id = int.from_bytes(message[4:8], "big")
        return (b"" if request_id == 9 else framed(wire.reply(wire.ST_OK, request_id))), False

    async def job() -> None:
        service = TcpService(answer)
        link = await service.link()
        try:
            assert (await link.exchange(get_request(7), 5.0))[4:8] == get_request(7)[4:8]
            exchange = asyncio.ensure_future(link.exchange(get_request(9), 30.0))
            deadline = time.monotonic() + 10
            while len(service.received) < 2:        # (the request is out: the reply awaited)
                assert time.monotonic() < deadline
                await asyncio.sleep(0.005)
            exchange.cancel()
            with pytest.raises(asyncio.CancelledError):
                await exchange
            assert link.closed
        finally:
            link.close()
            service.close()

    run(loop, job())
