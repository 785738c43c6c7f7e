"""The service's UDP data path: one non-blocking socket read straight from
the reactor.

The socket is registered with ``reactor.addReader``; when it is readable,
``doRead`` drains it.  With the C hot path, ``FastPath.serve`` reads each
datagram into a buffer, answers it and sends the reply to the peer without
making a Python object, and calls back into Python only for the datagrams it
declines (errors, control ops, ...), which the Python handler answers.
Without it, a Python loop does the same with ``recvfrom``/``sendto``.
The C path reads datagrams in batches (recvmmsg) and sends its replies
together (sendmmsg); the Python path reads one at a time.  Either way at
most ``MAX_DATAGRAMS`` per wake-up, so timers and TCP get their turn.

**The serving thread.**  With the C hot path and an epoll reactor (the
default on Linux), the socket is not read by the reactor at all: a C thread
(``FastPath.start_thread``) waits for datagrams without the GIL and handles
each batch holding the GIL and the *baton*, which the reactor thread holds
whenever it runs Python code and lets go of only while blocked in epoll
(``BatonPoller`` wraps the reactor's poller).  So a request is never served
while Python's state is half-updated, exactly as when the reactor read the
socket itself, and a request costs no reactor turn.  What C declines is
queued for the reactor thread, woken through an eventfd, and answered by
the Python handler as before.  ``DOMUS_SERVE_THREAD=0`` in the environment
(or ``UdpServer(..., serve_thread=False)``) keeps the socket on the reactor.

**What runs without the baton.**  Holding the baton, the reactor thread
stops the serving thread for as long as it runs Python: a timer that takes
5 ms is a 5 ms stall for every request that arrives meanwhile, and a
service's timers are cold code (on a VM, at a hundredth of their warm
speed: milliseconds every 0.1 s to look at the free disk space, tens of
milliseconds a second for the heartbeat's load sample: the p99 latency of
a busy service).  So work that changes nothing the C path reads (sampling the
process's and node's load, asking the filesystem for its free space,
writing to the supervisor's link) runs inside ``UdpServer.released()``:
the baton is let go of, and the serving thread handles batches
meanwhile, taking the GIL from the reactor thread within Python's switch
interval (5 ms; a lower one made things worse on a busy machine: a thread
that lets the GIL go on a switch request waits until the other has taken
it, and the serving thread then waited for the reactor thread to be
scheduled).  Anything that touches what C reads (the fast table, repositories, the
reply cache, a bucket's state) stays outside it.

A datagram or reply that is lost (a full socket buffer, an ICMP error from
an earlier peer) is counted and forgotten: the client retries it.

Bounds (domus.service.limits), the same on both paths:
- **Overload.** The socket stamps each datagram with its arrival time
  (SO_TIMESTAMPNS).  The service is *behind* when, for a whole interval
  (SHED_INTERVAL, 0.1 s), every datagram it read -- at least
  SHED_MIN_DATAGRAMS of them -- had waited longer than ``shed_after`` (a
  standing queue, as CoDel tells one from a burst), until
  an interval in which one waited less than half that; while behind, a
  datagram that waited longer than ``shed_after`` is answered BUSY without
  being served (``shed``): the client backs off, and the service spends its
  time on requests it can answer in time.  A burst, or a pause of the
  process, that drains within an interval sheds nothing.  A socket buffer
  that holds less than ``shed_after`` of work never lets a datagram wait
  that long: the kernel drops what does not fit, and clients would see
  timeouts rather than BUSY.  So an interval in which the kernel dropped
  datagrams (SO_RXQ_OVFL's count moved), with at least SHED_MIN_DATAGRAMS
  read, is behind too, and the limit past which a datagram is shed becomes
  half the longest wait of that interval (half what the full buffer
  holds) for as long as the service stays behind.
- **Amplification.** A reply to a request that does not parse (MALFORMED,
  BAD_VERSION, UNKNOWN_OP) is never larger than the request: its message
  is cut.  On an insecure deployment (where any source address can be
  spoofed) every reply is at most ``udp_reply_factor`` times the request;
  a larger one is answered REPLY_TOO_LARGE and the client asks over TCP.
  A secure deployment answers no datagram whose MAC does not check.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from twisted.internet.interfaces import IReadDescriptor
from twisted.logger import Logger
from twisted.python import threadable
from zope.interface import implementer

from domus.service.handler import RequestHandler
from domus.wire import auth
from domus.wire import protocol as wire

log = Logger(namespace="domus.service")

SERVE_THREAD = os.environ.get("DOMUS_SERVE_THREAD", "1") != "0"
SOCKET_BUFFER = 8 * 1024 * 1024
MAX_DATAGRAMS = 256
RECV_SIZE = 65536       # more than any UDP payload: no datagram is cut
_TIMESPEC = struct.Struct("@qq")
_DROPS = struct.Struct("@I")
_STAMP_SPACE = socket.CMSG_SPACE(_TIMESPEC.size) + socket.CMSG_SPACE(_DROPS.size)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)       # (Linux)
SO_RXQ_OVFL = getattr(socket, "SO_RXQ_OVFL", 40)             # (Linux)
SHED_INTERVAL = 0.1
SHED_MIN_DATAGRAMS = 32     # fewer an interval are late (an unscheduled process), not a queue
RETRY_AFTER_MAX = 2.0


class Shedder:
    """Whether a datagram is shed (see the module; the C path keeps the
    same state in FastPath)."""

    __slots__ = ("target", "interval_end", "interval_min", "interval_max", "interval_count",
                 "behind", "streak", "limit", "drops", "interval_drops")

    def __init__(self, target: float) -> None:
        self.target = target
        self.interval_end = 0.0
        self.interval_min = float("inf")
        self.interval_max = 0.0
        self.interval_count = 0
        self.behind = False
        self.streak = 0
        self.limit = target         # while behind, what waited longer is shed
        self.drops = 0              # the kernel's drop count, as last read
        self.interval_drops = 0     # ... as the interval began

    def retry_after(self) -> int:
        """A shed request's retry-after, in milliseconds: one interval,
        doubling with each interval behind in a row, up to 2 s."""
        return min(int(SHED_INTERVAL * 1000) << max(self.streak - 1, 0),
                   int(RETRY_AFTER_MAX * 1000))

    def shed(self, received: float, waited: float, drops: int | None = None) -> bool:
        """Whether to shed a datagram received at ``received`` that waited
        ``waited`` seconds, the kernel having dropped ``drops`` datagrams
        on this socket so far (None: not known)."""
        if drops is not None:
            self.drops = drops
        if received >= self.interval_end:
            if self.interval_end:
                limit = self.limit if self.behind else self.target
                enough = self.interval_count >= SHED_MIN_DATAGRAMS
                overflowed = enough and self.drops != self.interval_drops
                standing = enough and self.interval_min > (limit / 2 if self.behind else limit)
                self.behind = standing or overflowed
                if not self.behind:
                    limit = self.target
                elif overflowed:
                    limit = min(limit, max(self.interval_max / 2, 0.001))
                self.limit = limit
                self.streak = min(self.streak + 1, 6) if self.behind else 0
            self.interval_min = float("inf")
            self.interval_max = 0.0
            self.interval_count = 0
            self.interval_drops = self.drops
            self.interval_end = received + SHED_INTERVAL
        self.interval_count += 1
        if waited < self.interval_min:
            self.interval_min = waited
        if waited > self.interval_max:
            self.interval_max = waited
        return self.behind and waited > self.limit


# Errors a UDP socket reports about an earlier datagram (ICMP) or a passing
# shortage; the service goes on.
TRANSIENT_ERRORS = frozenset({
    errno.ECONNREFUSED, errno.ECONNRESET, errno.EHOSTUNREACH, errno.ENETUNREACH,
    errno.EHOSTDOWN, errno.ENETDOWN, errno.ETIMEDOUT, errno.EPROTO, errno.ENOPROTOOPT,
    errno.EMSGSIZE, errno.ENOBUFS, errno.ENOMEM, errno.EPERM, errno.EINTR,
})


def enlarge_buffers(sock: socket.socket, size: int = SOCKET_BUFFER) -> None:
    """Ask for big socket buffers (forcing past rmem_max when root), so that
    bursts of datagrams are queued rather than dropped."""
    for force, plain in ((getattr(socket, "SO_RCVBUFFORCE", None), socket.SO_RCVBUF),
                         (getattr(socket, "SO_SNDBUFFORCE", None), socket.SO_SNDBUF)):
        try:
            if force is None:
                raise PermissionError
            sock.setsockopt(socket.SOL_SOCKET, force, size)
        except OSError:
            try:
                sock.setsockopt(socket.SOL_SOCKET, plain, size)
            except OSError:
                pass


class BatonPoller:
    """A reactor's epoll object that lets go of ``baton`` while it waits
    (see the module): the reactor thread holds the baton at all other
    times."""

    def __init__(self, poller: Any, baton: Any) -> None:
        self.poller = poller
        self.baton = baton

    def poll(self, timeout: float = -1, maxevents: int = -1) -> list[tuple[int, int]]:
        self.baton.release()
        try:
            return self.poller.poll(timeout, maxevents)  # type: ignore[no-any-return]
        finally:
            self.baton.acquire()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.poller, name)


def reactor_baton(reactor: Any) -> Any:
    """The baton of ``reactor``, wrapping its poller on first use (called on
    the reactor thread, which then holds it), or None if the reactor does
    not wait in an epoll object of its own (only an epoll reactor's waits
    can be wrapped)."""
    from domus._hotpath import Baton

    poller = getattr(reactor, "_poller", None)
    if isinstance(poller, BatonPoller):
        return poller.baton
    if not isinstance(poller, select.epoll):
        return None
    if getattr(reactor, "running", False) and not threadable.isInIOThread():
        return None     # (the baton must be taken on the reactor's own thread)
    baton = Baton()
    baton.acquire()
    reactor._poller = BatonPoller(poller, baton)
    return baton


@implementer(IReadDescriptor)
class _Waker:
    """The reactor's side of the serving thread: reads the eventfd the
    thread writes when it queued datagrams, and answers them."""

    def __init__(self, server: UdpServer, fd: int) -> None:
        self.server = server
        self.fd = fd

    def fileno(self) -> int:
        return self.fd

    def logPrefix(self) -> str:
        return f"{self.server.handler.service_name} UDP thread"

    def connectionLost(self, reason: Any) -> None:
        pass

    def doRead(self) -> None:
        try:
            os.eventfd_read(self.fd)
        except BlockingIOError:
            pass
        self.server._answer_queued()


@implementer(IReadDescriptor)
class UdpServer:
    """Serves ``handler`` on a UDP socket bound to (host, port); from a C
    serving thread when ``serve_thread`` (default: unless
    DOMUS_SERVE_THREAD=0) and the C path and the reactor allow it."""

    def __init__(self, handler: RequestHandler, host: str, port: int,
                 serve_thread: bool | None = None) -> None:
        self.handler = handler
        self.serve_thread = SERVE_THREAD if serve_thread is None else serve_thread
        self.threaded = False       # whether a serving thread reads the socket now
        self._queue: list[Any] = []
        self._waker: _Waker | None = None
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.socket.setblocking(False)
            self.socket.bind((host, port))
        except BaseException:
            self.socket.close()
            raise
        enlarge_buffers(self.socket)
        limits = handler.limits
        self.shed_after = limits.shed_after
        self.shedder = Shedder(self.shed_after)
        self.reply_factor = limits.udp_reply_factor
        if self.shed_after > 0:
            self.socket.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            try:
                self.socket.setsockopt(socket.SOL_SOCKET, SO_RXQ_OVFL, 1)
            except OSError:     # (not Linux: the queue's length alone tells)
                pass
        fast = handler.fast
        if fast is not None:
            fast.shed_after_ns = int(self.shed_after * 1e9)
            fast.reply_factor = self.reply_factor
        self.address = self.socket.getsockname()
        self._fd = self.socket.fileno()
        self._reactor: Any = None
        self._baton: Any = None
        self.send_errors = 0        # Python-path counts; the C ones are in handler.fast
        self.recv_errors = 0
        self.bytes_received = 0     # datagrams read in Python (C counts those serve() reads)
        self.bytes_sent = 0         # replies sent from Python (the C path's fallbacks too)

    # ------------------------------------------------------------ lifecycle
    def start(self, reactor: Any) -> None:
        """Serve from ``reactor`` (called on its thread)."""
        self._reactor = reactor
        fast = self.handler.fast
        baton = reactor_baton(reactor) if fast is not None and self.serve_thread else None
        if baton is None:
            reactor.addReader(self)
            return
        fast.spin_ns = int(self.handler.limits.spin * 1e9)
        wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._waker = _Waker(self, wake)
        reactor.addReader(self._waker)
        try:
            fast.start_thread(self._fd, self._queue, wake, baton)
        except BaseException:
            self._close_waker()
            raise
        self._baton = baton
        self.threaded = True

    @contextmanager
    def released(self) -> Iterator[None]:
        """Run the body without the baton, so that the serving thread
        serves meanwhile (see the module): for code on the reactor thread
        that changes nothing the C path reads.  Without a serving thread,
        or on a thread that does not hold the baton, it changes nothing."""
        baton = self._baton if self.threaded else None
        if baton is None or not baton.held:
            yield
            return
        baton.release()
        try:
            yield
        finally:
            baton.acquire()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Run the body holding the baton, from inside ``released()`` (a
        timer that runs released takes it for what changes what the C path
        reads).  Where the baton is held already, or there is none, it
        changes nothing."""
        baton = self._baton
        if baton is None or baton.held:
            yield
            return
        baton.acquire()
        try:
            yield
        finally:
            baton.release()

    def _close_waker(self) -> None:
        if self._waker is not None:
            if self._reactor is not None:
                self._reactor.removeReader(self._waker)
            os.close(self._waker.fd)
            self._waker = None

    def _stop_thread(self) -> None:
        """Stop the serving thread and answer what it left queued."""
        if self.threaded:
            self.threaded = False
            self.handler.fast.stop_thread()
            self._answer_queued()
        self._close_waker()

    def stop(self) -> None:
        """Stop reading and close the socket (idempotent)."""
        self._stop_thread()
        if self._reactor is not None:
            self._reactor.removeReader(self)
            self._reactor = None
        if self._fd != -1:
            self._fd = -1
            self.socket.close()

    def _answer_queued(self) -> None:
        """Answer the datagrams the serving thread declined (on the reactor
        thread, holding the baton).  An OSError in the queue stopped the
        thread: the reactor reads the socket from now on."""
        queued = self._queue[:]
        del self._queue[:]
        for item in queued:
            if isinstance(item, BaseException):
                self.handler.counters["internal_errors"] += 1
                log.error("service {service}: the UDP serving thread stopped ({error}); "
                          "the reactor reads the socket now",
                          service=self.handler.service_name, error=item)
                if self.threaded:
                    self.threaded = False
                    self.handler.fast.stop_thread()
                    if self._reactor is not None and self._fd != -1:
                        self._reactor.addReader(self)
                continue
            try:
                if isinstance(item, int):       # a replicated change's turn (handler.claim)
                    self.handler.claim_ready(item)
                elif len(item) == 4:            # one C sent to its backups, handed back
                    data, peer, stamp, outcome = item
                    answer = self.handler.forwarded(data, outcome, self._limit(data, stamp))
                    self._send_later(answer, peer, data, stamp)
                else:
                    self._answer_in_python(*item)
            except Exception:
                self.handler.counters["internal_errors"] += 1
                log.failure("service {service}: error serving UDP",
                            service=self.handler.service_name)

    # ------------------------------------------------------------ IReadDescriptor
    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return f"{self.handler.service_name} UDP"

    def connectionLost(self, reason: Any) -> None:
        """The reactor gave up on the socket (it reported an error).  Unless
        it was closed on purpose, clear the error and keep serving."""
        reactor = self._reactor
        if reactor is None or self._fd == -1 or self.threaded:
            return
        try:
            pending = self.socket.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        except OSError:
            pending = 0
        log.warn("service {service}: the reactor dropped the UDP socket ({reason}, "
                 "errno {errno}); serving it again", service=self.handler.service_name,
                 reason=reason.getErrorMessage() if hasattr(reason, "getErrorMessage")
                 else reason, errno=pending)
        reactor.callLater(0, self._resume, reactor)

    def _resume(self, reactor: Any) -> None:
        if self._reactor is reactor and self._fd != -1:
            reactor.addReader(self)

    def doRead(self) -> None:
        """Drain the socket.  Returns None whatever happens: anything else
        would make the reactor drop the socket."""
        try:
            fast = self.handler.fast
            if fast is not None:
                fast.serve(self._fd, self._answer_in_python, MAX_DATAGRAMS)
            else:
                self._drain_in_python()
        except Exception:
            self.handler.counters["internal_errors"] += 1
            log.failure("service {service}: error serving UDP",
                        service=self.handler.service_name)

    # ------------------------------------------------------------ the Python path
    def _limit(self, data: bytes, stamp: bytes | None) -> int:
        """The largest reply to ``data`` (see the module)."""
        if stamp is not None:
            return wire.MAX_UDP_PAYLOAD - auth.REPLY_TRAILER
        if self.reply_factor > 0:
            return min(wire.MAX_UDP_PAYLOAD, len(data) * self.reply_factor)
        return wire.MAX_UDP_PAYLOAD

    def _answer_in_python(self, data: bytes, peer: Any, stamp: bytes | None = None) -> None:
        """A datagram the C path left to Python: without its trailer, and
        ``stamp``, its time, on a secure deployment (its MAC checked)."""
        if stamp is not None and not auth.fresh(stamp):
            self._send_later(self.handler.stale(data), peer, data, stamp)
            return
        answer = self.handler.handle(data, self._limit(data, stamp))
        if isinstance(answer, bytes):
            self._send_later(answer, peer, data, stamp)
        elif answer is not None:                # (a replicated change: later)
            answer.addCallback(self._send_later, peer, data, stamp)

    def _bounded(self, answer: bytes, request: bytes, stamp: bytes | None) -> bytes:
        """``answer`` within the bounds on replies to ``request``."""
        if len(answer) <= len(request):
            return answer
        status = answer[2] if len(answer) > 2 else 0
        if status in wire.MALFORMED_STATUSES:
            return trim(answer, len(request))
        limit = self._limit(request, stamp)
        if len(answer) <= limit:
            return answer
        # (An OK reply a handler made too large, a redirect, a STATS map:
        # the client asks again over TCP.)
        return trim(bytes((wire.REPLY_MAGIC, wire.VERSION, wire.ST_REPLY_TOO_LARGE, answer[3]))
                    + answer[4:8] + b"the reply is over this datagram's bound; ask over TCP",
                    limit)

    def _send_later(self, answer: bytes | None, peer: Any, request: bytes = b"",
                    stamp: bytes | None = None) -> None:
        if self._fd == -1 or answer is None:
            return
        if request:
            answer = self._bounded(answer, request, stamp)
        if stamp is not None:
            answer = auth.seal_reply(self.handler.data_key, answer,  # type: ignore[arg-type]
                                     request[8:16], stamp)
        try:
            self.bytes_sent += self.socket.sendto(answer, peer)
        except OSError:
            self.send_errors += 1  # the client retries

    def _shed(self, ancillary: list[tuple[int, int, bytes]]) -> bool:
        received = received_at(ancillary)
        if received is None:
            return False
        return self.shedder.shed(received, time.time() - received, kernel_drops(ancillary))

    def _drain_in_python(self) -> None:
        recvmsg = self.socket.recvmsg
        sendto = self.socket.sendto
        handle = self.handler.handle
        shed_after = self.shed_after
        for _ in range(MAX_DATAGRAMS):
            try:
                data, ancillary, _flags, peer = recvmsg(RECV_SIZE, _STAMP_SPACE)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in TRANSIENT_ERRORS:
                    raise
                self.recv_errors += 1
                continue
            self.bytes_received += len(data)
            key = self.handler.data_key
            stamp: bytes | None = None
            if key is not None:
                opened = auth.open_request(key, data)
                if opened is None:
                    self.handler.counters["unauthenticated"] += 1
                    continue
                data, stamp = opened
            if (shed_after > 0 and len(data) >= wire.REQUEST_HEADER_SIZE
                    and data[0] == wire.REQUEST_MAGIC
                    and (stamp is None or auth.fresh(stamp))
                    and self._shed(ancillary)):
                self.handler.counters["shed"] += 1
                self._send_later(bytes((wire.REPLY_MAGIC, wire.VERSION, wire.ST_BUSY, 0))
                                 + data[4:8] + wire.U16.pack(self.shedder.retry_after()),
                                 peer, data, stamp)
                continue
            if key is not None:
                self._answer_in_python(data, peer, stamp)
                continue
            answer = handle(data, self._limit(data, None))
            if isinstance(answer, bytes):
                try:
                    self.bytes_sent += sendto(self._bounded(answer, data, None), peer)
                except OSError:
                    self.send_errors += 1
            elif answer is not None:
                answer.addCallback(self._send_later, peer, data)


def received_at(ancillary: list[tuple[int, int, bytes]]) -> float | None:
    """A datagram's SO_TIMESTAMPNS arrival time (seconds since the epoch),
    or None without one."""
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS \
                and len(payload) >= _TIMESPEC.size:
            seconds, nanoseconds = _TIMESPEC.unpack_from(payload)
            return seconds + nanoseconds / 1e9
    return None


def kernel_drops(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The count of datagrams the kernel dropped on this socket (its
    buffer full) that SO_RXQ_OVFL adds to a datagram, or None."""
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == SO_RXQ_OVFL and len(payload) >= _DROPS.size:
            return _DROPS.unpack_from(payload)[0]
    return None


def trim(answer: bytes, size: int) -> bytes:
    """An error reply cut to at most ``size`` bytes (at least its header),
    its message cut at a character boundary."""
    if len(answer) <= size:
        return answer
    head = answer[:wire.REPLY_HEADER_SIZE]
    body = answer[wire.REPLY_HEADER_SIZE:max(size, wire.REPLY_HEADER_SIZE)]
    return head + body.decode("utf-8", "ignore").encode("utf-8")
