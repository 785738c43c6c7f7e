"""Fuzz targets of sealed datagrams: a secure deployment's data plane
(domus.wire.auth, docs/protocol.md "Sealed datagrams").

``sealed_udp``: one datagram to two secure services over real UDP sockets
on loopback: the reference reads it with the Python path a service runs
without C (``UdpServer._drain_in_python``: ``auth.open_request``,
``auth.fresh``, ``RequestHandler.handle``, ``auth.seal_reply``), the other
with the C path (``FastPath.serve`` with ``key=``, which checks and strips
the trailer, seals its replies and hands what it declines, stale requests
included, to ``UdpServer._answer_in_python``).  An input is one settings
byte, then:

    settings % 3 == 0   the datagram, as it is (its MAC almost never checks)
    settings % 3 == 1   a skew byte (int8; -128: 2**31), then the request,
                        which the harness seals with the deployment's key
                        and a time that many seconds from this clock
    settings % 3 == 2   the same, sealed with another deployment's key

What each input must show: both services send the same bytes back (their
replies' MACs included; STATS aside, whose C count of declined requests is
its own), then everything the service target checks of the request behind
the trailer (fuzz/service.py: the same records, reply cache and counters,
a well-formed reply that fits a datagram with its MAC, no change made by a
request answered with an error); and, by the trailer: a datagram whose MAC
does not check gets no reply, changes nothing and is counted
``unauthenticated``; one whose time is more than TIME_WINDOW seconds off is
answered STALE_REQUEST (when it has a request id) and changes nothing; a
reply opens with ``auth.open_reply`` for the request's client id and time.

``open_datagram``: ``auth.open_request`` and ``auth.open_reply`` (what a
service and a client apply to every datagram from a peer) on any bytes,
with the C SipHash (domus._codec.siphash24, fenced) and its Python twin
(``siphash24_reference``), and the client's C ``seal_request``,
``open_reply`` and ``open_reply_to`` (domus._codec, fenced) against their
Python twins (``auth.*_reference``): the same answer, never an exception,
and what opens is exactly what ``seal_request``/``seal_reply`` make of it.  An input
is a mode byte (a request or a reply; as it is, or re-sealed by the harness
so that the opening path is taken), then the datagram (a reply's: after the
client id and time it answers, 12 bytes).
"""

from __future__ import annotations

import atexit
import select
import socket
import time
from typing import Any

from domus.service.udp import UdpServer
from domus.wire import auth
from domus.wire import protocol as wire
from domus.wire.secret import Keys
from fuzz.harness import Finding, c_outcome, check, describe, outcome, same, target
from fuzz.service import APPLE, MAIN, SENTINEL_ID, Pair, is_stats, messages, shown

# The keys of two deployments, derived as a deployment derives them.
KEY = Keys.from_secret(bytes(range(32)), "fuzz").data
OTHER_KEY = Keys.from_secret(bytes(range(1, 33)), "fuzz").data
RAW, SEALED, OTHER_DEPLOYMENT = 0, 1, 2
SEALED_LIMIT = wire.MAX_UDP_PAYLOAD - auth.REPLY_TRAILER     # a request's reply, sealed


def skew_seconds(byte: int) -> int:
    signed = byte - 256 if byte > 127 else byte
    return 2**31 if signed == -128 else signed


def skew_byte(seconds: int) -> int:
    return seconds & 0xFF


# ------------------------------------------------------------ the services

class SealedServices:
    """A secure service served by the Python path and one served by the C
    path (fuzz/service.py's two services, with the deployment's data key),
    each on a UDP socket, with a client socket connected to each."""

    def __init__(self) -> None:
        self.pair = Pair("python-dict", False, data_key=KEY)
        self.pair.reference.fast = None          # UdpServer takes the Python path
        self.servers = [UdpServer(self.pair.reference, "127.0.0.1", 0),
                        UdpServer(self.pair.accelerated, "127.0.0.1", 0)]
        self.clients = []
        for server in self.servers:
            client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
            client.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
            client.bind(("127.0.0.1", 0))
            client.connect(server.address)
            client.setblocking(False)
            self.clients.append(client)

    def _serve(self, index: int) -> None:
        server = self.servers[index]
        if index == 0:
            server._drain_in_python()
        else:
            fast = self.pair.accelerated.fast
            while fast.serve(server.fileno(), server._answer_in_python, 256):
                pass

    def exchange(self, datagram: bytes) -> list[list[bytes]]:
        """The datagram, then a sentinel GET sealed now, to each service;
        the replies each sent before the sentinel's (which must be the same
        in both)."""
        sentinel = auth.seal_request(KEY, wire.encode_keyed(wire.OP_GET, 0xFFFFFFFF, 0x5E,
                                                             MAIN, 0, APPLE))
        answers = []
        for index, client in enumerate(self.clients):
            client.send(datagram)
            client.send(sentinel)
            replies: list[bytes] = []
            deadline = time.monotonic() + 10
            while True:
                self._serve(index)
                ready, _, _ = select.select([client], [], [], 0.05)
                if not ready:
                    if time.monotonic() > deadline:
                        raise Finding(f"no answer to the sentinel after {shown(datagram)}")
                    continue
                reply = client.recv(65536)
                if reply[4:8] == SENTINEL_ID:
                    break
                replies.append(reply)
            answers.append(replies + [reply])
        if answers[0][-1] != answers[1][-1]:
            raise Finding(f"the sentinel after {shown(datagram)} was answered "
                          f"{shown(answers[1][-1])} in C, {shown(answers[0][-1])} in Python")
        return [replies[:-1] for replies in answers]

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        for client in self.clients:
            client.close()
        self.pair.close()


_services: list[SealedServices] = []


def services() -> SealedServices:
    if not _services:
        _services.append(SealedServices())
        atexit.register(_services[0].close)
    return _services[0]


def unauthenticated(pair: Pair) -> tuple[int, int]:
    """The datagrams each service dropped for their MACs."""
    reference, accelerated = pair.reference, pair.accelerated
    return (reference.counters["unauthenticated"],
            accelerated.counters["unauthenticated"] + accelerated.fast.unauthenticated)


def steady_second(data: bytes) -> int:
    """This clock's second, once far enough from its edges that the services
    judge an input's time alike: the two paths read the clock one after the
    other, and a second may begin between their reads.  Only an input whose
    time is at the window's edge waits."""
    while True:
        moment = time.time()
        second, fraction = int(moment), moment % 1
        if 0.02 <= fraction <= 0.8 or not at_the_edge(data, second):
            return second
        time.sleep(1.02 - fraction if fraction > 0.8 else 0.02 - fraction)


def at_the_edge(data: bytes, now: int) -> bool:
    """Whether the input's time is a second from the window's edge (where a
    tick of the clock changes what the services make of it)."""
    if data[0] % 3 == RAW:
        opened = auth.open_request(KEY, data[1:1 + wire.MAX_UDP_PAYLOAD])
        if opened is None:
            return False
        skew = int.from_bytes(opened[1], "big") - now
    else:
        skew = skew_seconds(data[1]) if len(data) > 1 else 0
    return abs(skew) - auth.TIME_WINDOW in (-1, 0, 1, 2)


def seal(settings: int, body: bytes, now: int) -> tuple[bytes, bytes | None, bytes]:
    """(the datagram, its request if its MAC checks, its time) for one input
    at this clock's ``now``."""
    mode = settings % 3
    if mode == RAW:
        body = body[:wire.MAX_UDP_PAYLOAD]
        opened = auth.open_request(KEY, body)
        if opened is None:
            return body, None, b""
        return body, opened[0], opened[1]
    skew, request = (skew_seconds(body[0]), body[1:]) if body else (0, b"")
    if request[4:8] == SENTINEL_ID:             # the harness's own request id
        request = request[:4] + b"\xff\xff\xff\xfe" + request[8:]
    request = request[:wire.MAX_UDP_PAYLOAD - auth.REQUEST_TRAILER]
    stamp = ((now + skew) & 0xFFFFFFFF).to_bytes(4, "big")
    key = KEY if mode == SEALED else OTHER_KEY
    return auth.seal_request(key, request, int.from_bytes(stamp, "big")), \
        (request if mode == SEALED else None), stamp


@target("sealed_udp", seeds=lambda: sealed_seeds(), sweep_seeds=lambda: sealed_sweep_seeds(),
        fixed=1, smoke=400, max_len=wire.MAX_UDP_PAYLOAD + 2, c_sources=("cext/hotpath.c",))
def fuzz_sealed_udp(data: bytes) -> None:
    """A datagram to a secure service, read by FastPath.serve with key= (C)
    and by UdpServer's Python path: one settings byte (as it is, sealed with
    the deployment's key, or with another's), then the datagram or a skew
    byte and the request."""
    if not data:
        return
    found = services()
    pair = found.pair
    for _attempt in range(5):
        now = steady_second(data)
        datagram, request, stamp = seal(data[0], data[1:], now)
        before = unauthenticated(pair)
        answers = found.exchange(datagram)
        if int(time.time()) == now:
            break
        # The clock ticked while the services judged the request's time:
        # they may have judged it apart.  Both back as they were, their
        # counters' gap taken as it is, and again.
        pair.restore()
        pair.accept_counters()
    else:
        raise Finding("the clock ticked during every one of 5 attempts")
    python_replies, c_replies = answers
    if request is None:
        after = unauthenticated(pair)
        try:
            check(not python_replies and not c_replies,
                  f"a datagram whose MAC does not check ({shown(datagram)}) was answered: "
                  f"C {[shown(reply) for reply in c_replies]}, Python "
                  f"{[shown(reply) for reply in python_replies]}")
            check(after == (before[0] + 1, before[1] + 1),
                  f"a datagram whose MAC does not check ({shown(datagram)}) was counted "
                  f"unauthenticated {after[1] - before[1]} times in C, "
                  f"{after[0] - before[0]} in Python")
            held = pair.compare(None, None)
            check(held == pair.records, f"{shown(datagram)}, not authentic, changed records")
        finally:
            pair.restore()
        return
    check(len(python_replies) <= 1 and len(c_replies) <= 1,
          f"{shown(datagram)} got {len(python_replies)} replies in Python, "
          f"{len(c_replies)} in C")
    python_reply = python_replies[0] if python_replies else None
    c_reply = c_replies[0] if c_replies else None
    if c_reply != python_reply and not is_stats(request):
        pair.restore()
        raise Finding(f"the C path sent {shown(c_reply)}, the Python path "
                      f"{shown(python_reply)}, for {shown(datagram)}")
    opened = []
    for reply in (python_reply, c_reply):
        if reply is None:
            opened.append(None)
            continue
        body = auth.open_reply(KEY, reply, request[8:16], stamp)
        if body is None:
            pair.restore()
            raise Finding(f"the reply {shown(reply)} to {shown(datagram)} does not open for "
                          f"the request's client id and time")
        opened.append(body)
    if not auth.fresh(stamp, now) and opened[0] is not None:
        if opened[0][2] != wire.ST_STALE_REQUEST:
            pair.restore()
            raise Finding(f"{shown(datagram)}, {(int.from_bytes(stamp, 'big') - now)} s off "
                          f"this clock, was answered {shown(opened[0])}, not STALE_REQUEST")
    pair.judge(request, SEALED_LIMIT, opened[0], opened[1])


def sealed_messages() -> list[bytes]:
    """A request of every kind C answers and a few it leaves to Python, the
    largest that fits a sealed datagram among them."""
    wanted = {wire.OP_PUT, wire.OP_GET, wire.OP_DELETE, wire.OP_CONTAINS, wire.OP_PUT_MANY,
              wire.OP_GET_MANY, wire.OP_PING, wire.OP_STATS, wire.OP_SCAN, wire.OP_LENGTH}
    found, seen = [], set()
    for message in messages():
        kind = (message[2], len(message) > 60000)
        if message[2] in wanted and kind not in seen:
            seen.add(kind)
            found.append(message[:wire.MAX_UDP_PAYLOAD - auth.REQUEST_TRAILER])
    return found


def sealed_seeds() -> list[bytes]:
    now = int(time.time())
    found = []
    for message in sealed_messages():
        found.append(bytes((SEALED, skew_byte(0))) + message)
        found.append(bytes((OTHER_DEPLOYMENT, skew_byte(0))) + message)
        found.append(bytes((RAW,)) + auth.seal_request(KEY, message, now))
    get = wire.encode_keyed(wire.OP_GET, 1, 0xA, MAIN, 0, APPLE)
    for seconds in (auth.TIME_WINDOW, -auth.TIME_WINDOW, auth.TIME_WINDOW + 1,
                    -auth.TIME_WINDOW - 1, 2**31):
        found.append(bytes((SEALED, skew_byte(seconds))) + get)
    found.append(bytes((SEALED, skew_byte(9))) + get[:wire.REQUEST_HEADER_SIZE - 1])
    found.append(bytes((SEALED, 0)))
    found.append(bytes((RAW,)) + auth.seal_request(KEY, b"", now))
    return found


def sealed_sweep_seeds() -> list[bytes]:
    """The trailer's boundaries (a short sealed request as it is, the time
    window's edges) and each small request C answers, sealed: the parsing
    behind the trailer is the service target's sweep."""
    get = wire.encode_keyed(wire.OP_GET, 1, 0xA, MAIN, 0, APPLE)
    ping = wire.request_header(wire.OP_PING, 2, 0xA)
    put = wire.encode_keyed(wire.OP_PUT, 3, 0xA, MAIN, 0, APPLE, b"sealed")
    get_many = wire.encode_get_many(4, 0xA, MAIN, [(0, APPLE), (2, APPLE)])
    return [bytes((RAW,)) + auth.seal_request(KEY, ping),
            bytes((SEALED, skew_byte(auth.TIME_WINDOW))) + get,
            bytes((SEALED, skew_byte(-auth.TIME_WINDOW))) + put,
            bytes((SEALED, 0)) + get_many]


# ------------------------------------------------------------ opening datagrams

REQUEST_AS_IS, REQUEST_SEALED, REPLY_AS_IS, REPLY_SEALED = range(4)


def _with(siphash: Any, function: Any, *args: Any) -> Any:
    """``function(*args)`` with domus.wire.auth using ``siphash``."""
    kept, auth.siphash24 = auth.siphash24, siphash
    try:
        return outcome(function, *args)
    finally:
        auth.siphash24 = kept


def _c_siphash() -> Any:
    from domus import _codec
    return _codec.siphash24


def _c_codec() -> Any:
    from domus import _codec
    return _codec


def open_seeds() -> list[bytes]:
    request = wire.encode_keyed(wire.OP_PUT, 5, 0xA, MAIN, 0, APPLE, b"v")
    reply = wire.reply(wire.ST_OK, 5, b"\x01")
    context = request[8:16] + (1234).to_bytes(4, "big")
    return [bytes((REQUEST_AS_IS,)) + auth.seal_request(KEY, request, 1234),
            bytes((REQUEST_SEALED,)) + request + (1234).to_bytes(4, "big"),
            bytes((REQUEST_SEALED,)) + b"\0\0\0\0",
            bytes((REPLY_AS_IS,)) + context + auth.seal_reply(KEY, reply, *_split(context)),
            bytes((REPLY_SEALED,)) + context + reply,
            bytes((REPLY_SEALED,)) + context + b"x"]


def _split(context: bytes) -> tuple[bytes, bytes]:
    return context[:8], context[8:12]


@target("open_datagram", seeds=open_seeds, fixed=1, smoke=3000, max_len=2048,
        c_sources=("cext/codec.c",))
def fuzz_open_datagram(data: bytes) -> None:
    """auth.open_request / open_reply on any bytes, with the C SipHash and
    its Python twin: the same answer, no exception, and what opens is what
    seal_request / seal_reply make of it."""
    if not data:
        return
    mode, body = data[0] % 4, data[1:]
    c_siphash = _c_siphash()
    for key in (KEY, body[:16]) if len(body) >= 16 else (KEY,):
        same(f"siphash24 of {len(body)} bytes", c_outcome(c_siphash, key, body),
             outcome(auth.siphash24_reference, key, body))
    c_codec = _c_codec()
    if mode in (REQUEST_AS_IS, REQUEST_SEALED):
        datagram = body
        if mode == REQUEST_SEALED:
            stamp = int.from_bytes(body[-4:].rjust(4, b"\0"), "big")
            datagram = auth.seal_request(KEY, body[:-4], stamp)
            same("seal_request", c_outcome(c_codec.seal_request, KEY, body[:-4], stamp),
                 _with(auth.siphash24_reference, auth.seal_request_reference, KEY, body[:-4],
                       stamp))
        c_result = _with(c_siphash, auth.open_request, KEY, datagram)
        same("open_request", c_result, _with(auth.siphash24_reference, auth.open_request, KEY,
                                             datagram))
        check(c_result[0] == "ok", f"open_request raised {describe(c_result)}")
        opened = c_result[1]
        if mode == REQUEST_SEALED:
            check(opened is not None, f"a sealed request does not open: {datagram[:80]!r}")
        if opened is not None:
            request, stamp_bytes = opened
            check(len(stamp_bytes) == 4 and auth.seal_request(
                KEY, request, int.from_bytes(stamp_bytes, "big")) == datagram,
                f"open_request took {datagram[:80]!r} apart as {request[:80]!r}, "
                f"{stamp_bytes!r}")
            check(auth.open_request(OTHER_KEY, datagram) is None,
                  "a request opens under two keys")
        return
    if len(body) < 12:
        return
    client_id, stamp_bytes = _split(body[:12])
    datagram = body[12:]
    if mode == REPLY_SEALED:
        datagram = auth.seal_reply(KEY, datagram, client_id, stamp_bytes)
    c_result = c_outcome(c_codec.open_reply, KEY, datagram, client_id, stamp_bytes)
    same("open_reply", c_result, _with(auth.siphash24_reference, auth.open_reply_reference,
                                       KEY, datagram, client_id, stamp_bytes))
    check(c_result[0] == "ok", f"open_reply raised {describe(c_result)}")
    opened = c_result[1]
    # The same reply to a request of that client id tried at two times (the
    # other one first), as every client opens what comes back.
    request = bytes(8) + client_id
    tries = [bytes((stamp_bytes[0] ^ 0x80,)) + stamp_bytes[1:], stamp_bytes]
    to_result = c_outcome(c_codec.open_reply_to, KEY, datagram, request, tries)
    same("open_reply_to", to_result, _with(auth.siphash24_reference,
                                           auth.open_reply_to_reference, KEY, datagram,
                                           request, tries))
    check(to_result == c_result, f"open_reply_to gave {describe(to_result)} where open_reply "
                                 f"gave {describe(c_result)}")
    if mode == REPLY_SEALED and datagram[:-8]:
        check(opened == datagram[:-8], f"a sealed reply does not open: {datagram[:80]!r}")
    if opened is not None:
        check(auth.seal_reply(KEY, opened, client_id, stamp_bytes) == datagram,
              f"open_reply took {datagram[:80]!r} apart as {opened[:80]!r}")
        other_id = bytes((client_id[0] ^ 1,)) + client_id[1:]
        check(auth.open_reply(KEY, datagram, other_id, stamp_bytes) is None,
              "a reply opens for another client id")


# ------------------------------------------------------------ the sealed round trip

ROUNDTRIP_ID = 0x5EA1ED
ROUNDTRIP_SECONDS = 0x6000_0000
ROUNDTRIP_MESSAGE = wire.encode_keyed(wire.OP_GET, ROUNDTRIP_ID, 0xC11E, MAIN, 0, APPLE)
AS_IS, FOR_THE_REQUEST, FOR_ANOTHER_TIME, FOR_ANOTHER_KEY = range(4)


def sealed_as(mode: int, body: bytes) -> bytes:
    """One datagram of a sealed round trip's input: ``body`` as it is, or
    sealed as a reply to ROUNDTRIP_MESSAGE (for its time, for another time,
    or under another deployment's key)."""
    client_id = ROUNDTRIP_MESSAGE[8:16]
    stamp = ROUNDTRIP_SECONDS.to_bytes(4, "big")
    if mode == FOR_THE_REQUEST:
        return auth.seal_reply(KEY, body, client_id, stamp)
    if mode == FOR_ANOTHER_TIME:
        return auth.seal_reply(KEY, body, client_id, (ROUNDTRIP_SECONDS - 1).to_bytes(4, "big"))
    if mode == FOR_ANOTHER_KEY:
        return auth.seal_reply(OTHER_KEY, body, client_id, stamp)
    return body


def sealed_datagrams(data: bytes) -> list[bytes]:
    """The input as datagrams: a mode byte (sealed_as), a u16 length and
    that many bytes, again and again; 16 at most."""
    found = []
    while len(data) >= 3 and len(found) < 16:
        mode, length = data[0] % 4, int.from_bytes(data[1:3], "big")
        found.append(sealed_as(mode, data[3:3 + length])[:wire.MAX_UDP_PAYLOAD])
        data = data[3 + length:]
    return found


def the_sealed_reply(datagrams: list[bytes]) -> bytes | None:
    """The reply the round trip must take: the first datagram that opens
    for the request (auth.open_reply_to) and has its id, opened."""
    for datagram in datagrams:
        opened = auth.open_reply_to_reference(KEY, datagram, ROUNDTRIP_MESSAGE,
                                              [ROUNDTRIP_SECONDS.to_bytes(4, "big")])
        if opened is not None and len(opened) >= wire.REPLY_HEADER_SIZE \
                and opened[4:8] == ROUNDTRIP_MESSAGE[4:8]:
            return opened
    return None


class SealedRoundtrip:
    """A "service" that is a bare UDP socket and a client socket connected
    to it, for domus._codec.roundtrip with key= and its Python twin
    (domus.client.codec.roundtrip_reference)."""

    def __init__(self) -> None:
        self.service = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.service.bind(("127.0.0.1", 0))
        self.service.setblocking(False)
        self.client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 21)
        self.client.connect(self.service.getsockname())
        self.client.settimeout(0.25)        # (as a ServiceChannel leaves it)

    def run(self, roundtrip: Any, datagrams: list[bytes], fence: bool) -> tuple[Any, bytes]:
        """(what the round trip returned, the bytes the service got)."""
        _drain(self.client)
        _drain(self.service)
        for datagram in datagrams:
            self.service.sendto(datagram, self.client.getsockname())
        # Patient when a datagram answers (a loaded machine may be slow to
        # deliver it), milliseconds when none does.
        timeout = 5.0 if the_sealed_reply(datagrams) is not None else 0.002
        arguments = (self.client.fileno(), ROUNDTRIP_MESSAGE, timeout, 0.0, KEY,
                     ROUNDTRIP_SECONDS)
        got = c_outcome(roundtrip, *arguments) if fence else outcome(roundtrip, *arguments)
        deadline = time.monotonic() + 5
        while True:
            try:
                sent = self.service.recv(65536)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise Finding("the round trip sent nothing") from None
                select.select([self.service], [], [], 0.05)
        return got, sent

    def close(self) -> None:
        self.client.close()
        self.service.close()


def _drain(sock: socket.socket) -> None:
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        while True:
            try:
                sock.recv(65536)
            except (BlockingIOError, ConnectionRefusedError):
                return
    finally:
        sock.settimeout(timeout)


def sealed_roundtrip_seeds() -> list[bytes]:
    reply = wire.reply(wire.ST_OK, ROUNDTRIP_ID, b"\xa5value")
    stale = wire.reply(wire.ST_OK, ROUNDTRIP_ID - 1, b"\xa5stale")

    def pieces(*parts: tuple[int, bytes]) -> bytes:
        return b"".join(bytes((mode,)) + len(body).to_bytes(2, "big") + body
                        for mode, body in parts)

    return [pieces((FOR_THE_REQUEST, reply)),
            pieces((AS_IS, reply), (FOR_THE_REQUEST, reply)),
            pieces((FOR_ANOTHER_TIME, reply), (FOR_ANOTHER_KEY, reply),
                   (FOR_THE_REQUEST, stale), (FOR_THE_REQUEST, reply)),
            pieces((FOR_THE_REQUEST, reply[:7]), (FOR_THE_REQUEST, reply[:8])),
            pieces((AS_IS, sealed_as(FOR_THE_REQUEST, reply)[:-1])),
            pieces((FOR_ANOTHER_TIME, reply))]                      # no answer


_roundtrips: list[SealedRoundtrip] = []


@target("sealed_roundtrip", seeds=sealed_roundtrip_seeds, smoke=250, max_len=8192,
        c_sources=("cext/codec.c",))
def fuzz_sealed_roundtrip(data: bytes) -> None:
    """A secure client's round trip (domus._codec.roundtrip with key=)
    meeting the fuzzer's datagrams (a mode byte: as they are, or sealed by
    the harness for the request, for another time or under another key;
    a u16 length; the bytes) as its replies, over real UDP sockets: the C
    round trip and its Python twin send the same sealed request, take the
    same reply (the first one that opens for the request, opened) or time
    out alike, and neither raises."""
    from domus import _codec
    from domus.client.codec import roundtrip_reference

    if not _roundtrips:
        _roundtrips.append(SealedRoundtrip())
        atexit.register(_roundtrips[0].close)
    pair = _roundtrips[0]
    datagrams = sealed_datagrams(data)
    got_c, sent_c = pair.run(_codec.roundtrip, datagrams, fence=True)
    got_python, sent_python = pair.run(roundtrip_reference, datagrams, fence=False)
    expected_request = auth.seal_request_reference(KEY, ROUNDTRIP_MESSAGE, ROUNDTRIP_SECONDS)
    check(sent_c == sent_python == expected_request,
          f"the round trips sent {shown(sent_c)} (C) and {shown(sent_python)} (Python), not "
          f"{shown(expected_request)}")
    check(got_c[0] == "ok", f"the C round trip raised {describe(got_c)}")
    same("the sealed round trip", got_c, got_python)
    check(got_c[1] == the_sealed_reply(datagrams),
          f"the round trip took {shown(got_c[1])}, not {shown(the_sealed_reply(datagrams))}")


__all__ = ["fuzz_sealed_udp", "fuzz_open_datagram", "fuzz_sealed_roundtrip", "SealedServices",
           "KEY"]
