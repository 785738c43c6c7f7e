"""The service's TCP port: connections with bounded state.

Each connection is a ``domus.wire.control.MessageProtocol`` (the handshake,
sealed frames, data and control requests) with bounds on what a peer can
make the service hold for it, whatever the peer does, secret or not:

- **Output.** A connection is its own transport's streaming producer:
  when the replies it has not read pass ``output_high_water`` bytes
  (Twisted's ``bufferSize`` on the transport), the service stops reading
  its requests (TCP flow control pushes back on the peer), and reads again
  once they drain.  So the unsent output of a connection is at most the
  high-water mark plus one reply (a request read after the mark is never
  answered before the output drains).  A connection whose output stays
  over the mark for ``write_timeout`` seconds is a reader that stopped: it
  is aborted (``tcp_slow_readers``).
- **Input.** A frame may be up to MAX_FRAME_BYTES (16 MiB + 64 KiB); the
  bytes of partial frames held across all connections are at most
  ``input_budget``: a connection whose data would take the total past it
  is aborted (``tcp_input_overflows``).
- **Idle.** A connection that completes no frame for ``idle_timeout``
  seconds (it sends nothing, or only part of a frame) and waits for no
  reply is closed (``tcp_idle_closed``); clients open a new one when they
  next need it.
- **Count.** At most ``max_connections`` (in total, and never more than the
  file descriptor limit allows) and ``max_connections_per_host`` from one
  peer address are open at once; one more is closed as soon as it is
  accepted (``tcp_refused``).
"""

from __future__ import annotations

from typing import Any

from twisted.internet import protocol
from twisted.internet.interfaces import IPushProducer
from twisted.logger import Logger
from zope.interface import implementer

from domus.service.limits import Limits
from domus.wire.control import MessageProtocol

log = Logger(namespace="domus.service")

COUNTERS = ("tcp_connections", "tcp_refused", "tcp_slow_readers", "tcp_input_overflows",
            "tcp_idle_closed")


@implementer(IPushProducer)
class DataConnection(MessageProtocol):
    """One peer's connection to the service's TCP port (see the module)."""

    accepting = True
    factory: DataFactory

    def __init__(self) -> None:
        super().__init__()
        self._last_frame = 0.0
        self._stalled_since: float | None = None    # output over the mark since
        self._held_input = 0                        # bytes of partial frames held
        self._waiting = 0                           # requests answered later
        self._timer: Any = None
        self._closing = False

    # ------------------------------------------------------------ lifecycle
    def connectionMade(self) -> None:
        factory = self.factory
        clock = factory.clock
        self._count_bytes_sent()
        self._last_frame = clock.seconds()
        self.transport.bufferSize = factory.limits.output_high_water
        self.transport.registerProducer(self, True)
        super().connectionMade()
        self._timer = clock.callLater(self._next_check(), self._check)

    def connectionLost(self, reason: Any = None) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self.factory.lost(self)
        super().connectionLost(reason)

    def _count_bytes_sent(self) -> None:
        """Count every byte written to the transport, each way's frame
        headers, handshake and tags included, in ``tcp_bytes_sent`` (the
        metrics read it; ``tcp_bytes_received`` is counted as data comes)."""
        counters = self.factory.counters
        transport = self.transport
        write, write_sequence = transport.write, transport.writeSequence

        def counted_write(data: bytes) -> None:
            counters["tcp_bytes_sent"] = counters.get("tcp_bytes_sent", 0) + len(data)
            write(data)

        def counted_sequence(data: Any) -> None:
            data = list(data)
            counters["tcp_bytes_sent"] = counters.get("tcp_bytes_sent", 0) + sum(map(len, data))
            write_sequence(data)

        transport.write, transport.writeSequence = counted_write, counted_sequence

    def sent_directly(self, count: int) -> None:
        counters = self.factory.counters
        counters["tcp_bytes_sent"] = counters.get("tcp_bytes_sent", 0) + count

    # ------------------------------------------------------------ input
    def dataReceived(self, data: bytes) -> None:
        # (The rest of a large frame that is already in the socket is read
        # at once, ``pull``: not on another turn of the reactor.  Each
        # piece is counted and held to the input budget alike.)
        counters = self.factory.counters
        while True:     # (data is b"" on resumeProducing: what is held is delivered)
            counters["tcp_bytes_received"] = counters.get("tcp_bytes_received", 0) + len(data)
            super().dataReceived(data)
            if self._closing:
                return
            held = self.input_held()
            if held != self._held_input:
                if not self.factory.hold_input(self, held - self._held_input):
                    self._abort("tcp_input_overflows",
                                "its partial frames would take the service past its input "
                                f"budget of {self.factory.limits.input_budget:,} bytes")
                    return
                self._held_input = held
            data = self.pull()
            if not data:
                return

    def stringReceived(self, frame: bytes, tag: bytes | None = None,  # noqa: N802
                       hashed: Any = None) -> None:
        self._last_frame = self.factory.clock.seconds()
        super().stringReceived(frame, tag, hashed)

    def _answer_later(self, answer: Any) -> None:
        self._waiting += 1
        answer.addCallback(self._answered_later)

    def _answered_later(self, frame: bytes) -> None:
        self._waiting -= 1
        self._last_frame = self.factory.clock.seconds()
        self._send_if_connected(frame)

    # ------------------------------------------------------------ IPushProducer
    # (The transport calls these as its unsent output passes the high-water
    # mark and drains below it.)
    def pauseProducing(self) -> None:
        if self._stalled_since is None:
            self._stalled_since = self.factory.clock.seconds()
        super().pauseProducing()

    def resumeProducing(self) -> None:
        self._stalled_since = None
        if self._closing or self.transport is None:
            return
        super().resumeProducing()

    def stopProducing(self) -> None:
        self._closing = True

    # ------------------------------------------------------------ timers
    def _next_check(self) -> float:
        limits = self.factory.limits
        return max(min(limits.idle_timeout, limits.write_timeout) / 4, 0.05)

    def _check(self) -> None:
        self._timer = None
        if self._closing or self.transport is None:
            return
        limits = self.factory.limits
        now = self.factory.clock.seconds()
        if self._stalled_since is not None and now - self._stalled_since >= limits.write_timeout:
            self._abort("tcp_slow_readers", f"it left its replies unread for "
                        f"{limits.write_timeout:g}s")
            return
        if (self._stalled_since is None and not self._waiting
                and now - self._last_frame >= limits.idle_timeout):
            self._close_idle()
            return
        self._timer = self.factory.clock.callLater(self._next_check(), self._check)

    # ------------------------------------------------------------ closing
    def _abort(self, counter: str, why: str) -> None:
        self._closing = True
        self.factory.count(counter)
        log.warn("service {service}: closing the connection of {peer}: {why}",
                 service=self.factory.service_name, peer=self._peer(), why=why)
        self._release_input()
        self.transport.abortConnection()

    def _close_idle(self) -> None:
        self._closing = True
        self.factory.count("tcp_idle_closed")
        self._release_input()
        self.transport.unregisterProducer()      # (else it waits for the producer)
        self.transport.loseConnection()

    def _release_input(self) -> None:
        self.drop_input()
        if self._held_input:
            self.factory.hold_input(self, -self._held_input)
            self._held_input = 0

    def lengthLimitExceeded(self, length: int) -> None:
        self._closing = True
        self._release_input()
        super().lengthLimitExceeded(length)


class DataFactory(protocol.Factory):
    """Builds the service's TCP connections and keeps the bounds shared by
    all of them (see the module).  ``counters`` is the handler's: the
    counts appear in the service's stats."""

    noisy = False

    def __init__(self, service_name: str, limits: Limits, counters: dict[str, int],
                 configure: Any, clock: Any = None) -> None:
        if clock is None:
            from twisted.internet import reactor as clock
        self.service_name = service_name
        self.limits = limits
        self.counters = counters
        for name in COUNTERS:
            counters.setdefault(name, 0)
        self.configure = configure          # (connection) -> None: its handlers, keys
        self.clock = clock
        self.open: set[DataConnection] = set()
        self.per_host: dict[str, int] = {}
        self.input_held = 0

    def buildProtocol(self, addr: Any) -> DataConnection | None:  # noqa: N802
        host = getattr(addr, "host", "?")
        limits = self.limits
        if (len(self.open) >= limits.connections
                or self.per_host.get(host, 0) >= limits.max_connections_per_host):
            self.count("tcp_refused")
            if self.counters["tcp_refused"] in (1, 10, 100) or \
                    not self.counters["tcp_refused"] % 1000:
                log.warn("service {service}: refusing a TCP connection from {host}: "
                         "{open} open ({from_host} from that host), the caps are {cap} and "
                         "{per_host} per host ({refused} refused so far)",
                         service=self.service_name, host=host, open=len(self.open),
                         from_host=self.per_host.get(host, 0), cap=limits.connections,
                         per_host=limits.max_connections_per_host,
                         refused=self.counters["tcp_refused"])
            return None                     # (Twisted closes it)
        connection = DataConnection()
        connection.factory = self
        connection.peer_host = host         # type: ignore[attr-defined]
        self.configure(connection)
        self.open.add(connection)
        self.per_host[host] = self.per_host.get(host, 0) + 1
        self.count("tcp_connections")
        return connection

    def lost(self, connection: DataConnection) -> None:
        if connection in self.open:
            self.open.discard(connection)
            host = connection.peer_host     # type: ignore[attr-defined]
            left = self.per_host.get(host, 1) - 1
            if left:
                self.per_host[host] = left
            else:
                self.per_host.pop(host, None)
        connection._release_input()

    def hold_input(self, connection: DataConnection, change: int) -> bool:
        """Account ``change`` more bytes of partial frames; False (nothing
        accounted) if that would pass the input budget."""
        if change > 0 and self.input_held + change > self.limits.input_budget:
            return False
        self.input_held += change
        return True

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1
