"""Authentication on the wire: who may talk to a deployment.

A secure deployment (one with a secret, domus.wire.secret) authenticates
every connection and every datagram; an insecure one (``--insecure``, for a
trusted network) neither.

**TCP connections** (every control link, a service's links to its backups,
a client's TCP data connection) begin with a handshake, in frames whose
first byte is ``0xDA`` (neither a request nor a reply), before anything
else is read:

1. the side that accepted sends HELLO: ``DA 02 'H' secure(u8) nonce(16)``;
2. the side that connected answers PROOF: ``DA 02 'P' nonce(16)
   proof(32)``, proof = HMAC-SHA256(control key, "connect" || the HELLO's
   nonce || its own);
3. the accepting side checks it and answers ACCEPT: ``DA 02 'A'
   proof(32)``, HMAC-SHA256(control key, "accept" || the two nonces, the
   other way round), which the connecting side checks in turn; or REFUSE:
   ``DA 02 'X' reason``, and closes.

So each side proves it holds the secret, the secret never travels, and
nothing recorded from one connection opens another.  From then on every
frame, each way, ends with a 16-byte tag: keyed BLAKE3, under a key of
that connection (from the control key and both nonces), of the direction
and the frame's number in it and the frame: a frame changed, dropped,
replayed or sent the other way does not check, and the connection is
closed.

**Datagrams** carry a trailer.  A request: ``time(u32) mac(u64)``, the
client's clock in seconds and SipHash-2-4, under the data key, of the
request and that time; a service drops (and counts) a request whose MAC
does not check, and answers STALE_REQUEST to one whose time is more than
TIME_WINDOW seconds from its own (a replay, or a clock that is off), so that
no old datagram can be applied again once its reply has left the reply
cache.  A reply: ``mac(u64)``, SipHash-2-4 of the reply, the request's
client id and its time: a client takes no reply it did not ask for.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from typing import Any

from blake3 import blake3

from domus.errors import AuthenticationError
from domus.wire.secret import Keys

AUTH_MAGIC = 0xDA
# 2: frames tagged with keyed BLAKE3 (1: BLAKE2b, 7 times slower on large
# frames; a peer of version 1 is told it is another version).
AUTH_VERSION = 2
HELLO, PROOF, ACCEPT, REFUSE = b"H", b"P", b"A", b"X"
NONCE_BYTES = 16
PROOF_BYTES = 32
TAG_BYTES = 16
REQUEST_TRAILER = 12            # time u32, mac u64
REPLY_TRAILER = 8               # mac u64
TIME_WINDOW = 5                 # seconds (and the reply cache keeps replies 15 s at least)
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_SEQUENCE = struct.Struct(">BQ")

try:
    if os.environ.get("DOMUS_PURE_PYTHON") == "1":
        raise ImportError
    from domus._codec import siphash24 as _c_siphash24
except ImportError:
    _c_siphash24 = None


# ------------------------------------------------------------------ SipHash

_MASK = (1 << 64) - 1


def _rotate(value: int, bits: int) -> int:
    return ((value << bits) | (value >> (64 - bits))) & _MASK


def siphash24_reference(key: bytes, data: bytes) -> int:
    """SipHash-2-4 of ``data`` under a 16-byte ``key`` (Aumasson and
    Bernstein, 2012), as an int; the C twin is domus._codec.siphash24."""
    if len(key) != 16:
        raise ValueError("a SipHash key is 16 bytes")
    k0, k1 = struct.unpack("<QQ", key)
    v0, v1 = k0 ^ 0x736F6D6570736575, k1 ^ 0x646F72616E646F6D
    v2, v3 = k0 ^ 0x6C7967656E657261, k1 ^ 0x7465646279746573

    def rounds(count: int) -> None:
        nonlocal v0, v1, v2, v3
        for _ in range(count):
            v0 = (v0 + v1) & _MASK
            v1 = _rotate(v1, 13) ^ v0
            v0 = _rotate(v0, 32)
            v2 = (v2 + v3) & _MASK
            v3 = _rotate(v3, 16) ^ v2
            v0 = (v0 + v3) & _MASK
            v3 = _rotate(v3, 21) ^ v0
            v2 = (v2 + v1) & _MASK
            v1 = _rotate(v1, 17) ^ v2
            v2 = _rotate(v2, 32)

    whole = len(data) - len(data) % 8
    for offset in range(0, whole, 8):
        (word,) = struct.unpack_from("<Q", data, offset)
        v3 ^= word
        rounds(2)
        v0 ^= word
    last = (len(data) & 0xFF) << 56
    for index, byte in enumerate(data[whole:]):
        last |= byte << (8 * index)
    v3 ^= last
    rounds(2)
    v0 ^= last
    v2 ^= 0xFF
    rounds(4)
    return v0 ^ v1 ^ v2 ^ v3


siphash24 = _c_siphash24 if _c_siphash24 is not None else siphash24_reference


# ------------------------------------------------------------------ datagrams
#
# The client's side (seal_request, open_reply, open_reply_to) is done in C
# when domus._codec is built (cext/codec.c; its round trip seals and opens
# too): the functions named ``..._reference`` below are their pure-Python
# twins, which tests/unit/test_auth.py holds them to, byte for byte and
# error for error.  The service's side (open_request, fresh, seal_reply) is
# done in C by its hot path (cext/hotpath.c), and here for what it leaves to
# Python.

def now_seconds() -> int:
    return int(time.time()) & 0xFFFFFFFF


def _check_key(key: Any) -> None:
    if not isinstance(key, bytes):
        raise TypeError(f"key must be bytes, not {type(key).__name__}")
    if len(key) != 16:
        raise ValueError("a SipHash key is 16 bytes")


def _check_bytes(value: Any, what: str) -> None:
    if not isinstance(value, bytes):
        raise TypeError(f"{what} must be bytes, not {type(value).__name__}")


def _check_seconds(seconds: Any) -> int:
    if seconds is None:
        return now_seconds()
    if not isinstance(seconds, int):
        raise TypeError(f"seconds must be an int, not {type(seconds).__name__}")
    if not 0 <= seconds <= 0xFFFFFFFF:
        raise OverflowError("seconds must be in [0, 4294967295]")
    return seconds


def seal_request_reference(key: bytes, message: bytes, /,
                           seconds: int | None = None) -> bytes:
    """``message`` with its trailer: the time (``seconds``, or this
    clock's) and the MAC of the message and that time."""
    _check_key(key)
    _check_bytes(message, "message")
    stamp = _U32.pack(_check_seconds(seconds))
    return message + stamp + _U64.pack(siphash24(key, message + stamp))


def open_request(key: bytes, datagram: bytes) -> tuple[bytes, bytes] | None:
    """(request, its time as 4 bytes) if the MAC checks, else None.  (The
    time is checked by ``fresh``.)"""
    if len(datagram) < REQUEST_TRAILER:
        return None
    body = datagram[:-8]
    if _U64.unpack_from(datagram, len(datagram) - 8)[0] != siphash24(key, body):
        return None
    return body[:-4], body[-4:]


def fresh(stamp: bytes, seconds: int | None = None) -> bool:
    """Whether a request's time is within TIME_WINDOW of this clock."""
    now = now_seconds() if seconds is None else seconds
    skew = (now - _U32.unpack(stamp)[0]) & 0xFFFFFFFF
    return min(skew, 0x100000000 - skew) <= TIME_WINDOW


def seal_reply(key: bytes, reply: bytes, client_id: bytes, stamp: bytes) -> bytes:
    return reply + _U64.pack(siphash24(key, reply + client_id + stamp))


def open_reply_reference(key: bytes, datagram: bytes, client_id: bytes,
                         stamp: bytes) -> bytes | None:
    """The reply if its MAC checks for the request of ``client_id`` sealed
    at ``stamp``, else None."""
    _check_key(key)
    _check_bytes(datagram, "datagram")
    _check_bytes(client_id, "client_id")
    _check_bytes(stamp, "stamp")
    if len(datagram) < REPLY_TRAILER + 1:
        return None
    reply = datagram[:-8]
    if _U64.unpack_from(datagram, len(datagram) - 8)[0] != siphash24(key, reply + client_id
                                                                          + stamp):
        return None
    return reply


def open_reply_to_reference(key: bytes, datagram: bytes, request: bytes,
                            stamps: list[bytes] | tuple[bytes, ...]) -> bytes | None:
    """The reply to ``request`` (unsealed, as the client built it) if its
    MAC checks for one of the request's tries, sealed at ``stamps`` (the
    newest tried first), else None: what every client does with a datagram
    that comes back."""
    _check_key(key)
    _check_bytes(datagram, "datagram")
    _check_bytes(request, "request")
    if not isinstance(stamps, (list, tuple)):
        raise TypeError(f"stamps must be a list or a tuple of bytes, not "
                        f"{type(stamps).__name__}")
    for stamp in stamps:
        _check_bytes(stamp, "a stamp")
    client_id = request[8:16]
    for stamp in reversed(stamps):
        opened = open_reply_reference(key, datagram, client_id, stamp)
        if opened is not None:
            return opened
    return None


if _c_siphash24 is not None:
    from domus._codec import open_reply, open_reply_to, seal_request
else:
    seal_request = seal_request_reference
    open_reply = open_reply_reference
    open_reply_to = open_reply_to_reference


# ------------------------------------------------------------------ connections

def _frame(kind: bytes, payload: bytes = b"") -> bytes:
    return bytes((AUTH_MAGIC, AUTH_VERSION)) + kind + payload


def _kind(frame: bytes) -> tuple[bytes, bytes]:
    if len(frame) < 3 or frame[0] != AUTH_MAGIC or frame[1] != AUTH_VERSION:
        raise AuthenticationError("the peer did not open with the Domus handshake (a peer of "
                                  "another version, or not Domus)")
    return frame[2:3], frame[3:]


class Session:
    """A connection's frames after the handshake: ``seal`` tags each one
    sent, ``open`` checks and strips each one received (numbered per
    direction)."""

    def __init__(self, key: bytes, sends: int, receives: int) -> None:
        self._key = key
        self._sends, self._receives = sends, receives
        self._sent = self._received = 0

    def _hash(self, direction: int, number: int) -> Any:
        # (The frame is fed after the direction and number, however large,
        # where it lies: never copied behind them.)
        return blake3(_SEQUENCE.pack(direction, number), key=self._key)

    def tag(self, frame: Any) -> bytes:
        """The tag of the next frame sent, ``frame`` (bytes or any buffer):
        it goes on the wire right after the frame (``seal`` without the
        copy of the frame)."""
        hashed = self.sending()
        hashed.update(frame)
        return self.sent_tag(hashed)

    def sending(self) -> Any:
        """A hash of the next frame sent, to be fed its bytes as they go
        (``update``) and finished with ``sent_tag``: ``tag`` of a large
        frame sent piece by piece, each piece hashed as it is handed over
        rather than the whole frame before its first byte goes."""
        return self._hash(self._sends, self._sent)

    def sent_tag(self, hashed: Any) -> bytes:
        """The tag of the next frame sent, whose bytes ``hashed`` (from
        ``sending``, made after the frame before was tagged) has been fed."""
        self._sent += 1
        return hashed.digest(TAG_BYTES)

    def seal(self, frame: bytes) -> bytes:
        return frame + self.tag(frame)

    def check(self, frame: Any, tag: Any) -> None:
        """Check the next frame received, ``frame`` (without its tag, bytes
        or any buffer) against ``tag``, the 16 bytes that followed it on
        the wire; AuthenticationError if it does not check (``open``
        without the copy of the frame)."""
        hashed = self.receiving()
        hashed.update(frame)
        self.check_received(hashed, tag)

    def receiving(self) -> Any:
        """A hash of the next frame received, to be fed its bytes as they
        come (``update``) and checked, once its tag has come, with
        ``check_received``: ``check`` without holding the whole frame first,
        so that a large frame is hashed while the rest of it is still on the
        way."""
        return self._hash(self._receives, self._received)

    def check_received(self, hashed: Any, tag: Any) -> None:
        """``check`` of the next frame received, whose bytes (without its
        tag) ``hashed`` (from ``receiving``, made after the frame before was
        checked) has been fed, against ``tag``."""
        if len(tag) != TAG_BYTES or not hmac.compare_digest(tag, hashed.digest(TAG_BYTES)):
            raise AuthenticationError("a frame from the peer did not check (changed, replayed "
                                      "or forged); closing the connection")
        self._received += 1

    def open(self, frame: bytes) -> bytes:
        if len(frame) < TAG_BYTES:
            self.check(b"", b"")        # (raises)
        body = memoryview(frame)[:-TAG_BYTES]
        self.check(body, frame[-TAG_BYTES:])
        return frame[:-TAG_BYTES]


def _session(keys: Keys, accepted_nonce: bytes, connected_nonce: bytes,
             accepting: bool) -> Session:
    key = hmac.new(keys.control, b"session" + accepted_nonce + connected_nonce,
                   hashlib.sha256).digest()[:32]
    return Session(key, sends=0 if accepting else 1, receives=1 if accepting else 0)


class Accepting:
    """The handshake of the side that accepted a connection."""

    def __init__(self, keys: Keys | None) -> None:
        self.keys = keys
        self.nonce = os.urandom(NONCE_BYTES)

    def hello(self) -> bytes:
        return _frame(HELLO, bytes((self.keys is not None,)) + self.nonce)

    def proof(self, frame: bytes) -> tuple[bytes, Session | None]:
        """The answer to the other side's PROOF: (ACCEPT, the session) or
        AuthenticationError whose message goes back in a REFUSE."""
        kind, payload = _kind(frame)
        if kind != PROOF or len(payload) != NONCE_BYTES + PROOF_BYTES:
            raise AuthenticationError("malformed handshake from the peer")
        theirs, proof = payload[:NONCE_BYTES], payload[NONCE_BYTES:]
        if self.keys is None:
            return _frame(ACCEPT, bytes(PROOF_BYTES)), None
        if proof == bytes(PROOF_BYTES):
            raise AuthenticationError("this deployment needs its secret, and the peer has "
                                      "none: give it with --secret-file or "
                                      "$DOMUS_SECRET_FILE")
        expected = hmac.new(self.keys.control, b"connect" + self.nonce + theirs,
                            hashlib.sha256).digest()
        if not hmac.compare_digest(proof, expected):
            raise AuthenticationError("the peer does not hold this deployment's secret (a "
                                      "wrong secret file, or another deployment's)")
        answer = hmac.new(self.keys.control, b"accept" + theirs + self.nonce,
                          hashlib.sha256).digest()
        return _frame(ACCEPT, answer), _session(self.keys, self.nonce, theirs, accepting=True)

    @staticmethod
    def refusal(reason: str) -> bytes:
        return _frame(REFUSE, reason.encode("utf-8", "replace")[:512])


class Connecting:
    """The handshake of the side that connected (``keys`` None: it has no
    secret, which only an insecure deployment takes)."""

    def __init__(self, keys: Keys | None, peer: str) -> None:
        self.keys = keys
        self.peer = peer
        self.nonce = os.urandom(NONCE_BYTES)
        self._theirs = b""
        self.secure = False
        self.proved = False         # (its PROOF sent: what comes next is the verdict)

    def hello(self, frame: bytes) -> bytes:
        """The PROOF answering the other side's HELLO."""
        kind, payload = _kind(frame)
        if kind != HELLO or len(payload) != 1 + NONCE_BYTES:
            raise AuthenticationError(f"{self.peer} did not open with the Domus handshake")
        self.secure = bool(payload[0])
        self._theirs = payload[1:]
        self.proved = True
        if self.keys is not None and self.keys.explicit and not self.secure:
            raise AuthenticationError(
                f"{self.peer} runs without a secret (--insecure), but this process was given "
                f"one ({self.keys.source}): it is not the deployment that secret belongs to, "
                f"or it was started insecure by mistake")
        if self.keys is None or not self.secure:
            return _frame(PROOF, self.nonce + bytes(PROOF_BYTES))
        return _frame(PROOF, self.nonce + hmac.new(
            self.keys.control, b"connect" + self._theirs + self.nonce, hashlib.sha256).digest())

    def verdict(self, frame: bytes) -> Session | None:
        """The session, once ACCEPT checks; AuthenticationError for a
        REFUSE (with the other side's reason) or an ACCEPT that does not
        check (the other side does not hold the secret)."""
        kind, payload = _kind(frame)
        if kind == REFUSE:
            raise AuthenticationError(f"{self.peer} refused this process: "
                                      f"{payload.decode('utf-8', 'replace')}"
                                      + self._where())
        if kind != ACCEPT or len(payload) != PROOF_BYTES:
            raise AuthenticationError(f"malformed handshake from {self.peer}")
        if not self.secure or self.keys is None:
            return None
        expected = hmac.new(self.keys.control, b"accept" + self.nonce + self._theirs,
                            hashlib.sha256).digest()
        if not hmac.compare_digest(payload, expected):
            raise AuthenticationError(f"{self.peer} does not hold this deployment's secret "
                                      f"(it is another deployment's, or an impostor)"
                                      + self._where())
        return _session(self.keys, self._theirs, self.nonce, accepting=False)

    def _where(self) -> str:
        if self.keys is None:
            return ("; this process has no secret file (--secret-file or "
                    "$DOMUS_SECRET_FILE)")
        return (f"; this process used the secret in {self.keys.source} (give the "
                f"deployment's own with --secret-file or $DOMUS_SECRET_FILE)")


def is_handshake(frame: Any) -> bool:
    return bool(frame) and frame[0] == AUTH_MAGIC


__all__ = ["siphash24", "siphash24_reference", "seal_request", "open_request", "fresh",
           "seal_reply", "open_reply", "open_reply_to", "seal_request_reference",
           "open_reply_reference", "open_reply_to_reference", "Session", "Accepting",
           "Connecting", "is_handshake", "TIME_WINDOW", "REQUEST_TRAILER", "REPLY_TRAILER",
           "TAG_BYTES"]
