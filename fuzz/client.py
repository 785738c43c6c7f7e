"""Fuzz targets of what a client reads from services: reply decoders, the
values in them, keys sent back by scans and ranges, and the round trip.

Where the decoding is done in C (domus._codec, cext/codec.c) the C function
and its pure-Python reference (domus.client.codec.reference) must agree on
every input: the same result, or the same exception with the same message.
Where Python alone decodes, a decoded reply must encode back to the very
bytes it came from: a decoder accepts exactly what the encoder writes.
The errors allowed are the documented ones: ProtocolError for a reply that
does not follow docs/protocol.md, ValueDecodeError for a value that is not
msgpack.
"""

from __future__ import annotations

import atexit
import socket
import struct
from typing import Any

import msgpack

from domus.client import codec
from domus.client import transport as client_transport
from domus.client.lookup import DirectLookup, reply_error
from domus.client.transport import ServiceChannel
from domus.errors import DomusError, ProtocolError, ValueDecodeError
from domus.wire import keys as wire_keys
from domus.wire import protocol as wire
from fuzz.harness import (
    Finding,
    c_outcome,
    check,
    describe,
    documented,
    equal,
    fenced,
    outcome,
    same,
    target,
)

try:  # directly: the comparisons hold under DOMUS_PURE_PYTHON=1 too
    from domus import _codec as C
except ImportError:  # pragma: no cover - make builds it
    C = None
P = codec.reference
REQUEST_ID = 0x0A0B0C0D
HEADER = wire.reply(wire.ST_OK, REQUEST_ID)


def _c() -> Any:
    if C is None:
        raise RuntimeError("domus._codec is not built: there is no C decoder to fuzz "
                           "(.venv/bin/python setup.py build_ext --inplace)")
    return C


# ------------------------------------------------------------ seeds

VALUES: list[Any] = [
    None, True, False, 0, 1, -1, 127, 128, -32, -33, 255, 256, 65535, 65536, 2**32, 2**63 - 1,
    -(2**63), 2**64 - 1, 1.5, float("inf"), "", "é", "x" * 31, "x" * 32, "x" * 300, b"",
    b"\x00" * 40, b"b" * 300, [], [1, [2, [3, [None]]]], (1, "two"), {}, {"a": 1, 2: [b"c"]},
    {"nested": {"deep": {"map": [1.25, -7, "s"]}}}, list(range(20)),
    {str(number): number for number in range(20)},
]


def packed_values() -> list[bytes]:
    """Values a client writes, packed by domus.wire.values (msgpack), and a
    few that only other writers produce (single floats, ext types)."""
    found = [P.pack_value(value) for value in VALUES]
    found += [msgpack.packb(2.5, use_single_float=True), msgpack.packb(msgpack.ExtType(5, b"e")),
              msgpack.packb([msgpack.Timestamp(1, 2)])]
    return found


def get_many_replies() -> list[bytes]:
    values = packed_values()
    return [wire.encode_get_many_reply(REQUEST_ID, []),
            wire.encode_get_many_reply(REQUEST_ID, [None]),
            wire.encode_get_many_reply(REQUEST_ID, values[:6]),
            wire.encode_get_many_reply(REQUEST_ID, [values[10], None, values[20], None]),
            wire.encode_get_many_reply(REQUEST_ID, values[25:])]


ENTRIES = [(wire_keys.encode_key(key), P.pack_value(value)) for key, value in [
    (0, None), (-5, [1]), (2**70, "big"), (-(2**70), b"neg"), ("", {}), ("é", "v" * 40),
    (b"", b""), (b"\xff" * 9, {"k": [1, 2]})]]


def scan_replies() -> list[bytes]:
    return [wire.encode_scan_reply(REQUEST_ID, 1, wire.SCAN_END, []),
            wire.encode_scan_reply(REQUEST_ID, 7, 3, ENTRIES[:3]),
            wire.encode_scan_reply(REQUEST_ID, 0xFFFFFFFE, wire.SCAN_END, ENTRIES)]


def range_replies() -> list[bytes]:
    keys_only = [(key, b"") for key, _value in ENTRIES]
    return [wire.encode_range_reply(REQUEST_ID, [], False),
            wire.encode_range_reply(REQUEST_ID, ENTRIES[:2], True),
            wire.encode_range_reply(REQUEST_ID, ENTRIES, False),
            wire.encode_range_reply(REQUEST_ID, keys_only, True)]


def lookup_replies() -> list[bytes]:
    request_id = HEADER[4:8]
    return [wire.encode_lookup_reply(request_id, wire.LOOKUP_FOUND, 5, "s1", "127.0.0.1:7701"),
            wire.encode_lookup_reply(request_id, wire.LOOKUP_NEXT, 0xFFFFFFFE, "é" * 40,
                                     "[::1]:65535"),
            wire.not_owner_reply(request_id, "s2", "127.0.0.1:7702", "bucket 3 is on s2"),
            wire.not_owner_reply(request_id, "", "", "no idea where it is")]


def encoded_keys() -> list[bytes]:
    return [wire_keys.encode_key(key) for key in [
        0, 1, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64, -(2**64), 2**200, -(2**200),
        "", "a", "é", "\ud800", "😀" * 3, b"", b"\x00", b"bytes" * 5]]


# ------------------------------------------------------------ values

@target("unpack_value", seeds=packed_values, c_sources=("cext/codec.c",))
def fuzz_unpack_value(data: bytes) -> None:
    """A value, as the reply to a GET carries it: domus._codec.unpack_value
    against domus.wire.values (msgpack); a ValueDecodeError or nothing."""
    framed = HEADER + data
    python = outcome(P.unpack_value, framed, wire.REPLY_HEADER_SIZE)
    documented("unpack_value", python, ValueDecodeError)
    same("unpack_value(reply, 8)", c_outcome(_c().unpack_value, framed, wire.REPLY_HEADER_SIZE),
         python)
    same("unpack_value(value, 0)", c_outcome(_c().unpack_value, data, 0), python)


@target("get_many_take", seeds=get_many_replies, c_sources=("cext/codec.c",))
def fuzz_get_many_take(data: bytes) -> None:
    """A GET_MANY reply taken into a dict: the same dict and outcome from C
    and Python (unpacking with unpack_value and with a function of the
    caller's); nothing taken from a malformed reply."""
    count = min(struct.unpack_from(">H", data, 8)[0], 64) if len(data) >= 10 else 3
    batch = list(range(count))
    wanted = [f"key{index}" for index in batch]
    for unpack in (None, _reverse):
        found_c: dict[Any, Any] = {}
        found_python: dict[Any, Any] = {}
        python = outcome(P.get_many_take, data, batch, wanted, found_python, unpack)
        documented("get_many_take", python, ProtocolError, ValueDecodeError)
        same("get_many_take", c_outcome(_c().get_many_take, data, batch, wanted, found_c,
                                        unpack), python)
        check(repr(found_c) == repr(found_python),
              f"get_many_take took {found_c!r} in C, {found_python!r} in Python")
        if python[0] == "error" and python[1] is ProtocolError:
            check(found_python == {}, "a malformed get_many reply was partly taken")


def _reverse(raw: bytes) -> bytes:
    return raw[::-1]


# ------------------------------------------------------------ replies

def _reencoded(what: str, data: bytes, encoded: bytes) -> None:
    """A decoded reply encodes back to the bytes it came from (after the
    header, which the decoders leave to the caller)."""
    if encoded[wire.REPLY_HEADER_SIZE:] != data[wire.REPLY_HEADER_SIZE:]:
        raise Finding(f"{what} accepted {data[:80]!r}, which encodes back as "
                      f"{encoded[:80]!r}: the decoder takes bytes the encoder never writes")


@target("decode_get_many_reply", seeds=get_many_replies, c_sources=("cext/codec.c",))
def fuzz_decode_get_many_reply(data: bytes) -> None:
    """decode_get_many_reply in C and in Python: ProtocolError or the
    values, which encode back to the reply."""
    python = outcome(P.decode_get_many_reply, data)
    documented("decode_get_many_reply", python, ProtocolError)
    same("decode_get_many_reply", c_outcome(_c().decode_get_many_reply, data), python)
    if python[0] == "ok":
        _reencoded("decode_get_many_reply", data,
                   wire.encode_get_many_reply(REQUEST_ID, python[1]))


@target("decode_scan_reply", seeds=scan_replies, c_sources=("cext/codec.c",))
def fuzz_decode_scan_reply(data: bytes) -> None:
    """decode_scan_reply in C and in Python: ProtocolError or the page,
    which encodes back to the reply; its keys are keys or ProtocolError."""
    python = outcome(P.decode_scan_reply, data)
    documented("decode_scan_reply", python, ProtocolError)
    same("decode_scan_reply", c_outcome(_c().decode_scan_reply, data), python)
    if python[0] == "ok":
        scan_id, offset, entries = python[1]
        _reencoded("decode_scan_reply", data,
                   wire.encode_scan_reply(REQUEST_ID, scan_id, offset, entries))
        for key, _value in entries:
            _decoded_key(key)


@target("decode_range_reply", seeds=range_replies)
def fuzz_decode_range_reply(data: bytes) -> None:
    """domus.wire.protocol.decode_range_reply (Python only): ProtocolError
    or the entries, which encode back to the reply; 'more' only with an
    entry; the keys are keys or ProtocolError."""
    result = outcome(wire.decode_range_reply, data)
    documented("decode_range_reply", result, ProtocolError)
    if result[0] == "ok":
        entries, more = result[1]
        check(entries or not more, "a range reply with 'more' and no entry was accepted")
        _reencoded("decode_range_reply", data,
                   wire.encode_range_reply(REQUEST_ID, entries, more))
        for key, _value in entries:
            _decoded_key(key)


@target("lookup_reply", seeds=lookup_replies)
def fuzz_lookup_reply(data: bytes) -> None:
    """What a client reads in a LOOKUP reply and in a NOT_OWNER redirect
    (domus.wire.protocol, Python only): ProtocolError or the service
    named, which encodes back to the reply."""
    result = outcome(wire.decode_lookup_reply, data)
    documented("decode_lookup_reply", result, ProtocolError)
    if result[0] == "ok":
        kind, bucket, name, address = result[1]
        check(kind in (wire.LOOKUP_FOUND, wire.LOOKUP_NEXT) and name and address,
              f"decode_lookup_reply accepted {result[1]!r}")
        _reencoded("decode_lookup_reply", data,
                   wire.encode_lookup_reply(data[4:8], kind, bucket, name, address))
    redirect = outcome(wire.decode_redirect, data)
    documented("decode_redirect", redirect, ProtocolError)
    named = outcome(DirectLookup._redirect, data)
    documented("the client's redirect", named)
    if redirect[0] == "ok":
        name, address, _message = redirect[1]
        check(named[1] == ((name, address) if name and address else None),
              f"the client follows {named[1]!r} for the redirect {redirect[1]!r}")


def _decoded_key(key: bytes) -> None:
    result = outcome(wire_keys.decode_key, key)
    documented("decode_key", result, ProtocolError)
    if result[0] == "ok":
        again = P.encode_key(result[1])
        check(again == key, f"decode_key accepted {key[:40]!r} as {result[1]!r}, whose "
              f"encoding is {again[:40]!r}: every key has exactly one encoding")
        same("encode_key of a decoded key", c_outcome(_c().encode_key, result[1]),
             ("ok", key))


@target("decode_key", seeds=encoded_keys, max_len=wire.MAX_KEY_BYTES + 2)
def fuzz_decode_key(data: bytes) -> None:
    """domus.wire.keys.decode_key, for the keys scans and ranges send back:
    ProtocolError, or a key whose encoding (in Python and in C) is these
    very bytes."""
    _decoded_key(data)


# ------------------------------------------------------------ the round trip

class Roundtrip:
    """A GET sent to a "service" that is a bare UDP socket, which has put
    the fuzzer's datagrams in the client socket's queue first; once through
    ServiceChannel.request (the C round trip, then Python's retries) and
    once through its pure-Python path, each on a channel of its own.

    When one of the datagrams answers the GET (the protocol's rule: the
    first of at least 8 bytes with the request's id), the channels wait for
    it patiently (loopback delivers at once, but a loaded machine may be
    slow to); when none does, they give up after milliseconds."""

    MESSAGE = wire.encode_keyed(wire.OP_GET, REQUEST_ID, 0xC11E, 1, 0,
                                wire_keys.encode_key("apple"))

    def __init__(self) -> None:
        self.service = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.service.bind(("127.0.0.1", 0))
        self.service.setblocking(False)
        address = f"127.0.0.1:{self.service.getsockname()[1]}"
        self.channels = {
            (path, patient): ServiceChannel("s1", address, deadline=10.0 if patient else 0.003,
                                            first_timeout=5.0 if patient else 0.001)
            for path in ("c", "python") for patient in (True, False)}

    def close(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.service.close()

    def run(self, datagrams: list[bytes], path: str) -> tuple[Any, Any]:
        """(what the request returned, what the client made of it)."""
        channel = self.channels[path, answered(datagrams) is not None]
        _drain(channel.sock)
        for datagram in datagrams:
            self.service.sendto(datagram, channel.sock.getsockname())
        if path == "c":
            with_c = client_transport._roundtrip is not None
            check(with_c, "the C round trip is not in use (domus._codec missing?)")
            got = outcome(channel.request, self.MESSAGE, "t", 0)
        else:
            got = outcome(channel._request_udp, self.MESSAGE, "t", 0, None)
        _drain(self.service)
        _drain(channel.sock)
        if got[0] == "error":
            return got, None
        return got, interpret(got[1], channel, path)


def answered(datagrams: list[bytes]) -> bytes | None:
    """The datagram that answers the GET, by the protocol's rule."""
    for datagram in datagrams:
        if len(datagram) >= wire.REPLY_HEADER_SIZE \
                and datagram[4:8] == Roundtrip.MESSAGE[4:8]:
            return datagram
    return None


def _drain(sock: socket.socket) -> None:
    """Throw away every datagram waiting on ``sock``."""
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


def interpret(reply: bytes, channel: ServiceChannel, path: str) -> tuple[Any, ...]:
    """What the blocking client makes of a GET's reply, as an outcome: the
    value (unpacked in C or in Python), KeyError, or the redirect of a
    NOT_OWNER and the error its status stands for."""
    status = reply[2]
    if status == wire.ST_NOT_FOUND:
        return ("ok", "KeyError")
    if status == wire.ST_OK:
        if path == "c":
            with fenced(reply):
                return outcome(_value_of, _c().unpack_value, reply)
        return outcome(_value_of, P.unpack_value, reply)
    redirect = DirectLookup._redirect(reply) if status == wire.ST_NOT_OWNER else None
    error = reply_error("t", reply, channel, 0)
    return ("ok", ("error reply", redirect, type(error).__name__, str(error)))


def _value_of(unpack: Any, reply: bytes) -> Any:
    try:
        return unpack(reply, wire.REPLY_HEADER_SIZE)
    except ValueDecodeError as exc:
        raise exc.with_key("apple").with_dht("t") from None


def datagrams_of(data: bytes) -> list[bytes]:
    """The fuzzer's input as datagrams: u16 length, then that many bytes,
    again and again (the last one takes what is left); 16 at most."""
    found = []
    while data and len(found) < 16:
        if len(data) < 2:
            found.append(data)
            break
        length = struct.unpack_from(">H", data)[0]
        found.append(data[2:2 + length][:wire.MAX_UDP_PAYLOAD])
        data = data[2 + length:]
    return found


def as_datagrams(*datagrams: bytes) -> bytes:
    return b"".join(struct.pack(">H", len(datagram)) + datagram for datagram in datagrams)


# msgpack of a map keyed by a tuple, which reads back keyed by a list: not
# a value.
NOT_A_VALUE = msgpack.packb({(): 1})


def roundtrip_seeds() -> list[bytes]:
    reply = wire.reply
    stale = reply(wire.ST_OK, REQUEST_ID - 1, P.pack_value("stale"))
    return [
        as_datagrams(reply(wire.ST_OK, REQUEST_ID, P.pack_value({"colour": "red"}))),
        as_datagrams(reply(wire.ST_NOT_FOUND, REQUEST_ID)),
        as_datagrams(stale, HEADER[:2], reply(wire.ST_OK, REQUEST_ID, P.pack_value([1, 2]))),
        as_datagrams(wire.not_owner_reply(HEADER[4:8], "s2", "127.0.0.1:7702", "on s2")),
        as_datagrams(wire.error_reply(wire.ST_STORAGE_ERROR, REQUEST_ID, "disk full")),
        as_datagrams(wire.error_reply(wire.ST_MOVING, REQUEST_ID, "moving")),
        as_datagrams(wire.error_reply(wire.ST_INACTIVE, REQUEST_ID, "inactive")),
        as_datagrams(wire.error_reply(wire.ST_UNKNOWN_DHT, REQUEST_ID, "gone")),
        as_datagrams(reply(wire.ST_OK, REQUEST_ID, NOT_A_VALUE)),
        as_datagrams(stale, stale),                                        # no answer
    ]


_roundtrips: list[Roundtrip] = []


@target("client_roundtrip", seeds=roundtrip_seeds, smoke=250, max_len=8192,
        c_sources=("cext/codec.c",))
def fuzz_client_roundtrip(data: bytes) -> None:
    """A client's GET meeting the fuzzer's datagrams (u16 length, bytes, ...)
    as its replies, over real UDP sockets: the C round trip
    (domus._codec.roundtrip) and the Python one pick the same reply, and
    the client makes the same of it: a value, KeyError, a redirect, or a
    documented error (ServiceUnavailable when none of them answers it)."""
    if not _roundtrips:
        _roundtrips.append(Roundtrip())
        atexit.register(_roundtrips[0].close)
    roundtrip = _roundtrips[0]
    datagrams = datagrams_of(data)
    got_c, made_c = roundtrip.run(datagrams, "c")
    got_python, made_python = roundtrip.run(datagrams, "python")
    for got in (got_c, got_python):
        documented("ServiceChannel.request", got, DomusError)
    if got_python[0] == "error" or got_c[0] == "error":
        # (How many retries a timeout took is timing, not an answer.)
        check(got_c[:2] == got_python[:2], f"C round trip {describe(got_c)}, Python "
              f"{describe(got_python)}")
        return
    check(got_c == got_python, f"C round trip got {describe(got_c)}, Python "
          f"{describe(got_python)}")
    expected = answered(datagrams)
    if expected is not None and expected[2] != wire.ST_REPLY_TOO_LARGE:
        check(got_c[1] == expected, f"the round trip took {got_c[1][:80]!r}, not the "
              f"reply {expected[:80]!r}")
    documented("the value of a GET", made_python, ValueDecodeError)
    if not equal(made_c, made_python):
        raise Finding(f"the client made {describe(made_c)} of {got_c[1][:80]!r} in C, "
                      f"{describe(made_python)} in Python")


__all__ = ["fuzz_unpack_value", "fuzz_get_many_take", "fuzz_decode_get_many_reply",
           "fuzz_decode_scan_reply", "fuzz_decode_range_reply", "fuzz_lookup_reply",
           "fuzz_decode_key", "fuzz_client_roundtrip"]
