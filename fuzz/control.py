"""Fuzz targets of the control plane's TCP side (domus.wire.control), which
the supervisor, every service and the Twisted client speak, and of the
blocking client's reading of the supervisor's replies.

``control_stream``: the bytes a peer sends on a TCP connection, once its
handshake is done (fuzz/handshake.py fuzzes the handshake), as
``MessageProtocol`` receives them: length-prefixed frames carrying control
calls (msgpack maps), data requests for the service's handler, and replies
to a call this end made.  An input is a settings byte (bit 0: a secure
deployment's connection, whose every whole frame the harness seals as the
peer's session would), then the stream.  Nothing may escape
``dataReceived``; every frame sent back is a well-formed reply to a request
that came in (sealed, on a secure connection); the call made ends with its
result or a documented error; and the stream cut in two anywhere gives the
same answers as in one piece (where every sealed frame is hashed piece by
piece as it comes, as a large frame is, against the whole frame's check).

``control_reply``: a reply frame to a control call, as the blocking
client (domus.client.transport) and the Twisted side (domus.wire.control)
read it: its result, or the domus.errors class the reply names, or
ProtocolError.

``aio_stream``: the bytes a service sends on the asyncio client's TCP link
(domus.client.aio._FrameReader, past its handshake), as the blocking
client's reader (transport._recv_frame, on a socket) is their twin.  An
input is a settings byte (bit 0: a secure connection, whose every whole
frame the harness seals; bit 1: the replies to a GET, split as
transport.value_reply_split says), then the stream, which ends with the
peer's close.  Both readers give the same frames (a GET reply's value in
bytes of its own, a ValueReply, alike), then the same error (ProtocolError
and AuthenticationError with the same message; ConnectionError at the
close), whether the stream comes in one read, cut in two or a few bytes a
read.  The readers' size thresholds are made small for the while
(transport.LARGE_FRAME, aio.INPUT_BYTES), so that short inputs take the
paths of large frames.
"""

from __future__ import annotations

import itertools
import socket
import struct
from collections.abc import Callable
from typing import Any

import msgpack
from twisted.internet import defer
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.logger import Logger
from twisted.python.failure import Failure

from domus.client import aio
from domus.client import transport as client_transport
from domus.errors import AuthenticationError, DomusError, ProtocolError, SupervisorError
from domus.service.handler import RequestHandler
from domus.wire import auth, control
from domus.wire import protocol as wire
from domus.wire.control import ControlError, MessageProtocol, RemoteControlError
from domus.wire.keys import encode_key
from domus.wire.secret import Keys
from fuzz.harness import Finding, check, describe, documented, outcome, target

FRAME = struct.Struct(">I")
# What domus.wire.control logs while a stream is fed (a handler's bug is
# logged as critical, which Twisted prints until logging begins): nowhere.
QUIET = Logger(namespace="domus.wire.control", observer=lambda _event: None)
CALL_ID = 1         # the id of the first call a MessageProtocol makes
KEYS = Keys.from_secret(bytes(range(32)), "fuzz")
KEY = encode_key("k")
DHT = {"id": 1, "name": "t1", "buckets": 8, "hash": "xxh3", "storage": "ram",
       "platform": "python-dict", "routing": "chord", "lookup": "D", "state": "active",
       "routing_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 8}],
       "storage_services": [{"name": "s1", "address": "127.0.0.1:1", "count": 8}]}


def control_handler(body: dict[str, Any], _link: MessageProtocol) -> Any:
    """A control handler with every kind of answer: a result, a Deferred,
    a refusal (ControlError) and a bug (any other exception)."""
    op = body["op"]
    if op == "echo":
        return {"echo": body}
    if op == "later":
        return defer.succeed([body.get("value")])
    if op == "refuse":
        raise ControlError("UnknownDht", f"no DHT named {body.get('name')!r}")
    raise KeyError(op)      # a handler's bug: answered as an internal error


class Connection:
    """One end of a control connection, in memory: a MessageProtocol with
    the handlers above and a service's request handler for data requests,
    on the side that connected (a service's link to the supervisor), its
    handshake done (``secure``: with a deployment's secret), which has made
    one call (``call``) and has not had its answer yet.  ``peer`` is the
    other side's session (None: insecure)."""

    def __init__(self, secure: bool = False) -> None:
        self.protocol = MessageProtocol()
        self.protocol.clock = Clock()
        self.protocol.control_handler = control_handler
        self.protocol.keys = KEYS if secure else None
        service = RequestHandler("s1")
        service.assign(DHT)
        self.protocol.data_handler = service.handle_fast
        self.transport = StringTransport()
        self.call: list[Any] = []
        logger, control.log = control.log, QUIET
        try:
            self.protocol.makeConnection(self.transport)
            self.protocol.call("stats").addBoth(self.call.append)
            check(self.transport.value() == b"", "a call went out before the handshake")
            peer = auth.Accepting(self.protocol.keys)
            self.protocol.dataReceived(framed(peer.hello()))
            proof = frames(self.transport.value())
            check(len(proof) == 1, f"the answer to HELLO is not one frame: {proof!r}")
            self.transport.clear()
            accept, self.peer = peer.proof(proof[0])
            self.protocol.dataReceived(framed(accept))
        finally:
            control.log = logger
        check(self.protocol.authenticated.called and self.protocol.secure == secure,
              "the handshake did not end")
        self.sent = self.transport.value()
        self.transport.clear()

    def seal(self, data: bytes) -> bytes:
        """A stream as the peer sends it: each whole frame sealed by its
        session (none on an insecure connection), the rest as it is."""
        if self.peer is None:
            return data
        whole = frames(data)
        rest = data[len(framed(*whole)):]
        return framed(*(self.peer.seal(frame) for frame in whole)) + rest

    def open(self, frame: bytes) -> bytes:
        """A frame this end sent, as the peer reads it."""
        if self.peer is None:
            return frame
        try:
            return self.peer.open(frame)
        except DomusError as exc:
            raise Finding(f"a frame sent back does not open: {frame[:80]!r}") from exc

    def feed(self, pieces: list[bytes]) -> tuple[bytes, list[Any]]:
        """The pieces, in turn, as TCP delivers them (none after the
        connection is being closed); what came back, and how the call ended."""
        logger, control.log = control.log, QUIET
        try:
            for piece in pieces:
                if self.transport.disconnecting:
                    break
                self.protocol.dataReceived(piece)
            replies = self.transport.value()
            self.protocol.connectionLost(None)
        finally:
            control.log = logger
        return replies, self.call


def frames(data: bytes) -> list[bytes]:
    """The whole frames at the start of a TCP stream."""
    found, offset = [], 0
    while len(data) - offset >= FRAME.size:
        (length,) = FRAME.unpack_from(data, offset)
        if length > wire.MAX_FRAME_BYTES or len(data) - offset - FRAME.size < length:
            break
        found.append(data[offset + FRAME.size:offset + FRAME.size + length])
        offset += FRAME.size + length
    return found


def framed(*messages: bytes) -> bytes:
    return b"".join(FRAME.pack(len(message)) + message for message in messages)


def stream_seeds() -> list[bytes]:
    """Each stream on an insecure connection and on a secure one."""
    return [bytes((secure,)) + stream for stream in streams() for secure in (0, 1)]


def stream_sweep_seeds() -> list[bytes]:
    """Each stream on an insecure connection, the first three on a secure
    one too (the sealing is the same whatever the frames hold)."""
    return [bytes((0,)) + stream for stream in streams()] \
        + [bytes((1,)) + stream for stream in streams()[:3]]


def streams() -> list[bytes]:
    control_call = wire.encode_control
    reply = wire.reply
    return [
        framed(control_call(7, 1, {"op": "echo", "value": [1, "two", b"3"]})),
        framed(control_call(8, 1, {"op": "later", "value": {"a": None}}),
               control_call(9, 1, {"op": "refuse", "name": "words"})),
        framed(control_call(10, 1, {"op": "no_such_op"}),
               wire.request_header(wire.OP_CONTROL, 11, 1) + b"\xc1",       # not msgpack
               control_call(12, 1, {"op": 5})),
        framed(wire.encode_keyed(wire.OP_PUT, 13, 1, 1, 0, KEY, wire.pack("v")),
               wire.encode_keyed(wire.OP_GET, 14, 1, 1, 0, KEY),
               wire.encode_get_many(15, 1, 1, [(0, KEY), (1, encode_key("j"))])),
        framed(reply(wire.ST_OK, CALL_ID, wire.pack({"requests": 3}))),
        framed(reply(wire.ST_CONTROL_ERROR, CALL_ID,
                     wire.pack({"error": "UnknownDht", "message": "gone"}))),
        framed(reply(wire.ST_MALFORMED, CALL_ID, b"what?")),
        framed(b"", bytes((wire.REQUEST_MAGIC,)), wire.request_header(wire.OP_PING, 16, 1)[:-1]),
        FRAME.pack(wire.MAX_FRAME_BYTES + 1) + b"\x00" * 8,           # over the limit
        framed(control_call(17, 1, {"op": "echo"})) + FRAME.pack(100) + b"cut short",
    ]


def _well_formed_reply(frame: bytes, asked: dict[bytes, int]) -> None:
    check(len(frame) >= wire.REPLY_HEADER_SIZE and frame[0] == wire.REPLY_MAGIC
          and frame[1] == wire.VERSION, f"a frame sent back is not a reply: {frame[:40]!r}")
    status = frame[2]
    check(status in wire.STATUS_NAMES and status != wire.ST_INTERNAL,
          f"a reply of status 0x{status:02x}: {frame[:200]!r}")
    check(frame[4:8] in asked, f"a reply to request id {frame[4:8]!r}, which was not asked")
    if asked[frame[4:8]] == wire.OP_CONTROL and status in (wire.ST_OK, wire.ST_CONTROL_ERROR):
        body = outcome(msgpack.unpackb, frame[wire.REPLY_HEADER_SIZE:])
        check(body[0] == "ok", f"the body of a control reply is not msgpack: {frame[:200]!r}")
        if status == wire.ST_CONTROL_ERROR:
            error = body[1]
            check(isinstance(error, dict) and isinstance(error.get("error"), str)
                  and isinstance(error.get("message"), str),
                  f"a control error without its class and message: {error!r}")


@target("control_stream", seeds=stream_seeds, sweep_seeds=stream_sweep_seeds, fixed=1,
        smoke=1000, max_len=16384, c_sources=("cext/hotpath.c",))
def fuzz_control_stream(data: bytes) -> None:
    """A TCP stream into MessageProtocol after its handshake (control calls,
    data requests, replies to the call it made; sealed on a secure
    connection): nothing escapes dataReceived, every frame sent back is a
    well-formed reply to a request received, the call ends with its result
    or a documented error, and the stream cut in two gives the same
    answers."""
    if not data:
        return
    secure, data = bool(data[0] & 1), data[1:]
    whole = Connection(secure)
    sent = frames(whole.sent)
    check(len(sent) == 1 and framed(*sent) == whole.sent, "the call was not one frame")
    whole.open(sent[0])
    replies, call = whole.feed([whole.seal(data)])
    asked = {}
    for frame in frames(data):
        if len(frame) >= wire.REQUEST_HEADER_SIZE and frame[0] == wire.REQUEST_MAGIC:
            asked[frame[4:8]] = frame[2]
    opened = [whole.open(frame) for frame in frames(replies)]
    for frame in opened:
        _well_formed_reply(frame, asked)
    check(framed(*frames(replies)) == replies,
          f"what was sent back is not whole frames: {replies[:80]!r}")
    check(len(call) == 1, f"the call ended {len(call)} times")
    ended = call[0]
    if isinstance(ended, Failure):
        error = ended.value
        if not isinstance(error, (RemoteControlError, ProtocolError, ConnectionError)):
            raise Finding(f"the call failed with {type(error).__name__}: {error}, not a "
                          f"documented error") from error
    in_two = Connection(secure)
    # (Cut in two, every sealed frame is hashed as it comes, as a large one
    # is: held to the whole frame's check above.)
    in_two.protocol.hash_as_it_comes = 1
    in_two.open(frames(in_two.sent)[0])
    stream = in_two.seal(data)
    cut = len(stream) // 2
    replies_in_two, call_in_two = in_two.feed([stream[:cut], stream[cut:]])
    opened_in_two = [in_two.open(frame) for frame in frames(replies_in_two)]
    check(opened_in_two == opened, "the stream cut in two was answered differently: "
          f"{opened_in_two[:3]!r} / {opened[:3]!r}")
    check(_ending(call_in_two[0]) == _ending(ended),
          f"the call ended {_ending(ended)} in one piece, {_ending(call_in_two[0])} in two")


def _ending(result: Any) -> str:
    if isinstance(result, Failure):
        return f"{type(result.value).__name__}: {result.value}"
    return repr(result)


def reply_seeds() -> list[bytes]:
    reply = wire.reply
    return [reply(wire.ST_OK, CALL_ID, wire.pack({"dhts": [DHT]})),
            reply(wire.ST_OK, CALL_ID),
            reply(wire.ST_CONTROL_ERROR, CALL_ID,
                  wire.pack({"error": "DhtExists", "message": "'words' exists"})),
            reply(wire.ST_CONTROL_ERROR, CALL_ID, wire.pack({"error": "Nonsense"})),
            reply(wire.ST_MALFORMED, CALL_ID, b"malformed: why")]


@target("control_reply", seeds=reply_seeds)
def fuzz_control_reply(data: bytes) -> None:
    """A reply to a control call, as the blocking client reads it from the
    supervisor (a domus.errors class, SupervisorError by default, or
    ProtocolError) and as domus.wire.control reads it (RemoteControlError
    or ProtocolError)."""
    header = outcome(wire.decode_reply_header, data)
    documented("decode_reply_header", header, ProtocolError)
    if header[0] == "ok":
        status = header[1][0]
        blocking = outcome(client_transport._control_result, "stats", status, data)
        documented("the blocking client's control result", blocking, SupervisorError,
                   ProtocolError)
        if blocking[0] == "error":
            check(issubclass(blocking[1], DomusError), describe(blocking))
    if len(data) >= 3:
        twisted_side = outcome(control._control_result, (data[2], data))
        documented("domus.wire.control's control result", twisted_side, RemoteControlError,
                   ProtocolError)


# ------------------------------------------------------------ the asyncio client's link

SMALL_LARGE_FRAME = 48      # transport.LARGE_FRAME while aio_stream runs
SMALL_INPUT = 24            # aio.INPUT_BYTES while aio_stream runs


def aio_seeds() -> list[bytes]:
    """Replies as a service sends them on the TCP link, in each setting."""
    return [bytes((settings,)) + stream for stream in aio_streams() for settings in range(4)]


def aio_sweep_seeds() -> list[bytes]:
    """Each stream sealed and read as GET replies, the first two in the
    three other settings too."""
    streams = aio_streams()
    return [bytes((3,)) + stream for stream in streams] + [
        bytes((settings,)) + stream for stream in streams[:2] for settings in range(3)]


def aio_streams() -> list[bytes]:
    reply = wire.reply
    value = bytes(range(SMALL_LARGE_FRAME + 12))
    streams = [
        framed(reply(wire.ST_OK, 7, b"\xc6" + len(value).to_bytes(4, "big") + value),
               reply(wire.ST_OK, 8, b"\xc6" + (3).to_bytes(4, "big") + b"abc")),
        framed(reply(wire.ST_MOVING, 9, b"\xc6" + len(value).to_bytes(4, "big") + value),
               reply(wire.ST_OK, 10, b"\xdb" + len(value).to_bytes(4, "big") + value)),
        framed(b"", b"x" * 15, b"y" * 16, b"z" * 17, bytes(SMALL_INPUT + auth.TAG_BYTES)),
        framed(reply(wire.ST_OK, 11, wire.pack({"records": 3}))) + FRAME.pack(100) + b"cut",
        FRAME.pack(wire.MAX_FRAME_BYTES + auth.TAG_BYTES + 1) + b"\x00" * 8,
    ]
    return streams


def _blocking_frames(stream: bytes, session: auth.Session | None,
                     value_reply: bool) -> list[Any]:
    """What transport._recv_frame reads of ``stream`` (then the peer's
    close): its frames, then ("error", type, message)."""
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(stream)
        theirs.shutdown(socket.SHUT_WR)
        ours.settimeout(5.0)
        read: list[Any] = []
        while True:
            frame = outcome(client_transport._recv_frame, ours, wire.MAX_FRAME_BYTES, session,
                            value_reply)
            if frame[0] == "error":
                return read + [frame]
            read.append(frame[1])
    finally:
        ours.close()
        theirs.close()


def _aio_frames(stream: bytes, session: auth.Session | None, value_reply: bool,
                most: Callable[[], int]) -> list[Any]:
    """What aio._FrameReader reads of ``stream``, at most ``most()`` bytes a
    read (then the peer's close), as ``_blocking_frames`` says it."""
    reader = aio._FrameReader(session=session)

    class Transport:
        closed = False

        def close(self) -> None:
            self.closed = True

    reader.connection_made(Transport())     # type: ignore[arg-type]
    reader.value_reply = value_reply
    view = memoryview(stream)
    while view and not reader.transport.closed:  # type: ignore[union-attr]
        buffer = reader.get_buffer(-1)
        check(len(buffer) > 0, "get_buffer handed out an empty buffer")
        count = min(len(buffer), len(view), most())
        buffer[:count] = view[:count]
        del buffer
        reader.buffer_updated(count)
        view = view[count:]
    if not reader.transport.closed:         # type: ignore[union-attr]
        reader.eof_received()
    read: list[Any] = []
    while True:
        frame = outcome(_read_at_once, reader)
        if frame[0] == "error":
            return read + [frame]
        read.append(frame[1])


def _read_at_once(reader: aio._FrameReader) -> bytes:
    """``reader.read()`` once the stream has ended (it never waits then)."""
    reading = reader.read()
    try:
        reading.send(None)
    except StopIteration as done:
        return done.value
    reading.close()
    raise Finding("the reader waited for more after the peer's close")


def _shown(frames: list[Any]) -> list[Any]:
    """Frames and the error after them, as compared: a ValueReply as its
    head and value; ConnectionError without its message (each reader says
    the close its own way)."""
    shown = []
    for frame in frames:
        if type(frame) is client_transport.ValueReply:
            shown.append(("ValueReply", bytes(frame), frame.value, type(frame.value)))
        elif type(frame) is tuple:
            shown.append(frame[:2] if issubclass(frame[1], ConnectionError) else frame)
        else:
            shown.append((type(frame), frame))
    return shown


@target("aio_stream", seeds=aio_seeds, sweep_seeds=aio_sweep_seeds, fixed=1, smoke=1000,
        max_len=2048)
def fuzz_aio_stream(data: bytes) -> None:
    """A TCP stream into the asyncio client's frame reader (sealed or not,
    GET replies or not): the frames and then the error that the blocking
    client's reader gives, however the stream is cut."""
    if not data:
        return
    secure, value_reply, data = bool(data[0] & 1), bool(data[0] & 2), data[1:]
    large, chunk = client_transport.LARGE_FRAME, aio.INPUT_BYTES
    client_transport.LARGE_FRAME, aio.INPUT_BYTES = SMALL_LARGE_FRAME, SMALL_INPUT
    try:
        stream = data
        if secure:
            whole = frames(data)
            sealer = auth.Session(bytes(range(32)), sends=0, receives=1)
            stream = b"".join(FRAME.pack(len(frame) + auth.TAG_BYTES) + sealer.seal(frame)
                              for frame in whole) + data[len(framed(*whole)):]

        def session() -> auth.Session | None:
            return auth.Session(bytes(range(32)), sends=1, receives=0) if secure else None

        expected = _shown(_blocking_frames(stream, session(), value_reply))
        ending = expected[-1]
        check(ending[0] == "error" and issubclass(
            ending[1], (ProtocolError, AuthenticationError, ConnectionError)),
              f"the blocking client's reader ended with {ending!r}")
        sizes = itertools.cycle((1, 2, 3, 7, 1, 13))
        cuts: dict[str, Callable[[], int]] = {
            "one read": lambda: 1 << 30, "cut in two": lambda: max(1, len(stream) // 2),
            "reads of 1 to 13 bytes": lambda: next(sizes)}
        for how, most in cuts.items():
            got = _shown(_aio_frames(stream, session(), value_reply, most))
            if got != expected:
                raise Finding(f"the asyncio client's reader ({how}) read {got!r:.600}, the "
                              f"blocking client's {expected!r:.600}")
    finally:
        client_transport.LARGE_FRAME, aio.INPUT_BYTES = large, chunk


__all__ = ["fuzz_control_stream", "fuzz_control_reply", "fuzz_aio_stream"]
