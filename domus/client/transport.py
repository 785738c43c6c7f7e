"""Blocking transports for the synchronous client.

``SupervisorLink``: one TCP connection to the supervisor for control calls.
``ServiceChannel``: a connected UDP socket to one service (and a TCP
connection opened when a message does not fit a datagram).

Retry rule (the reply cache relies on it): a UDP request is sent again after
``first_timeout``, then after twice that, and so on, until ``deadline``
seconds have passed since the first send; ``deadline`` is capped at half the
service's reply-cache lifetime, so no retry can reach a service after the
reply of its first try was forgotten.  A connected UDP socket also learns at
once (ECONNREFUSED) when nothing listens on the service's port.

When the C codec is built, a request's first try is ``domus.client.codec.roundtrip``
(send, spin briefly for the reply, then poll and recv; without the GIL; on a
secure deployment it also seals the request and skips any datagram whose
MAC does not check for it, so that no per-request crypto runs in Python);
if it times out or is refused, the Python loop below carries on from there
under the same rule (taking a late reply to that first try too: it is
given the time the first try was sealed with).

Threads: a ``ServiceChannel`` may be used by any number of threads at once.
Each thread has its own connected UDP socket (and TCP connection) to the
service, opened on its first request and closed with the channel or when
the thread ends, so a reply only ever reaches the thread that asked, and
requests of different threads are in flight side by side with no lock
between them.  ``SupervisorLink`` serialises its (rare) control calls with
a lock.  After a fork the child opens its own sockets and locks
(``_after_fork``), so a job may connect once and fork its workers.
"""

from __future__ import annotations

import itertools
import os
import random
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from domus.client import codec
from domus.client.throttle import HOLD_PAUSE_MS, Throttle
from domus.errors import (
    SUPERVISOR_ERRORS,
    AuthenticationError,
    ProtocolError,
    ServiceBusy,
    ServiceUnavailable,
    SupervisorError,
    SupervisorUnreachable,
)
from domus.wire import address as addresses
from domus.wire import auth
from domus.wire import protocol as wire
from domus.wire.secret import Keys

FRAME = struct.Struct(">I")      # a TCP message's length prefix
_FRAME = FRAME
FIRST_TIMEOUT = 0.25
MAX_DEADLINE = wire.MAX_DEADLINE
REFUSED_LIMIT = 3
READ_ONLY_CONTROL = frozenset({"ping", "open_dht", "dht_info", "list_dhts", "services",
                               "status", "balancer_status"})
WINDOW = 4              # datagrams in flight per service in a pipelined batch
RECV_BUFFER = 4 * 1024 * 1024
_roundtrip = codec.roundtrip   # None without the C codec
DEFAULT_SPIN_US = 30.0
# A change to a DHT with copies is answered once its backups have it: two
# round trips, the inner one (primary to backup) often to a backup that was
# asleep.  Its first try spins this many times as long as a request's.
REPLICATED_SPIN_FACTOR = 4


def next_timeout(timeout: float, elapsed: float, deadline: float) -> float | None:
    """The retry rule: after a try that waited ``timeout`` seconds without
    a reply, ``elapsed`` seconds after the first send, how long the next try
    waits (twice as long, never past the deadline); None once the deadline
    has passed (give up).  The event-driven clients follow it to the
    letter; ServiceChannel's loop below is the same rule, inline."""
    if elapsed >= deadline:
        return None
    return min(timeout * 2, max(deadline - elapsed, 0.001))


def spin_from_environment(environ: Any = os.environ) -> float:
    """Seconds the C round trip polls for a reply before it sleeps:
    ``DOMUS_CLIENT_SPIN_US`` microseconds (default 30; 0 sleeps at once;
    at most 10000).  See docs/architecture.md, "Waiting for a reply"."""
    text = environ.get("DOMUS_CLIENT_SPIN_US", "")
    if not text.strip():
        return DEFAULT_SPIN_US / 1e6
    try:
        microseconds = float(text)
    except ValueError:
        raise ValueError(f"DOMUS_CLIENT_SPIN_US must be a number of microseconds in "
                         f"[0, 10000], not {text!r}") from None
    if not 0 <= microseconds <= 10_000:
        raise ValueError(f"DOMUS_CLIENT_SPIN_US must be a number of microseconds in "
                         f"[0, 10000], not {text!r}")
    return microseconds / 1e6


def replicated_spin(spin: float) -> float:
    """How long the first try of a change to a replicated DHT spins for its
    reply, when a request's spins ``spin`` seconds: REPLICATED_SPIN_FACTOR
    times as long, within what the C round trip takes (codec.MAX_SPIN)."""
    return min(spin * REPLICATED_SPIN_FACTOR, codec.MAX_SPIN)


SPIN = spin_from_environment()
REPLICATED_SPIN = replicated_spin(SPIN)
_wall_clock = time.time
_STAMP = struct.Struct(">I")   # a sealed request's time (domus.wire.auth)
_TIMED_OUT = "timed out"       # how a first try made in C ended
_REFUSED = "refused"


# Objects holding sockets, locks or ids that a forked child must not share
# with its parent: each has ``_after_fork()``, run in the child (one hook for
# all, holding them weakly, so a closed client is not kept alive by it).
# (by id: a Dht, a mapping, is not hashable)
_FORK_AWARE: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def _after_fork_in_child() -> None:
    for holder in list(_FORK_AWARE.values()):
        holder._after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


def fork_aware(holder: Any) -> None:
    """Have ``holder._after_fork()`` run in every forked child (while
    ``holder`` lives)."""
    _FORK_AWARE[id(holder)] = holder


class RequestIds:
    """Request ids and the client id, fresh in a forked child.  ``next()``
    is safe from any thread (one C-level counter step under the GIL)."""

    def __init__(self) -> None:
        self._reset()
        fork_aware(self)

    def _after_fork(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.client_id = int.from_bytes(os.urandom(8), "big")
        self._counter = itertools.count(int.from_bytes(os.urandom(2), "big"))

    def next(self) -> int:
        return next(self._counter) & 0xFFFFFFFF


# A frame at least this long is sent gathered (sendmsg of its prefix, its
# body and its tag, none copied) and received whole (one recv with
# MSG_WAITALL into the bytes returned: the kernel's copy is the only one).
LARGE_FRAME = 64 * 1024
HASH_PIECE = 256 * 1024     # the most of a sealed large frame received before it is hashed
SEND_PIECE = 512 * 1024     # the most of a sealed large frame sent before it is hashed
_TIMEVAL = struct.Struct("@ll")


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    """The next ``size`` bytes of ``sock`` (TimeoutError, after the
    socket's timeout without data; ConnectionError if it closes first)."""
    if size >= LARGE_FRAME and sock.gettimeout() != 0.0:   # (not a non-blocking socket)
        return _recv_whole(sock, size)
    chunks = []
    while size:
        chunk = sock.recv(min(size, 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed mid-message")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _recv_whole(sock: socket.socket, size: int) -> bytes:
    """``_recv_exactly`` of a large ``size``: the socket is made blocking
    for the while (its timeout becomes the kernel's SO_RCVTIMEO) so that
    one recv(MSG_WAITALL) fills the bytes object returned; pieces are
    joined only if a signal or the timeout cut it short."""
    timeout = sock.gettimeout()
    pieces = []
    try:
        sock.settimeout(None)
        seconds = timeout or 0.0
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                        _TIMEVAL.pack(int(seconds), int(seconds % 1 * 1e6)))
        while size:
            try:
                chunk = sock.recv(size, socket.MSG_WAITALL)
            except BlockingIOError:     # (SO_RCVTIMEO passed with nothing come)
                raise TimeoutError("timed out") from None
            if not chunk:
                raise ConnectionError("connection closed mid-message")
            pieces.append(chunk)
            size -= len(chunk)
    finally:
        sock.settimeout(timeout)
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


# A large GET reply's value, when it is msgpack bin 32 and fills the rest of
# the frame, is received into bytes of its own (ValueReply): the value the
# caller gets is the bytes the kernel filled, with no copy out of a frame.
# One large block a GET instead of two (the frame, then the value copied
# out of it) also spares the process the page faults of the second: glibc
# gives back a freed block at the top of its heap once twice the largest
# block freed lies free there, so the next GET's blocks were fresh pages.
_BIN32 = 0xC6
VALUE_HEAD = wire.REPLY_HEADER_SIZE + 5        # reply header, msgpack bin 32 header


class ValueReply(bytes):
    """A large OK reply to a GET, received in two parts: these bytes are the
    reply's header and the msgpack bin 32 header of its value, ``value`` the
    value's own bytes (``size``: the reply's, both parts).  Only a GET's
    reply is received so (``_recv_frame(..., value_reply=True)``), and only
    ``reply_value``, ``stored_digest`` and ``reply_size`` read past the
    header."""

    value: bytes

    @property
    def size(self) -> int:
        return super().__len__() + len(self.value)

    def whole(self) -> bytes:
        """The reply as one bytes object (a copy)."""
        return bytes(self) + self.value


def reply_value(values: codec.ValueCodec, reply: bytes, offset: int) -> Any:
    """The value stored as ``reply[offset:]``, by the codec ``values``
    (ValueDecodeError if it does not decode): a ValueReply's own bytes as
    they are where msgpack stores them (no copy)."""
    if type(reply) is ValueReply:
        if offset == wire.REPLY_HEADER_SIZE and values.name == "msgpack":
            return reply.value
        reply = reply.whole()
    return values.unpack_at(reply, offset)


def stored_digest(reply: bytes) -> bytes:
    """The digest (wire.value_digest) of the value an OK reply to a GET
    carries, as the service stores it: what DELETE_IF names it by."""
    stored = memoryview(reply)[wire.REPLY_HEADER_SIZE:]
    if type(reply) is ValueReply:
        return wire.value_digest(stored, reply.value)
    return wire.value_digest(stored)


def reply_size(reply: bytes) -> int:
    """The length of a reply as it came (a ValueReply's, both parts)."""
    return reply.size if type(reply) is ValueReply else len(reply)


def value_reply_split(size: int, session: auth.Session | None) -> int:
    """For a frame of ``size`` bytes (its tag included when ``session``)
    that answers a GET: where to split it, reading its first bytes and the
    rest apart (``value_reply``); 0 if it is not large enough to."""
    body = size - (auth.TAG_BYTES if session is not None else 0)
    return VALUE_HEAD if body >= LARGE_FRAME else 0


def value_reply(head: bytes, rest: bytes) -> bytes:
    """The reply to a GET read as ``head`` (``value_reply_split`` bytes),
    then ``rest`` (its tag checked, not included): a ValueReply when its
    value is msgpack bin 32 filling the rest, else the two joined."""
    if (head[0] == wire.REPLY_MAGIC and head[2] == wire.ST_OK
            and head[wire.REPLY_HEADER_SIZE] == _BIN32
            and int.from_bytes(head[wire.REPLY_HEADER_SIZE + 1:], "big") == len(rest)):
        reply = ValueReply(head)
        reply.value = rest
        return reply
    return head + rest


def _recv_value_reply(sock: socket.socket, size: int, session: auth.Session | None) -> bytes:
    """The rest of a large frame of ``size`` bytes that answers a GET (see
    ``value_reply``)."""
    head = _recv_exactly(sock, VALUE_HEAD)
    if session is None:
        return value_reply(head, _recv_exactly(sock, size - VALUE_HEAD))
    hashed = session.receiving()
    hashed.update(head)
    rest = _recv_hashing(sock, size - auth.TAG_BYTES - VALUE_HEAD, hashed)
    session.check_received(hashed, _recv_exactly(sock, auth.TAG_BYTES))
    return value_reply(head, rest)


def _recv_hashing(sock: socket.socket, size: int, hashed: Any) -> bytes:
    """The next ``size`` bytes of ``sock``, each piece fed to ``hashed`` as
    it comes: the service hashes a large frame after sending it, so this
    side's hash runs beside the service's and is all but done when the tag
    comes, instead of starting then.  The pieces land in the bytes returned
    (codec.bytes_to_fill), not copied after (TimeoutError, after the
    socket's timeout without data; ConnectionError if it closes first)."""
    value, buffer = codec.bytes_to_fill(size)
    with memoryview(buffer) as view:
        done = 0
        while done < size:
            got = sock.recv_into(view[done:], min(size - done, HASH_PIECE))
            if not got:
                raise ConnectionError("connection closed mid-message")
            hashed.update(view[done:done + got])
            done += got
    return value if type(value) is bytes else bytes(value)


def _send_frame(sock: socket.socket, message: bytes | wire.Gathered,
                session: auth.Session | None = None) -> None:
    if len(message) < LARGE_FRAME and type(message) is bytes:
        tag = session.tag(message) if session is not None else b""
        sock.sendall(_FRAME.pack(len(message) + len(tag)) + message + tag)
    elif session is None:
        _send_gathered(sock, [_FRAME.pack(len(message)), *wire.parts_of(message)])
    else:
        # The tag last, each piece hashed for it once sent.  A frame the
        # service reads whole (wire.READ_WHOLE_BYTES) it hashes once it has
        # come: that frame goes whole, and this side hashes it meanwhile.
        # A larger one goes a piece at a time: the service hashes each
        # piece as it comes while this side sends and hashes the next.
        hashed = session.sending()
        size = len(message) + auth.TAG_BYTES
        if size <= wire.READ_WHOLE_BYTES:
            parts = wire.parts_of(message)
            _send_gathered(sock, [_FRAME.pack(size), *parts])
            for part in parts:
                hashed.update(part)
        else:
            prefix = _FRAME.pack(size)
            for pieces in sendings(message, SEND_PIECE):
                _send_gathered(sock, [prefix, *pieces] if prefix else pieces)
                prefix = b""
                for piece in pieces:
                    hashed.update(piece)
        sock.sendall(session.sent_tag(hashed))


def sendings(message: bytes | wire.Gathered, step: int) -> Iterator[list[memoryview]]:
    """``message``'s bytes in order, in sends of ``step`` bytes (the last
    one less), each the views of the bytes of its parts it holds: only the
    first of a Gathered's holds more than one (its head, its payload's
    first bytes)."""
    pending: list[memoryview] = []
    room = step
    for part in wire.parts_of(message):
        with memoryview(part) as view:
            start = 0
            while start < len(view):
                piece = view[start:start + room]
                pending.append(piece)
                start += len(piece)
                room -= len(piece)
                if not room:
                    yield pending
                    pending, room = [], step
    if pending:
        yield pending


def _send_gathered(sock: socket.socket, parts: list[bytes]) -> None:
    """sendall of ``parts`` one after the other, none copied (sendmsg)."""
    views = [memoryview(part) for part in parts]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]


def _recv_frame(sock: socket.socket, limit: int = wire.MAX_FRAME_BYTES,
                session: auth.Session | None = None, value_reply: bool = False) -> bytes:
    """The next frame's message (its tag checked and dropped); with
    ``value_reply`` (the reply to a GET) a large one may be a ValueReply."""
    (size,) = _FRAME.unpack(_recv_exactly(sock, _FRAME.size))
    if size > limit + auth.TAG_BYTES:
        raise ProtocolError(f"peer sent a {size}-byte frame, over the {limit}-byte limit")
    if value_reply and value_reply_split(size, session):
        return _recv_value_reply(sock, size, session)
    if session is None:
        return _recv_exactly(sock, size)
    if size < LARGE_FRAME:
        return session.open(_recv_exactly(sock, size))
    # (The frame and its tag apart: the frame is returned as it came.  It
    # is hashed before its tag is read: the service sends a large frame
    # before its tag and hashes it meanwhile.)
    if size < auth.TAG_BYTES:
        session.check(b"", b"")         # (raises)
    hashed = session.receiving()
    frame = _recv_hashing(sock, size - auth.TAG_BYTES, hashed)
    session.check_received(hashed, _recv_exactly(sock, auth.TAG_BYTES))
    return frame


def handshake(sock: socket.socket, keys: Keys | None, peer: str) -> auth.Session | None:
    """The connecting side of domus.wire.auth's handshake, on a blocking
    socket; the session (None: an insecure deployment).  AuthenticationError
    when the peer refuses this process, or is not who it should be."""
    connecting = auth.Connecting(keys, peer)
    _send_frame(sock, connecting.hello(_recv_frame(sock, 4096)))
    return connecting.verdict(_recv_frame(sock, 4096))


class SupervisorLink:
    """Blocking control calls to the supervisor, reconnecting as needed."""

    def __init__(self, address: str, timeout: float, ids: RequestIds,
                 keys: Keys | None = None) -> None:
        self.address = address
        self.host, self.port = addresses.parse(address)
        self.timeout = timeout
        self.ids = ids
        self.keys = keys
        self._sock: socket.socket | None = None
        self._session: auth.Session | None = None
        self.secure = False             # (the deployment's handshake said so)
        self._pid = os.getpid()
        # One call at a time on the one connection (control calls are rare
        # and never on the data path).
        self._lock = threading.RLock()
        fork_aware(self)

    def _after_fork(self) -> None:
        """In a forked child: a lock of its own (another thread of the parent
        may have held this one when it forked); the connection is the
        parent's, left to it (``_connect`` opens another)."""
        self._lock = threading.RLock()
        self._sock = None
        self._session = None

    def _connect(self) -> socket.socket:
        if self._sock is not None and self._pid == os.getpid():
            # The supervisor never speaks first: a readable idle connection
            # means it was closed (e.g. the supervisor restarted).
            readable, _, _ = select.select([self._sock], [], [], 0)
            if not readable:
                return self._sock
            self.close()
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as exc:
            raise SupervisorUnreachable(
                f"cannot reach the Domus supervisor at {self.address}: {exc.strerror or exc}; "
                f"is it running (`domus up` or `domus supervisor`)? Pass its HOST:PORT or set "
                f"DOMUS_SUPERVISOR") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._session = handshake(sock, self.keys, f"the supervisor at {self.address}")
            self.secure = self._session is not None
        except TimeoutError:
            sock.close()
            raise SupervisorUnreachable(
                f"the Domus supervisor at {self.address} did not answer within "
                f"{self.timeout:.1f}s (it accepted the connection but sent no handshake); is "
                f"it a Domus supervisor, and not overloaded?") from None
        except (OSError, ConnectionError, ProtocolError) as exc:
            sock.close()
            raise SupervisorUnreachable(f"the Domus supervisor at {self.address} closed the "
                                        f"connection during its handshake ({exc}); is it "
                                        f"this version of Domus?") from None
        except AuthenticationError:
            sock.close()
            raise
        self._sock, self._pid = sock, os.getpid()
        return sock

    def call(self, op: str, timeout: float | None = None, **params: Any) -> Any:
        """Run control op ``op``; its result, or the matching domus.errors
        exception.  A read-only op is sent again once if the connection
        breaks; a change is not (it may have been applied)."""
        with self._lock:
            return self._call(op, timeout, params)

    def _call(self, op: str, timeout: float | None, params: dict[str, Any]) -> Any:
        attempts = (1, 2) if op in READ_ONLY_CONTROL else (2,)
        for attempt in attempts:
            sock = self._connect()
            request_id = self.ids.next()
            message = wire.encode_control(request_id, self.ids.client_id, {"op": op, **params})
            try:
                sock.settimeout(timeout or self.timeout)
                _send_frame(sock, message, self._session)
                while True:
                    frame = _recv_frame(sock, session=self._session)
                    status, reply_id = wire.decode_reply_header(frame)
                    if reply_id == request_id:
                        break
            except TimeoutError:
                self.close()
                raise SupervisorUnreachable(
                    f"the Domus supervisor at {self.address} did not answer {op!r} within "
                    f"{timeout or self.timeout:.1f}s; check that it is running and not "
                    f"overloaded") from None
            except (ConnectionError, OSError):
                self.close()
                if attempt == 2:
                    raise SupervisorUnreachable(
                        f"lost the connection to the Domus supervisor at {self.address} "
                        f"during {op!r} (if it changed something, it may or may not have "
                        f"been applied: check before retrying); is it running?") from None
                continue  # one reconnect: the supervisor may have restarted
            return _control_result(op, status, frame)
        raise AssertionError("unreachable")

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                try:
                    self._sock.close()
                finally:
                    self._sock = None


def control_result(op: str, status: int, frame: bytes) -> Any:
    """The result of control op ``op`` from the supervisor's reply (status
    and frame), or its domus.errors exception, raised."""
    return _control_result(op, status, frame)


def _control_result(op: str, status: int, frame: bytes) -> Any:
    body = frame[wire.REPLY_HEADER_SIZE:]
    if status == wire.ST_OK:
        return wire.unpack(body) if body else None
    if status == wire.ST_CONTROL_ERROR:
        kind, message = wire.decode_control_error(body)
        raise SUPERVISOR_ERRORS.get(kind, SupervisorError)(message or f"{op!r} failed")
    raise SupervisorError(f"{op!r} failed with status 0x{status:02x}: "
                          f"{body.decode('utf-8', 'replace')}")


def busy_backoff(tries: int, reply: bytes = b"") -> float:
    """How long to wait before sending a request again after its ``tries``-th
    BUSY answer ``reply``: BUSY_BACKOFF doubling up to BUSY_BACKOFF_MAX, or
    the retry-after the reply carries if longer, times a random factor in
    [0.5, 1.5) so that clients refused together do not come back together."""
    base = min(wire.BUSY_BACKOFF * 2 ** min(tries - 1, 16), wire.BUSY_BACKOFF_MAX)
    return max(base, wire.busy_retry_after(reply)) * random.uniform(0.5, 1.5)


def held_back(message: bytes) -> bytes:
    """What a request the client's throttle held back counts as: a BUSY
    answer whose retry-after is HOLD_PAUSE_MS (domus.client.throttle)."""
    return (bytes((wire.REPLY_MAGIC, wire.VERSION, wire.ST_BUSY, 0)) + message[4:8]
            + HOLD_PAUSE_MS.to_bytes(2, "big"))


def service_busy(name: str, address: str, waited: float, tries: int, dht: str = "",
                 bucket: int | None = None) -> ServiceBusy:
    if dht and bucket is not None:
        where = f" for bucket {bucket} of DHT {dht!r}"
    else:
        where = f" for DHT {dht!r}" if dht else ""
    return ServiceBusy(
        f"service {name} at {address} was too busy to serve a request{where}: it answered "
        f"BUSY {tries} times in {waited:.1f}s (the client's deadline). It is overloaded; "
        f"retry later, spread the load over more services, or give the client a longer "
        f"timeout", service=name, address=address, dht=dht, bucket=bucket)


def service_unavailable(name: str, address: str, what: str, dht: str = "",
                        bucket: int | None = None) -> ServiceUnavailable:
    """The error for service ``name`` at ``address`` that ``what`` (did not
    answer, refused, ...) a request on DHT ``dht`` (bucket ``bucket``)."""
    if dht and bucket is not None:
        where = f" for bucket {bucket} of DHT {dht!r}"
    else:
        where = f" for DHT {dht!r}" if dht else ""
    return ServiceUnavailable(
        f"service {name} at {address} {what}{where}; buckets on other services "
        f"keep working. Check `domus status`, restart the service, or retry later",
        service=name, address=address, dht=dht, bucket=bucket)


class _Closer:
    """Closes one thread's sockets to a service when the thread ends (its
    thread-local values are dropped), so they never linger as unclosed."""

    __slots__ = ("sockets",)

    def __init__(self) -> None:
        self.sockets: list[socket.socket] = []

    def hold(self, sock: socket.socket) -> None:
        self.sockets = [held for held in self.sockets if held.fileno() != -1]
        self.sockets.append(sock)

    def __del__(self) -> None:
        for sock in self.sockets:
            try:
                sock.close()
            except OSError:
                pass


class _ThreadSockets(threading.local):
    """One thread's sockets to one service (see ServiceChannel)."""

    sock: socket.socket | None = None
    fd = -1
    tcp: socket.socket | None = None
    tcp_session: auth.Session | None = None
    closer: _Closer | None = None
    # The last GET's value did not fit a datagram: the next GET goes over
    # TCP at once (asking over UDP first would only be told REPLY_TOO_LARGE),
    # until a reply comes that a datagram could have carried.
    get_over_tcp = False

    def hold(self, sock: socket.socket) -> None:
        if self.closer is None:
            self.closer = _Closer()
        self.closer.hold(sock)


class ServiceChannel:
    """Requests to one service, from any number of threads.

    Each thread that uses the channel gets its own connected UDP socket
    (``sock``, opened on first use) and its own TCP connection (``_tcp``,
    opened when a message does not fit a datagram): a thread only ever
    reads replies to its own requests, threads never wait for one another,
    and a thread's sockets close when it ends or the channel is closed.
    ``retries`` and ``timeouts`` are counted by every thread, unlocked."""

    def __init__(self, name: str, address: str, *, deadline: float,
                 first_timeout: float = FIRST_TIMEOUT, keys: Keys | None = None) -> None:
        self.name = name
        self.address = address
        # A secure deployment's: datagrams sealed and checked with the data
        # key, TCP connections opened with the handshake (domus.wire.auth).
        self.keys = keys
        self._key = keys.data if keys is not None else None
        self.host, self.port = addresses.parse(address)
        self.deadline = min(deadline, MAX_DEADLINE)
        self.first_timeout = min(first_timeout, self.deadline)
        self.retries = 0
        self.timeouts = 0
        self.busy = 0           # BUSY answers (each followed by a backoff and a retry)
        # Requests held back here while the service sheds load
        # (domus.client.throttle); ``throttle.held`` counts them.
        self.throttle = Throttle()
        self._closed = False
        self._local = _ThreadSockets()
        # Every socket any thread opened (weakly: a thread that ends takes
        # its sockets with it), for close().
        self._sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
        self._open()            # (the caller's: an unreachable address fails here)
        fork_aware(self)

    def _open(self) -> socket.socket:
        """The calling thread's UDP socket, connected to the service."""
        if self._closed:
            raise ServiceUnavailable(f"the client's channel to service {self.name} "
                                     f"({self.address}) is closed; connect again",
                                     service=self.name, address=self.address)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
        except OSError:
            pass
        try:
            sock.connect((self.host, self.port))
        except OSError:
            sock.close()
            raise
        sock.settimeout(self.first_timeout)
        local = self._local
        local.sock, local.fd = sock, sock.fileno()
        local.hold(sock)
        self._sockets.add(sock)
        return sock

    def _after_fork(self) -> None:
        """In a forked child: sockets of its own, opened as it needs them
        (the inherited ones are the parent's: a reply to the child's
        request could reach the parent, or the other way round)."""
        for sock in list(self._sockets):
            sock.close()            # (the child's copy of the descriptor only)
        self._sockets = weakref.WeakSet()
        self._local = _ThreadSockets()

    @property
    def sock(self) -> socket.socket:
        """The calling thread's connected UDP socket to the service."""
        sock = self._local.sock
        return sock if sock is not None else self._open()

    @property
    def _fd(self) -> int:
        local = self._local
        return local.fd if local.sock is not None else self._open().fileno()

    @property
    def _tcp(self) -> socket.socket | None:
        return self._local.tcp

    @_tcp.setter
    def _tcp(self, sock: socket.socket | None) -> None:
        self._local.tcp = sock
        if sock is not None:
            self._local.hold(sock)
            self._sockets.add(sock)

    @property
    def _tcp_session(self) -> auth.Session | None:
        return self._local.tcp_session

    @_tcp_session.setter
    def _tcp_session(self, session: auth.Session | None) -> None:
        self._local.tcp_session = session

    def close(self) -> None:
        """Close every thread's sockets; requests made after fail."""
        self._closed = True
        for sock in list(self._sockets):
            sock.close()
        self._local = _ThreadSockets()

    def unavailable(self, what: str, dht: str = "",
                    bucket: int | None = None) -> ServiceUnavailable:
        return service_unavailable(self.name, self.address, what, dht, bucket)

    def request(self, message: bytes, dht: str = "", bucket: int | None = None,
                spin: float | None = None) -> bytes:
        """Send one request, return its reply (retrying over UDP, or over TCP
        when it is too big for a datagram).  A BUSY answer is not a reply:
        the same request is sent again after a backoff (busy_backoff), until
        the deadline since the first send, then ServiceBusy.  ``spin``: how
        long the first try spins for its reply before it sleeps (SPIN when
        None; see "Waiting for a reply" in docs/architecture.md)."""
        started = time.monotonic()
        throttle = self.throttle
        if throttle.allow():
            reply = self._request(message, dht, bucket, self.deadline, spin)
            if reply[2] != wire.ST_BUSY:
                throttle.taken += 1.0
                return reply
            throttle.answered(True)
        else:
            reply = held_back(message)
        return self._while_busy(message, dht, bucket, started, self._request, reply)

    def _while_busy(self, message: bytes, dht: str, bucket: int | None, started: float,
                    send: Any, first: bytes) -> bytes:
        """Send ``message`` again (with ``send``) while the service answers
        BUSY (or this client's throttle holds it back), backing off, within
        the deadline since ``started``."""
        tries = 1
        reply = first
        throttle = self.throttle
        while True:
            self.busy += 1
            pause = busy_backoff(tries, reply)
            elapsed = time.monotonic() - started
            if elapsed + pause >= self.deadline:
                raise service_busy(self.name, self.address, self.deadline, tries, dht, bucket)
            time.sleep(pause)
            if throttle.allow():
                reply = send(message, dht, bucket, self.deadline - elapsed - pause)
                throttle.answered(reply[2] == wire.ST_BUSY)
                if reply[2] != wire.ST_BUSY:
                    return reply
            else:
                reply = held_back(message)
            tries += 1

    def _request(self, message: bytes, dht: str, bucket: int | None,
                 deadline: float, spin: float | None = None) -> bytes:
        if len(message) > wire.DEFAULT_MAX_DATAGRAM - auth.REQUEST_TRAILER:
            return self._request_tcp(message, dht, bucket)
        if message[2] == wire.OP_GET and self._local.get_over_tcp:
            reply = self._request_tcp(message, dht, bucket)
            if reply_size(reply) <= wire.DEFAULT_MAX_DATAGRAM:
                self._local.get_over_tcp = False
            return reply
        if _roundtrip is None:
            return self._request_udp(message, dht, bucket, None)
        key = self._key
        # The first try in C: (on a secure deployment, seal it,) send, poll,
        # recv (skipping any datagram whose MAC does not check, and opening
        # the reply), all without the GIL.
        try:
            if spin is None:
                spin = SPIN
            if key is None:
                reply = _roundtrip(self._fd, message, min(self.first_timeout, deadline), spin)
            else:
                seconds = int(_wall_clock()) & 0xFFFFFFFF     # (auth.now_seconds)
                reply = _roundtrip(self._fd, message, min(self.first_timeout, deadline), spin,
                                   key, seconds)
        except ConnectionRefusedError:
            return self._request_udp(message, dht, bucket, _REFUSED, deadline=deadline)
        if reply is None:               # (a late reply to this try is still taken)
            return self._request_udp(message, dht, bucket, _TIMED_OUT,
                                     None if key is None else [_STAMP.pack(seconds)],
                                     deadline=deadline)
        if reply[2] == wire.ST_REPLY_TOO_LARGE:
            return self._too_large(message, dht, bucket)
        return reply

    def _too_large(self, message: bytes, dht: str, bucket: int | None) -> bytes:
        """Ask over TCP what the service answered REPLY_TOO_LARGE over UDP
        (and, for a GET whose reply is past a datagram, the next GETs too)."""
        reply = self._request_tcp(message, dht, bucket)
        if message[2] == wire.OP_GET and reply_size(reply) > wire.DEFAULT_MAX_DATAGRAM:
            self._local.get_over_tcp = True
        return reply

    def _request_udp(self, message: bytes, dht: str, bucket: int | None,
                     first_try: str | None, stamps: list[bytes] | None = None,
                     deadline: float | None = None) -> bytes:
        """The UDP round trip and its retries, in Python.  ``first_try`` is
        how a try already made (by the C round trip) ended: _TIMED_OUT,
        _REFUSED, or None if none was made; ``stamps``: the times it was
        sealed with (a secure deployment: each try is sealed afresh, and a
        reply is taken if its MAC checks for one of them)."""
        sock = self.sock
        request_id = message[4:8]
        deadline = self.deadline if deadline is None else deadline
        timeout = min(self.first_timeout, deadline)
        started = time.monotonic() - (timeout if first_try is _TIMED_OUT else 0.0)
        refused = 0
        outcome = first_try
        key = self._key
        stamps = list(stamps or [])
        try:
            while True:
                if outcome is None:
                    try:
                        if key is None:
                            sock.send(message)
                        else:
                            sealed = auth.seal_request(key, message)
                            stamps.append(sealed[-12:-8])
                            sock.send(sealed)
                        while True:
                            data = sock.recv(65536)
                            if key is not None:
                                data = self._opened(data, message, stamps)
                            if data[4:8] == request_id and len(data) >= wire.REPLY_HEADER_SIZE:
                                if data[2] == wire.ST_REPLY_TOO_LARGE:
                                    return self._too_large(message, dht, bucket)
                                return data
                            # else: the late reply of an earlier request, or
                            # one that is not the service's; skip it
                    except TimeoutError:
                        outcome = _TIMED_OUT
                    except ConnectionRefusedError:
                        outcome = _REFUSED
                if outcome is _TIMED_OUT:
                    self.timeouts += 1
                    refused = 0
                else:
                    refused += 1
                    if refused >= REFUSED_LIMIT:
                        raise self.unavailable("refused the request (nothing listens on its "
                                               "port: the service is down)", dht,
                                               bucket) from None
                    time.sleep(0.02 * refused)
                outcome = None
                elapsed = time.monotonic() - started
                if elapsed >= deadline:
                    raise self.unavailable(f"did not answer within {self.deadline:.1f}s "
                                           f"({self.retries} retries so far)", dht, bucket)
                self.retries += 1
                timeout = min(timeout * 2, max(deadline - elapsed, 0.001))
                sock.settimeout(timeout)
        finally:
            if timeout != self.first_timeout:
                sock.settimeout(self.first_timeout)

    def _opened(self, data: bytes, message: bytes, stamps: list[bytes]) -> bytes:
        """A datagram as this request's reply if its MAC checks for one of
        the request's tries, else b"" (skipped)."""
        return auth.open_reply_to(self._key, data, message, stamps) or b""  # type: ignore

    def request_tcp(self, message: bytes, dht: str = "", bucket: int | None = None) -> bytes:
        """``request`` over TCP (BUSY answers backed off and retried alike)."""
        started = time.monotonic()
        reply = self._request_tcp(message, dht, bucket)
        self.throttle.answered(reply[2] == wire.ST_BUSY)
        if reply[2] != wire.ST_BUSY:
            return reply
        return self._while_busy(message, dht, bucket, started,
                                lambda message, dht, bucket, _left:
                                self._request_tcp(message, dht, bucket), reply)

    def _request_tcp(self, message: bytes, dht: str = "", bucket: int | None = None,
                     _deadline: float | None = None) -> bytes:
        request_id = message[4:8]
        for attempt in (1, 2):
            try:
                if self._tcp is None:
                    self._tcp = socket.create_connection((self.host, self.port),
                                                         timeout=self.deadline)
                    self._tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    self._tcp_session = handshake(self._tcp, self.keys,
                                                  f"service {self.name} ({self.address})")
                _send_frame(self._tcp, message, self._tcp_session)
                while True:
                    frame = _recv_frame(self._tcp, session=self._tcp_session,
                                        value_reply=message[2] == wire.OP_GET)
                    if frame[4:8] == request_id:
                        return frame
            except (OSError, ConnectionError) as exc:
                if self._tcp is not None:
                    self._tcp.close()
                    self._tcp = None
                if attempt == 2 or isinstance(exc, TimeoutError):
                    raise self.unavailable(f"failed over TCP ({exc})", dht, bucket) from None
        raise AssertionError("unreachable")


def exchange(requests: Sequence[tuple[ServiceChannel, bytes]], dht: str = "") -> list[bytes]:
    """Send many requests, to one or several services, with up to WINDOW
    datagrams in flight per service; return the replies in request order.
    Lost datagrams are retried under the same rule as single requests."""
    replies: list[bytes | None] = [None] * len(requests)
    queues: dict[ServiceChannel, list[int]] = {}
    for index, (channel, message) in enumerate(requests):
        if len(message) > wire.DEFAULT_MAX_DATAGRAM:
            replies[index] = channel.request_tcp(message, dht)
        else:
            queues.setdefault(channel, []).append(index)
    if not queues:
        return replies  # type: ignore[return-value]
    for channel in queues:
        channel.sock.setblocking(False)
    try:
        _pipeline(requests, replies, queues, dht)
    finally:
        for channel in queues:
            channel.sock.settimeout(channel.first_timeout)
    return replies  # type: ignore[return-value]


def _pipeline(requests: Sequence[tuple[ServiceChannel, bytes]], replies: list[bytes | None],
              queues: dict[ServiceChannel, list[int]], dht: str) -> None:
    poller = select.poll()
    by_fd = {}
    for channel in queues:
        poller.register(channel.sock.fileno(), select.POLLIN)
        by_fd[channel.sock.fileno()] = channel
    # per channel: request id -> (index, time sent, timeout, time first sent)
    in_flight: dict[ServiceChannel, dict[bytes, tuple[int, float, float, float]]] = {
        channel: {} for channel in queues}
    # request id -> BUSY answers so far; those waiting out a backoff (in
    # flight, their timer the backoff's end)
    busy: dict[bytes, int] = {}
    backing_off: set[bytes] = set()
    stamps: dict[bytes, list[bytes]] = {}       # (secure) request id -> its tries' times
    refused: dict[ServiceChannel, int] = {channel: 0 for channel in queues}
    remaining = len(requests) - sum(reply is not None for reply in replies)

    def fill(channel: ServiceChannel) -> None:
        queue, flying = queues[channel], in_flight[channel]
        while queue and len(flying) < WINDOW:
            index = queue.pop(0)
            message = requests[index][1]
            now = time.monotonic()
            flying[message[4:8]] = (index, now, channel.first_timeout, now)
            _send(channel, message, refused, stamps)

    for channel in queues:
        fill(channel)
    while remaining:
        now = time.monotonic()
        wake = min((sent + timeout for flying in in_flight.values()
                    for _i, sent, timeout, _f in flying.values()), default=now)
        events = poller.poll(max(0.0, wake - now) * 1000)
        for fd, _event in events:
            channel = by_fd[fd]
            while True:
                try:
                    data = channel.sock.recv(65536)
                except BlockingIOError:
                    break
                except ConnectionRefusedError:
                    refused[channel] += 1
                    if refused[channel] >= REFUSED_LIMIT:
                        raise channel.unavailable("refused the request (the service is down)",
                                                  dht) from None
                    break
                if channel._key is not None:
                    data = channel._opened(data, requests[in_flight[channel][data[4:8]][0]][1],
                                           stamps.get(data[4:8], [])) \
                        if data[4:8] in in_flight[channel] else b""
                entry = in_flight[channel].pop(data[4:8], None)
                if entry is None:
                    continue
                index = entry[0]
                channel.throttle.answered(data[2] == wire.ST_BUSY)
                if data[2] == wire.ST_BUSY:
                    # Not a reply: wait a backoff (still holding its window
                    # slot, so the whole window slows down), then again.
                    tries = busy[data[4:8]] = busy.get(data[4:8], 0) + 1
                    channel.busy += 1
                    pause = busy_backoff(tries, data)
                    first = entry[3]
                    if time.monotonic() + pause - first >= channel.deadline:
                        raise service_busy(channel.name, channel.address, channel.deadline,
                                           tries, dht)
                    in_flight[channel][data[4:8]] = (index, time.monotonic(), pause, first)
                    backing_off.add(data[4:8])
                    continue
                if data[2] == wire.ST_REPLY_TOO_LARGE:
                    data = channel.request_tcp(requests[index][1], dht)
                replies[index] = data
                remaining -= 1
            fill(channel)
        now = time.monotonic()
        for channel, flying in in_flight.items():
            for request_id, (index, sent, timeout, first) in list(flying.items()):
                if now < sent + timeout:
                    continue
                if request_id in backing_off:   # (a backoff ended: no timeout)
                    if not channel.throttle.allow():
                        # (held back here: another backoff, as if BUSY)
                        tries = busy[request_id] = busy.get(request_id, 0) + 1
                        pause = busy_backoff(tries)
                        if now + pause - first >= channel.deadline:
                            raise service_busy(channel.name, channel.address,
                                               channel.deadline, tries, dht)
                        flying[request_id] = (index, now, pause, first)
                        continue
                    backing_off.discard(request_id)
                    flying[request_id] = (index, now, channel.first_timeout, first)
                    _send(channel, requests[index][1], refused, stamps)
                    continue
                channel.timeouts += 1
                if now - first >= channel.deadline:
                    if request_id in busy:
                        raise service_busy(channel.name, channel.address, channel.deadline,
                                           busy[request_id], dht)
                    raise channel.unavailable(f"did not answer within {channel.deadline:.1f}s",
                                              dht)
                channel.retries += 1
                flying[request_id] = (index, now, min(timeout * 2, channel.deadline), first)
                _send(channel, requests[index][1], refused, stamps)


def _send(channel: ServiceChannel, message: bytes, refused: dict[ServiceChannel, int],
          stamps: dict[bytes, list[bytes]]) -> None:
    if channel._key is not None:
        message = auth.seal_request(channel._key, message)
        stamps.setdefault(message[4:8], []).append(message[-12:-8])
    try:
        channel.sock.send(message)
    except ConnectionRefusedError:
        refused[channel] += 1
        if refused[channel] >= REFUSED_LIMIT:
            raise channel.unavailable("refused the request (the service is down)") from None
    except BlockingIOError:
        pass  # a full send buffer: the retry timer sends it again
