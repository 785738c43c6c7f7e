"""The TCP side of the protocol, on Twisted: length-prefixed messages, both
directions on one connection.

``MessageProtocol`` is used by the supervisor (clients and services connect
to it), by the service (its TCP port serves data requests too large for a
datagram, and its link to the supervisor carries calls both ways) and by the
Twisted client.  Either end may send requests on a connection; replies are
told from requests by their magic byte and matched by request id.

Every connection opens with the handshake of domus.wire.auth (``keys``:
the deployment's, or None on an insecure one; ``accepting``: the side that
accepted the connection speaks first); nothing else is sent or taken
before it ends, and on a secure deployment every frame after it is sealed
with the connection's key.  ``authenticated`` fires once it has ended (or
fails with AuthenticationError, and the connection is closed).

A request with op CONTROL carries a msgpack map ``{"op": name, ...}``; the
``control_handler`` answers it with a msgpack-able value (or a Deferred of
one), or raises ``ControlError``.  Any other op is passed, as raw bytes, to
the ``data_handler`` (the service's request handler), whose reply bytes are
sent back as they are.
"""

from __future__ import annotations

import collections
import itertools
import os
import socket
import struct
from collections.abc import Callable
from typing import Any

from twisted.internet import defer
from twisted.logger import Logger
from twisted.protocols.basic import Int32StringReceiver, StringTooLongError

from domus.errors import AuthenticationError, ProtocolError
from domus.wire import auth
from domus.wire import protocol as wire
from domus.wire.secret import Keys

log = Logger(namespace="domus.wire.control")

ControlHandler = Callable[[dict[str, Any], "MessageProtocol"], Any]
# (A reply that comes later is an object with addCallback: a Deferred, or
# domus.service.handler.Later.)
DataHandler = Callable[[bytes, int], Any]

_PREFIX = struct.Struct(">I")
# A frame at least this long is handed to the transport in pieces (prefix,
# frame, tag), not concatenated first: one copy less of a large value.
GATHER_WRITE = 64 * 1024
# What a connection may give the kernel in one send() (Twisted's default is
# 128 KiB: a 16 MiB reply took 128 turns of the reactor).
SEND_LIMIT = 4 * 1024 * 1024
# A sealed frame at least this long is hashed piece by piece as it comes
# (its sender sends it before its tag, and hashes it meanwhile), and the
# rest of it is read at once when the socket has it (``pull``).
HASH_AS_IT_COMES = GATHER_WRITE
# At most this much is read from the socket at once by ``pull``.
PULL_LIMIT = 4 * 1024 * 1024


class ControlError(Exception):
    """Raised by a control handler: sent to the caller as an error reply with
    ``kind`` naming a class in domus.errors and ``message`` for the user."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class RemoteControlError(Exception):
    """The far end answered a control call with an error."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class MessageProtocol(Int32StringReceiver):
    MAX_LENGTH = wire.MAX_FRAME_BYTES

    control_handler: ControlHandler | None = None
    data_handler: DataHandler | None = None
    keys: Keys | None = None          # the deployment's (None: insecure)
    accepting = False                 # the side that accepted the connection
    auth_failures: Callable[[str], None] | None = None   # (accepting side: counted)
    # Replies to requests not sent with ``request`` (the service's copies
    # to its backups, which keep their own table): (status, id, frame).
    reply_handler: Callable[[int, int, bytes], None] | None = None
    call_timeout = 10.0
    # Bounds of a control request's body (domus.wire.protocol.decode_control)
    max_control_body = wire.MAX_FRAME_BYTES
    max_control_containers = wire.MAX_CONTROL_CONTAINERS
    clock: Any = None  # IReactorTime for call timeouts; None: the global reactor
    # A sealed frame at least this long is hashed as it comes (the fuzz
    # harness lowers it to hold that path to the whole frame's check).
    hash_as_it_comes = HASH_AS_IT_COMES

    def __init__(self) -> None:
        self._pending: dict[int, tuple[defer.Deferred, Any]] = {}
        self._request_ids = itertools.count(1)
        self.client_id = int.from_bytes(os.urandom(8), "big")
        self.peer_name = ""
        self.lost = defer.Deferred()  # fires when the connection goes away
        self.authenticated: defer.Deferred = defer.Deferred()
        self._handshake: auth.Accepting | auth.Connecting | None = None
        self._session: auth.Session | None = None
        self._held: list[bytes] | None = []     # frames sent before the handshake ended
        self._refusal: AuthenticationError | None = None    # (the handshake failed)
        # The frame decoder: data received and not yet delivered, as the
        # pieces it came in (``_input_offset`` bytes of the first already
        # taken), and the length of the frame whose prefix was read (-1:
        # none).  A frame is copied once, when it is whole (b"".join of
        # its pieces), whatever the number of pieces: Twisted's
        # IntNStringReceiver copied everything held on every piece, which
        # made a 10 MiB frame cost a gigabyte of copying.
        self._input: collections.deque[bytes] = collections.deque()
        self._input_offset = 0
        self._input_bytes = 0
        self._frame_length = -1
        # The hash of the large sealed frame under way, fed its bytes as
        # they come (auth.Session.receiving); None: none.
        self._hashing: Any = None
        self._low_water = 1     # the socket's SO_RCVLOWAT, as ``_wake_at`` set it

    @property
    def secure(self) -> bool:
        """Whether this connection's frames are sealed (its handshake ended
        with a secure deployment's session)."""
        return self._session is not None

    def connectionMade(self) -> None:
        # Requests wait for their replies: no Nagle delay on either.
        try:
            self.transport.setTcpNoDelay(True)
        except (AttributeError, OSError):
            pass
        if hasattr(self.transport, "SEND_LIMIT"):
            self.transport.SEND_LIMIT = SEND_LIMIT
        if self.accepting:
            self._handshake = auth.Accepting(self.keys)
            self._write_frame(self._handshake.hello())
        else:
            self._handshake = auth.Connecting(self.keys, self._peer())

    def sendString(self, string: bytes | wire.Gathered) -> None:  # noqa: N802 (Twisted's)
        if self._held is not None:
            self._held.append(string)           # (sent once the handshake ends)
            return
        session = self._session
        if session is None:
            self._write_frame(string)
        elif len(string) < HASH_AS_IT_COMES and type(string) is bytes:
            self._write_frame(string, session.tag(string))
        else:
            # The frame first, its tag once hashed: the peer hashes what it
            # has received of the frame while this side hashes it.
            size = len(string) + auth.TAG_BYTES
            if size >= 1 << 32:
                raise StringTooLongError(f"a {size}-byte frame does not fit its 4-byte prefix")
            parts = wire.parts_of(string)
            self._send([_PREFIX.pack(size), *parts])
            hashed = session.sending()
            for part in parts:
                hashed.update(part)
            self._send([session.sent_tag(hashed)])

    def _write_frame(self, frame: bytes | wire.Gathered, tag: bytes = b"") -> None:
        """Write ``frame`` (and its ``tag``) behind its length prefix; a
        large frame is never copied into one string first."""
        size = len(frame) + len(tag)
        if size >= 1 << 32:
            raise StringTooLongError(f"a {size}-byte frame does not fit its 4-byte prefix")
        if size < GATHER_WRITE and type(frame) is bytes:
            self._send([_PREFIX.pack(size) + frame + tag])
        else:
            parts = [_PREFIX.pack(size), *wire.parts_of(frame)]
            self._send([*parts, tag] if tag else parts)

    def _send(self, parts: list[Any]) -> None:
        """Write ``parts`` (bytes or buffers) one after the other.  When
        nothing is waiting in the transport (Twisted's TCP transport), they
        go to the socket at once, with one ``sendmsg``, none copied; what the
        kernel does not take (or everything, on another transport or behind
        output waiting) is given to the transport, which sends it in order
        and pauses this producer past its high-water mark as before.  Bytes
        sent here are told to ``sent_directly``."""
        transport = self.transport
        sock = getattr(transport, "socket", None)
        sent = 0
        if (sock is not None and getattr(transport, "connected", False)
                and not getattr(transport, "disconnecting", True)
                and not getattr(transport, "_writeDisconnected", True)
                and not getattr(transport, "dataBuffer", True)
                and not getattr(transport, "_tempDataBuffer", True)):
            try:
                sent = sock.sendmsg(parts)
            except OSError:     # (would block; or an error the transport will meet)
                sent = 0
            if sent:
                self.sent_directly(sent)
        if not sent:
            transport.writeSequence([bytes(part) if not isinstance(part, bytes) else part
                                     for part in parts])
            return
        rest = []
        for part in parts:
            if sent >= len(part):
                sent -= len(part)
                continue
            rest.append(bytes(memoryview(part)[sent:]) if sent or not isinstance(part, bytes)
                        else part)
            sent = 0
        if rest:
            transport.writeSequence(rest)

    def sent_directly(self, count: int) -> None:
        """``count`` bytes went to the socket without the transport (see
        ``_send``); a subclass counting bytes sent counts them here."""

    # -- the frame decoder
    def dataReceived(self, data: bytes) -> None:  # noqa: N802 (Twisted's name)
        """Take ``data`` from the connection and deliver every frame it
        completes (to ``stringReceived``), unless paused; a frame whose
        prefix says more than MAX_LENGTH calls ``lengthLimitExceeded`` and
        nothing more is read."""
        if data:
            if self._frame_length == -2:
                return                  # (over the limit: closing)
            self._input.append(data)
            self._input_bytes += len(data)
            if self._hashing is not None and self._refusal is None:
                self._hash_piece(data, self._input_bytes - len(data))
        while not self.paused:
            length = self._frame_length
            if length < 0:
                if self._input_bytes < _PREFIX.size:
                    return
                (length,) = _PREFIX.unpack(self._take(_PREFIX.size))
                if length > self.MAX_LENGTH:
                    self.drop_input()
                    self._frame_length = -2
                    self.lengthLimitExceeded(length)
                    return
                self._frame_length = length
                if (length >= max(self.hash_as_it_comes, auth.TAG_BYTES)
                        and self._session is not None
                        and self._handshake is None and self._refusal is None):
                    self._hashing = self._session.receiving()
                    position, skip = 0, self._input_offset
                    for piece in self._input:
                        self._hash_piece(memoryview(piece)[skip:], position)
                        position += len(piece) - skip
                        skip = 0
            if self._input_bytes < length:
                self._wake_at(length - self._input_bytes)
                return
            if self._low_water != 1:
                self._wake_at(0)
            self._frame_length = -1
            if (self._session is not None and self._handshake is None
                    and length >= auth.TAG_BYTES):
                # (Sealed: the frame and its tag apart, neither copied again.)
                frame = self._take(length - auth.TAG_BYTES)
                hashed, self._hashing = self._hashing, None
                if hashed is not None:
                    self.stringReceived(frame, self._take(auth.TAG_BYTES), hashed)
                else:
                    self.stringReceived(frame, self._take(auth.TAG_BYTES))
            else:
                self.stringReceived(self._take(length))

    def _wake_at(self, missing: int) -> None:
        """Have the socket wake the reactor once ``missing`` more bytes
        have come (SO_RCVLOWAT), when they are GATHER_WRITE or more, all
        that a frame of at most wire.READ_WHOLE_BYTES lacks; else at every
        byte.  (A peer closing, or an error, wakes it whatever is missing;
        the kernel bounds the mark by its socket buffer's, and wakes the
        reactor at that.)  Read as it came, a 1 MiB frame woke the receiver
        a dozen times, and each wake-up was the sender's work too (on
        loopback the sender delivers into the receiver's socket, and the
        two contend for it): an insecure 1 MiB PUT took 0.38-0.39 ms,
        0.28-0.30 so; 2 MiB 0.66-0.67 and 0.57-0.61 ms (three runs each,
        alternated).  A larger frame is read as it comes: waiting for the
        last few MiB of a 4 MiB frame made its PUT slower, not faster."""
        wanted = missing if (missing >= GATHER_WRITE
                             and self._frame_length <= wire.READ_WHOLE_BYTES) else 1
        if wanted == self._low_water:
            return
        sock = getattr(self.transport, "socket", None)
        if sock is None:
            return
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, wanted)
        except OSError:     # (closed meanwhile: the transport finds out)
            return
        self._low_water = wanted

    def _hash_piece(self, piece: Any, position: int) -> None:
        """Feed the hash of the frame under way what ``piece``, its bytes
        from ``position`` on, holds of the frame before its tag."""
        end = self._frame_length - auth.TAG_BYTES - position
        if end > 0:
            self._hashing.update(piece if len(piece) <= end else memoryview(piece)[:end])

    def pull(self) -> bytes:
        """The next bytes of a large frame under way that the socket
        already holds (at most what the frame still lacks, and PULL_LIMIT),
        read at once rather than on the reactor's next turn; b"" if there
        are none yet, or nothing to pull (no frame under way, paused, not
        Twisted's TCP transport).  The caller gives them to
        ``dataReceived``.  An error or the peer's close is left to the
        transport, which meets it on its next read."""
        missing = self._frame_length - self._input_bytes
        if self._frame_length < GATHER_WRITE or missing <= 0 or self.paused:
            return b""
        sock = getattr(self.transport, "socket", None)
        if sock is None:
            return b""
        try:
            return sock.recv(min(missing, PULL_LIMIT))
        except OSError:         # (nothing there yet, or an error: the transport's)
            return b""

    def _take(self, size: int) -> bytes:
        """The next ``size`` bytes of input (there are that many)."""
        if not size:
            return b""
        pieces = self._input
        first, offset = pieces[0], self._input_offset
        self._input_bytes -= size
        available = len(first) - offset
        if available > size:
            self._input_offset = offset + size
            return first[offset:offset + size]
        if available == size:
            pieces.popleft()
            self._input_offset = 0
            return first if not offset else first[offset:]
        parts: list[Any] = [memoryview(first)[offset:]]
        pieces.popleft()
        wanted = size - available
        while wanted:
            piece = pieces[0]
            if len(piece) <= wanted:
                parts.append(piece)
                pieces.popleft()
                wanted -= len(piece)
                self._input_offset = 0
            else:
                parts.append(memoryview(piece)[:wanted])
                self._input_offset = wanted
                wanted = 0
        return b"".join(parts)

    def input_held(self) -> int:
        """Bytes received and not yet delivered (partial frames, and whole
        ones held while paused), the length prefix of the frame under way
        not counted."""
        return self._input_bytes

    def drop_input(self) -> None:
        """Forget every byte received and not delivered (and, past a frame
        over the limit, every byte to come)."""
        self._input.clear()
        self._input_offset = self._input_bytes = 0
        self._hashing = None
        if self._frame_length != -2:
            self._frame_length = -1

    def _handshake_frame(self, frame: bytes) -> None:
        handshake = self._handshake
        try:
            if isinstance(handshake, auth.Accepting):
                answer, self._session = handshake.proof(frame)
                self._write_frame(answer)
            elif isinstance(handshake, auth.Connecting):
                handshake.peer = self._peer()       # (named by now)
                if not handshake.proved:
                    self._write_frame(handshake.hello(frame))
                    return
                self._session = handshake.verdict(frame)
            else:
                raise AuthenticationError("a frame before the connection was made")
        except AuthenticationError as exc:
            self._refuse(exc)
            return
        self._handshake = None
        held, self._held = self._held or [], None
        for string in held:
            self.sendString(string)
        if not self.authenticated.called:
            self.authenticated.callback(self)

    def _refuse(self, exc: AuthenticationError) -> None:
        log.warn("{peer}: {error}", peer=self._peer(), error=str(exc))
        if self.accepting:
            if self.auth_failures is not None:
                self.auth_failures(str(exc))
            self._write_frame(auth.Accepting.refusal(str(exc)))
        self._held = []
        self._refusal = exc
        self._hashing = None            # (nothing more is checked)
        pending, self._pending = self._pending, {}
        for deferred, timer in pending.values():
            timer.cancel()
            deferred.errback(exc)
        if not self.accepting and not self.authenticated.called:
            self.authenticated.errback(exc)     # (the side that connected waits on it)
        if self.transport is not None:
            self.transport.loseConnection()

    # -- incoming
    def stringReceived(self, frame: bytes, tag: bytes | None = None,  # noqa: N802
                       hashed: Any = None) -> None:
        """One frame from the peer; ``tag``: its tag, taken apart by the
        decoder (None: the frame still ends with it, if sealed);
        ``hashed``: the frame's hash, fed as it came (None: not hashed
        yet)."""
        if self._refusal is not None:
            return      # (refused: closing; nor the rest of what came in with it)
        if self._handshake is not None:
            self._handshake_frame(frame)
            return
        if self._held is not None:
            return                      # (refused: closing)
        if self._session is not None:
            try:
                if tag is None:
                    frame = self._session.open(frame)
                elif hashed is not None:
                    self._session.check_received(hashed, tag)
                else:
                    self._session.check(frame, tag)
            except AuthenticationError as exc:
                self._refuse(exc)
                return
        if not frame:
            log.warn("empty frame from {peer}", peer=self._peer())
            return
        if frame[0] == wire.REPLY_MAGIC:
            self._reply_received(frame)
            return
        try:
            op, request_id, _client = wire.decode_request_header(frame)
        except ProtocolError as exc:
            log.warn("dropping bad frame from {peer}: {error}", peer=self._peer(), error=exc)
            self.factory_counters("malformed")
            if len(frame) >= wire.REQUEST_HEADER_SIZE and frame[0] == wire.REQUEST_MAGIC:
                request_id = wire.U32.unpack_from(frame, 4)[0]
                self.sendString(wire.error_reply(wire.ST_BAD_VERSION, request_id, str(exc)))
            return
        if op == wire.OP_CONTROL:
            self._control_received(frame, request_id)
        elif self.data_handler is not None:
            answer = self.data_handler(frame, wire.MAX_FRAME_BYTES)
            if isinstance(answer, bytes):
                self.sendString(answer)
            elif answer is not None:            # (answered later)
                self._answer_later(answer)
        else:
            self.sendString(wire.error_reply(
                wire.ST_UNKNOWN_OP, request_id,
                f"op 0x{op:02x} is not served on this connection"))

    def _answer_later(self, answer: Any) -> None:
        answer.addCallback(self._send_if_connected)

    def _send_if_connected(self, frame: bytes) -> None:
        if self.transport is not None and self.connected:
            self.sendString(frame)

    def _control_received(self, frame: bytes, request_id: int) -> None:
        try:
            body = wire.decode_control(frame, max_body=self.max_control_body,
                                       max_containers=self.max_control_containers)
        except ProtocolError as exc:
            self.sendString(wire.reply(wire.ST_CONTROL_ERROR, request_id,
                                       wire.pack({"error": "ProtocolError", "message": str(exc)})))
            return
        if self.control_handler is None:
            self._send_control_error(request_id, "DomusError", "no control operations here")
            return
        result = defer.maybeDeferred(self.control_handler, body, self)
        result.addCallbacks(lambda value: self._send_control_result(request_id, value),
                            lambda failure: self._control_failed(request_id, body, failure))

    def _send_control_result(self, request_id: int, value: Any) -> None:
        if self.transport is not None and self.connected:
            self.sendString(wire.reply(wire.ST_OK, request_id, wire.pack(value)))

    def _control_failed(self, request_id: int, body: dict, failure: Any) -> None:
        if failure.check(ControlError):
            kind, message = failure.value.kind, failure.value.message
        else:
            log.failure("control op {op!r} failed", failure, op=body.get("op"))
            kind, message = "DomusError", f"internal error in {body.get('op')!r}: {failure.value}"
        if self.transport is not None and self.connected:
            self._send_control_error(request_id, kind, message)

    def _send_control_error(self, request_id: int, kind: str, message: str) -> None:
        self.sendString(wire.reply(wire.ST_CONTROL_ERROR, request_id,
                                   wire.pack({"error": kind, "message": message})))

    def _reply_received(self, frame: bytes) -> None:
        try:
            status, request_id = wire.decode_reply_header(frame)
        except ProtocolError as exc:
            log.warn("dropping bad reply from {peer}: {error}", peer=self._peer(), error=exc)
            return
        pending = self._pending.pop(request_id, None)
        if pending is None:
            if self.reply_handler is not None:
                self.reply_handler(status, request_id, frame)
            return  # (else: timed out already)
        deferred, timer = pending
        timer.cancel()
        deferred.callback((status, frame))

    # -- outgoing
    def request(self, message: bytes, request_id: int,
                timeout: float | None = None) -> defer.Deferred:
        """Send a whole request message; the Deferred fires with
        (status, reply frame) or fails with TimeoutError/ConnectionError."""
        if self._refusal is not None:
            return defer.fail(self._refusal)
        clock = self.clock
        if clock is None:
            from twisted.internet import reactor as clock

        deferred: defer.Deferred = defer.Deferred()
        timer = clock.callLater(timeout or self.call_timeout, self._timed_out, request_id)
        self._pending[request_id] = (deferred, timer)
        self.sendString(message)
        return deferred

    def next_request_id(self) -> int:
        return next(self._request_ids) & 0xFFFFFFFF

    def call(self, op: str, timeout: float | None = None, **params: Any) -> defer.Deferred:
        """Call control op ``op`` on the far end; fires with its result or
        fails with RemoteControlError."""
        request_id = self.next_request_id()
        message = wire.encode_control(request_id, self.client_id, {"op": op, **params})
        return self.request(message, request_id, timeout).addCallback(_control_result)

    def _timed_out(self, request_id: int) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending[0].errback(TimeoutError(f"no reply from {self._peer()} in time"))

    def connectionLost(self, reason: Any = None) -> None:
        if not self.accepting and not self.authenticated.called:
            self.authenticated.errback(ConnectionError(
                f"the connection to {self._peer()} closed before its handshake ended"))
        pending, self._pending = self._pending, {}
        for deferred, timer in pending.values():
            timer.cancel()
            deferred.errback(ConnectionError(f"connection to {self._peer()} lost"))
        if not self.lost.called:
            self.lost.callback(None)

    def lengthLimitExceeded(self, length: int) -> None:
        log.warn("{peer} sent a {length}-byte frame, over the {limit}-byte limit; "
                 "closing the connection", peer=self._peer(), length=length,
                 limit=self.MAX_LENGTH)
        self.factory_counters("oversized")
        self.transport.loseConnection()

    def factory_counters(self, name: str) -> None:
        counters = getattr(self.factory, "counters", None)
        if counters is not None:
            counters[name] = counters.get(name, 0) + 1

    def _peer(self) -> str:
        if self.peer_name:
            return self.peer_name
        if self.transport is None:
            return "?"
        peer = self.transport.getPeer()
        return f"{getattr(peer, 'host', '?')}:{getattr(peer, 'port', '?')}"


def _control_result(answer: tuple[int, bytes]) -> Any:
    status, frame = answer
    body = frame[wire.REPLY_HEADER_SIZE:]
    if status == wire.ST_OK:
        return wire.unpack(body) if body else None
    if status == wire.ST_CONTROL_ERROR:
        raise RemoteControlError(*wire.decode_control_error(body))
    raise RemoteControlError("DomusError", f"unexpected reply status 0x{status:02x}: "
                             f"{body.decode('utf-8', 'replace')}")


__all__ = ["MessageProtocol", "ControlError", "RemoteControlError"]
