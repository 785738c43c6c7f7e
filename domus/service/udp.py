"""The service's UDP data path: one non-blocking socket read straight from
the reactor.

The socket is registered with ``reactor.addReader``; when it is readable,
``doRead`` drains it.  With the C hot path, ``FastPath.serve`` reads each
datagram into a buffer, answers it and sends the reply to the peer without
making a Python object, and calls back into Python only for the datagrams it
declines (errors, control ops, ...), which the Python handler answers.
Without it, a Python loop does the same with ``recvfrom``/``sendto``.
Either way: one recvfrom and one sendto per datagram, at most
``MAX_DATAGRAMS`` per wake-up so timers and TCP get their turn.

A datagram or reply that is lost (a full socket buffer, an ICMP error from
an earlier peer) is counted and forgotten: the client retries it.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

from twisted.internet.interfaces import IReadDescriptor
from twisted.logger import Logger
from zope.interface import implementer

from domus.service.handler import RequestHandler
from domus.wire import auth
from domus.wire import protocol as wire

log = Logger(namespace="domus.service")

SOCKET_BUFFER = 8 * 1024 * 1024
MAX_DATAGRAMS = 256
RECV_SIZE = 65536       # more than any UDP payload: no datagram is cut
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


@implementer(IReadDescriptor)
class UdpServer:
    """Serves ``handler`` on a UDP socket bound to (host, port)."""

    def __init__(self, handler: RequestHandler, host: str, port: int) -> None:
        self.handler = handler
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_DGRAM)
        try:
            self.socket.setblocking(False)
            self.socket.bind((host, port))
        except BaseException:
            self.socket.close()
            raise
        enlarge_buffers(self.socket)
        self.address = self.socket.getsockname()
        self._fd = self.socket.fileno()
        self._reactor: Any = None
        self.send_errors = 0        # Python-path counts; the C ones are in handler.fast
        self.recv_errors = 0
        self.bytes_received = 0     # datagrams read in Python (C counts those serve() reads)
        self.bytes_sent = 0         # replies sent from Python (the C path's fallbacks too)

    # ------------------------------------------------------------ lifecycle
    def start(self, reactor: Any) -> None:
        self._reactor = reactor
        reactor.addReader(self)

    def stop(self) -> None:
        """Stop reading and close the socket (idempotent)."""
        if self._reactor is not None:
            self._reactor.removeReader(self)
            self._reactor = None
        if self._fd != -1:
            self._fd = -1
            self.socket.close()

    # ------------------------------------------------------------ IReadDescriptor
    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return f"{self.handler.service_name} UDP"

    def connectionLost(self, reason: Any) -> None:
        """The reactor gave up on the socket (it reported an error).  Unless
        it was closed on purpose, clear the error and keep serving."""
        reactor = self._reactor
        if reactor is None or self._fd == -1:
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
    def _answer_in_python(self, data: bytes, peer: Any, stamp: bytes | None = None) -> None:
        """A datagram the C path left to Python: without its trailer, and
        ``stamp``, its time, on a secure deployment (its MAC checked)."""
        key = self.handler.data_key
        if stamp is not None and not auth.fresh(stamp):
            self._send_later(self.handler.stale(data), peer, data, stamp)
            return
        answer = self.handler.handle(data, wire.MAX_UDP_PAYLOAD - (key is not None)
                                     * auth.REPLY_TRAILER)
        if isinstance(answer, bytes):
            self._send_later(answer, peer, data, stamp)
        elif answer is not None:                # (a replicated change: later)
            answer.addCallback(self._send_later, peer, data, stamp)

    def _send_later(self, answer: bytes | None, peer: Any, request: bytes = b"",
                    stamp: bytes | None = None) -> None:
        if self._fd == -1 or answer is None:
            return
        if stamp is not None:
            answer = auth.seal_reply(self.handler.data_key, answer,  # type: ignore[arg-type]
                                     request[8:16], stamp)
        try:
            self.bytes_sent += self.socket.sendto(answer, peer)
        except OSError:
            self.send_errors += 1  # the client retries

    def _drain_in_python(self) -> None:
        recvfrom = self.socket.recvfrom
        sendto = self.socket.sendto
        handle = self.handler.handle
        for _ in range(MAX_DATAGRAMS):
            try:
                data, peer = recvfrom(RECV_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno not in TRANSIENT_ERRORS:
                    raise
                self.recv_errors += 1
                continue
            self.bytes_received += len(data)
            key = self.handler.data_key
            if key is not None:
                opened = auth.open_request(key, data)
                if opened is None:
                    self.handler.counters["unauthenticated"] += 1
                    continue
                self._answer_in_python(opened[0], peer, opened[1])
                continue
            answer = handle(data, wire.MAX_UDP_PAYLOAD)
            if isinstance(answer, bytes):
                try:
                    self.bytes_sent += sendto(answer, peer)
                except OSError:
                    self.send_errors += 1
            elif answer is not None:
                answer.addCallback(self._send_later, peer)
