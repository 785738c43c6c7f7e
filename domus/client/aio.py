"""The asyncio client: the synchronous client's operations, as coroutines.

For asyncio jobs (aiohttp crawlers, async services), which keep many
requests outstanding on one event loop::

    import asyncio
    import domus.aio

    async def job():
        async with domus.aio.connect("127.0.0.1:7700") as cluster:
            dht = await cluster.create_dht("words")
            await asyncio.gather(*(dht.put(n, n * n) for n in range(1000)))
            print(await dht.get(12), await dht.length())
            async for key in dht.keys():
                ...

    asyncio.run(job())

It behaves as the other clients: the same wire messages, the same lookups,
redirects and failover (domus.client.evented, the coroutines the Twisted
client runs too), the same retry rule (domus.client.transport.next_timeout)
and per-service window (domus.client.evented.WINDOW), the same errors from
domus.errors.  It runs on whatever loop runs it: asyncio's default loop or
uvloop's.  A client belongs to the loop it was connected on.

One UDP socket carries every request to every service; a message that does
not fit a datagram, or whose reply does not, goes over TCP (one connection
per service, opened when first needed).  At most WINDOW datagrams are in
flight to any one service; the rest wait, in order, on the client.  A
request's retry clock starts when it is first sent; when a request reaches
its deadline, those still queued for the same service fail with it.  A
request whose task is cancelled leaves the table at once (a late reply is
dropped); a change it had sent may or may not have been applied.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import ipaddress
import itertools
import math
import socket
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Generator, Iterable, Mapping
from typing import Any

from domus.client import codec, transport
from domus.client.blocking import DEFAULT_TIMEOUT, STATE_CHANGE_TIMEOUT, move_target
from domus.client.evented import WINDOW, EventedChannel, EventedDht
from domus.client.lookup import MISSING
from domus.client.transport import (
    FIRST_TIMEOUT,
    FRAME,
    LARGE_FRAME,
    READ_ONLY_CONTROL,
    RECV_BUFFER,
    RequestIds,
    busy_backoff,
    control_result,
    held_back,
    next_timeout,
    reply_size,
    sendings,
    service_busy,
)
from domus.errors import (
    AuthenticationError,
    DomusError,
    ProtocolError,
    SupervisorUnreachable,
    UnknownDht,
    ValueDecodeError,
)
from domus.wire import address as addresses
from domus.wire import auth, secret
from domus.wire import protocol as wire
from domus.wire.attributes import check_strategy, create_request
from domus.wire.keys import decode_key
from domus.wire.secret import Keys

MAX_PACKET = 65536

__all__ = ["connect", "AioCluster", "AioDht", "AioChannel", "DatagramRequests", "WINDOW"]


# ------------------------------------------------------------ framed TCP

# A _Link reads its connection with a BufferedProtocol (_FrameReader), not a
# StreamReader, so that a large frame is copied once on its way in: by the
# kernel, into the bytes handed on.  asyncio's StreamReader copied each byte
# three times (the transport's chunk, its buffer, readexactly's slice).
# Once a frame's length prefix has come, each part of the frame (its
# message; or a GET reply's head and value, split as the blocking client
# splits them, transport.value_reply_split; then its tag, when sealed) gets
# a buffer of its own at its exact size (_Part), and the socket is read
# straight into a part of INPUT_BYTES or more.  Length prefixes, small
# parts and small frames go through one input buffer, many frames a read;
# it never reads past the start of a large part, and while a GET's reply is
# awaited it reads no further than the reply's head, so that the first
# bytes of a large value are not copied out of it.
INPUT_BYTES = 16 * 1024


class _Part:
    """``size`` bytes of a frame, written where they land (``view``), then
    taken (``take``) as bytes with no copy: the bytes object is made
    first, not zeroed, and written through a buffer over it
    (codec.bytes_to_fill; without the C codec, a bytearray copied once
    filled)."""

    __slots__ = ("size", "filled", "view", "_value")

    def __init__(self, size: int) -> None:
        self.size = size
        self.filled = 0
        self._value, buffer = codec.bytes_to_fill(size)
        self.view = memoryview(buffer)

    def take(self) -> bytes:
        self.view.release()
        value = self._value
        return value if type(value) is bytes else bytes(value)


class _Incoming:
    """A frame whose length prefix has come, ``size`` bytes (its tag
    included when ``session``), split after ``split`` bytes of its message
    when not 0: its parts, filled in order as bytes come; when sealed, the
    message's bytes hashed for the tag as they come (auth.Session.receiving)."""

    __slots__ = ("parts", "index", "split", "sealed", "hashed")

    def __init__(self, size: int, session: auth.Session | None, split: int) -> None:
        self.hashed = session.receiving() if session is not None and \
            size >= auth.TAG_BYTES else None
        self.sealed = self.hashed is not None
        body = size - auth.TAG_BYTES if self.sealed else size
        sizes = [split, body - split] if split else [body]
        if self.sealed:
            sizes.append(auth.TAG_BYTES)
        self.parts = [_Part(part_size) for part_size in sizes]
        self.split = split
        self.index = 0              # (the part under way)
        self._advance()

    @property
    def done(self) -> bool:
        return self.index == len(self.parts)

    def fill(self, data: memoryview) -> int:
        """Copy the frame's next bytes from ``data``; how many it took."""
        taken = 0
        while not self.done and taken < len(data):
            part = self.parts[self.index]
            count = min(part.size - part.filled, len(data) - taken)
            part.view[part.filled:part.filled + count] = data[taken:taken + count]
            self.filled(count)
            taken += count
        return taken

    def lend(self) -> memoryview | None:
        """Where the socket may write the rest of the part under way, when
        it is large; None: it goes through the input buffer."""
        part = self.parts[self.index]
        return part.view[part.filled:] if part.size >= INPUT_BYTES else None

    def ahead(self) -> int | None:
        """How many bytes may go through the input buffer before a large
        part begins (None: no large part is left)."""
        count = 0
        for part in self.parts[self.index:]:
            if part.size >= INPUT_BYTES:
                return count
            count += part.size - part.filled
        return None

    def filled(self, count: int) -> None:
        """The part under way has ``count`` bytes more."""
        part = self.parts[self.index]
        if self.hashed is not None and self.index < len(self.parts) - 1:
            self.hashed.update(part.view[part.filled:part.filled + count])
        part.filled += count
        self._advance()

    def _advance(self) -> None:
        while self.index < len(self.parts) and self.parts[self.index].filled == \
                self.parts[self.index].size:
            self.index += 1

    def tag(self) -> bytes:
        return self.parts[-1].take()

    def message(self) -> bytes:
        """The frame without its tag: a GET reply split in two is
        transport.value_reply's (a ValueReply, or the two parts joined)."""
        body = self.parts[:-1] if self.sealed else self.parts
        if self.split:
            return transport.value_reply(body[0].take(), body[1].take())
        return body[0].take()


class _FrameReader(asyncio.BufferedProtocol):
    """A _Link's protocol: the frames of the connection, in order
    (``read``), each checked against the limit (``limit``, by its length
    prefix, before any of it is read) and, once the handshake has given a
    session, against its tag; the error that ends the reading (a frame over
    the limit, a tag that does not check, the peer's close: ConnectionError)
    closes the connection and comes after the frames before it.  The
    handshake (``connecting``, domus.wire.auth) is answered as its frames
    come, so the session is known before any byte after the verdict is
    read.  ``value_reply``: a GET's reply is awaited (its frame read as
    transport.value_reply_split says).  Writes are paused past the
    transport's high-water mark (``drain``)."""

    def __init__(self, connecting: auth.Connecting | None = None,
                 session: auth.Session | None = None) -> None:
        self.transport: asyncio.BaseTransport | None = None
        self.connecting = connecting
        self.session = session
        self.limit = 4096 if connecting is not None else wire.MAX_FRAME_BYTES
        self.value_reply = False
        self.frames: deque[bytes | _Incoming] = deque()
        self.failure: BaseException | None = None
        self._input = bytearray(INPUT_BYTES)
        self._input_view = memoryview(self._input)
        self._start = self._end = 0         # (what of the input is not taken yet)
        self._incoming: _Incoming | None = None
        self._lent = False                  # (the last buffer given is a large part's)
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._drained: asyncio.Future | None = None

    # -- the frames
    async def read(self) -> bytes:
        """The next frame's message (its tag checked and dropped); once
        every frame that came is read, the error that ended the reading."""
        if not self.frames and self.failure is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self.frames:
            item = self.frames.popleft()
            return item if isinstance(item, bytes) else item.message()
        raise self.failure.with_traceback(None)     # type: ignore[union-attr]

    def get_buffer(self, sizehint: int) -> memoryview:
        incoming = self._incoming
        ahead: int | None = None
        if incoming is not None and self.failure is None:
            lent = incoming.lend()
            if lent is not None:
                self._lent = True
                return lent
            ahead = incoming.ahead()
        elif self.value_reply:
            ahead = FRAME.size + transport.VALUE_HEAD
        self._lent = False
        start, end = self._start, self._end
        if start:       # (part of a length prefix: to the front)
            self._input[:end - start] = self._input[start:end]
            self._start, self._end = 0, end - start
        stop = len(self._input) if ahead is None else min(len(self._input), ahead)
        return self._input_view[self._end:stop]

    def buffer_updated(self, nbytes: int) -> None:
        if self.failure is not None:
            return
        try:
            incoming = self._incoming
            if self._lent and incoming is not None:
                self._lent = False
                incoming.filled(nbytes)
                if incoming.done:
                    self._incoming = None
                    self._complete(incoming)
            else:
                self._end += nbytes
                self._parse()
        except (AuthenticationError, ProtocolError) as exc:
            self._fail(exc)

    def _parse(self) -> None:
        """Take every frame the input completes, and what it holds of the
        frame under way."""
        view, start, end = self._input_view, self._start, self._end
        while True:
            incoming = self._incoming
            if incoming is None:
                if end - start < FRAME.size:
                    break
                (size,) = FRAME.unpack_from(view, start)
                start += FRAME.size
                if size > self.limit + auth.TAG_BYTES:
                    raise ProtocolError(f"peer sent a {size}-byte frame, over the "
                                        f"{self.limit}-byte limit")
                split = transport.value_reply_split(size, self.session) \
                    if self.value_reply else 0
                if not split and end - start >= size:
                    self._deliver(self._whole(view[start:start + size]))
                    start += size
                    continue
                incoming = self._incoming = _Incoming(size, self.session, split)
            start += incoming.fill(view[start:end])
            if not incoming.done:
                break
            self._incoming = None
            self._complete(incoming)
        self._start, self._end = (0, 0) if start == end else (start, end)

    def _whole(self, data: memoryview) -> bytes:
        """The message of a frame that came whole into the input, its tag
        checked."""
        session = self.session
        if session is None:
            return bytes(data)
        if len(data) < auth.TAG_BYTES:
            return session.open(bytes(data))        # (raises)
        # (The frame and its tag apart: the frame is not copied to drop its tag.)
        frame = bytes(data[:-auth.TAG_BYTES])
        session.check(frame, bytes(data[-auth.TAG_BYTES:]))
        return frame

    def _complete(self, incoming: _Incoming) -> None:
        if incoming.hashed is not None:
            self.session.check_received(incoming.hashed, incoming.tag())  # type: ignore
        elif self.session is not None:
            self.session.open(incoming.message())   # (shorter than a tag: raises)
        self._deliver(incoming)

    def _deliver(self, item: bytes | _Incoming) -> None:
        if self.connecting is not None:
            item = item if isinstance(item, bytes) else item.message()
            self._shake(item)
        self.frames.append(item)
        self._wake()

    def _shake(self, frame: bytes) -> None:
        """A frame of the handshake: the peer's HELLO, answered; then its
        verdict, which gives the session (the frame stays in ``frames``
        for the caller, who waits on each)."""
        connecting = self.connecting
        assert connecting is not None
        if not connecting.proved:
            _write_frame(self.transport, connecting.hello(frame))  # type: ignore[arg-type]
            return
        self.session = connecting.verdict(frame)
        self.connecting = None
        self.limit = wire.MAX_FRAME_BYTES

    def _fail(self, exc: BaseException) -> None:
        if self.failure is None:
            self.failure = exc
        self._incoming = None
        self._start = self._end = 0
        if self.transport is not None:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # -- the connection
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def eof_received(self) -> None:
        if self.failure is None:
            cut = self._incoming is not None or self._end > self._start
            self.failure = ConnectionError(
                f"the peer closed the connection{' mid-frame' if cut else ''}")
        self._wake()            # (and the transport closes)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.failure is None:
            self.failure = exc if exc is not None else ConnectionError("connection closed")
        self._wake()
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    # -- writes
    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    async def drain(self) -> None:
        """Wait until the transport holds no more than its high-water mark
        (StreamWriter.drain); the reading's error if it has ended."""
        if self._paused and self.failure is None:
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None
        if self.failure is not None:
            raise self.failure.with_traceback(None)


def _write_frame(writer: asyncio.WriteTransport, message: bytes,
                 session: auth.Session | None = None) -> None:
    """Write a frame under LARGE_FRAME (``_send_large`` sends the others)."""
    tag = session.tag(message) if session is not None else b""
    writer.writelines((FRAME.pack(len(message) + len(tag)), message, tag))


SEND_PIECE = 256 * 1024     # a large frame's bytes handed to the transport at a time


async def _send_large(writer: asyncio.WriteTransport, reader: _FrameReader,
                      message: bytes | wire.Gathered,
                      session: auth.Session | None) -> None:
    """Send a large ``message`` (its link's lock held), hashed for the tag
    as it is handed over, then the tag.  A frame larger than the service
    reads whole goes a piece at a time, each let drain before the next: the
    transport sends what the socket takes at once and keeps a copy of the
    rest, so a frame written whole had most of its bytes copied into the
    transport's buffer, then moved down it send by send (Python 3.11's
    buffer is one bytearray), and was hashed before its first byte went.
    The bytes on the wire are those of the frame sealed whole."""
    hashed = session.sending() if session is not None else None
    size = len(message) + (auth.TAG_BYTES if hashed is not None else 0)
    prefix = FRAME.pack(size)
    # (A frame the service reads whole goes whole: in pieces, a 1 MiB PUT
    # read 0.51 ms, whole 0.43-0.44; a 4 MiB one 1.75 ms in pieces, 1.9-2.3
    # whole.)
    step = len(message) if size <= wire.READ_WHOLE_BYTES else SEND_PIECE
    for pieces in sendings(message, step):
        # (Each large piece written as it is: this Python's writelines
        # joins what it is given.  The prefix and a Gathered's head, a
        # few bytes, go together.)
        if prefix or len(pieces) > 1:
            writer.write(b"".join((prefix, *pieces[:-1])))
        writer.write(pieces[-1])
        prefix = b""
        if hashed is not None:
            for piece in pieces:
                hashed.update(piece)
        await reader.drain()
    if hashed is not None:
        writer.write(session.sent_tag(hashed))  # type: ignore[union-attr]


class _Link:
    """One TCP connection that has passed domus.wire.auth's handshake; one
    exchange at a time (``lock``)."""

    def __init__(self, transport: asyncio.Transport, reader: _FrameReader) -> None:
        self.transport = transport
        self.reader = reader
        self.session = reader.session
        self.lock = asyncio.Lock()

    @classmethod
    async def open(cls, host: str, port: int, keys: Keys | None, peer: str,
                   timeout: float) -> _Link:
        """Connect and shake hands within ``timeout`` seconds: OSError or
        TimeoutError when the peer cannot be reached or stays silent,
        AuthenticationError when either side refuses the other."""
        connecting = auth.Connecting(keys, peer)
        transport, reader = await asyncio.wait_for(asyncio.get_running_loop().create_connection(
            lambda: _FrameReader(connecting), host, port), timeout)
        try:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _frame in ("hello", "verdict"):     # (each answered by the reader as it came)
                await asyncio.wait_for(reader.read(), timeout)
        except BaseException:
            transport.close()
            raise
        return cls(transport, reader)

    async def exchange(self, message: bytes, timeout: float) -> bytes:
        """Send ``message``, return the frame answering it (same request id);
        a connection cut or timed out mid-way is closed, so the next
        exchange never reads this one's reply."""
        async with self.lock:
            reader = self.reader
            try:
                reader.value_reply = message[2] == wire.OP_GET
                if len(message) < LARGE_FRAME:
                    _write_frame(self.transport, message, self.session)
                else:
                    await _send_large(self.transport, reader, message, self.session)
                await reader.drain()
                while True:
                    async with asyncio.timeout(timeout):
                        frame = await reader.read()
                    if frame[4:8] == message[4:8]:
                        return frame
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        self.transport.close()

    @property
    def closed(self) -> bool:
        return self.transport.is_closing()


# ------------------------------------------------------------ datagrams

READ_BATCH = 256    # datagrams read at most each time the socket is readable
_QUEUED, _SENT, _OVER = 0, 1, 2     # a request's course: waiting, in flight, done
_BACKING = 3                        # (in flight) waiting out a BUSY backoff


class _Reply(asyncio.Future):
    """The future of one UDP request's reply.  Cancelling it (as a task
    awaiting it does when it is cancelled, or a ``gather`` of it) takes the
    request out of the table or the queue at once and frees its slot.

    Its done-callbacks (the awaiting task's wake-up, a ``gather``'s) are
    kept here rather than in the base future, so that ``resolve`` can run
    them at once.  asyncio's future schedules them with ``call_soon``: the
    task that awaits a reply would run only in the next turn of the loop,
    which first polls the selector again; with one request outstanding
    that is a turn and a system call more per request than Twisted, whose
    Deferred runs its callbacks as it fires.  ``resolve`` is for the
    socket's read callback (no task is running then, so a task may step
    at once, in its own context, as the loop would step it); every other
    way a reply future ends (``set_result``, ``set_exception``, ``cancel``)
    schedules them as asyncio does."""

    __slots__ = ("entry", "waiters")

    def add_done_callback(self, fn: Any, *, context: Any = None) -> None:
        if self.done():
            super().add_done_callback(fn, context=context)     # (scheduled at once)
            return
        self.waiters.append((fn, contextvars.copy_context() if context is None else context))

    def remove_done_callback(self, fn: Any) -> int:
        kept = [(callback, context) for callback, context in self.waiters if callback != fn]
        removed = len(self.waiters) - len(kept)
        self.waiters[:] = kept
        return removed + super().remove_done_callback(fn)

    def resolve(self, reply: bytes) -> None:
        """Set the result and run the callbacks now: only from a loop
        callback, outside any task."""
        super().set_result(reply)
        waiters = self._taken()
        loop = self.get_loop()
        if asyncio.current_task(loop) is not None:
            self._schedule(waiters)
            return
        for fn, context in waiters:
            try:
                context.run(fn, self)
            except (SystemExit, KeyboardInterrupt):
                raise
            except BaseException as exc:    # (what the loop does with a failed callback)
                loop.call_exception_handler({
                    "message": f"exception in a callback of {self!r}", "exception": exc,
                    "future": self})

    def set_result(self, result: Any) -> None:
        super().set_result(result)
        self._schedule(self._taken())

    def set_exception(self, exception: Any) -> None:
        super().set_exception(exception)
        self._schedule(self._taken())

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        self._schedule(self._taken())
        self.entry.channel.requests.forget(self.entry)
        return True

    def _taken(self) -> list[tuple[Any, Any]]:
        waiters, self.waiters = self.waiters, []
        return waiters

    def _schedule(self, waiters: list[tuple[Any, Any]]) -> None:
        call_soon = self.get_loop().call_soon
        for fn, context in waiters:
            call_soon(fn, self, context=context)


class _Pending:
    """One UDP request, from when it is queued until its reply, its deadline,
    its cancellation or the client's close."""

    __slots__ = ("future", "message", "request_id", "channel", "dht", "bucket", "started",
                 "timeout", "tries", "state", "stamps", "busy")

    def __init__(self, channel: AioChannel, message: bytes, dht: str, bucket: int | None,
                 future: asyncio.Future) -> None:
        self.channel = channel
        self.message = message
        self.request_id = message[4:8]
        self.dht = dht
        self.bucket = bucket
        self.future = future
        self.started = 0.0
        self.timeout = channel.first_timeout
        self.tries = 0                  # sends so far (a retry clock counts for one)
        self.state = _QUEUED
        self.stamps: list[bytes] = []   # (secure) the times its tries were sealed with
        self.busy = 0                   # BUSY answers so far (and holds of the throttle)


class DatagramRequests:
    """The client's one UDP socket: requests out, replies matched back by id.

    The same invariants as the Twisted client's (domus.client.tx): an id is
    in ``pending`` from its first send until its reply, its deadline, its
    cancellation or the close, then never again (a late reply is dropped);
    a retry resends the same request id, so a service's reply cache answers
    a change it applied already; every request in flight has one live retry
    clock, for its latest try.

    What a request costs the loop is kept small, so that thousands
    outstanding run as fast on asyncio's default loop as on Twisted's:
    - the socket is read until it is empty (at most READ_BATCH datagrams)
      each time it is readable, not one datagram per turn of the loop (as
      Twisted's doRead);
    - datagrams go out on the socket itself (as the Twisted client's);
    - retry clocks are not one loop timer each.  A first try's clock goes
      to the FIFO of its timeout (``_fifos``, in practice one: every
      channel of a cluster has the same first timeout), where expiries
      come in the order they were sent; a retry's, whose timeouts vary, to
      a heap (``_retries``).  One loop timer is armed for the earliest.  A
      clock is (expiry, request, try); it counts only while the request is
      in flight at that try, and one that no longer counts (answered,
      retried, cancelled) is dropped when the sweep passes it;
    - a request needs no callback of its own: its future (``_Reply``)
      frees its slot when it is cancelled;
    - a reply wakes the task awaiting it in the turn that read it
      (``_Reply.resolve``), not in the next."""

    def __init__(self, loop: asyncio.AbstractEventLoop, window: int = WINDOW) -> None:
        self.loop = loop
        self.window = window
        self.pending: dict[bytes, _Pending] = {}
        self.channels: set[AioChannel] = set()
        self.sock: socket.socket | None = None
        self.late_replies = 0
        self.stray = 0
        self.unauthenticated = 0
        self.send_errors = 0
        self.closed = False
        self._sendto: Any = None
        self._fifos: dict[float, deque[tuple[float, _Pending, int]]] = {}
        self._retries: list[tuple[float, int, _Pending, int]] = []
        self._order = itertools.count()     # (ties in the heap: requests are not ordered)
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf

    async def open(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
            except OSError:
                pass
            sock.bind(("0.0.0.0", 0))
            sock.setblocking(False)
            self.loop.add_reader(sock.fileno(), self._readable)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self._sendto = sock.sendto

    # -- requests
    def request(self, channel: AioChannel, message: bytes, dht: str,
                bucket: int | None) -> asyncio.Future:
        future = _Reply(loop=self.loop)
        future.waiters = []
        if self.closed or self.sock is None:
            future.set_exception(DomusError("this asyncio Domus client is closed; "
                                            "connect again"))
            return future
        entry = future.entry = _Pending(channel, message, dht, bucket, future)
        self.channels.add(channel)
        channel.waiting.append(entry)
        if channel.in_flight < self.window:
            self._pump(channel)
        return future

    def _pump(self, channel: AioChannel) -> None:
        """Send what waits for ``channel`` while its window has room."""
        if channel.ip is None:
            channel.resolve()
            return
        waiting = channel.waiting
        while waiting and channel.in_flight < self.window:
            entry = waiting.popleft()
            if entry.future.done():
                entry.state = _OVER
                continue
            channel.in_flight += 1
            entry.state = _SENT
            entry.started = self.loop.time()
            self.pending[entry.request_id] = entry
            if channel.throttle.allow():
                self._send(entry)
            else:
                self._busy(entry, held_back(entry.message))

    def _send(self, entry: _Pending) -> None:
        entry.tries += 1
        expires = self.loop.time() + entry.timeout
        if entry.tries == 1:
            fifo = self._fifos.get(entry.timeout)
            if fifo is None:
                fifo = self._fifos[entry.timeout] = deque()
            fifo.append((expires, entry, 1))
        else:
            heapq.heappush(self._retries, (expires, next(self._order), entry, entry.tries))
        if expires < self._timer_at:
            self._arm(expires)
        message, key = entry.message, entry.channel.key
        if key is not None:
            message = auth.seal_request(key, message)   # (each try sealed afresh)
            entry.stamps.append(message[-12:-8])
        try:
            self._sendto(message, (entry.channel.ip, entry.channel.port))
        except OSError:
            self.send_errors += 1       # (a full send buffer: the retry clock sends it again)

    # -- retry clocks
    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self.loop.call_at(when, self._sweep)

    def _sweep(self) -> None:
        """Every clock that has run out: its request's next try, or its
        failure (domus.client.transport's retry rule).  Replies already
        waiting in the socket are read first: a job that kept the loop busy
        must not see retries, or a ServiceUnavailable, for replies that did
        arrive in time."""
        self._timer = None
        self._timer_at = math.inf
        if self.closed:
            return
        self._readable()
        # (A loop may run a timer a little before its time: within a
        # millisecond counts as run out, or the sweep would spin.)
        now = self.loop.time() + 0.001
        due: list[_Pending] = []
        earliest = math.inf
        for fifo in list(self._fifos.values()):
            while fifo:
                expires, entry, tries = fifo[0]
                if entry.state == _SENT and entry.tries == tries:
                    if expires > now:
                        earliest = min(earliest, expires)
                        break
                    due.append(entry)
                fifo.popleft()
        retries = self._retries
        backed_off: list[_Pending] = []
        while retries and retries[0][0] <= now:
            _expires, _order, entry, tries = heapq.heappop(retries)
            if entry.tries == tries:
                if entry.state == _SENT:
                    due.append(entry)
                elif entry.state == _BACKING:
                    backed_off.append(entry)
        for entry in due:
            if entry.state == _SENT:    # (not failed with another meanwhile)
                self._expired(entry)
        for entry in backed_off:
            if entry.state == _BACKING:
                entry.state = _SENT
                if entry.channel.throttle.allow():
                    entry.timeout = entry.channel.first_timeout
                    self._send(entry)
                else:
                    self._busy(entry, held_back(entry.message))
        if retries:
            earliest = min(earliest, retries[0][0])
        if earliest < self._timer_at:   # (_expired's retries may have armed it)
            self._arm(earliest)

    def _expired(self, entry: _Pending) -> None:
        """domus.client.transport's retry rule (next_timeout)."""
        channel = entry.channel
        channel.timeouts += 1
        elapsed = self.loop.time() - entry.started
        timeout = next_timeout(entry.timeout, elapsed, channel.deadline)
        if timeout is None:
            # The service has not answered for a whole deadline: those still
            # waiting for its window fail with this one.
            doomed = [entry, *channel.waiting]
            channel.waiting.clear()
            self.forget(entry)
            what = (f"did not answer within {channel.deadline:.1f}s ({channel.retries} retries "
                    f"so far)")
            for request in doomed:
                request.state = _OVER
                if not request.future.done():
                    request.future.set_exception(
                        service_busy(channel.name, channel.address, channel.deadline,
                                     request.busy, request.dht, request.bucket)
                        if request.busy else
                        channel.unavailable(what, request.dht, request.bucket))
            return
        channel.retries += 1
        entry.timeout = timeout
        self._send(entry)

    def _busy(self, entry: _Pending, reply: bytes) -> None:
        """The service answered BUSY (or the client's throttle held the
        request back, domus.client.throttle): send the same request again
        after a backoff, keeping its window slot (so the channel slows
        down), or fail with ServiceBusy if that would pass the deadline."""
        channel = entry.channel
        entry.busy += 1
        channel.busy += 1
        pause = busy_backoff(entry.busy, reply)
        now = self.loop.time()
        if now - entry.started + pause >= channel.deadline:
            self.forget(entry)
            if not entry.future.done():
                entry.future.set_exception(service_busy(
                    channel.name, channel.address, channel.deadline, entry.busy, entry.dht,
                    entry.bucket))
            return
        entry.state = _BACKING
        entry.tries += 1                # (the clock of the try it answered no longer counts)
        expires = now + pause
        heapq.heappush(self._retries, (expires, next(self._order), entry, entry.tries))
        if expires < self._timer_at:
            self._arm(expires)

    def forget(self, entry: _Pending) -> None:
        """Take ``entry`` out of the table (or the queue) and free its slot."""
        state, entry.state = entry.state, _OVER
        if state in (_SENT, _BACKING):
            del self.pending[entry.request_id]
            channel = entry.channel
            channel.in_flight -= 1
            if channel.waiting:
                self._pump(channel)
        elif state == _QUEUED:
            try:
                entry.channel.waiting.remove(entry)
            except ValueError:
                pass

    # -- replies
    def _readable(self) -> None:
        """Read what the socket holds (at most READ_BATCH datagrams), or
        until no request is pending: a datagram that comes when none is
        (a late reply) wakes the loop again, and one request at a time
        does not pay for a read that fails each time."""
        recvfrom = self.sock.recvfrom   # type: ignore[union-attr]
        received = self.datagram_received
        pending = self.pending
        for _ in range(READ_BATCH):
            try:
                data, peer = recvfrom(MAX_PACKET)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                if self.closed:
                    return
                self.send_errors += 1   # (an ICMP error: the retry rule covers it)
                continue
            received(data, peer)
            if not pending:
                return

    def datagram_received(self, data: bytes, addr: Any) -> None:
        if len(data) < wire.REPLY_HEADER_SIZE or data[0] != wire.REPLY_MAGIC:
            self.stray += 1
            return
        entry = self.pending.get(data[4:8])
        if entry is None:
            self.late_replies += 1
            return
        key = entry.channel.key
        if key is not None:
            opened = auth.open_reply_to(key, data, entry.message, entry.stamps)
            if opened is None:
                self.unauthenticated += 1   # not the service's: wait on for its own
                return
            data = opened
        if data[2] == wire.ST_BUSY:
            entry.channel.throttle.answered(True)
            if entry.state == _SENT:    # (a BUSY for an earlier try while backing off: one wait)
                self._busy(entry, data)
            return
        entry.channel.throttle.taken += 1.0
        self.forget(entry)
        if entry.future.done():
            return
        if data[2] == wire.ST_REPLY_TOO_LARGE:
            self.loop.create_task(self._over_tcp(entry))
        else:
            entry.future.resolve(data)

    async def _over_tcp(self, entry: _Pending) -> None:
        try:
            reply = await entry.channel.request_tcp(entry.message, entry.dht, entry.bucket)
        except BaseException as exc:     # (handed to the request's caller)
            if not entry.future.done():
                entry.future.set_exception(exc)
            if not isinstance(exc, Exception):
                raise
        else:
            if entry.message[2] == wire.OP_GET \
                    and reply_size(reply) > wire.DEFAULT_MAX_DATAGRAM:
                entry.channel.get_over_tcp = True
            if not entry.future.done():
                entry.future.set_result(reply)

    def close(self) -> None:
        """Fail what is outstanding and close the socket."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._fifos.clear()
        self._retries.clear()
        entries = list(self.pending.values())
        self.pending.clear()
        for channel in self.channels:
            entries.extend(channel.waiting)
            channel.waiting.clear()
            channel.in_flight = 0
        for entry in entries:
            entry.state = _OVER
            if not entry.future.done():
                entry.future.set_exception(DomusError(
                    f"the asyncio Domus client was closed before service {entry.channel.name} "
                    f"answered"))
        sock, self.sock = self.sock, None
        if sock is not None:
            if not self.loop.is_closed():
                self.loop.remove_reader(sock.fileno())
            sock.close()


class AioChannel(EventedChannel):
    """Requests to one service: over the client's UDP socket, or over this
    channel's own TCP connection when a message does not fit a datagram."""

    def __init__(self, name: str, address: str, *, requests: DatagramRequests,
                 deadline: float, first_timeout: float = FIRST_TIMEOUT,
                 keys: Keys | None = None) -> None:
        super().__init__(name, address, requests=requests, deadline=deadline,
                         first_timeout=first_timeout, keys=keys)
        self.requests: DatagramRequests = requests
        try:
            self.ip: str | None = str(ipaddress.IPv4Address(self.host))
        except ValueError:
            self.ip = None
        self._resolving = False
        self._tcp: _Link | None = None
        self._tcp_opening: asyncio.Lock | None = None
        # A GET whose reply was past a datagram (REPLY_TOO_LARGE over UDP,
        # then TCP): the next GETs go over TCP at once, until one's reply
        # would have fitted a datagram (as the blocking client's do).
        self.get_over_tcp = False

    def request(self, message: bytes, dht: str = "", bucket: int | None = None) -> Any:
        if message[2] == wire.OP_GET and self.get_over_tcp \
                and len(message) <= wire.DEFAULT_MAX_DATAGRAM - auth.REQUEST_TRAILER:
            return self._get_over_tcp(message, dht, bucket)
        return super().request(message, dht, bucket)

    async def _get_over_tcp(self, message: bytes, dht: str, bucket: int | None) -> bytes:
        reply = await self.request_tcp(message, dht, bucket)
        if reply_size(reply) <= wire.DEFAULT_MAX_DATAGRAM:
            self.get_over_tcp = False
        return reply

    def resolve(self) -> None:
        """Find the service host's IPv4 address, then send what waits."""
        if not self._resolving:
            self._resolving = True
            self.requests.loop.create_task(self._resolve())

    async def _resolve(self) -> None:
        try:
            found = await self.requests.loop.getaddrinfo(self.host, self.port,
                                                         family=socket.AF_INET,
                                                         type=socket.SOCK_DGRAM)
            self.ip = found[0][4][0]
        except OSError as exc:
            waiting, self.waiting = self.waiting, deque()
            for entry in waiting:
                if not entry.future.done():
                    entry.future.set_exception(self.unavailable(
                        f"cannot be reached: host {self.host!r} does not resolve ({exc})",
                        entry.dht, entry.bucket))
        finally:
            self._resolving = False
        if self.ip is not None:
            self.requests._pump(self)

    async def request_tcp(self, message: bytes, dht: str = "",
                          bucket: int | None = None) -> bytes:
        for attempt in (1, 2):
            link = None
            try:
                link = await self._connect()
                return await self._exchange_while_busy(link, message, dht, bucket)
            except AuthenticationError:
                raise
            except TimeoutError as exc:
                raise self.unavailable(f"failed over TCP (no answer within "
                                       f"{self.deadline:.1f}s{': ' if str(exc) else ''}{exc})",
                                       dht, bucket) from None
            except (OSError, ConnectionError, ProtocolError) as exc:
                # One reconnect (the service may have restarted); a retry of
                # a change is answered from the service's reply cache.
                if link is not None and link is self._tcp:
                    self._tcp = None
                if attempt == 2:
                    raise self.unavailable(f"failed over TCP ({exc})", dht, bucket) from None
        raise AssertionError("unreachable")

    def _exchange_while_busy(self, link: _Link, message: bytes, dht: str,
                             bucket: int | None) -> Awaitable[bytes]:
        """One TCP request, sent again after a backoff while the service
        answers BUSY, within the deadline; then ServiceBusy."""
        return self._while_busy(lambda: link.exchange(message, self.deadline), dht, bucket,
                                self.requests.loop.time, asyncio.sleep)

    async def _connect(self) -> _Link:
        if self._tcp is not None and not self._tcp.closed:
            return self._tcp
        if self._tcp_opening is None:
            self._tcp_opening = asyncio.Lock()
        async with self._tcp_opening:
            if self._tcp is None or self._tcp.closed:
                self._tcp = await _Link.open(self.host, self.port, self.keys,
                                             f"service {self.name} ({self.address})",
                                             self.deadline)
            return self._tcp

    def close(self) -> None:
        if self._tcp is not None:
            self._tcp.close()
            self._tcp = None


# ------------------------------------------------------------ the cluster

class _Connecting:
    """What ``connect()`` returns: await it for the cluster, or use it as
    ``async with`` (the cluster closed on the way out)."""

    def __init__(self, opening: Any) -> None:
        self._opening = opening
        self._cluster: AioCluster | None = None

    def __await__(self) -> Generator[Any, None, AioCluster]:
        return self._opening().__await__()

    async def __aenter__(self) -> AioCluster:
        self._cluster = await self._opening()
        return self._cluster

    async def __aexit__(self, *exc: object) -> None:
        if self._cluster is not None:
            await self._cluster.close()


def connect(address: str | None = None, *, timeout: float = DEFAULT_TIMEOUT,
            window: int = WINDOW, secret_file: str | None = None) -> _Connecting:
    """Connect to a deployment's supervisor: ``address`` (HOST:PORT), else
    $DOMUS_SUPERVISOR, else 127.0.0.1:7700.  ``await connect(...)`` gives an
    AioCluster (close it with ``await cluster.close()``); ``async with
    connect(...) as cluster`` closes it on the way out.  ``timeout`` bounds
    every call (SupervisorUnreachable, ServiceUnavailable); ``secret_file``
    as domus.connect's (AuthenticationError when it is wrong or missing);
    ``window``: datagrams in flight per service."""

    async def opening() -> AioCluster:
        cluster = AioCluster(addresses.supervisor_address(address), timeout, window=window,
                             secret_file=secret_file)
        try:
            await cluster.requests.open()
            await cluster.ping()
        except BaseException:
            await cluster.close()
            raise
        return cluster

    return _Connecting(opening)


class AioCluster:
    """A connection to one Domus deployment, for one asyncio event loop."""

    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT, *,
                 window: int = WINDOW, secret_file: str | None = None) -> None:
        self.address = address
        self.host, self.port = addresses.parse(address)
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.keys = secret.keys(secret_file)
        self.secure = False             # (the supervisor's handshake said so)
        self.ids = RequestIds()
        self.requests = DatagramRequests(self.loop, window)
        self._channels: dict[tuple[str, str], AioChannel] = {}
        self._link: _Link | None = None
        self._link_lock = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"<domus.aio.AioCluster supervisor={self.address}>"

    async def __aenter__(self) -> AioCluster:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def channel(self, name: str, address: str) -> AioChannel:
        """The (shared) channel to a service, by name and address."""
        key = (name, address)
        channel = self._channels.get(key)
        if channel is None:
            channel = self._channels[key] = AioChannel(
                name, address, requests=self.requests, deadline=self.timeout,
                keys=self.keys if self.secure else None)
        return channel

    # -- the supervisor link
    async def _supervisor(self) -> _Link:
        if self._closed:
            raise SupervisorUnreachable("this asyncio Domus client is closed; connect again")
        if self._link is None or self._link.closed:
            try:
                self._link = await _Link.open(self.host, self.port, self.keys,
                                              f"the supervisor at {self.address}", self.timeout)
            except AuthenticationError:
                raise
            except TimeoutError:
                raise SupervisorUnreachable(
                    f"the Domus supervisor at {self.address} did not answer within "
                    f"{self.timeout:.1f}s; is it running (`domus up` or `domus supervisor`) "
                    f"and not overloaded?") from None
            except (OSError, ConnectionError, ProtocolError) as exc:
                raise SupervisorUnreachable(
                    f"cannot reach the Domus supervisor at {self.address}: "
                    f"{getattr(exc, 'strerror', None) or exc}; is it running (`domus up` or "
                    f"`domus supervisor`)? Pass its HOST:PORT or set DOMUS_SUPERVISOR") from None
            self.secure = self._link.session is not None
        return self._link

    async def call(self, op: str, timeout: float | None = None, **params: Any) -> Any:
        """Run control op ``op`` on the supervisor: its result, or the
        matching domus.errors exception.  As the other clients: a read-only
        op is sent again once if the connection breaks; a change is not (it
        may have been applied)."""
        wait = timeout or self.timeout
        async with self._link_lock:
            for attempt in (1, 2) if op in READ_ONLY_CONTROL else (2,):
                link = await self._supervisor()
                request_id = self.ids.next()
                message = wire.encode_control(request_id, self.ids.client_id,
                                              {"op": op, **params})
                try:
                    frame = await link.exchange(message, wait)
                except TimeoutError:
                    raise SupervisorUnreachable(
                        f"the Domus supervisor at {self.address} did not answer {op!r} within "
                        f"{wait:.1f}s; check that it is running and not overloaded") from None
                except (OSError, ConnectionError, ProtocolError):
                    if attempt == 2:
                        raise SupervisorUnreachable(
                            f"lost the connection to the Domus supervisor at {self.address} "
                            f"during {op!r} (if it changed something, it may or may not have "
                            f"been applied: check before retrying); is it running?") from None
                    continue        # one reconnect: the supervisor may have restarted
                status, _reply_id = wire.decode_reply_header(frame)
                return control_result(op, status, frame)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Close every connection and socket; outstanding requests fail."""
        self._closed = True
        self.requests.close()
        if self._link is not None:
            self._link.close()
            self._link = None
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    # -- the deployment
    async def ping(self) -> dict[str, Any]:
        return await self.call("ping")

    async def status(self) -> dict[str, Any]:
        return await self.call("status")

    async def services(self) -> list[dict[str, Any]]:
        """As Cluster.services."""
        return await self.call("services")

    async def balancer_status(self) -> dict[str, Any]:
        return await self.call("balancer_status")

    # -- DHTs
    async def create_dht(self, name: str, *, exist_ok: bool = False,
                         **attributes: Any) -> AioDht:
        """Create a DHT and open it; the attributes of Cluster.create_dht
        (buckets, hash, storage, platform, routing, lookup, replicas,
        codec, ...), and ``exist_ok`` as there (the existing DHT if its
        attributes are these; one being created is waited for)."""
        request = create_request(name, **attributes)
        extra = {"exist_ok": True} if exist_ok else {}
        descriptor = await self.call("create_dht", name=name, attributes=request,
                                     timeout=max(self.timeout, 15.0), **extra)
        return AioDht(self, descriptor)

    async def open_dht(self, name: str, *, lookup: str | None = None,
                       cache: float | None = None, direct_cutoff: int | None = None) -> AioDht:
        """Open an existing DHT; ``lookup``, ``cache`` and ``direct_cutoff``
        as for Cluster.open_dht."""
        if lookup is not None:
            check_strategy(lookup)
        descriptor = await self.call("open_dht", name=name)
        return AioDht(self, descriptor, lookup=lookup, cache=cache, direct_cutoff=direct_cutoff)

    async def list_dhts(self) -> list[dict[str, Any]]:
        return await self.call("list_dhts")

    async def dht_info(self, name: str) -> dict[str, Any]:
        return await self.call("dht_info", name=name)

    async def destroy_dht(self, name: str) -> None:
        await self.call("destroy_dht", name=name)

    async def deactivate_dht(self, name: str) -> dict[str, int]:
        """As Cluster.deactivate_dht."""
        answer = await self.call("deactivate_dht", name=name,
                                 timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))
        return answer["records"]

    async def activate_dht(self, name: str) -> dict[str, int]:
        """As Cluster.activate_dht."""
        answer = await self.call("activate_dht", name=name,
                                 timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))
        return answer["records"]

    async def move_bucket(self, name: str, bucket: int, *, routing: str | None = None,
                          storage: str | None = None) -> dict[str, Any]:
        """As Cluster.move_bucket."""
        role, service = move_target(routing, storage)
        return await self.call("move_bucket", name=name, bucket=bucket, role=role,
                               service=service, timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))

    async def rebalance(self, name: str, dry_run: bool = False) -> list[dict[str, Any]]:
        """As Cluster.rebalance."""
        answer = await self.call("rebalance", name=name, dry_run=dry_run,
                                 timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))
        return answer["moves"]

    async def resize_dht(self, name: str, buckets: int) -> dict[str, Any]:
        """As Cluster.resize_dht."""
        return await self.call("resize_dht", name=name, buckets=buckets,
                               timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))

    async def accept_loss(self, name: str) -> list[int]:
        """As Cluster.accept_loss."""
        return (await self.call("accept_loss", name=name))["accepted"]

    async def dht_services(self, name: str, *, add: Iterable[str] = (),
                           remove: Iterable[str] = (),
                           roles: Iterable[str] = ("routing", "storage")) -> list[dict[str, Any]]:
        """As Cluster.dht_services."""
        answer = await self.call("dht_services", name=name, add=list(add), remove=list(remove),
                                 roles=list(roles),
                                 timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))
        return answer["moves"]

    async def drain_service(self, name: str) -> dict[str, Any]:
        """As Cluster.drain_service."""
        return await self.call("drain_service", name=name,
                               timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))

    async def remove_service(self, name: str, force: bool = False) -> dict[str, Any]:
        """As Cluster.remove_service."""
        return await self.call("remove_service", name=name, force=force,
                               timeout=max(self.timeout, STATE_CHANGE_TIMEOUT))


class AioDht(EventedDht[AioChannel]):
    """One DHT; every data operation is a coroutine (domus.client.evented's
    requests, on the running asyncio loop)."""

    def __init__(self, cluster: AioCluster, descriptor: dict[str, Any],
                 **options: Any) -> None:
        self._fetches = 0
        self._refreshing: asyncio.Task | None = None
        super().__init__(cluster, descriptor, **options)

    # -- the loop's primitives (domus.client.evented)
    def _sleep(self, seconds: float) -> Awaitable[None]:
        return asyncio.sleep(seconds)

    def _now(self) -> float:
        return self.cluster.loop.time()

    def _gather(self, awaitables: list[Any]) -> Awaitable[list[Any]]:
        return asyncio.gather(*awaitables)

    # -- layout
    def _start_fetch(self) -> asyncio.Task:
        if self._refreshing is None:
            self._fetches += 1
            self._counters["refreshes"] += 1
            task = self._refreshing = self.cluster.loop.create_task(self._fetch())
            task.add_done_callback(self._fetched)
        return self._refreshing

    async def _fetch(self) -> None:
        try:
            descriptor = await self.cluster.call("open_dht", name=self.name)
        except UnknownDht:
            raise UnknownDht(f"DHT {self.name!r} no longer exists (destroyed?); "
                             f"create or open it again") from None
        self._load(descriptor)

    def _fetched(self, task: asyncio.Task) -> None:
        if self._refreshing is task:
            self._refreshing = None
        if not task.cancelled():
            task.exception()            # (retrieved: its awaiters, if any, get it)

    def refresh(self) -> Awaitable[None]:
        """Fetch the DHT's layout from the supervisor again (a fetch under
        way is shared by every caller)."""
        return asyncio.shield(self._start_fetch())

    def _join_refresh(self) -> Awaitable[None]:
        return asyncio.shield(self._refreshing)   # type: ignore[arg-type]

    def _refresh_soon(self) -> None:
        self._start_fetch()             # (in the background; a failure is dropped)

    # -- single keys
    async def put(self, key: Any, value: Any) -> bool:
        """Store ``value`` under ``key``; True if the key was new."""
        return await self._put(key, value)

    async def get(self, key: Any, default: Any = None) -> Any:
        """The value of ``key``, or ``default`` if it is absent."""
        return await self._get(key, default, raise_missing=False)

    async def getitem(self, key: Any) -> Any:
        """The value of ``key``; KeyError if it is absent."""
        return await self._get(key, None, raise_missing=True)

    async def delete(self, key: Any) -> bool:
        """Remove ``key``; True if it was there."""
        return await self._answer(wire.OP_DELETE, key)

    async def contains(self, key: Any) -> bool:
        """Whether ``key`` is stored."""
        return await self._answer(wire.OP_CONTAINS, key)

    async def pop(self, key: Any, default: Any = MISSING) -> Any:
        """Remove ``key`` and return its value; ``default`` if it is not
        there (KeyError without one).  Read, then deleted on the service
        only if it is still the value read (else read again): of clients
        popping one key at once exactly one gets its value, and a value
        written in between is never deleted unseen."""
        return await self._pop(key, default)

    async def setdefault(self, key: Any, default: Any = None) -> Any:
        """The value of ``key``; if it is not there, ``default``, stored
        under it in one step on the service: of clients setting a default
        for one key at once, one stores its own and the others get it."""
        return await self._setdefault(key, default)

    # -- batches
    async def put_many(self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]]) -> int:
        """Store many records, one message per service where they fit in a
        datagram (more where they do not), all sent at once.  Returns how
        many keys were new.  Either every key and value is valid and all
        are sent, or none is."""
        return await self._put_many(items)

    async def get_many(self, keys: Iterable[Any]) -> dict[Any, Any]:
        """The values of the keys that are present (absent keys are left out)."""
        return await self._get_many(keys)

    # -- whole DHT
    async def length(self) -> int:
        """The number of records in the DHT."""
        return sum((await self._records_by_service()).values())

    async def records_by_service(self) -> dict[str, int]:
        """How many records each storage service holds of this DHT."""
        return await self._records_by_service()

    async def keys(self) -> AsyncIterator[Any]:
        """Every key, bucket by bucket (as the blocking client's iteration:
        a key present throughout is seen once)."""
        async for key, _value in self._scan():
            yield decode_key(key)

    async def items(self) -> AsyncIterator[tuple[Any, Any]]:
        """Every (key, value), bucket by bucket."""
        async for key, value in self._scan():
            key = decode_key(key)
            yield key, self._value_of(key, value)

    async def values(self) -> AsyncIterator[Any]:
        """Every value, bucket by bucket."""
        async for key, value in self._scan():
            try:
                yield self._values.unpack_at(value, 0)
            except ValueDecodeError as exc:
                raise exc.with_key(decode_key(key)).with_dht(self.name) from None

    def __aiter__(self) -> AsyncIterator[Any]:
        return self.keys()

    # -- key ranges
    def irange(self, lo: Any = None, hi: Any = None, *,
               inclusive: tuple[bool, bool] = (True, True), reverse: bool = False,
               items: bool = False) -> AsyncIterator[Any]:
        """An asynchronous iterator over the keys from ``lo`` to ``hi``
        (None: unbounded) in key order, or over (key, value) pairs if
        ``items``; descending if ``reverse``; ``inclusive`` says whether
        each bound belongs to the range::

            async for key, value in dht.irange("a", "b", items=True):
                ...

        As the blocking client's ``Dht.irange`` in every respect: key order
        (every int before every str before every bytes), a DHT on an
        ordered platform (``domus-rbt``, else the first step raises
        RemoteError saying so), pages asked for one service at a time as
        they are used up (the first of every service at once), not a
        snapshot (a key present throughout is yielded once, in order).
        Argument errors (a bound that is not a key) are raised here, at
        once, before anything is sent."""
        query = codec.range_query(self.id, lo, hi, inclusive, reverse, items)
        return self._irange(query, bool(items))

    async def _irange(self, query: wire.RangeQuery, items: bool) -> AsyncIterator[Any]:
        async for key, value in self._range(query):
            if items:
                key = decode_key(key)
                yield key, self._value_of(key, value)
            else:
                yield decode_key(key)

    def _value_of(self, key: Any, data: bytes) -> Any:
        """The value of ``key`` stored as ``data``, by this DHT's codec; a
        ValueDecodeError names the DHT and the key."""
        try:
            return self._values.unpack_at(data, 0)
        except ValueDecodeError as exc:
            raise exc.with_key(key).with_dht(self.name) from None

